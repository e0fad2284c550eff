"""A separate small causal LM as the drafter (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

import torch

from selfspec.decode.drafters.base import Drafter, DrafterInfo, DraftLimit, chain_room, context_length
from selfspec.decode.kv import call_with_cache, crop_cache, new_cache
from selfspec.decode.masks import attention_layout
from selfspec.decode.sampling import SamplingConfig, probs_from_logits, process_logits
from selfspec.decode.tree import DraftTree, chain_parents


class DraftModelDrafter(Drafter):
    """A separate small causal LM (same tokenizer) drafting a chain of K tokens.

    Greedy: argmax drafts (``q = None``). Sampling: each draft token is sampled from q, the draft
    model's distribution after the same processing as the target's (temperature, top-k/p, ...), and
    q is returned for the verifier (Leviathan et al. 2023, Algorithm 1). The draft model keeps its own
    KV cache (:func:`~selfspec.decode.kv.new_cache`: every layer keeps every key, sliding-window layers
    masked by position), cropped to the longest prefix it shares with the context each step.

    Drafting stays inside the draft model's context (``config.max_position_embeddings``, which GPT-2's
    ``n_positions`` answers to: absolute position embeddings end there): near it the chain gets shorter, and
    past it the drafter proposes the root alone (the step is plain decoding). It is never longer than the
    ``max_depth`` the loop passes (the tokens still allowed minus one).

    Args:
        model: the draft causal LM, on the target's device; its vocabulary must be the target's.
        num_tokens: K, the longest chain.
        logits_processor: user processors applied to the draft logits (as to the target's).
        target_vocab_size: V of the target's logits; when given, a draft vocabulary of another size is
            refused now (see :meth:`check_vocab`), else when a decode starts.
        shared_vocab_size: for a draft model with the target's tokenizer whose embedding matrices are padded
            to another size (e.g. two sizes of one family): the ids both share, ``len(tokenizer)``, at most
            S and V. Drafts are then drawn among ids below it only, and q is over the target's V ids (zero
            elsewhere): an exact id mapping. A context id beyond the draft's input embeddings (a padding id
            the target produced) stops drafting: the root alone from then on.

    Raises:
        selfspec.decode.masks.UnsupportedLayoutError: a draft model whose attention layers the cache
            cannot crop by position (see :func:`~selfspec.decode.masks.attention_layout`).
        ValueError: a vocabulary other than the target's (see :meth:`check_vocab`).
    """

    def __init__(
        self,
        model,
        num_tokens: int = 4,
        logits_processor=None,
        target_vocab_size: int | None = None,
        shared_vocab_size: int | None = None,
    ) -> None:
        attention_layout(model.config)  # refuses, now rather than at the first step, a cache it cannot crop
        self.model = model
        self.num_tokens = num_tokens
        self.logits_processor = logits_processor
        self.context_length = context_length(model)
        self.shared_vocab_size = shared_vocab_size
        self._mapped: tuple[int, int] | None = None  # (shared ids, V) when the sizes differ
        self._cache = None
        self._cached: list[int] = []
        if target_vocab_size is not None:
            self.check_vocab(target_vocab_size)

    def info(self) -> DrafterInfo:
        # No vocab_size: check_vocab (below) decides, since a padded draft vocabulary may map onto the target's.
        return DrafterInfo(name="draft_model", max_depth=self.num_tokens, sampled=True)

    def check_vocab(self, target_vocab_size: int) -> None:
        """Refuse a draft model whose vocabulary is not the target's: its input embeddings would be indexed
        with target ids beyond them, or the target with draft ids beyond its own (an ``IndexError`` mid-way).

        Draft and target must share one tokenizer. With one vocabulary size, ids map to themselves. Models
        whose embedding matrices are padded to different sizes (the same tokenizer) need
        ``shared_vocab_size``: which ids are padding cannot be told from the models, so no mapping is guessed.

        Args:
            target_vocab_size: V, the number of the target's logits.

        Raises:
            ValueError: the draft's input embeddings or lm_head have another size than V and no valid
                ``shared_vocab_size`` (at most S and V) was given.
        """
        s_in = self.model.get_input_embeddings().num_embeddings
        s_out = self.model.get_output_embeddings().weight.shape[0]
        v = target_vocab_size
        if s_in == s_out == v:
            self._mapped = None
            return
        shared = self.shared_vocab_size
        if shared is not None and 0 < shared <= min(s_in, s_out, v):
            self._mapped = (shared, v)
            return
        raise ValueError(
            f"the draft model's vocabulary ({s_out} ids: input embeddings {s_in}, lm_head {s_out}) differs "
            f"from the target's ({v} ids); a draft model must use the target's tokenizer, or its ids would fall "
            "outside one of the two embeddings. Pick a draft model of the target's family with the same "
            "vocab_size, or use prompt_lookup=True; if both use one tokenizer and only the embeddings are padded, "
            f"pass draft_shared_vocab=len(tokenizer), at most {min(s_in, s_out, v)}"
            + (f" (got {shared})" if shared is not None else "")
        )

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        device = next(self.model.parameters()).device
        if device != prompt_ids.device:
            raise ValueError(
                f"the draft model is on {device}, the target on {prompt_ids.device}; move the draft model to the "
                "target's device (draft_model.to(device)) or load both with the same device="
            )
        self._cache = new_cache(self.model)
        self._cached = []

    @torch.inference_mode()
    def _feed(self, ids: list[int], device) -> torch.Tensor:
        start = len(self._cached)
        out = call_with_cache(
            self.model,
            self._cache,
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.arange(start, start + len(ids), device=device).unsqueeze(0),
            logits_to_keep=1,
        )
        self._cached.extend(ids)
        return out.logits[0, -1].float()

    def _chain_length(self, context_len: int, max_depth: int | None) -> int:
        """K for this step: the context (positions ``0 .. T-1``) and K - 1 drafts must fit the draft's
        positions; never above ``num_tokens`` or ``max_depth``."""
        k = self.num_tokens if max_depth is None else min(self.num_tokens, max_depth)
        if self.context_length is not None:
            k = min(k, self.context_length - context_len + 1)
        return max(0, k)

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """A chain: the root then ``K`` draft tokens (see :meth:`_chain_length`; ``K = 0``: the root alone)."""
        ctx = context.tolist()
        k = self._chain_length(len(ctx), chain_room(limit))
        if self._mapped is not None and max(ctx) >= self.model.get_input_embeddings().num_embeddings:
            k = 0  # a target id the draft cannot embed: no more drafts (exact, just plain decoding)
        if k == 0:
            return DraftTree(tokens=context[-1:], parents=chain_parents(1, context.device))
        common = 0
        for a, b in zip(self._cached, ctx, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(ctx) - 1)  # always re-feed at least the root to get its logits
        if common < len(self._cached):
            crop_cache(self._cache, common)
            del self._cached[common:]
        logits = self._feed(ctx[common:], context.device)
        draft: list[int] = []
        q_rows: list[torch.Tensor] = []
        running = list(ctx)
        for i in range(k):
            if self._mapped is not None:
                logits = self._to_target_ids(logits)
            row = process_logits(
                logits.unsqueeze(0), torch.tensor([running], device=context.device), sampling, self.logits_processor
            )
            if sampling.do_sample:
                q = probs_from_logits(row)[0]
                tok = int(torch.multinomial(q, 1, generator=generator))
                q_rows.append(q)
            else:
                tok = int(row[0].argmax())
            draft.append(tok)
            running.append(tok)
            if i + 1 < k:  # the last draft's logits are never used
                logits = self._feed([tok], context.device)
        tokens = torch.tensor([ctx[-1]] + draft, dtype=torch.long, device=context.device)
        q = None
        if sampling.do_sample:
            q = torch.cat([torch.stack(q_rows), torch.zeros_like(q_rows[0]).unsqueeze(0)])  # leaf row unused
        return DraftTree(tokens=tokens, parents=chain_parents(tokens.numel(), context.device), q=q)

    def _to_target_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[S]`` -> ``[V]`` over the target's ids: the shared ids keep theirs, the rest -inf."""
        shared, v = self._mapped
        out = logits.new_full((v,), float("-inf"))
        out[:shared] = logits[:shared]
        return out
