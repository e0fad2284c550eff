"""One verification step's exact parts: the target distribution p at every tree node, processed as plain
``generate`` processes it, the check that a token can be chosen from it, and the acceptance rule.

Every function here is a function of tensors and the step's host copy of the tree
(:class:`~selfspec.decode.host.HostTree`); the loop (:mod:`selfspec.decode.loop`) calls them once per row
and step. Greedy steps choose by argmax (the target's greedy output token for token); sampled steps use the
lossless tree rejection sampler (Leviathan et al. 2023; Chen et al. 2023; Miao et al. 2024, SpecInfer);
``acceptance="typical"`` is Medusa's typical acceptance (Cai et al. 2024), lossy and flagged as such.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.decode.host import HostTree
from selfspec.decode.rejection import verify_tree_sampling
from selfspec.decode.sampling import EosBan, SamplingConfig, probs_from_logits, process_logits
from selfspec.decode.tree import DraftTree
from selfspec.decode.verify import VerifyResult, verify_greedy, verify_typical

ACCEPTANCE_RULES = ("exact", "typical")


class NonFiniteLogitsError(RuntimeError):
    """The target's logits hold NaN or inf: no token can be chosen from them (the message names the step)."""


def _node_contexts(context: torch.Tensor, host: HostTree) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Nodes grouped by depth with the token context preceding each node's next token.

    Returns:
        ``[(node_ids [n_d], contexts [n_d, T + d]) ...]``; the context of node i is the decided tokens
        (ending with the root) plus the draft tokens on the path to node i.
    """
    paths: list[list[int]] = [[]]
    for i in range(1, host.num_nodes):
        paths.append(paths[host.parents[i]] + [host.tokens[i]])
    groups = []
    for d in range(host.max_depth + 1):
        nodes = [i for i, depth in enumerate(host.depths) if depth == d]
        ext = torch.tensor([paths[i] for i in nodes], dtype=torch.long, device=context.device).reshape(len(nodes), d)
        groups.append((torch.tensor(nodes), torch.cat([context.expand(len(nodes), -1), ext], dim=1)))
    return groups


def target_distributions(
    logits: torch.Tensor,
    context: torch.Tensor,
    host: HostTree,
    sampling: SamplingConfig,
    logits_processor,
    generated_before_root: int,
    min_new_tokens: int,
    eos_ids: Sequence[int],
) -> torch.Tensor:
    """Process the target logits at every tree node exactly as plain ``generate`` would at that position.

    Args:
        logits: ``[N, V]`` float32 raw target logits at the nodes.
        context: LongTensor ``[T]`` decided tokens ending with the root.
        host: the tree's structure on the host (tokens for the per-node contexts a repetition penalty or a
            logits processor needs; depths for the EOS ban).
        sampling: the sampling settings.
        logits_processor: ``transformers`` ``LogitsProcessor`` objects, or None.
        generated_before_root: new tokens emitted before the root's successor, i.e. ``len(output)``.
        min_new_tokens: EOS is masked while fewer than this many tokens have been generated, after the
            repetition penalty and before the user's processors and the warpers, as ``generate`` orders its
            ``MinNewTokensLengthLogitsProcessor`` (:class:`~selfspec.decode.sampling.EosBan`).
        eos_ids: the EOS ids that ban applies to.

    Returns:
        ``[N, V]`` float32 processed logits (-inf = disallowed).
    """
    needs_context = sampling.repetition_penalty != 1.0 or bool(logits_processor)
    # HF's MinNewTokensLengthLogitsProcessor: before the next token, generated = output + depth; it bans EOS
    # before the warpers, so top-k / top-p / min-p choose among the tokens still allowed.
    banned = None
    if min_new_tokens > 0 and eos_ids:
        depths = torch.tensor(host.depths, device=logits.device)
        banned = (generated_before_root + depths) < min_new_tokens
    if needs_context:
        out = torch.empty_like(logits)
        for nodes, ctx in _node_contexts(context, host):
            ban = EosBan(eos_ids, banned[nodes.to(banned.device)]) if banned is not None else None
            rows = nodes.to(logits.device)
            out[rows] = process_logits(logits[rows], ctx, sampling, logits_processor, ban)
        return out
    ban = EosBan(eos_ids, banned) if banned is not None else None
    return process_logits(logits, context.new_empty((logits.shape[0], 0)), sampling, None, ban)


def check_finite(logits: torch.Tensor, step: int) -> torch.Tensor:
    """``logits`` unchanged, after checking that a token can be chosen from every row (step 0 = the prefill):
    no NaN, no +inf, not every entry -inf. A ``-inf`` entry among finite ones is a token the model rules out,
    as ``generate`` takes it, and passes.

    Raises:
        NonFiniteLogitsError: NaN, +inf, or a row of -inf only; the message names the step.
    """
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


def argmax_with_check(p: torch.Tensor, logits: torch.Tensor, step: int) -> list[int]:
    """``argmax(p, dim=-1)`` on the host (``[N]`` ints), read in one copy together with whether ``logits``
    are all finite; when they are not, :func:`check_finite` decides (raises, or passes logits whose ``-inf``
    entries sit among finite ones).

    Args:
        p: ``[N, V]`` processed logits.
        logits: the raw logits they came from (any shape).
        step: for the error message (0 = the prefill).
    """
    values = torch.cat([torch.argmax(p, dim=-1), torch.isfinite(logits).all().view(1).long()]).tolist()
    if not values[-1]:
        check_finite(logits, step)
    return values[:-1]


def verify_step(
    p: torch.Tensor,
    tree: DraftTree,
    host: HostTree,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    acceptance: str,
    argmax: list[int] | None = None,
) -> VerifyResult:
    """The step's acceptance of one row's tree.

    Args:
        p: ``[N, V]`` processed target logits at the nodes (:func:`target_distributions`).
        tree: the row's draft (``q`` for sampled children).
        host: its host copy.
        sampling: greedy (argmax path) or sampling (lossless tree rejection sampling).
        generator: every random draw.
        acceptance: ``"exact"`` or ``"typical"`` (lossy).
        argmax: under greedy, the nodes' argmax already read (:func:`argmax_with_check`); read here if None.

    Returns:
        :class:`~selfspec.decode.verify.VerifyResult`: the accepted path (node indices, root first) and the
        next token (bonus or correction).
    """
    if acceptance == "typical":
        return verify_typical(probs_from_logits(p), tree.tokens, tree.parents, generator=generator, host=host)
    if not sampling.do_sample:
        return verify_greedy(p, tree.tokens, tree.parents, host=host, argmax=argmax)
    return verify_tree_sampling(probs_from_logits(p), tree.tokens, tree.parents, tree.q, generator, host=host)
