"""Speculative decoding of a batch of ragged prompts: one target forward per step for every row still decoding.

Each row keeps its own drafter state, output, stopping rule and statistics, and accepts its own number of
tokens per step; the rows share the target's forwards. A step:

1. every active row drafts its tree (its own fork of the drafter; the tree sized for the current batch by
   a :class:`~selfspec.decode.tuning.batch_rule.BatchTreeRule`, down to the root alone: plain decoding);
2. the trees, padded to the largest, go through one target forward (:meth:`Verifier.forward_block`: per-row
   positions and tree masks over the row's own cache slots, :mod:`selfspec.decode.batch_cache`);
3. each row's target distributions are processed and verified exactly as in
   :func:`~selfspec.decode.generate.speculative_generate` (greedy: the target's argmax path; sampling: the
   lossless tree rejection sampler, Leviathan et al. 2023; Miao et al. 2024), so every row's output is
   the target's own: under greedy its batch-1 output token for token (up to floating-point ties between
   batch shapes), under sampling the target's distribution;
4. accepted KV entries are kept per row; rows that stop leave the batch, so later steps cost less.

Prompts are not padded into the target: each row's cache holds only its own tokens (empty slots are
masked), so no row attends to padding and positions are per row.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.decode.batch_cache import SlotTable
from selfspec.decode.drafters import Drafter, DraftTree
from selfspec.decode.generate import (
    GenerationOutput,
    GenerationStats,
    _count,
    _count_depths,
    _finite,
    _proposer,
    _room_in_context,
    _single_prompt,
    _verify,
    cut_tree,
    target_distributions,
)
from selfspec.decode.sampling import SamplingConfig, probs_from_logits, sample
from selfspec.decode.stopping import Stopper
from selfspec.decode.tree import tree_depths
from selfspec.decode.verifier import Verifier, as_verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.decode.tuning.batch_rule import BatchTreeRule

# Pack the cache (squeeze out the slots rejected drafts left empty) once this many are left.
PACK_EMPTY_SLOTS = 32


def fork_drafter(drafter: Drafter) -> Drafter:
    """A drafter for one more sequence: ``drafter.fork()`` when it has one, else a shallow copy (weights and
    settings shared; the per-sequence state is set anew by ``begin``)."""
    fork = getattr(drafter, "fork", None)
    return fork() if fork is not None else copy.copy(drafter)


@dataclass
class _Row:
    """One sequence of the batch."""

    index: int  # position in the caller's list
    prompt: torch.Tensor  # [T]
    drafter: Drafter
    stopper: Stopper
    room: int | None
    stats: GenerationStats
    out: list[int] = field(default_factory=list)
    context: torch.Tensor | None = None  # prompt + output (the root last)
    reason: str | None = None
    next_token: int = 0  # this step's bonus or correction token
    draft_s: float = 0.0  # this step's drafting seconds


@torch.inference_mode()
def speculative_generate_batch(
    verifier: Verifier | PreTrainedModel,
    drafter: Drafter | Sequence[Drafter],
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 128,
    min_new_tokens: int = 0,
    sampling: SamplingConfig | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop_strings: Sequence[str] = (),
    tokenizer=None,
    logits_processor=None,
    generator: torch.Generator | None = None,
    acceptance: str = "exact",
    tree_rule: BatchTreeRule | None = None,
) -> list[GenerationOutput]:
    """Generate for several prompts at once; each row's output is the target's own (see module docstring).

    Args:
        verifier: the target's :class:`~selfspec.decode.verifier.Verifier`, or the target itself.
        drafter: the drafter; each row gets its own fork (:func:`fork_drafter`). A list gives one drafter per
            row instead (used as they are; e.g. drafters that know their row's prompt).
        prompts: B >= 1 LongTensors ``[T_b]`` (or ``[1, T_b]``), of any lengths ``T_b >= 1``.
        tree_rule: sizes every row's tree from the number of rows still decoding (and turns speculation off
            where it does not pay); None drafts each drafter's own tree at every batch size.
        Others: as :func:`~selfspec.decode.generate.speculative_generate` (one value for every row; a
            shared ``generator`` draws every row's random numbers).

    Returns:
        One :class:`~selfspec.decode.generate.GenerationOutput` per prompt, in the prompts' order; each row's
        ``stats`` count its own steps and acceptance, and the batch's wall time (``total_s`` is the whole
        call's, the same for every row).

    Raises:
        ValueError: no prompt, a prompt that is empty, batch-shaped or leaves no room in the target's
            context, ``max_new_tokens < 1``, ``min_new_tokens < 0``, a drafter whose vocabulary is not the
            target's; nothing has run.
        selfspec.decode.generate.NonFiniteLogitsError: NaN or inf in the target's logits (names the step).
    """
    sampling = sampling or SamplingConfig()
    if acceptance not in ("exact", "typical"):
        raise ValueError("acceptance must be 'exact' (lossless) or 'typical' (lossy, Medusa)")
    if isinstance(prompts, torch.Tensor) or not prompts:
        raise ValueError("prompts must be a non-empty list of LongTensors [T] (one per row; lengths may differ)")
    rows_in = [_single_prompt(p) for p in prompts]
    max_new_tokens = _count("max_new_tokens", max_new_tokens, 1)
    min_new_tokens = _count("min_new_tokens", min_new_tokens, 0)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    verifier = as_verifier(verifier)
    device = next(verifier.target.parameters()).device
    if isinstance(drafter, (list, tuple)):
        if len(drafter) != len(rows_in):
            raise ValueError(
                f"got {len(drafter)} drafters for {len(rows_in)} prompts: pass one drafter, or one per prompt"
            )
        drafters = list(drafter)
    else:
        drafters = [fork_drafter(drafter) for _ in rows_in]
    for d in drafters:
        check_vocab = getattr(d, "check_vocab", None)
        if check_vocab is not None:
            check_vocab(verifier.target.get_output_embeddings().weight.shape[0])
    rows: list[_Row] = []
    for i, prompt in enumerate(rows_in):
        room = _room_in_context(verifier.target, prompt.numel())
        limit = max_new_tokens if room is None else min(max_new_tokens, room)
        stats = GenerationStats(lossy=acceptance == "typical")
        stopper = Stopper(eos_ids, stop_strings, tokenizer, limit)
        rows.append(_Row(i, prompt.to(device), drafters[i], stopper, room, stats))
    loop = _BatchLoop(verifier, rows, sampling, min_new_tokens, eos_ids, logits_processor, generator, acceptance)
    loop.run(tree_rule)
    outputs = []
    for row in rows:
        row.stats.finish_reason = row.reason or "length"
        row.stats.new_tokens = len(row.out)
        row.stats.total_s = loop.total_s
        text = tokenizer.decode(row.out, skip_special_tokens=True) if tokenizer is not None else None
        outputs.append(GenerationOutput(tokens=row.out, stats=row.stats, text=text))
    return outputs


class _BatchLoop:
    """The steps of :func:`speculative_generate_batch` on validated rows."""

    def __init__(self, verifier, rows, sampling, min_new_tokens, eos_ids, logits_processor, generator, acceptance):
        self.verifier = verifier
        self.rows: list[_Row] = rows
        self.sampling = sampling
        self.min_new_tokens = min_new_tokens
        self.eos_ids = eos_ids
        self.logits_processor = logits_processor
        self.generator = generator
        self.acceptance = acceptance
        self.layers = getattr(rows[0].drafter, "target_layers", None)
        self.cache = verifier.new_cache()
        self.table = SlotTable(len(rows))
        self.total_s = 0.0
        self.steps = 0

    def _forward(self, active: list[_Row], trees: list[DraftTree], depths: list[torch.Tensor]):
        """One target forward over the rows' trees; returns per-row (hidden [N, D], feats [N, F])."""
        q = max(t.tokens.numel() for t in trees)
        device = trees[0].tokens.device
        tokens = torch.zeros(len(trees), q, dtype=torch.long, device=device)
        lengths = self.table.lengths
        positions = torch.zeros(len(trees), q, dtype=torch.long)
        for b, (tree, d) in enumerate(zip(trees, depths, strict=True)):
            n = tree.tokens.numel()
            tokens[b, :n] = tree.tokens
            positions[b, :n] = d + lengths[b]
            positions[b, n:] = lengths[b]
        out = self.verifier.forward_block(
            tokens, positions, self.table.positions, [t.parents.cpu() for t in trees], self.cache, layers=self.layers
        )
        hidden, feats = out if self.layers else (out, out)
        per_row = [(hidden[b, : t.tokens.numel()], feats[b, : t.tokens.numel()]) for b, t in enumerate(trees)]
        return per_row, positions

    def _logits(self, per_row: list[tuple[torch.Tensor, torch.Tensor]], step: int) -> list[torch.Tensor]:
        """Target logits of every row's nodes, in one projection: B tensors ``[N_b, V]`` float32."""
        flat = torch.cat([h for h, _ in per_row])
        logits = _finite(self.verifier.lm_logits(flat), step)
        return list(torch.split(logits, [h.shape[0] for h, _ in per_row]))

    def run(self, tree_rule) -> None:
        t0 = time.perf_counter()
        rows = self.rows
        # Prefill: each prompt as a chain block, every node kept.
        chains = [DraftTree(tokens=r.prompt, parents=torch.arange(-1, r.prompt.numel() - 1)) for r in rows]
        depths = [torch.arange(r.prompt.numel()) for r in rows]
        per_row, positions = self._forward(rows, chains, depths)
        self.table.keep(self.cache, [torch.arange(r.prompt.numel()) for r in rows], positions)
        last = [h[-1:] for h, _ in per_row]
        logits = self._logits([(h, h) for h in last], 0)
        root = torch.tensor([-1])
        for row, (_, f), lg in zip(rows, per_row, logits, strict=True):
            tree = DraftTree(tokens=row.prompt[-1:], parents=root)
            p0 = target_distributions(
                lg, row.prompt, tree, self.sampling, self.logits_processor, 0, self.min_new_tokens, self.eos_ids,
                torch.zeros(1, dtype=torch.long),
            )  # fmt: skip
            if self.sampling.do_sample:
                first = int(sample(probs_from_logits(p0), self.generator)[0])
            else:
                first = int(p0[0].argmax())
            row.drafter.begin(row.prompt, f)
            row.reason = row.stopper.push(row.out, [first])
            row.context = torch.cat([row.prompt, torch.tensor([first], device=row.prompt.device)])
            row.stats.prefill_s = time.perf_counter() - t0
        active = self._drop_finished([r for r in rows])
        while active:
            active = self._step(active, tree_rule)
        self.total_s = time.perf_counter() - t0

    def _drop_finished(self, active: list[_Row]) -> list[_Row]:
        keep = [i for i, r in enumerate(active) if r.reason is None]
        if len(keep) < len(active) and keep:
            self.table.select_rows(self.cache, keep)
        elif self.table.empty_slots >= PACK_EMPTY_SLOTS:
            self.table.pack(self.cache)
        return [active[i] for i in keep]

    def _draft(self, row: _Row, cap) -> tuple[DraftTree, torch.Tensor]:
        """Row's tree for this step, cut to ``cap`` (a :class:`~selfspec.decode.tuning.batch_rule.TreeCap`), to the
        tokens still allowed and to the target's context."""
        allowed = row.stopper.max_new_tokens - len(row.out) - 1
        if row.room is not None:
            allowed = min(allowed, row.room - len(row.out) - 1)
        max_depth = allowed if cap is None or cap.depth is None else min(allowed, cap.depth)
        if max_depth <= 0:
            return DraftTree(tokens=row.context[-1:], parents=torch.tensor([-1])), torch.zeros(1, dtype=torch.long)
        if cap is not None:
            cap.apply(row.drafter)
        tree = _proposer(row.drafter)(row.context, self.sampling, self.generator, max_depth)
        depths = tree_depths(tree.parents.cpu())
        if int(depths.max()) > max_depth:
            tree, depths = cut_tree(tree, depths, max_depth)
        if cap is not None and cap.max_nodes is not None and tree.tokens.numel() > cap.max_nodes:
            tree, depths = _prefix(tree, depths, cap.max_nodes)
        return tree, depths

    def _step(self, active: list[_Row], tree_rule) -> list[_Row]:
        self.steps += 1
        cap = tree_rule(len(active)) if tree_rule is not None else None
        trees, depths = [], []
        for row in active:
            t1 = time.perf_counter()
            tree, d = self._draft(row, cap)
            trees.append(tree)
            depths.append(d)
            row.draft_s = time.perf_counter() - t1
            row.stats.draft_s += row.draft_s
        t2 = time.perf_counter()
        per_row, positions = self._forward(active, trees, depths)
        logits = self._logits(per_row, self.steps)
        accepted = []
        for row, tree, d, lg in zip(active, trees, depths, logits, strict=True):
            p = target_distributions(
                lg, row.context, tree, self.sampling, self.logits_processor, len(row.out), self.min_new_tokens,
                self.eos_ids, d,
            )  # fmt: skip
            result = _verify(p, tree, self.sampling, self.generator, self.acceptance)
            accepted.append(result.accepted_nodes.cpu())
            row.next_token = result.next_token
        self.table.keep(self.cache, accepted, positions)
        t3 = time.perf_counter()
        for row, tree, d, (_, feats), acc in zip(active, trees, depths, per_row, accepted, strict=True):
            new = tree.tokens[acc[1:].to(tree.tokens.device)].tolist() + [row.next_token]
            row.drafter.accept(tree.tokens[acc.to(tree.tokens.device)], feats[acc.to(feats.device)])
            row.stats.verify_s += t3 - t2
            row.stats.steps += 1
            row.stats.tree_nodes += tree.tokens.numel()
            row.stats.accepted_per_step.append(len(new))
            _count_depths(row.stats, int(d.max()), acc.numel() - 1)
            if tree_rule is not None:
                tree_rule.observe(d, acc.numel() - 1, row.draft_s)
            row.reason = row.stopper.push(row.out, new)
            row.context = torch.cat([row.context, torch.tensor(new, device=row.context.device)])
        return self._drop_finished(active)


def _prefix(tree: DraftTree, depths: torch.Tensor, n: int) -> tuple[DraftTree, torch.Tensor]:
    """The tree's first ``n`` nodes (a tree, since parents precede children). Exact: which nodes go depends
    on their index only, never on the drafted tokens' values under the target."""
    q = None if tree.q is None else tree.q[:n]
    return DraftTree(tokens=tree.tokens[:n], parents=tree.parents[:n], q=q), depths[:n]
