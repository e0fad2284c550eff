"""Public Python API: ``selfspec.load(target, heads)`` -> a model whose ``generate`` is the target's, faster."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.fingerprint import is_peft_model
from selfspec.decode.drafters import (
    Drafter,
)
from selfspec.decode.drafters.served_history import ServedHistory
from selfspec.decode.loop import decode_rows
from selfspec.decode.request import GenerationOutput, GenerationRequest
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.streaming import iterate_text
from selfspec.decode.target_check import check_target
from selfspec.decode.tuning.batch_rule import BatchTreeRule, get_batch_cost_profile
from selfspec.decode.tuning.costs import get_cost_profile
from selfspec.decode.tuning.draft_costs import get_draft_cost
from selfspec.decode.verifier import Verifier
from selfspec.generate_args import (
    SequencesOutput,
    build_sequences,
    check_vocab,
    new_token_budget,
    prompt_rows,
    resolve_generation_config,
)

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

    from selfspec.train.online import OnlineAdapter, OnlineOptions
from selfspec.drafting import (
    TUNE_MODES,
    DrafterPlan,
    TreeBudgetChoice,
    make_drafter,
    make_verifier,
    plan_drafter,
)
from selfspec.prompts import encode_prompt, resolve_eos

__all__ = [
    "DrafterPlan",
    "SpeculativeModel",
    "TreeBudgetChoice",
    "from_pretrained",
    "load",
    "make_drafter",
    "make_verifier",
    "plan_drafter",
]


class SpeculativeModel:
    """A frozen target plus a drafter. Build it with :func:`load`.

    Attributes:
        target: the ``transformers`` causal LM (frozen, eval mode).
        tokenizer: its tokenizer (None if the target was passed as a module without one).
        drafter: the :class:`~selfspec.decode.drafters.base.Drafter` in use.
        verifier: the :class:`~selfspec.decode.verifier.Verifier` that runs the target's forwards (its
            kernel plan and packed weights); None at construction = :func:`make_verifier` with ``tune="auto"``.
        tree_budget: how an EAGLE drafter's tree budget was chosen (:class:`TreeBudgetChoice`), or None.
        tune: ``"auto"`` or ``"off"`` (``load(tune="off")``: nothing is measured; batches draft the drafter's
            own tree).
        history: the :class:`~selfspec.decode.drafters.served_history.ServedHistory` a hybrid drafter draws on
            (``load(hybrid=True, history=True)``), fed every output this model returns; None without one. It lives
            in this process only.
        online: the :class:`~selfspec.train.online.OnlineAdapter` that adapts the head to the requests served
            (``load(..., adapt=True)``), or None.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer,
        drafter: Drafter,
        verifier: Verifier | None = None,
        tree_budget: TreeBudgetChoice | None = None,
        tune: str = "auto",
        history: ServedHistory | None = None,
        online: OnlineAdapter | None = None,
    ) -> None:
        if tune not in TUNE_MODES:
            raise ValueError(f"tune must be one of {TUNE_MODES}, got {tune!r}")
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.verifier = make_verifier(target, drafter) if verifier is None else verifier
        self.tree_budget = tree_budget
        self.tune = tune
        self.history = history
        self.online = online
        self._tree_rule: BatchTreeRule | None = None

    # ------------------------------------------------------------------ inputs
    def encode(self, prompt: Any) -> torch.Tensor:
        """Token ids ``[T]`` for a prompt given as ids (list / LongTensor ``[T]`` or ``[1, T]``), a string
        (tokenized as is) or chat messages (``[{"role", "content"}]``, rendered with the chat template
        and the generation prompt); see :func:`selfspec.prompts.encode_prompt`.

        Raises:
            ValueError: empty prompt, or a string / messages without a tokenizer.
        """
        return encode_prompt(self.tokenizer, prompt)

    def default_eos(self) -> list[int]:
        """EOS ids from the target's generation config (falling back to the tokenizer's); see
        :func:`selfspec.prompts.resolve_eos`."""
        return resolve_eos(self.target, self.tokenizer)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: Any = None,
        max_new_tokens: int | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        max_length: int | None = None,
        min_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        stop_strings: Sequence[str] = (),
        logits_processor=None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        acceptance: str = "exact",
        streamer: BaseStreamer | Callable[[list[int]], None] | None = None,
        batch_tree: str = "auto",
        return_dict_in_generate: bool | None = None,
    ) -> GenerationOutput | list[GenerationOutput] | SequencesOutput:
        """Generate like ``transformers`` ``generate``, with speculative decoding, for one prompt or a batch.

        Output is exactly the target's: token-identical under greedy, distribution-identical under
        sampling (``acceptance="typical"`` is the one lossy opt-in, flagged in ``stats.lossy``). The settings a call
        leaves unset come from ``generation_config``, then the target's ``generation_config``, then ``generate``'s
        defaults (``top_k`` 50), as ``target.generate`` takes them
        (:func:`selfspec.generate_args.resolve_generation_config`): the same call samples from the same distribution.

        Args:
            prompt: ids, a string or chat messages (see :meth:`encode`); or a batch: a list of such prompts
                (of any lengths) or a LongTensor ``[B, T]`` (every row a whole prompt unless ``attention_mask``
                says otherwise), decoded together (:func:`selfspec.decode.loop.decode_rows`).
            max_new_tokens: cap on new tokens (never exceeded); unset: ``max_length`` less the prompt's (padded)
                length, else the generation config's, else 128.
            input_ids, attention_mask: ``transformers``' form of the prompt (``model.generate(**tokenizer(texts,
                return_tensors="pt", padding=True))``): LongTensor ``[B, T]`` (or ``[T]``), left- or right-padded, and
                its mask of 1 for prompt tokens; give ``input_ids`` or ``prompt``, not both.
            generation_config: a ``transformers.GenerationConfig`` for the call (the arguments given win over it).
            max_length: total length cap, prompt (its padded width) included, where ``max_new_tokens`` is unset.
            min_new_tokens: EOS suppressed until this many tokens exist.
            do_sample, temperature, top_k, top_p, min_p, repetition_penalty: as in ``transformers``, defaults
                included (``top_k=0`` turns top-k off).
            eos_token_id: one id or several; default: the generation config's (the target's, else the tokenizer's).
            pad_token_id: fills ``sequences`` past a row's end (default: the generation config's, else the first EOS).
            stop_strings: stop at the token that completes any of them.
            logits_processor: extra ``transformers`` ``LogitsProcessor`` objects.
            seed: seed for a fresh ``torch.Generator`` (same seed, same output).
            generator: an explicit ``torch.Generator`` (wins over ``seed``).
            acceptance: ``"exact"`` or ``"typical"`` (lossy).
            return_dict_in_generate: return a :class:`~selfspec.generate_args.SequencesOutput` whose ``sequences``
                (LongTensor ``[B, T + N]``, prompt and new tokens, padded) are laid out as ``generate``'s.
            streamer: a ``transformers`` streamer (``TextStreamer``, ``TextIteratorStreamer``, any
                ``BaseStreamer``), fed like ``generate`` feeds it (prompt, then each step's accepted tokens,
                never a token later withdrawn, then ``end()``); or a callable given each step's new token ids.
                For a batch, a list of one such streamer (or None) per prompt. See also :meth:`stream`.
            batch_tree: ``"auto"`` sizes every row's tree, at batch 1 and in batches, to the number of rows still
                decoding and the acceptance the drafter is getting (across calls), from this machine's measured
                costs, and turns speculation off for a while where it does not pay (:meth:`batch_tree_rule`; a model
                loaded with ``tune="off"`` measures nothing and drafts as ``"fixed"``, and one prompt of an EAGLE
                head whose ``depth`` and ``total_tokens`` were both given drafts that tree); ``"fixed"`` drafts the
                drafter's own tree at every step.

        Returns:
            :class:`~selfspec.decode.request.GenerationOutput` (``tokens``, ``text``, ``stats`` with
            ``steps``, ``mean_accepted_tokens`` (tau), ``tokens_per_s``, ``finish_reason``); for a batch, a
            list of them in the prompts' order; with ``return_dict_in_generate``, a
            :class:`~selfspec.generate_args.SequencesOutput` (``sequences`` and every row's output).

        Raises:
            ValueError: invalid sampling values (temperature <= 0, top_p outside (0, 1], top_k < 0, min_p
                outside [0, 1], ...), a generation config that sets a processor selfspec does not reproduce
                (``num_beams``, ``no_repeat_ngram_size`` ...), an empty prompt, a token id outside the target's
                vocabulary, an ``attention_mask`` that is not one run of ones per row, both ``prompt`` and
                ``input_ids``, a prompt that leaves no room in the target's context (or under ``max_length``),
                ``max_new_tokens < 1``, a batch given one streamer instead of one per prompt, an unknown
                ``batch_tree``; nothing has run.
            selfspec.decode.step.NonFiniteLogitsError: NaN or inf in the target's logits (names the step).
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass the prompt (ids, text or chat messages) or input_ids=[B, T], one of the two")
        tensor_input = input_ids if input_ids is not None else prompt if isinstance(prompt, torch.Tensor) else None
        if attention_mask is not None and tensor_input is None:
            raise ValueError("attention_mask goes with a tensor of ids (input_ids=[B, T]); text and messages have none")
        if tensor_input is not None and (attention_mask is not None or input_ids is not None):
            rows = prompt_rows(tensor_input, attention_mask)
            prompt = rows[0] if len(rows) == 1 else rows
        batch = _as_batch(prompt)
        if batch_tree not in ("auto", "fixed"):
            raise ValueError(f"batch_tree must be 'auto' or 'fixed', got {batch_tree!r}")
        prompts = [prompt] if batch is None else batch
        streamers = _streamers(streamer, len(prompts), batch is not None)
        explicit = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
        explicit |= {"min_p": min_p, "repetition_penalty": repetition_penalty}
        explicit |= {"pad_token_id": pad_token_id, "return_dict_in_generate": return_dict_in_generate}
        config = resolve_generation_config(self.target, generation_config, **explicit)
        sampling = SamplingConfig.from_generation_config(config)
        if eos_token_id is None and generation_config is not None:
            eos_token_id = generation_config.eos_token_id
        eos = self.default_eos() if eos_token_id is None else eos_token_id
        if generator is None and seed is not None:
            generator = torch.Generator(device=next(self.target.parameters()).device).manual_seed(seed)
        ids = [self.encode(p) for p in prompts]
        check_vocab(ids, self.target.get_input_embeddings().num_embeddings)
        width = tensor_input.shape[-1] if tensor_input is not None else max(row.numel() for row in ids)
        request = GenerationRequest(
            max_new_tokens=new_token_budget(
                config.max_new_tokens if max_new_tokens is None else max_new_tokens,
                config.max_length if max_length is None else max_length,
                width,
            ),
            min_new_tokens=(config.min_new_tokens or 0) if min_new_tokens is None else min_new_tokens,
            sampling=sampling,
            eos_ids=eos,
            stop_strings=(stops,) if isinstance(stops := stop_strings or config.stop_strings or (), str) else stops,
            tokenizer=self.tokenizer,
            logits_processor=logits_processor,
            generator=generator,
            acceptance=acceptance,
        )
        drafters = [self.drafter] if batch is None else [self.drafter.fork() for _ in ids]
        policy = None
        given = self.tree_budget is not None and self.tree_budget.source == "given"  # a tree the caller fixed
        if batch_tree == "auto" and self.tune == "auto" and self.drafter.info().max_depth > 0:
            if batch is not None or not given:  # one prompt: the tree the caller fixed is drafted as given
                policy = self.batch_tree_rule(batch=batch is not None)
        if self.online is not None:
            self.online.before_request()  # a pending swap lands here, never within a request
        t0 = time.perf_counter()
        outs = decode_rows(self.verifier, drafters, ids, request, streamers=streamers, tree_policy=policy)
        if self.online is not None:  # learns from what it served; the target verified every token
            served_s = (time.perf_counter() - t0) / len(outs)
            for row, out in zip(ids, outs, strict=True):
                sequence = torch.cat([row.cpu(), torch.tensor(out.tokens, dtype=torch.long)])
                self.online.observe(sequence, row.numel(), out.stats.mean_accepted_tokens, served_s)
        if self.history is not None:  # served outputs become a drafting source for the next requests
            for out in outs:
                self.history.add(out.tokens)
        if config.return_dict_in_generate:
            first_eos = [eos] if isinstance(eos, int) else list(eos)
            pad = config.pad_token_id if config.pad_token_id is not None else (first_eos or [0])[0]
            return build_sequences(tensor_input if tensor_input is not None else ids, outs, pad)
        return outs if batch is not None else outs[0]

    def save_heads(self, directory: str | Path) -> Path:
        """Write the head adapted online (``load(..., adapt=True)``) to ``directory``: the strict head files and
        ``adaptation.json`` (counts only: no text, no paths). A later ``selfspec.load(target, directory,
        adapt=True)`` continues from it.

        Raises:
            ValueError: the model adapts nothing (its heads are the files it was loaded from).
        """
        if self.online is None:
            raise ValueError("save_heads writes heads adapted online: load with adapt=True (or use selfspec adapt)")
        return self.online.save(directory)

    def batch_tree_rule(self, batch: bool = True) -> BatchTreeRule:
        """The model's one tree rule (:class:`~.tuning.batch_rule.BatchTreeRule`): each step's tree from the rows
        still decoding and the acceptance this drafter is getting on the traffic served (kept across calls, decayed),
        with drafting switched off for a bounded back-off where it does not pay. Its costs: the batch-1 cost profile
        of the verifier that decodes (measured once, then cached) and, for a batch (``batch=True``), the cost by
        batch size (measured once, about 30 s, then cached). An EAGLE head with an acceptance profile gets the
        EAGLE-2 budget with the profile as the prior; any other drafter a depth cap from the acceptance by depth.
        Built on first use."""
        if self._tree_rule is None:
            single = get_cost_profile(self.target)
            single = single if self.verifier.plan else single.linear_only()
            profile = self.tree_budget.acceptance_profile if self.tree_budget is not None else None
            if profile is not None and self.drafter.info().draft_cost is not None:  # the head's profile and draft cost
                draft = get_draft_cost(self.drafter, self.target, range(1, profile.depth_max + 1))
                self._tree_rule = BatchTreeRule(None, profile, draft, single=single)
            else:
                self._tree_rule = BatchTreeRule(None, max_depth=self.drafter.info().max_depth, single=single)
        if batch:
            self._tree_rule.with_batch_cost(get_batch_cost_profile(self.target, verifier=self.verifier))
        return self._tree_rule

    def stream(self, prompt: Any, *, skip_special_tokens: bool = True, **kwargs: Any) -> Iterator[str]:
        """``for text in model.stream(prompt, max_new_tokens=...)``: the output's text, piece by piece as tokens
        are accepted (a ``transformers`` ``TextIteratorStreamer`` fed by :meth:`generate` in a worker thread,
        see :func:`selfspec.decode.streaming.iterate_text`). Joined, the pieces equal ``generate(...).text``.

        Args:
            prompt: as for :meth:`generate`.
            skip_special_tokens: as for the returned ``text`` (True).
            kwargs: any :meth:`generate` argument except ``streamer``.

        Raises:
            ValueError: no tokenizer, ``streamer`` given, or what :meth:`generate` raises (raised when the
                iteration reaches it).
        """
        if self.tokenizer is None:
            raise ValueError("stream() decodes text and needs a tokenizer: load the target with one")
        if "streamer" in kwargs:
            raise ValueError("stream() makes its own streamer; call generate(streamer=...) to pass one")
        _refuse_batch(prompt)
        return iterate_text(
            lambda s: self.generate(prompt, streamer=s, **kwargs),
            self.tokenizer,
            skip_special_tokens=skip_special_tokens,
        )


def _as_batch(prompt: Any) -> list | None:
    """The prompts of a batch (a ``[B, T]`` tensor with B > 1 or a list of prompts: never flattened), or None
    for one prompt (ids ``[T]`` / ``[1, T]`` / a list of ids, a string, chat messages)."""
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() > 2:
            raise ValueError(f"input ids of shape {tuple(prompt.shape)}: pass [T], [1, T], [B, T] or a list of prompts")
        return list(prompt) if prompt.dim() == 2 and prompt.shape[0] != 1 else None
    if isinstance(prompt, (list, tuple)) and prompt:
        first = prompt[0]  # a token id may be a 0-d tensor; a list, string or 1-d tensor is a prompt
        if isinstance(first, (list, tuple, str)) or (isinstance(first, torch.Tensor) and first.dim() > 0):
            return list(prompt)
    return None


def _refuse_batch(prompt: Any) -> None:
    """Refuse several prompts where one is needed (streaming)."""
    if _as_batch(prompt) is not None:
        raise ValueError("stream() follows one prompt: call it once per prompt, or generate(list of prompts)")


def _streamers(streamer: Any, n: int, batch: bool) -> list | None:
    """One streamer per prompt: a batch takes a list of them (one per prompt, each may be None), one prompt
    takes one streamer.

    Raises:
        ValueError: a single streamer for a batch, or a list whose length is not the batch's.
    """
    if streamer is None:
        return None
    if not batch:
        return [streamer]
    if not isinstance(streamer, (list, tuple)):
        raise ValueError(
            "a batch streams through one streamer per prompt: pass streamer=[s_1, ..., s_B] (None allowed)"
        )
    if len(streamer) != n:
        raise ValueError(f"got {len(streamer)} streamers for {n} prompts: pass one per prompt (None allowed)")
    return list(streamer)


def load(
    target: str | Path | Any,
    heads: str | Path | torch.nn.Module | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    tokenizer=None,
    threads: int | None = None,
    tune: str = "auto",
    adapter: str | Path | Any | None = None,
    adapt: bool | OnlineOptions = False,
    **drafter_options: Any,
) -> SpeculativeModel:
    """Load a target and a drafter.

    Args:
        target: a target name (see :func:`selfspec.target.resolve_target`) or a loaded model; a
            ``peft.PeftModel`` (``AutoPeftModelForCausalLM``) is decoded as its merged copy
            (:mod:`selfspec.adapter`: why merged), the PeftModel itself left as it is.
        heads: a head directory, a Hub repo id of heads pushed with ``push_to_hub`` / ``selfspec push``
            (``$HF_TOKEN`` for a private one), or a head module; or pass ``draft_model=`` / ``prompt_lookup=True``.
        dtype: target dtype when loading by name.
        device: target device when loading by name.
        tokenizer: needed for text prompts when ``target`` is a module.
        threads: ``torch.set_num_threads`` value.
        tune: ``"auto"``: for heads, size the tree to this machine and, on a CPU, verify with the fastest
            measured linear kernels. The first use on a target/device/dtype/thread count measures the
            verification cost (announced with its rough duration, about 40 s for SmolLM2-135M on 2 CPU
            cores, and a progress bar; then cached), and the packed kernel may hold a second copy of the
            linear weights (logged with its size). ``"off"``: no measurement, no packing, plain kernels,
            default tree sizes.
        adapter: a PEFT adapter directory (``PeftModel.save_pretrained``) or a ``PeftModel`` wrapping
            ``target``: the target decoded is the base with the adapter merged in, and heads must have been
            trained on that adapted target (the fingerprint names base and adapter). Default: the ``adapter/``
            directory inside ``heads`` when there is one (Medusa-2 heads, :mod:`selfspec.train.medusa2`).
        adapt: True or :class:`~selfspec.train.online.OnlineOptions`: the EAGLE-3 head learns from the requests it
            serves (:mod:`selfspec.train.online`: between requests by default, within a CPU share, swapped in only
            when it beats the live head on held-out traffic, rolled back when served acceptance falls); outputs
            stay the target's. :meth:`SpeculativeModel.save_heads` writes the adapted head.
        drafter_options: ``tree``, ``tree_nodes``, ``draft_model``, ``draft_tokens``, ``draft_shared_vocab``,
            ``prompt_lookup``, ``hybrid``, ``suffix_index`` (a saved index or a JSONL of conversations,
            indexed with ``tokenizer``; see :func:`make_drafter`), ``history`` (True or a
            :class:`~selfspec.decode.drafters.served_history.ServedHistory`: the hybrid also drafts from the outputs
            served so far), and EAGLE options (``depth``, ``top_k``,
            ``total_tokens``; ``"auto"`` = sized to this machine when the head has an acceptance profile, see
            :func:`make_drafter`).

    Returns:
        :class:`SpeculativeModel`. Nothing is stored on the target model.

    Raises:
        ValueError: ``tune`` not ``"auto"`` / ``"off"``, or see :func:`make_drafter`.
        selfspec.adapter.AdapterError: (a ``ValueError``) a missing adapter, or one for another base model.
        selfspec.decode.target_check.UnsupportedTargetError: (a ``ValueError``) a target that cannot be
            decoded exactly (an unsupported attention-layer type, or a forward that does not apply the tree
            mask); the message names the model class and the reason
            (:func:`~selfspec.decode.target_check.check_target`).
    """
    if tune not in TUNE_MODES:
        raise ValueError(f"tune must be one of {TUNE_MODES}, got {tune!r}")
    if threads:
        torch.set_num_threads(threads)
    own_adapter = Path(heads) / "adapter" if isinstance(heads, (str, Path)) else None
    if adapter is None and own_adapter is not None and (own_adapter / "adapter_config.json").is_file():
        adapter = own_adapter  # Medusa-2 heads: trained with their own adapter, saved beside them
    if isinstance(target, (str, Path)):
        from selfspec.target import load_target  # selfspec.target imports transformers' Auto classes

        target, tokenizer = load_target(target, dtype=dtype, device=device, adapter=adapter)
    elif adapter is not None or is_peft_model(target):
        from selfspec.base.adapter import load_adapted, merge_adapter  # imports peft

        if adapter is None:
            target = merge_adapter(target)
        else:  # an adapter directory is merged into a copy: the caller's model stays the bare base
            target = load_adapted(target if is_peft_model(adapter) else copy.deepcopy(target), adapter)
    check_target(target)  # refuses a target whose decoding would not be exactly its own
    plan = plan_drafter(target, heads, tune=tune, tokenizer=tokenizer, **drafter_options)
    verifier = make_verifier(target, plan.drafter, tune)
    online = None
    if adapt:
        head = plan.drafter.trained_head()
        if head is None:
            raise ValueError(f"adapt= trains a drafter's head; this model drafts with {plan.drafter.info().name}")
        from selfspec.train.online import OnlineOptions  # the training stack, only when adapting
        from selfspec.train.recipes import online_adapter

        online = online_adapter(head, target, adapt if isinstance(adapt, OnlineOptions) else None)
    return SpeculativeModel(target, tokenizer, plan.drafter, verifier, plan.tree_budget, tune, plan.history, online)


from_pretrained = load
