"""One draft tree from two sources: a trained head's tree and n-gram continuations of the context.

The verifier does not care where a candidate came from, and the two sources win on different text: a
head (EAGLE-2 dynamic tree or Medusa tree) on text it has learnt to predict, prompt lookup (Saxena 2023)
where the answer copies the prompt or itself (extraction, retrieval-augmented QA, translation, code
that repeats identifiers). :class:`HybridDrafter` drafts with both and merges them into one tree
(:func:`merge_chain`: the n-gram chain is walked down from the root along nodes the head already has;
the rest becomes new nodes, so no two siblings hold the same token), in the spirit of SuffixDecoding
(Oliaro et al. 2024, arXiv:2411.04975).

Every candidate of both sources is deterministic (top-k of the head, the continuation of the latest
match), so the merged tree has ``q = None`` and the lossless tree verifier treats each node as a one-hot
proposal (:func:`~selfspec.decode.rejection.verify_tree_sampling`): sampling stays exact.

How many nodes each source gets is decided every step from the machine's verification cost profile and
the acceptance each source has shown so far in this decode (:class:`SourceAcceptance`): for each choice
of (head tree on/off or smaller, n-gram length L) the expected tokens

    1 + sum_d [h_d + c_d - h_d * c_d]

(h_d: how often the head's path reached depth d; c_d: how often an n-gram chain of the current match
length and source reached depth d; the two treated as independent) over the cost ``draft_ms + verify_ms(nodes)``
(the verification cost measured here, e.g. :meth:`~selfspec.decode.tuning.costs.CostProfile.verify_cost_ms`),
and the best ratio is drafted. Nodes both sources propose are counted once.

With a second n-gram source (a :class:`~selfspec.decode.drafters.suffix_index.SuffixIndex` of training answers, or
the served history), the chain of a step comes from the context or from that source: the one whose chains of the
matched size have had their first token accepted more often in this decode, the longer match while neither has been
tried (the context on a tie). The acceptance of the second source's chains is counted apart from the context's
(keyed by ``-n``), so a source whose long matches lead astray (a worked solution of another question) stops
replacing the request's own n-grams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from selfspec.decode.drafters.base import AcceptedPath, Drafter, DrafterInfo, DraftLimit
from selfspec.decode.drafters.prompt_lookup import PromptLookupDrafter
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree, depths_of, root_only


class ContinuationSource(Protocol):
    """A second n-gram source of the hybrid: continuations of the context's longest matching suffix n-gram
    (:class:`~selfspec.decode.drafters.suffix_index.SuffixIndex` over training answers,
    :class:`~selfspec.decode.drafters.served_history.ServedHistory` over served outputs)."""

    def lookup(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """``(up to max_tokens ids, the match length n)``; ``([], 0)`` when nothing matches."""

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ValueError when the source holds ids outside the target's vocabulary."""


def merge_chain(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, list[int]]:
    """Add a chain of tokens under the root of a deterministic tree, sharing the nodes it already has.

    From the root, each chain token follows the child holding it when there is one, else becomes a new
    node (appended, so parents still precede children and the first nodes are the tree's own).

    Args:
        tree: a deterministic draft (``q is None``), ``N`` nodes.
        chain: draft token ids continuing the root, in order.

    Returns:
        ``(merged tree with N + new nodes, the chain's node indices [len(chain)])``.

    Raises:
        ValueError: a tree with sampled children (``q`` given): merging would change the distributions
            its children were drawn from, and sampling would no longer be exact.
    """
    if tree.q is not None:
        raise ValueError("only deterministic trees (q=None) can be merged; sampled draft trees cannot")
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    children: dict[tuple[int, int], int] = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True))}
    node, path = 0, []
    for tok in chain:
        child = children.get((node, tok))
        if child is None:
            child = len(tokens)
            tokens.append(tok)
            parents.append(node)
            children[(node, tok)] = child
        path.append(child)
        node = child
    device = tree.tokens.device
    merged = DraftTree(
        tokens=torch.tensor(tokens, dtype=tree.tokens.dtype, device=device),
        parents=torch.tensor(parents, dtype=tree.parents.dtype, device=tree.parents.device),
    )
    return merged, path


def new_nodes(tree: DraftTree, chain: list[int]) -> list[int]:
    """How many nodes :func:`merge_chain` adds for each prefix of ``chain``: ``[len(chain) + 1]``, entry L
    for the first L tokens (entry 0 is 0)."""
    index = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))}
    counts, node, added, fresh = [0], 0, 0, False
    for tok in chain:
        if not fresh and (node, tok) in index:
            node = index[(node, tok)]
        else:
            fresh = True
            added += 1
        counts.append(added)
    return counts


@dataclass
class SourceAcceptance:
    """How deep each source's path was accepted, by depth, in one decode (counts, with a weak prior).

    Attributes:
        head_drafted: steps drafted with the head at full size.
        head_reached: ``head_reached[d - 1]``: of those, steps whose accepted path held a head node at depth d.
        chain_drafted: ``{match n-gram size: [steps whose chain had a node at depth d]}``; the key is the size
            n for a chain from the context, ``-n`` for one from a suffix index.
        chain_reached: ``{match n-gram size: [steps whose accepted path followed the chain to depth d]}``.
    """

    head_drafted: int = 0
    head_reached: list[int] = field(default_factory=list)
    chain_drafted: dict[int, list[int]] = field(default_factory=dict)
    chain_reached: dict[int, list[int]] = field(default_factory=dict)

    def head_rate(self, depth: int) -> float:
        """P(the head's path reaches ``depth``), prior 0.5 (one pseudo-step each way)."""
        got = self.head_reached[depth - 1] if depth <= len(self.head_reached) else 0
        return (got + 0.5) / (self.head_drafted + 1.0)

    def chain_rate(self, ngram: int, depth: int) -> float:
        """P(a chain from a match of ``ngram`` tokens is accepted to ``depth``), prior 0.25 (one pseudo-step:
        prompt lookup's first-depth acceptance on the development machine's prompt sets was 0.35, deeper less)."""
        drafted = self.chain_drafted.get(ngram, [])
        reached = self.chain_reached.get(ngram, [])
        n = drafted[depth - 1] if depth <= len(drafted) else 0
        r = reached[depth - 1] if depth <= len(reached) else 0
        return (r + 0.25) / (n + 1.0)

    def record_head(self, reached: int) -> None:
        self.head_drafted += 1
        while len(self.head_reached) < reached:
            self.head_reached.append(0)
        for d in range(reached):
            self.head_reached[d] += 1

    def record_chain(self, ngram: int, length: int, reached: int) -> None:
        drafted = self.chain_drafted.setdefault(ngram, [])
        got = self.chain_reached.setdefault(ngram, [])
        while len(drafted) < length:
            drafted.append(0)
            got.append(0)
        for d in range(length):
            drafted[d] += 1
            got[d] += int(d < reached)


class HybridDrafter(Drafter):
    """A head's draft tree merged with prompt-lookup continuations, sized every step (see module docstring).

    Args:
        head: the head's drafter (:class:`~selfspec.decode.drafters.eagle.EagleDrafter` or
            :class:`~selfspec.decode.drafters.medusa.MedusaDrafter`; any drafter whose trees are deterministic).
        verify_cost_ms: the target's verification cost here by tree size (nodes -> ms), e.g. a cost
            profile's ``verify_cost_ms`` (:mod:`selfspec.decode.tuning.costs`).
        lookup: the n-gram source (its ``max_ngram`` / ``min_ngram``; ``num_tokens`` is the longest chain).
        suffix_index: an optional second n-gram source (:class:`ContinuationSource`): continuations from training
            answers (:class:`~selfspec.decode.drafters.suffix_index.SuffixIndex`) or from the outputs served so far
            (:class:`~selfspec.decode.drafters.served_history.ServedHistory`); shared by :meth:`fork`.

    Attributes:
        acceptance: the :class:`SourceAcceptance` of the current decode (reset by :meth:`begin`).
        split: per step, ``(head nodes, chain nodes added)`` as drafted (for reports).

    Raises:
        ValueError: a head drafter that is itself a hybrid, or one that samples its trees.
    """

    def __init__(
        self,
        head: Drafter,
        verify_cost_ms: Callable[[int], float],
        lookup: PromptLookupDrafter | None = None,
        suffix_index: ContinuationSource | None = None,
    ) -> None:
        if isinstance(head, HybridDrafter):
            raise ValueError("the head of a hybrid drafter cannot be a hybrid drafter")
        if head.info().sampled:
            raise ValueError(
                f"the {head.info().name} drafter samples its trees under sampling; a hybrid merges deterministic "
                "(top-k) trees only: use a head drafter (EAGLE, Medusa)"
            )
        self.head = head
        self.verify_cost_ms = verify_cost_ms
        self.lookup = lookup or PromptLookupDrafter(num_tokens=8)
        self.suffix_index = suffix_index
        self.acceptance = SourceAcceptance()
        self.split: list[tuple[int, int]] = []
        self._head_ms = 0.0
        self._head_calls = 0
        self._last: tuple[DraftTree, int, list[int], int] | None = None  # tree, head nodes, chain path, n-gram
        self._head_shape: tuple[int, int] | None = None  # (nodes, depth) of the head's last tree

    def info(self) -> DrafterInfo:
        head = self.head.info()
        return DrafterInfo(
            name="hybrid",
            max_depth=max(head.max_depth, self.lookup.num_tokens),
            target_layers=head.target_layers,
            vocab_size=head.vocab_size,
            head=head.head,
        )

    def trained_head(self) -> torch.nn.Module | None:
        """The head drafter's head module."""
        return self.head.trained_head()

    def fork(self) -> HybridDrafter:
        """A hybrid for another sequence (a batch row): its own head fork and statistics."""
        return HybridDrafter(self.head.fork(), self.verify_cost_ms, self.lookup, self.suffix_index)

    def check_vocab(self, target_vocab_size: int) -> None:
        if self.suffix_index is not None:
            self.suffix_index.check_vocab(target_vocab_size)
        self.head.check_vocab(target_vocab_size)

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        self.head.begin(prompt_ids, hidden)
        self.acceptance = SourceAcceptance()
        self.split = []
        self._last = None
        self._head_shape = None

    def _expected(self, head_on: bool, chain_len: int, ngram: int, depth: int) -> float:
        tokens = 1.0
        for d in range(1, depth + 1):
            h = self.acceptance.head_rate(d) if head_on else 0.0
            c = self.acceptance.chain_rate(ngram, d) if d <= chain_len else 0.0
            tokens += h + c - h * c
        return tokens

    def _choose(
        self, head_nodes: int, head_depth: int, chain: list[int], ngram: int, added: list[int], heads=(True, False)
    ):
        """The (head on?, chain length) with the most expected tokens per ms."""
        head_ms = self._head_ms if self._head_calls else 0.0
        best = (True, 0)
        best_rate = -1.0
        for head_on in heads:
            for length in range(len(chain) + 1):
                if not head_on and length == 0:
                    continue
                nodes = (head_nodes if head_on else 1) + (added[length] if head_on else length)
                depth = max(head_depth if head_on else 0, length)
                ms = (head_ms if head_on else 0.0) + self.verify_cost_ms(nodes)
                rate = self._expected(head_on, length, ngram, depth) / ms
                if rate > best_rate:
                    best, best_rate = (head_on, length), rate
        return best

    def _index_wins(self, ngram: int, n: int) -> bool:
        """Whether the index's chain (a match of ``n`` tokens) replaces the context's (``ngram`` tokens; 0: none):
        the one whose first token this decode has accepted more often at that match size wins, the longer match on
        a tie (both unseen), the context on an equal length."""
        if ngram == 0:
            return True
        ours, theirs = self.acceptance.chain_rate(ngram, 1), self.acceptance.chain_rate(-n, 1)
        return theirs > ours if theirs != ours else n > ngram

    @torch.inference_mode()
    def propose(
        self, context: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, limit: DraftLimit
    ) -> DraftTree:
        """The merged tree for this step (root ``context[-1]``); the limit caps the n-gram chain and passes on
        to the head."""
        room = limit.useful_depth if limit.depth is None else min(limit.useful_depth, limit.depth)
        ctx = context.tolist()
        chain, ngram = self.lookup.chain(ctx, room)
        if self.suffix_index is not None and room:
            found, n = self.suffix_index.lookup(ctx, min(self.lookup.num_tokens, room))
            if found and self._index_wins(ngram if chain else 0, n):
                chain, ngram = found, -n
        head_on = True
        if chain and self._head_shape is not None:
            # Whether to draft with the head at all, from its last tree's size (the chain counted as all new):
            # a step the chain alone serves better skips the head's drafting cost too.
            n_last, depth_last = self._head_shape
            head_on, _ = self._choose(n_last, depth_last, chain, ngram, list(range(len(chain) + 1)))
        path: list[int] = []
        if head_on:
            t0 = time.perf_counter()
            tree = self.head.propose(context, sampling, generator, limit)
            self._head_calls += 1
            self._head_ms += ((time.perf_counter() - t0) * 1e3 - self._head_ms) / self._head_calls
            parents = tree.parents.tolist()
            n_head = len(parents)
            self._head_shape = (n_head, max(depths_of(parents)))
            if chain:
                _, length = self._choose(n_head, self._head_shape[1], chain, ngram, new_nodes(tree, chain), (True,))
                if length:
                    tree, path = merge_chain(tree, chain[:length])
        else:
            n_head = 1
            tree = root_only(context)
            _, length = self._choose(1, 0, chain, ngram, list(range(len(chain) + 1)), (False,))
            tree, path = merge_chain(tree, chain[: max(1, length)])
        self.split.append((n_head, tree.tokens.numel() - n_head))
        self._last = (tree, n_head, path, ngram)
        return tree

    def accept(self, accepted: AcceptedPath) -> None:
        """Pass the accepted path on to the head and record how far each source's nodes were accepted."""
        self.head.accept(accepted)
        if self._last is None:
            return
        _, n_head, path, ngram = self._last
        self._last = None
        nodes = accepted.nodes
        if n_head > 1:
            self.acceptance.record_head(sum(1 for i in nodes[1:] if i < n_head))
        if path:
            reached = 0
            for a, b in zip(nodes[1:], path, strict=False):
                if a != b:
                    break
                reached += 1
            self.acceptance.record_chain(ngram, len(path), reached)


def head_of(drafter: Drafter) -> Drafter:
    """The head drafter inside a hybrid (the drafter itself otherwise)."""
    return drafter.head if isinstance(drafter, HybridDrafter) else drafter
