"""EAGLE drafting: an EAGLE-1 feature head (:class:`selfspec.heads.eagle.EagleHead`) grows an EAGLE-2
dynamic draft tree (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees", arXiv:2406.16858).

The head's context is the sequence of pairs ``(f_t, x_{t+1})`` (target feature after the final norm,
next token); pair t sits at head position t and its output predicts ``f_{t+1}``. Only pairs built from
*target* features are kept in the head's KV cache ("stable" entries). One :meth:`EagleDrafter.propose`:

1. Feed the pending stable pairs (the accepted tokens of the last step with their target features),
   ending with ``(f_last, root)``; the root's predicted feature gives depth-1 candidates.
2. For each further level: take the ``top_k`` newest candidates with the highest cumulative draft
   log-probability (the frontier), feed all of them in ONE head forward (inputs: parent's predicted
   feature, own token; a tree mask over the head's own KV), and give each its ``top_k`` best tokens.
3. Rerank every candidate by cumulative log-probability and keep the best ``total_tokens`` (ancestor-closed
   because a child never scores above its parent; ties go to the earlier-created node, so parents win),
   ordered by creation, which puts parents before children.

Drafts are deterministic top-k (``DraftTree.q = None``): the verifier treats them as one-hot proposals,
which keeps sampling lossless. Afterwards the cache is cropped back to the stable pairs: the draft
nodes' KV came from *predicted* features, so after verification the accepted tokens are re-fed with the
target's own features (as EAGLE's reference code does), which is what the head was trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from selfspec.decode.drafters.base import AcceptedPath, DraftCostKey, Drafter, DrafterInfo, DraftLimit, TreeShape
from selfspec.decode.kv import crop_cache
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Sized for a 2-core CPU without a measured budget: verifying 13 nodes costs about 1.4-1.5 single-token target steps
# there (docs/ARCHITECTURE.md, "Facts this design rests on").
DEFAULT_DEPTH = 5
DEFAULT_TOP_K = 4
DEFAULT_TOTAL_TOKENS = 12


def num_candidates(top_k: int, depth: int) -> int:
    """Candidates an EAGLE-2 drafter creates: ``top_k`` at depth 1, ``top_k ** 2`` at each further depth."""
    return top_k + (depth - 1) * top_k * top_k


def select_nodes(scores: torch.Tensor, parents: torch.Tensor, budget: int) -> torch.Tensor:
    """EAGLE-2 reranking: the ``budget`` candidates with the highest cumulative log-probability.

    Args:
        scores: ``[M]`` float cumulative draft log-probabilities (a child's score <= its parent's).
        parents: LongTensor ``[M]``, parent candidate index (``< own index``) or -1 for children of the root.
        budget: how many to keep.

    Returns:
        LongTensor ``[min(budget, M)]`` of kept candidate indices, ascending (so parents precede children).
        The set is ancestor-closed: ties are broken by creation order, and a parent is created before and
        scores at least as high as each child.
    """
    m = scores.numel()
    if budget >= m:
        return torch.arange(m)
    # Stable sort on -score: equal scores keep creation order, so a parent always precedes its child.
    order = torch.sort(-scores.float(), stable=True).indices[:budget]
    return torch.sort(order).values


class EagleDrafter(Drafter):
    """EAGLE-2 dynamic-tree drafter on an EAGLE-1 or EAGLE-3 head (:class:`~selfspec.decode.drafters.base.Drafter`).

    Args:
        head: an :class:`~selfspec.heads.eagle.EagleHead` on the target's device and dtype (attached to
            ``target`` here).
        target: the frozen target.
        depth: maximum draft depth d (tokens beyond the root); one head forward per level.
        top_k: candidates per expansion and nodes expanded per level; ``top_k=1`` drafts a chain.
        total_tokens: draft tokens kept after reranking (the root excluded), so a tree has at most
            ``total_tokens + 1`` nodes (EAGLE-2's ``total_token``). ``selfspec.load`` can size depth and
            total_tokens to the machine (:mod:`selfspec.decode.tuning.budget`) and passes them here.

    Raises:
        ValueError: non-positive sizes, or ``top_k`` larger than the draft vocabulary.
    """

    def __init__(
        self,
        head,
        target,
        depth: int = DEFAULT_DEPTH,
        top_k: int = DEFAULT_TOP_K,
        total_tokens: int = DEFAULT_TOTAL_TOKENS,
    ) -> None:
        if depth < 1 or top_k < 1 or total_tokens < 1:
            raise ValueError("depth, top_k and total_tokens must be >= 1")
        if top_k > head.config.n_draft:
            raise ValueError(f"top_k={top_k} exceeds the draft vocabulary ({head.config.n_draft})")
        head.attach_target(target)  # always this target: a head may still reference the one it was trained with
        self.head = head
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self._cache = None
        self._stable = 0  # head KV entries built from target features
        self._feats: torch.Tensor | None = None  # [m + 1, D] pending target features
        self._tokens: torch.Tensor | None = None  # [m] tokens paired with all but the last pending feature
        # Diagnostics of the last propose(): every candidate (creation order) and which were kept.
        self.last_candidates: dict[str, torch.Tensor] | None = None

    def info(self) -> DrafterInfo:
        """EAGLE-3 heads take the states of three target layers (``head.target_layers``); EAGLE-1 heads the last."""
        cfg = self.head.config
        nodes = min(self.total_tokens, num_candidates(self.top_k, self.depth)) + 1
        return DrafterInfo(
            name="eagle",
            max_depth=self.depth,
            target_layers=self.head.target_layers,
            vocab_size=cfg.vocab_size,
            head=True,
            draft_cost=DraftCostKey(cfg.head_type, f"k{self.top_k}-{cfg.cost_shape}", self.top_k),
            tree=TreeShape(self.depth, self.total_tokens, nodes, self.top_k),
        )

    def trained_head(self) -> torch.nn.Module:
        """The EAGLE head module (what :mod:`selfspec.train.online` adapts)."""
        return self.head

    def at_depth(self, depth: int, target: PreTrainedModel) -> EagleDrafter:
        """An EAGLE drafter of this head, ``top_k`` and ``total_tokens`` that drafts ``depth`` levels."""
        return EagleDrafter(self.head, target, depth, self.top_k, self.total_tokens)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.head.arch_config)

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Reset; pairs ``(f_t, x_{t+1})`` of the prompt become pending.

        ``prompt_ids`` ``[T]``, ``hidden`` ``[T, D]``."""
        self._cache = self._new_cache()
        self._stable = 0
        self._feats = hidden
        self._tokens = prompt_ids[1:]

    def accept(self, accepted: AcceptedPath) -> None:
        """Queue the accepted path (root first, ``[A]``) with its target features ``[A, D]`` for the next step.

        The root's pair is already stable; the pairs ``(f_root, a_1) ... (f_{A-2}, a_{A-1})`` and the last
        feature (paired with the next root) are fed at the start of the next :meth:`propose`. A step decoded
        without drafting (no :meth:`propose` since the last call, e.g. a batch whose rule turned speculation
        off) leaves its pairs pending: they are kept, and this step's follow them (its root is the token
        after the last pending feature).
        """
        tokens, hidden = accepted.tokens, accepted.hidden
        if self._feats is not None and self._tokens is not None and self._cache is not None:
            self._feats = torch.cat([self._feats, hidden.to(self._feats.dtype)])
            self._tokens = torch.cat([self._tokens, tokens.to(self._tokens.device)])
            return
        self._feats = hidden
        self._tokens = tokens[1:]

    def _mask(self, allowed: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
        """``allowed`` Bool ``[Q, K]`` over the non-stable tail -> additive ``[1, 1, Q, past + K]``."""
        q, k = allowed.shape
        bias = torch.zeros(1, 1, q, past + k, dtype=dtype, device=allowed.device)
        bias[0, 0, :, past:].masked_fill_(~allowed, torch.finfo(dtype).min)
        return bias

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """Draft an EAGLE-2 tree rooted at ``context[-1]``; returns ``DraftTree(tokens, parents, q=None)``.

        The tree has the drafter's own ``depth`` and ``total_tokens``, or a batch rule's (``limit.depth``,
        ``limit.tokens``) when it sets them; ``limit.useful_depth`` is not used (the tree's nodes are
        reranked across depths, so a shallower tree is not the deep one cut)."""
        head, cache, k = self.head, self._cache, self.top_k
        depth = self.depth if limit.depth is None else limit.depth
        total_tokens = self.total_tokens if limit.tokens is None else limit.tokens
        if cache is None or self._feats is None:
            raise RuntimeError("EagleDrafter.propose called before begin()")
        device = context.device
        dtype = head.fc.weight.dtype
        root = context[-1:]

        # 1. stable pairs, ending with (f_last, root): causal over themselves, all of the cache.
        toks = torch.cat([self._tokens.to(device), root])
        m = toks.numel()
        past = self._stable
        pos = torch.arange(past, past + m, device=device).unsqueeze(0)
        causal = torch.ones(m, m, dtype=torch.bool, device=device).tril()
        out = head(self._feats.unsqueeze(0), toks.unsqueeze(0), pos, self._mask(causal, past, dtype), cache)
        self._stable = past + m
        self._feats = self._tokens = None
        root_pos = past + m - 1

        # Candidate bookkeeping (index = creation order).
        cand_tok: list[torch.Tensor] = []  # draft ids
        cand_par: list[torch.Tensor] = []  # parent candidate index, -1 = root
        cand_score: list[torch.Tensor] = []
        logp = torch.log_softmax(head.draft_logits(out[0, -1:]).float(), dim=-1)  # [1, N]
        top = logp.topk(k, dim=-1)
        cand_tok.append(top.indices[0])
        cand_par.append(torch.full((k,), -1, dtype=torch.long, device=device))
        cand_score.append(top.values[0])
        n_cand = k
        frontier = torch.arange(k, device=device)  # candidates to expand next
        # the predicted feature each frontier node is paired with: the head's output as its forward returns it
        # (post-norm for an EAGLE-3.1 head with norm_output), the same that training's unrolled steps feed
        frontier_feat = out[0, -1:].expand(k, -1)
        # Draft nodes fed to the head this step: their candidate ids and ancestor mask among themselves.
        fed: list[int] = []
        fed_allowed = torch.zeros(0, 0, dtype=torch.bool, device=device)

        for level in range(1, depth):
            toks_all = torch.cat(cand_tok)
            par_all = torch.cat(cand_par)
            f_ids = frontier.tolist()
            # Tree mask: each frontier node sees its fed ancestors (its parent is fed, transitively) and itself.
            slot = {c: i for i, c in enumerate(fed)}
            q = len(f_ids)
            allowed = torch.zeros(q, len(fed) + q, dtype=torch.bool, device=device)
            for i, c in enumerate(f_ids):
                p = int(par_all[c])
                if p >= 0:
                    allowed[i, : len(fed)] = fed_allowed[slot[p]]
                allowed[i, len(fed) + i] = True
            grown = torch.zeros(len(fed) + q, len(fed) + q, dtype=torch.bool, device=device)
            grown[: len(fed), : len(fed)] = fed_allowed
            grown[len(fed) :] = allowed
            pos = torch.full((1, q), root_pos + level, dtype=torch.long, device=device)
            ids = head.draft_ids[toks_all[frontier]].unsqueeze(0)
            out = head(frontier_feat.unsqueeze(0), ids, pos, self._mask(allowed, self._stable, dtype), cache)
            fed.extend(f_ids)
            fed_allowed = grown

            logp = torch.log_softmax(head.draft_logits(out[0]).float(), dim=-1)  # [q, N]
            top = logp.topk(k, dim=-1)
            parent_scores = torch.cat(cand_score)[frontier]
            scores = (parent_scores.unsqueeze(1) + top.values).reshape(-1)  # [q * k]
            cand_tok.append(top.indices.reshape(-1))
            cand_par.append(frontier.repeat_interleave(k))
            cand_score.append(scores)
            best = scores.topk(min(k, scores.numel())).indices
            frontier = n_cand + best
            frontier_feat = out[0][best // k]
            n_cand += scores.numel()

        crop_cache(cache, self._stable)  # draft KV came from predicted features: drop it all
        scores = torch.cat(cand_score)
        parents = torch.cat(cand_par)
        keep = select_nodes(scores.cpu(), parents.cpu(), total_tokens).to(device)
        new_index = torch.full((n_cand,), -1, dtype=torch.long, device=device)
        new_index[keep] = torch.arange(1, keep.numel() + 1, device=device)
        kept_par = parents[keep]
        tree_par = torch.where(kept_par < 0, torch.zeros_like(kept_par), new_index[kept_par.clamp(min=0)])
        tokens = torch.cat([root, head.draft_ids[torch.cat(cand_tok)[keep]].to(root.dtype)])
        tree_parents = torch.cat([torch.tensor([-1], device=device), tree_par])
        self.last_candidates = {
            "tokens": head.draft_ids[torch.cat(cand_tok)],
            "parents": parents,
            "scores": scores,
            "kept": keep,
        }
        return DraftTree(tokens=tokens, parents=tree_parents, q=None)
