"""The speculative decoding loop: draft -> verify forward -> accept -> compact KV, one named call each.

The output is exactly the target's: under greedy the same tokens as ``model.generate(do_sample=False)``
(up to floating-point ties between a tree forward and a one-token forward), under sampling the same
distribution (Leviathan et al. 2023; Chen et al. 2023; Miao et al. 2024 for trees), because every target
distribution p is processed exactly as plain ``generate`` would process it at that position.

Outputs stay inside the target's context (``max_position_embeddings``): near its end the tree is cut to the
depth that still fits, down to the root alone (plain decoding), and a prompt that fills it is refused.
Streamers (``transformers``' ``BaseStreamer``) get the prompt, then only accepted tokens, then ``end()``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from selfspec.decode import kv
from selfspec.decode.drafters import Drafter, DraftTree, context_length
from selfspec.decode.host import HostTree, read_tree, to_device
from selfspec.decode.sampling import EosBan, SamplingConfig, probs_from_logits, process_logits, sample
from selfspec.decode.stopping import Stopper
from selfspec.decode.streaming import as_streamer
from selfspec.decode.verifier import Verifier, as_verifier
from selfspec.decode.verify import VerifyResult, verify_greedy, verify_tree_sampling, verify_typical

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.streamers import BaseStreamer

logger = logging.getLogger(__name__)


class NonFiniteLogitsError(RuntimeError):
    """The target's logits hold NaN or inf: no token can be chosen from them (the message names the step)."""


@dataclass
class GenerationStats:
    """Per-call statistics.

    Attributes:
        steps: target verification forwards (prefill excluded).
        new_tokens: tokens returned.
        accepted_per_step: tokens produced by each verification step (accepted drafts + 1).
        mean_accepted_tokens: tau, mean of ``accepted_per_step``.
        accepted_by_depth: ``accepted_by_depth[d]`` = steps whose accepted path reached depth d+1.
        drafted_by_depth: ``drafted_by_depth[d]`` = steps whose tree had a node at depth d+1.
        prefill_s, draft_s, verify_s, total_s: wall seconds.
        tokens_per_s: ``new_tokens / total_s`` (prefill included, like plain generate).
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"``.
        lossy: True when typical acceptance was used (not distribution-preserving).
    """

    steps: int = 0
    new_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    drafted_by_depth: list[int] = field(default_factory=list)
    tree_nodes: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"
    lossy: bool = False

    @property
    def mean_accepted_tokens(self) -> float:
        return sum(self.accepted_per_step) / max(1, len(self.accepted_per_step))

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["mean_accepted_tokens"] = self.mean_accepted_tokens
        d["tokens_per_s"] = self.tokens_per_s
        return d


@dataclass
class GenerationOutput:
    """``tokens``: the new token ids; ``text``: their decoding (when a tokenizer was given); ``stats``."""

    tokens: list[int]
    stats: GenerationStats
    text: str | None = None


def _node_contexts(
    context: torch.Tensor, tree: DraftTree, depths: torch.Tensor, host: HostTree | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Group nodes by depth with the token context preceding each node's next token (the tree's structure
    from ``host`` when given, else read from the tree).

    Returns:
        ``[(node_ids [n_d], contexts [n_d, T + d]) ...]``; the context of node i is the decided tokens
        (ending with the root) plus the draft tokens on the path to node i.
    """
    parents = tree.parents.tolist() if host is None else host.parents
    toks = tree.tokens.tolist() if host is None else host.tokens
    paths: list[list[int]] = [[]]
    for i in range(1, len(parents)):
        paths.append(paths[parents[i]] + [toks[i]])
    groups = []
    for d in range(int(depths.max()) + 1):
        nodes = (depths == d).nonzero().flatten()
        ext = torch.tensor([paths[i] for i in nodes.tolist()], dtype=torch.long, device=context.device)
        ext = ext.reshape(len(nodes), d)
        groups.append((nodes, torch.cat([context.expand(len(nodes), -1), ext], dim=1)))
    return groups


def target_distributions(
    logits: torch.Tensor,
    context: torch.Tensor,
    tree: DraftTree,
    sampling: SamplingConfig,
    logits_processor,
    generated_before_root: int,
    min_new_tokens: int,
    eos_ids: Sequence[int],
    depths: torch.Tensor,
    host: HostTree | None = None,
) -> torch.Tensor:
    """Process the target logits at every tree node exactly as plain ``generate`` would at that position.

    Args:
        logits: ``[N, V]`` float32 raw target logits at the nodes.
        context: LongTensor ``[T]`` decided tokens ending with the root.
        tree: the draft tree.
        generated_before_root: new tokens emitted before the root... i.e. ``len(output)`` (root included).
        min_new_tokens: EOS is masked while fewer than this many tokens have been generated, after the
            repetition penalty and before the user's processors and the warpers, as ``generate`` orders its
            ``MinNewTokensLengthLogitsProcessor`` (:class:`~selfspec.decode.sampling.EosBan`).
        depths: LongTensor ``[N]`` (CPU) node depths (computed once per step by the caller); moved to the
            logits' device only when ``min_new_tokens`` bans EOS.
        host: the tree's structure on the host (:func:`~selfspec.decode.host.read_tree`), for the per-node
            contexts a repetition penalty or a logits processor needs; read from ``tree`` when None.

    Returns:
        ``[N, V]`` float32 processed logits (-inf = disallowed).
    """
    needs_context = sampling.repetition_penalty != 1.0 or bool(logits_processor)
    # HF's MinNewTokensLengthLogitsProcessor: before the next token, generated = output + depth; it bans EOS
    # before the warpers, so top-k / top-p / min-p choose among the tokens still allowed.
    banned = None
    if min_new_tokens > 0 and eos_ids:
        banned = (generated_before_root + depths.to(logits.device)) < min_new_tokens
    if needs_context:
        out = torch.empty_like(logits)
        for nodes, ctx in _node_contexts(context, tree, depths, host):
            ban = EosBan(eos_ids, banned[nodes]) if banned is not None else None
            out[nodes] = process_logits(logits[nodes], ctx, sampling, logits_processor, ban)
    else:
        ban = EosBan(eos_ids, banned) if banned is not None else None
        out = process_logits(logits, context.new_empty((logits.shape[0], 0)), sampling, None, ban)
    return out


@torch.inference_mode()
def speculative_generate(
    verifier: Verifier | PreTrainedModel,
    drafter: Drafter,
    input_ids: torch.Tensor,
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
    streamer: BaseStreamer | Callable[[list[int]], None] | None = None,
    step_callback: Callable[[DraftTree, VerifyResult], None] | None = None,
) -> GenerationOutput:
    """Generate with draft-and-verify; output equals the target's own (see module docstring).

    Args:
        verifier: the :class:`~selfspec.decode.verifier.Verifier` of the frozen target (its kernel plan
            speeds up tree verification), or the target itself (``transformers`` causal LM, batch size 1),
            then verified with plain kernels.
        drafter: a :class:`~selfspec.decode.drafters.Drafter`.
        input_ids: LongTensor ``[T]`` or ``[1, T]``, the prompt (``T >= 1``; batch > 1 is refused).
        max_new_tokens: hard cap on returned tokens (never exceeded). The target's context
            (``config.max_position_embeddings``) caps it too: prompt plus output never pass it, and near it
            the tree is cut to the depth that still fits, down to plain decoding (finish reason ``"length"``).
        min_new_tokens: EOS is suppressed until this many tokens exist (counts tokens, not steps).
        sampling: greedy by default.
        eos_token_id: one id or several; output stops right after the first one produced.
        stop_strings: output stops at the token that completes any of them (needs ``tokenizer``).
        logits_processor: ``transformers`` ``LogitsProcessor`` objects applied at every position.
        generator: ``torch.Generator`` for every random draw (drafts, acceptance, residual, bonus).
        acceptance: ``"exact"`` (lossless) or ``"typical"`` (Medusa typical acceptance: LOSSY, flagged in stats).
        streamer: a ``transformers`` streamer (any ``BaseStreamer``: ``TextStreamer``,
            ``TextIteratorStreamer``, ...), fed as ``generate`` feeds it: ``put(prompt [1, T])`` first, then
            ``put(LongTensor [n])`` with each step's accepted tokens (only tokens that are part of the output:
            nothing is ever withdrawn), then ``end()``, also when generation fails. A plain callable is called
            with each step's new token ids (``list[int]``) instead.
        step_callback: called after each verification with the step's draft tree and its
            :class:`~selfspec.decode.verify.VerifyResult`, before the drafter is told what was accepted
            (so drafter diagnostics such as ``last_candidates`` still describe this tree). For measurements
            (:func:`selfspec.decode.tuning.calibration.calibrate_acceptance`); it must not modify its arguments.

    Returns:
        :class:`GenerationOutput`.

    Raises:
        ValueError: bad shapes or arguments (each message says which and what to pass): a batch-shaped or
            empty prompt, a prompt that leaves no room in the target's context, ``max_new_tokens < 1``,
            ``min_new_tokens < 0``, a drafter whose vocabulary is not the target's.
        NonFiniteLogitsError: (a ``RuntimeError``) NaN or inf in the target's logits; the message names the step.
    """
    sampling = sampling or SamplingConfig()
    if acceptance not in ("exact", "typical"):
        raise ValueError("acceptance must be 'exact' (lossless) or 'typical' (lossy, Medusa)")
    input_ids = _single_prompt(input_ids)
    max_new_tokens = _count("max_new_tokens", max_new_tokens, 1)
    min_new_tokens = _count("min_new_tokens", min_new_tokens, 0)
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    verifier = as_verifier(verifier)
    device = next(verifier.target.parameters()).device
    input_ids = input_ids.to(device)
    room = _room_in_context(verifier.target, input_ids.numel())
    check_vocab = getattr(drafter, "check_vocab", None)
    if check_vocab is not None:
        check_vocab(verifier.target.get_output_embeddings().weight.shape[0])
    stats = GenerationStats(lossy=acceptance == "typical")
    limit = max_new_tokens if room is None else min(max_new_tokens, room)
    stopper = Stopper(eos_ids, stop_strings, tokenizer, limit)
    stream = as_streamer(streamer)
    try:
        return _decode(
            verifier,
            drafter,
            input_ids,
            stopper,
            stats,
            sampling,
            min_new_tokens,
            eos_ids,
            logits_processor,
            generator,
            acceptance,
            stream,
            step_callback,
            tokenizer,
            room,
        )
    finally:
        if stream is not None:
            stream.end()


def _decode(
    verifier,
    drafter,
    input_ids,
    stopper,
    stats,
    sampling,
    min_new_tokens,
    eos_ids,
    logits_processor,
    generator,
    acceptance,
    stream,
    step_callback,
    tokenizer,
    room,
) -> GenerationOutput:
    """The loop of :func:`speculative_generate` on validated arguments (``room``: new tokens the target's
    context holds after the prompt, None for no limit)."""
    device = input_ids.device
    t0 = time.perf_counter()
    if stream is not None:
        stream.put(input_ids.unsqueeze(0).cpu())  # as generate: the prompt first (TextStreamer(skip_prompt=...))
    propose = _proposer(drafter)
    forward_tree = _tree_forward(verifier)
    greedy = acceptance == "exact" and not sampling.do_sample  # greedy reads the finite check with the argmaxes

    cache = verifier.new_cache()
    # A drafter with ``target_layers`` (EAGLE-3) takes those layers' hidden states instead of the last one.
    layers = getattr(drafter, "target_layers", None)
    hidden, feats = _with_layers(verifier.prefill(input_ids, cache, layers=layers), layers)
    root_tree = DraftTree(tokens=input_ids[-1:], parents=torch.tensor([-1]))
    logits0 = verifier.lm_logits(hidden[-1:])
    if sampling.do_sample:
        _finite(logits0, 0)
    p0 = target_distributions(
        logits0,
        input_ids,
        root_tree,
        sampling,
        logits_processor,
        0,
        min_new_tokens,
        eos_ids,
        torch.zeros(1, dtype=torch.long),
    )
    first = int(sample(probs_from_logits(p0), generator)[0]) if sampling.do_sample else _argmax(p0, logits0, 0)[0]
    drafter.begin(input_ids, feats)
    out: list[int] = []
    reason = stopper.push(out, [first])
    if stream is not None:
        stream.put(torch.tensor([first]))
    context = torch.cat([input_ids, to_device([first], device)])
    past = input_ids.numel()
    stats.prefill_s = time.perf_counter() - t0

    while reason is None:
        t1 = time.perf_counter()
        # A step yields accepted drafts + 1 tokens. Drafters that can are asked to draft no deeper than the
        # tokens still allowed minus one; every tree is cut to the depth the target's context still holds
        # (down to the root alone: plain decoding). Trees within the context are verified whole, so what
        # step_callback measures describes the drafter's own tree.
        tree = propose(context, sampling, generator, stopper.max_new_tokens - len(out) - 1)
        # The step's one read of the tree: positions, mask, acceptance, cache compaction and statistics share it.
        host = read_tree(tree.tokens, tree.parents)
        if room is not None and host.max_depth > room - len(out) - 1:
            tree, _ = cut_tree(tree, torch.tensor(host.depths), room - len(out) - 1, host=host)
            host = host.cut(room - len(out) - 1)
        depths = torch.tensor(host.depths)
        t2 = time.perf_counter()
        h, feats = _with_layers(forward_tree(tree, cache, past, layers, host), layers)
        logits = verifier.lm_logits(h)
        step = stats.steps + 1
        if not greedy:  # greedy checks on the argmax read instead (_argmax)
            _finite(logits, step)
        p = target_distributions(
            logits, context, tree, sampling, logits_processor, len(out), min_new_tokens, eos_ids, depths, host
        )
        result = _verify(p, tree, sampling, generator, acceptance, host, logits if greedy else None, step)
        path = result.path if result.path is not None else tuple(result.accepted_nodes.tolist())
        kv.compact_cache(cache, past, result.accepted_nodes, path)
        t3 = time.perf_counter()
        acc = result.accepted_nodes
        if step_callback is not None:
            step_callback(tree, result)
        new = [host.tokens[i] for i in path[1:]] + [result.next_token]  # from the host copy: no read back
        drafter.accept(tree.tokens[acc], feats[acc])
        stats.draft_s += t2 - t1
        stats.verify_s += t3 - t2
        stats.steps += 1
        stats.tree_nodes += host.num_nodes
        stats.accepted_per_step.append(len(new))
        _count_depths(stats, host.max_depth, len(path) - 1)
        before = len(out)
        reason = stopper.push(out, new)
        if stream is not None and len(out) > before:
            stream.put(torch.tensor(out[before:]))
        past += len(path)
        context = torch.cat([context, to_device(new, device)])

    if reason == "length" and room is not None and len(out) == room:
        logger.info(
            "generation stopped after %d new tokens at the target's context of %d positions",
            len(out),
            input_ids.numel() + len(out),
        )
    stats.finish_reason = reason
    stats.new_tokens = len(out)
    stats.total_s = time.perf_counter() - t0
    text = tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else None
    return GenerationOutput(tokens=out, stats=stats, text=text)


def _count(name: str, value, low: int) -> int:
    """``value`` as an int (anything with ``__index__``, e.g. numpy integers; not bool), at least ``low``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value.__index__()


def _single_prompt(input_ids: torch.Tensor) -> torch.Tensor:
    """``input_ids`` as ``[T]``: ``[T]`` or ``[1, T]`` pass; anything batch-shaped or empty is refused."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be an integer tensor [T] or [1, T], got {input_ids!r}")
    if input_ids.dim() == 2 and input_ids.shape[0] == 1:
        input_ids = input_ids[0]
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids of shape {tuple(input_ids.shape)}: speculative_generate decodes one prompt; pass [T] or "
            "[1, T], or decode a batch with selfspec.decode.batch.speculative_generate_batch (a list of prompts)"
        )
    if input_ids.numel() == 0:
        raise ValueError("the prompt is empty: pass at least one token")
    return input_ids


def _room_in_context(target, prompt_len: int) -> int | None:
    """New tokens the target's context still holds after a prompt of ``prompt_len`` tokens (None: no limit).

    Raises:
        ValueError: none (the prompt fills or passes the context).
    """
    n = context_length(target)
    if n is None:
        return None
    if prompt_len >= n:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, which leaves no room for a new token in the target's context "
            f"of {n} positions (max_position_embeddings); shorten the prompt to at most {n - 1} tokens"
        )
    return n - prompt_len


def _argmax(p: torch.Tensor, logits: torch.Tensor, step: int) -> list[int]:
    """``argmax(p, dim=-1)`` on the host (``[N]`` ints), read in one copy with whether ``logits`` are all finite;
    when they are not, :func:`_finite` decides (raises :class:`NonFiniteLogitsError`, or passes logits with
    ``-inf`` entries among finite ones)."""
    values = torch.cat([torch.argmax(p, dim=-1), torch.isfinite(logits).all().view(1).long()]).tolist()
    if not values[-1]:
        _finite(logits, step)
    return values[:-1]


def _finite(logits: torch.Tensor, step: int) -> torch.Tensor:
    """``logits`` unchanged, after checking that a token can be chosen from every row (step 0 = the prefill):
    no NaN, no +inf, not every entry -inf. A ``-inf`` entry among finite ones is a token the model rules out,
    as ``generate`` takes it, and passes."""
    if bool(torch.isfinite(logits).all()):
        return logits
    if bool(torch.isnan(logits).any()):
        bad = "NaN"
    elif bool(torch.isposinf(logits).any()):
        bad = "inf"
    elif bool(torch.isneginf(logits).all(dim=-1).any()):
        bad = "-inf for every token"
    else:
        return logits
    where = "the prefill (step 0)" if step == 0 else f"verification step {step}"
    raise NonFiniteLogitsError(
        f"the target's logits hold {bad} at {where}: no token can be chosen from them; check the target's "
        "weights and dtype (e.g. float16 overflow; load in float32 or bfloat16)"
    )


def cut_tree(
    tree: DraftTree, depths: torch.Tensor, max_depth: int, host: HostTree | None = None
) -> tuple[DraftTree, torch.Tensor]:
    """The draft tree without its nodes deeper than ``max_depth`` (ancestors of kept nodes are shallower, so
    what remains is a tree; node order is kept). Exact under sampling too: which nodes go depends only on
    depth, never on the drafted tokens, and a node left without children proposes nothing.

    Args:
        tree: the step's draft, ``N`` nodes.
        depths: LongTensor ``[N]`` (CPU), the node depths.
        max_depth: >= 0; 0 keeps only the root.
        host: the tree's structure on the host (:func:`~selfspec.decode.host.read_tree`): parents are taken
            from it instead of read from the device.

    Returns:
        ``(tree with M <= N nodes, depths [M])``.
    """
    keep = depths <= max_depth
    new_index = torch.cumsum(keep.long(), 0) - 1
    parents = (tree.parents.cpu() if host is None else torch.tensor(host.parents))[keep]
    parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    device = tree.tokens.device
    kept = keep.nonzero().flatten()
    q = None if tree.q is None else tree.q[kept.to(tree.q.device)]
    return DraftTree(tokens=tree.tokens[kept.to(device)], parents=parents.to(tree.parents.device), q=q), depths[keep]


def _proposer(drafter: Drafter) -> Callable[[torch.Tensor, SamplingConfig, torch.Generator | None, int], DraftTree]:
    """``propose(context, sampling, generator, max_depth)``: passes ``max_depth`` on to drafters whose
    ``propose`` takes it (they then draft no deeper); the loop cuts every tree to it anyway (:func:`cut_tree`)."""
    if "max_depth" in inspect.signature(drafter.propose).parameters:
        return lambda c, s, g, d: drafter.propose(c, s, g, max_depth=d)
    return lambda c, s, g, d: drafter.propose(c, s, g)


def _tree_forward(verifier: Verifier) -> Callable:
    """``forward(tree, cache, past, layers, host)``: ``verifier.forward_tree``, given the host copy of the tree
    where it takes one (a ``host`` keyword or ``**kwargs``; a subclass overriding it without reads the tree
    itself)."""
    params = inspect.signature(verifier.forward_tree).parameters.values()
    if any(p.name == "host" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda t, c, past, layers, host: verifier.forward_tree(
            t.tokens, t.parents, c, past, layers=layers, host=host
        )
    return lambda t, c, past, layers, host: verifier.forward_tree(t.tokens, t.parents, c, past, layers=layers)


def _with_layers(out, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """``(last hidden [N, D], what the drafter takes [N, D or len(layers) * D])`` of a verifier forward."""
    return out if layers else (out, out)


def _verify(
    p: torch.Tensor,
    tree: DraftTree,
    sampling: SamplingConfig,
    generator,
    acceptance: str,
    host: HostTree | None = None,
    logits: torch.Tensor | None = None,
    step: int = 0,
) -> VerifyResult:
    """The step's acceptance. Under greedy with the raw ``logits`` given, their finiteness check (step
    ``step``) rides on the argmax read (:func:`_argmax`); the caller checks them itself otherwise."""
    if acceptance == "typical":
        return verify_typical(probs_from_logits(p), tree.tokens, tree.parents, generator=generator, host=host)
    if not sampling.do_sample:
        argmax = None if logits is None else _argmax(p, logits, step)
        return verify_greedy(p, tree.tokens, tree.parents, host=host, argmax=argmax)
    return verify_tree_sampling(probs_from_logits(p), tree.tokens, tree.parents, tree.q, generator, host=host)


def _count_depths(stats: GenerationStats, max_depth: int, accepted_depth: int) -> None:
    while len(stats.drafted_by_depth) < max_depth:
        stats.drafted_by_depth.append(0)
        stats.accepted_by_depth.append(0)
    for d in range(max_depth):
        stats.drafted_by_depth[d] += 1
    for d in range(accepted_depth):
        stats.accepted_by_depth[d] += 1
