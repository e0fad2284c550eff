"""The decode loop: draft -> verify forward -> accept -> keep the accepted KV, one named call each, for rows.

Every call decodes B >= 1 rows, each with its own prompt, drafter, output, stopper, statistics and streamer.
A step:

1. each row's drafter proposes a tree (:meth:`~selfspec.decode.drafters.base.Drafter.propose`), read to the
   host once (:func:`~selfspec.decode.host.read_tree`: positions, masks, acceptance, cache bookkeeping and
   statistics share that copy) and cut to the depth the target's context still holds (and a batch tree
   rule's depth);
2. one target forward verifies every row's tree (batch 1: :meth:`Verifier.forward_tree` and
   :func:`~selfspec.decode.kv.compact_cache`; batch > 1: :meth:`Verifier.forward_block` over each row's own
   cache slots, :class:`~selfspec.decode.batch_cache.SlotTable`), and one projection gives every node's logits;
3. each row's target distributions are processed exactly as plain ``generate`` would process them
   (:func:`~selfspec.decode.step.target_distributions`) and verified (:func:`~selfspec.decode.step.verify_step`:
   greedy, the target's argmax path; sampling, lossless tree rejection sampling, Leviathan et al. 2023,
   Chen et al. 2023, Miao et al. 2024); under greedy every row's argmax is read in one copy;
4. the accepted KV entries are kept, the drafter is told the verified path
   (:class:`~selfspec.decode.drafters.base.AcceptedPath`), the accepted tokens go through the row's stopper
   (EOS, stop strings, length: token by token) and streamer, and rows that stop leave the batch.

So the output of every row is exactly the target's own: under greedy the tokens of
``model.generate(do_sample=False)`` (up to floating-point ties between a tree forward and a one-token
forward, or between batch shapes), under sampling the target's distribution. Outputs stay inside the
target's context (``max_position_embeddings``): near its end the tree is cut to the depth that still fits,
down to the root alone (plain decoding), and a prompt that fills it is refused. Streamers (``transformers``'
``BaseStreamer``) get the prompt, then only accepted tokens, then ``end()``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from selfspec.decode import kv
from selfspec.decode.batch_cache import SlotTable
from selfspec.decode.drafters.base import AcceptedPath, Drafter, DraftLimit
from selfspec.decode.host import HostTree, cut_tree, read_tree, to_device
from selfspec.decode.request import GenerationOutput, GenerationRequest, GenerationStats, room_in_context, single_prompt
from selfspec.decode.sampling import probs_from_logits, sample
from selfspec.decode.state import first_chain, one_at_a_time
from selfspec.decode.step import argmax_with_check, check_finite, target_distributions, verify_step
from selfspec.decode.stopping import Stopper
from selfspec.decode.streaming import as_streamer
from selfspec.decode.tree import DraftTree, chain_parents, root_only
from selfspec.decode.verifier import Verifier, as_verifier
from selfspec.decode.verify import VerifyResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

logger = logging.getLogger(__name__)

# Pack a batch's cache (squeeze out the slots rejected drafts left empty) once this many are left.
PACK_EMPTY_SLOTS = 32

StepCallback = Callable[[int, DraftTree, VerifyResult], None]


@dataclass(frozen=True)
class TreeCap:
    """The tree every row drafts this step at the batch's size (a :class:`TreePolicy`'s answer).

    Attributes:
        depth: deepest draft node allowed; 0 = no speculation (plain decoding); None = the drafter's own.
        total_tokens: draft tokens for a tree drafter with a node budget (EAGLE-2's ``total_tokens``; None:
            its own).
        expected_speedup: the policy's estimate against plain decoding at this batch size (None: unknown).
    """

    depth: int | None = None
    total_tokens: int | None = None
    expected_speedup: float | None = None


class TreePolicy(Protocol):
    """Sizes the rows' trees by the number of rows still decoding and the acceptance observed (the tuning layer's
    tree rule, :class:`selfspec.decode.tuning.batch_rule.BatchTreeRule`, is one); called once per step, at batch 1
    too."""

    def __call__(self, batch: int) -> TreeCap:
        """The cap for a step with ``batch`` rows decoding."""

    def observe(self, depths: torch.Tensor, accepted_depth: int, draft_s: float) -> None:
        """One drafted row-step: node depths ``[N]`` (CPU), how deep its accepted path went, its drafting seconds."""


@dataclass
class _Row:
    """One sequence of the call."""

    index: int  # position in the caller's list
    prompt: torch.Tensor  # [T]
    drafter: Drafter
    stopper: Stopper
    room: int | None  # new tokens the target's context holds after the prompt (None: no limit)
    stats: GenerationStats
    stream: Any = None
    drafts: bool = True  # False: the drafter declares max_depth 0 (every step is the plain step)
    out: list[int] = field(default_factory=list)
    context: torch.Tensor | None = None  # prompt + output (the root last)
    reason: str | None = None
    draft_s: float = 0.0  # this step's drafting seconds


class _OneRow:
    """Batch 1: the tree after the row's own ``DynamicCache`` (:meth:`Verifier.forward_tree`), the accepted
    path compacted into place (:func:`~selfspec.decode.kv.compact_cache`)."""

    def __init__(self, verifier: Verifier, layers) -> None:
        self.verifier, self.layers = verifier, layers
        self.cache = verifier.new_cache()
        self.past = 0

    def prefill(self, rows: list[_Row]):
        out = self.verifier.prefill(rows[0].prompt, self.cache, layers=self.layers)
        self.past = rows[0].prompt.numel()
        return [out if self.layers else (out, out)]

    def forward(self, rows: list[_Row], trees: list[DraftTree], hosts: list[HostTree]):
        tree, host = trees[0], hosts[0]
        out = self.verifier.forward_tree(
            tree.tokens, tree.parents, self.cache, self.past, layers=self.layers, host=host
        )
        return [out if self.layers else (out, out)]

    def keep(self, results: list[VerifyResult], paths: list[tuple[int, ...]]) -> None:
        kv.compact_cache(self.cache, self.past, results[0].accepted_nodes, paths[0])
        self.past += len(paths[0])

    def select(self, keep: list[int], before: int) -> None:
        pass  # the one row left the call: nothing to keep


class _Block:
    """Batch > 1: every row's tree after its own cache slots in one ``DynamicCache`` (:meth:`Verifier.forward_block`),
    accepted entries moved into place per row, finished rows dropped (:class:`SlotTable`)."""

    def __init__(self, verifier: Verifier, layers, batch: int) -> None:
        self.verifier, self.layers = verifier, layers
        self.cache = verifier.new_cache()
        self.table = SlotTable(batch)
        self.positions: torch.Tensor | None = None

    def _run(self, trees: list[DraftTree], structure: list[tuple[list[int], list[int]]]):
        """One block forward of the rows' trees; ``structure``: each tree's (parents, depths) on the host."""
        q = max(len(parents) for parents, _ in structure)
        lengths = self.table.row_lengths()
        tokens = torch.zeros(len(trees), q, dtype=torch.long, device=trees[0].tokens.device)
        positions = torch.zeros(len(trees), q, dtype=torch.long)
        for b, (tree, (parents, depths)) in enumerate(zip(trees, structure, strict=True)):
            n = len(parents)
            tokens[b, :n] = tree.tokens
            positions[b, :n] = torch.tensor(depths) + lengths[b]
            positions[b, n:] = lengths[b]
        out = self.verifier.forward_block(
            tokens,
            positions,
            self.table.positions,
            [parents for parents, _ in structure],  # host lists: the masks are built without a read
            self.cache,
            layers=self.layers,
        )
        hidden, feats = out if self.layers else (out, out)
        self.positions = positions
        return [(hidden[b, : len(pa)], feats[b, : len(pa)]) for b, (pa, _) in enumerate(structure)]

    def prefill(self, rows: list[_Row]):
        """Each prompt as a chain block, every node kept."""
        sizes = [r.prompt.numel() for r in rows]
        trees = [DraftTree(tokens=r.prompt, parents=chain_parents(n)) for r, n in zip(rows, sizes, strict=True)]
        per_row = self._run(trees, [(list(range(-1, n - 1)), list(range(n))) for n in sizes])
        self.table.keep(self.cache, [torch.arange(n) for n in sizes], self.positions)
        return per_row

    def forward(self, rows: list[_Row], trees: list[DraftTree], hosts: list[HostTree]):
        return self._run(trees, [(h.parents, h.depths) for h in hosts])

    def keep(self, results: list[VerifyResult], paths: list[tuple[int, ...]]) -> None:
        self.table.keep(self.cache, [torch.tensor(p) for p in paths], self.positions)

    def select(self, keep: list[int], before: int) -> None:
        if len(keep) < before:
            self.table.select_rows(self.cache, keep)
        elif self.table.empty_slots >= PACK_EMPTY_SLOTS:
            self.table.pack(self.cache)


@torch.inference_mode()
def decode_rows(
    verifier: Verifier | PreTrainedModel,
    drafters: Sequence[Drafter],
    prompts: Sequence[torch.Tensor],
    request: GenerationRequest,
    *,
    streamers: Sequence[BaseStreamer | Callable[[list[int]], None] | None] | None = None,
    step_callback: StepCallback | None = None,
    tree_policy: TreePolicy | None = None,
) -> list[GenerationOutput]:
    """Decode B >= 1 prompts with draft-and-verify; every row's output is the target's own (module docstring).

    Args:
        verifier: the :class:`~selfspec.decode.verifier.Verifier` of the frozen target (its kernel plan speeds
            up verification), or the target itself (``transformers`` causal LM), then verified with plain kernels.
        drafters: one :class:`~selfspec.decode.drafters.base.Drafter` per prompt (e.g. forks of one,
            :meth:`~selfspec.decode.drafters.base.Drafter.fork`); every one must take the same target layers.
        prompts: B LongTensors ``[T_b]`` (or ``[1, T_b]``), of any lengths ``T_b >= 1``.
        request: the call's settings (:class:`~selfspec.decode.request.GenerationRequest`).
        streamers: one per prompt (or None): a ``transformers`` streamer (any ``BaseStreamer``), fed as
            ``generate`` feeds it: ``put(prompt [1, T])`` first, then ``put(LongTensor [n])`` with each step's
            accepted tokens (only tokens that are part of the output: nothing is ever withdrawn), then ``end()``,
            also when generation fails; or a plain callable, called with each step's new token ids.
        step_callback: called after each row's verification with ``(row index, the row's draft tree, its
            VerifyResult)``, before the drafter is told what was accepted (so drafter diagnostics such as
            ``EagleDrafter.last_candidates`` still describe this tree). For measurements
            (:func:`selfspec.decode.tuning.calibration.calibrate_acceptance`); it must not modify its arguments.
        tree_policy: sizes every row's tree from the number of rows still decoding and the acceptance the
            drafters get, and turns speculation off where it does not pay (:class:`TreePolicy`; the steps it
            switched off are counted in each row's ``stats.drafting_off_steps``); None drafts each drafter's own tree.

    Returns:
        One :class:`~selfspec.decode.request.GenerationOutput` per prompt, in the prompts' order; each row's
        ``stats`` count its own steps and acceptance (``total_s`` is the whole call's).

    Raises:
        ValueError: no prompt, a prompt that is empty, batch-shaped or leaves no room in the target's context,
            a number of drafters or streamers other than the prompts', drafters taking different target layers,
            a drafter whose vocabulary is not the target's; nothing has run.
        selfspec.decode.step.NonFiniteLogitsError: (a ``RuntimeError``) NaN or inf in the target's logits; the
            message names the step.
    """
    if isinstance(prompts, torch.Tensor) or not prompts:
        raise ValueError("prompts must be a non-empty list of LongTensors [T] (one per row; lengths may differ)")
    prompts = [single_prompt(p) for p in prompts]
    for name, items in (("drafters", drafters), ("streamers", streamers)):
        if items is not None and len(items) != len(prompts):
            raise ValueError(f"got {len(items)} {name} for {len(prompts)} prompts: pass one per prompt")
    verifier = as_verifier(verifier)
    target = verifier.target
    if len(prompts) > 1 and verifier.chains_only:  # a state per row (decode/state.py): one prompt at a time
        return one_at_a_time(decode_rows, verifier, drafters, prompts, request, streamers, step_callback, tree_policy)
    vocab = target.get_output_embeddings().weight.shape[0]
    infos = [d.info() for d in drafters]
    if len({i.target_layers for i in infos}) > 1:
        raise ValueError("every row's drafter must take the same target layers: fork one drafter for all rows")
    for d in drafters:
        d.check_vocab(vocab)
    device = next(target.parameters()).device
    rows: list[_Row] = []
    for i, (prompt, drafter) in enumerate(zip(prompts, drafters, strict=True)):
        room = room_in_context(target, prompt.numel())
        limit = request.max_new_tokens if room is None else min(request.max_new_tokens, room)
        stopper = Stopper(request.eos_ids, request.stop_strings, request.tokenizer, limit)
        stats = GenerationStats(lossy=request.acceptance == "typical")
        stream = as_streamer(streamers[i]) if streamers is not None else None
        rows.append(_Row(i, prompt.to(device), drafter, stopper, room, stats, stream, infos[i].max_depth > 0))
    try:
        total_s = _Loop(verifier, rows, request, infos[0].target_layers, step_callback, tree_policy).run()
    finally:
        for row in rows:
            if row.stream is not None:
                row.stream.end()
    outputs = []
    for row in rows:
        if row.reason == "length" and row.room is not None and len(row.out) == row.room:
            logger.info(
                "generation stopped after %d new tokens at the target's context of %d positions",
                len(row.out),
                row.prompt.numel() + len(row.out),
            )
        row.stats.finish_reason = row.reason or "length"
        row.stats.new_tokens = len(row.out)
        row.stats.total_s = total_s
        tok = request.tokenizer
        text = tok.decode(row.out, skip_special_tokens=True) if tok is not None else None
        outputs.append(GenerationOutput(tokens=row.out, stats=row.stats, text=text))
    return outputs


class _Loop:
    """The steps of :func:`decode_rows` on validated rows."""

    def __init__(self, verifier, rows, request, layers, step_callback, tree_policy) -> None:
        self.verifier, self.rows, self.request = verifier, rows, request
        self.layers, self.step_callback, self.policy = layers, step_callback, tree_policy
        self.target = _OneRow(verifier, layers) if len(rows) == 1 else _Block(verifier, layers, len(rows))
        self.steps = 0

    def _choose(self, p: list[torch.Tensor], logits: torch.Tensor, step: int) -> list[list[int]] | None:
        """Under greedy, every row's node argmaxes in one host read (with the finite check); else None after
        the finite check of the logits."""
        if not self.request.greedy:
            check_finite(logits, step)
            return None
        flat = argmax_with_check(torch.cat(p), logits, step)
        out, start = [], 0
        for rows_p in p:
            out.append(flat[start : start + rows_p.shape[0]])
            start += rows_p.shape[0]
        return out

    def _distributions(self, active, logits, hosts) -> list[torch.Tensor]:
        req = self.request
        p, start = [], 0
        for row, host in zip(active, hosts, strict=True):
            lg = logits[start : start + host.num_nodes]
            start += host.num_nodes
            context = row.prompt if row.context is None else row.context  # the prefill's root ends the prompt
            p.append(
                target_distributions(
                    lg,
                    context,
                    host,
                    req.sampling,
                    req.logits_processor,
                    len(row.out),
                    req.min_new_tokens,
                    req.eos_ids,
                )
            )
        return p

    def run(self) -> float:
        t0 = time.perf_counter()
        rows, req = self.rows, self.request
        for row in rows:
            if row.stream is not None:
                row.stream.put(row.prompt.unsqueeze(0).cpu())  # as generate: the prompt first
        per_row = self.target.prefill(rows)
        logits = self.verifier.lm_logits(torch.cat([h[-1:] for h, _ in per_row]))
        # The first token is chosen at the root alone (node 0's context is the prompt: its token is never read).
        p = self._distributions(rows, logits, [HostTree([0], [-1], [0]) for _ in rows])
        if req.sampling.do_sample:
            check_finite(logits, 0)
            first = [int(sample(probs_from_logits(pr), req.generator)[0]) for pr in p]
        else:
            first = argmax_with_check(torch.cat(p), logits, 0)
        for row, (_, feats), tok in zip(rows, per_row, first, strict=True):
            row.drafter.begin(row.prompt, feats)
            row.reason = row.stopper.push(row.out, [tok])
            if row.stream is not None:
                row.stream.put(torch.tensor([tok]))
            row.context = torch.cat([row.prompt, to_device([tok], row.prompt.device)])
            row.stats.prefill_s = time.perf_counter() - t0
        active = self._drop_finished(rows)
        while active:
            active = self._step(active)
        return time.perf_counter() - t0

    def _drop_finished(self, active: list[_Row]) -> list[_Row]:
        keep = [i for i, r in enumerate(active) if r.reason is None]
        if keep:
            self.target.select(keep, len(active))
        return [active[i] for i in keep]

    def _draft(self, row: _Row, cap: TreeCap | None) -> tuple[DraftTree, HostTree]:
        """The row's tree for this step, read to the host once and cut to the depth the target's context
        still holds and to the cap's depth."""
        deepest = None if row.room is None else row.room - len(row.out) - 1
        if cap is not None and cap.depth is not None:
            deepest = cap.depth if deepest is None else min(deepest, cap.depth)
        if not row.drafts or (deepest is not None and deepest <= 0):  # plain step: the root is the last token
            return root_only(row.context), HostTree([row.out[-1]], [-1], [0])
        limit = DraftLimit(
            useful_depth=row.stopper.max_new_tokens - len(row.out) - 1,
            depth=None if cap is None else cap.depth,
            tokens=None if cap is None else cap.total_tokens,
        )
        tree = row.drafter.propose(row.context, self.request.sampling, self.request.generator, limit)
        host = read_tree(tree.tokens, tree.parents)  # the step's one read of this row's tree
        if deepest is not None and host.max_depth > deepest:
            tree, host = cut_tree(tree, host, deepest)
        return first_chain(tree, host) if self.verifier.chains_only else (tree, host)  # state targets: chains

    def _step(self, active: list[_Row]) -> list[_Row]:
        self.steps += 1
        req = self.request
        t_step = time.perf_counter()
        cap = self.policy(len(active)) if self.policy is not None else None
        off = cap is not None and cap.depth == 0  # the rule switched drafting off for this step
        trees, hosts = [], []
        for row in active:
            t1 = time.perf_counter()
            tree, host = self._draft(row, cap)
            trees.append(tree)
            hosts.append(host)
            row.draft_s = time.perf_counter() - t1
            row.stats.draft_s += row.draft_s
        t2 = time.perf_counter()
        per_row = self.target.forward(active, trees, hosts)
        logits = self.verifier.lm_logits(torch.cat([h for h, _ in per_row]) if len(per_row) > 1 else per_row[0][0])
        p = self._distributions(active, logits, hosts)
        argmax = self._choose(p, logits, self.steps)
        results, paths = [], []
        for b, (tree, host) in enumerate(zip(trees, hosts, strict=True)):
            result = verify_step(
                p[b], tree, host, req.sampling, req.generator, req.acceptance, None if argmax is None else argmax[b]
            )
            results.append(result)
            paths.append(result.path if result.path is not None else tuple(result.accepted_nodes.tolist()))
        self.target.keep(results, paths)
        t3 = time.perf_counter()
        for row, tree, host, (_, feats), result, path in zip(
            active, trees, hosts, per_row, results, paths, strict=True
        ):
            if self.step_callback is not None:
                self.step_callback(row.index, tree, result)
            new = [host.tokens[i] for i in path[1:]] + [result.next_token]  # from the host copy: no read back
            acc = result.accepted_nodes.to(tree.tokens.device)
            row.drafter.accept(
                AcceptedPath(tree, path, tree.tokens[acc], feats[acc.to(feats.device)], result.next_token)
            )
            row.stats.verify_s += t3 - t2
            row.stats.count_step(host.num_nodes, host.max_depth, len(path) - 1)
            if off and row.drafts:
                row.stats.drafting_off_steps += 1
                row.stats.drafting_off_s += time.perf_counter() - t_step
            if self.policy is not None:
                self.policy.observe(torch.tensor(host.depths), len(path) - 1, row.draft_s)
            before = len(row.out)
            row.reason = row.stopper.push(row.out, new)
            if row.stream is not None and len(row.out) > before:
                row.stream.put(torch.tensor(row.out[before:]))
            row.context = torch.cat([row.context, to_device(new, row.context.device)])
        return self._drop_finished(active)


def speculative_generate(
    verifier: Verifier | PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
    *,
    streamer: BaseStreamer | Callable[[list[int]], None] | None = None,
    step_callback: StepCallback | None = None,
    **settings: Any,
) -> GenerationOutput:
    """One prompt through :func:`decode_rows` (batch 1).

    Args:
        verifier: the target's :class:`~selfspec.decode.verifier.Verifier`, or the target itself.
        drafter: the :class:`~selfspec.decode.drafters.base.Drafter`.
        input_ids: LongTensor ``[T]`` or ``[1, T]``.
        streamer: as one entry of :func:`decode_rows`'s ``streamers``.
        step_callback: as for :func:`decode_rows` (the row index is 0).
        settings: the :class:`~selfspec.decode.request.GenerationRequest` fields (``max_new_tokens``,
            ``min_new_tokens``, ``sampling``, ``eos_token_id`` (or ``eos_ids``), ``stop_strings``, ``tokenizer``,
            ``logits_processor``, ``generator``, ``acceptance``).

    Returns:
        :class:`~selfspec.decode.request.GenerationOutput`.

    Raises:
        ValueError, NonFiniteLogitsError: as :func:`decode_rows` and :meth:`GenerationRequest.from_settings` (an
            unknown setting's message lists the valid names).
    """
    (out,) = decode_rows(
        verifier,
        [drafter],
        [input_ids],
        GenerationRequest.from_settings(settings),
        streamers=None if streamer is None else [streamer],
        step_callback=step_callback,
    )
    return out


def speculative_generate_batch(
    verifier: Verifier | PreTrainedModel,
    drafter: Drafter | Sequence[Drafter],
    prompts: Sequence[torch.Tensor],
    *,
    streamers: Sequence[BaseStreamer | Callable[[list[int]], None] | None] | None = None,
    step_callback: StepCallback | None = None,
    tree_rule: TreePolicy | None = None,
    **settings: Any,
) -> list[GenerationOutput]:
    """Several prompts through :func:`decode_rows`: one drafter forked for every row
    (:meth:`~selfspec.decode.drafters.base.Drafter.fork`), or a list of one drafter per prompt used as given.

    ``tree_rule`` is :func:`decode_rows`' ``tree_policy``; ``settings`` as for :func:`speculative_generate`.
    """
    if isinstance(drafter, (list, tuple)):
        drafters = list(drafter)
    else:
        drafters = [drafter.fork() for _ in range(len(prompts) if not isinstance(prompts, torch.Tensor) else 0)]
    return decode_rows(
        verifier,
        drafters,
        prompts,
        GenerationRequest.from_settings(settings),
        streamers=streamers,
        step_callback=step_callback,
        tree_policy=tree_rule,
    )
