"""What drafting costs here: median ms of one draft by depth, cached on disk.

The tree chooser (:func:`selfspec.decode.tuning.budget.choose_tree`, over :func:`~selfspec.decode.tuning.budget.
eagle_trees` or :func:`~selfspec.decode.tuning.budget.block_trees`) weighs the verification cost of a tree
(:mod:`selfspec.decode.tuning.costs`) against the cost of drafting it. For EAGLE that grows with the draft
depth (one head forward per level); a DFlash / DSpark block drafter runs one forward over its whole block
whatever it keeps, so its cost is measured once, at the block's length. Measured like the verification cost
(interleaved medians, same identity :func:`~selfspec.decode.tuning.costs.cost_key`) and cached as JSON beside
it under ``<cache root>/profiles``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.files import now_utc, profiles_dir, read_cached, read_dataclass, record_dict, write_cached
from selfspec.decode.drafters.base import AcceptedPath, DraftCostKey, Drafter, DraftLimit
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import DraftTree
from selfspec.decode.tuning.costs import DEFAULT_CONTEXT_LENGTH, cost_key, profile_stem
from selfspec.decode.tuning.timing import interleaved_medians
from selfspec.decode.verifier import Verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DRAFT_COST_VERSION = 1
_HEADER = {"format": "selfspec-draft-cost", "version": DRAFT_COST_VERSION}


@dataclass(frozen=True)
class DraftCost:
    """Median ms of one draft by depth (EAGLE) or block length (DFlash / DSpark), as cached on disk.

    Attributes:
        key: the measurement's identity (:func:`cost_key`).
        top_k: the drafter's ``top_k``.
        draft_ms: ``{str(depth): ms}`` (JSON object keys are strings).
        created_utc: ISO 8601 time.
    """

    key: Mapping[str, Any]
    top_k: int
    draft_ms: Mapping[str, float]
    created_utc: str = ""

    def __post_init__(self) -> None:
        if any(not d.isdigit() or not math.isfinite(v) or v <= 0 for d, v in self.draft_ms.items()):
            raise ValueError("draft_ms must map depths to positive numbers")

    def to_dict(self) -> dict[str, Any]:
        return record_dict(self, _HEADER)

    @classmethod
    def from_dict(cls, data: Any) -> DraftCost:
        """Parse :meth:`to_dict`'s layout strictly. Raises ValueError on anything else."""
        return read_dataclass(cls, data, header=_HEADER)


def draft_cost_key(drafter: Drafter) -> DraftCostKey:
    """What the drafter's cost depends on (:attr:`~selfspec.decode.drafters.base.DrafterInfo.draft_cost`).

    Raises:
        ValueError: a drafter that declares no drafting cost to measure (prompt lookup, a hybrid, ...).
    """
    key = drafter.info().draft_cost
    if key is None:
        raise ValueError(f"the {drafter.info().name} drafter declares no drafting cost to measure")
    return key


@torch.inference_mode()
def measure_draft_cost(
    drafter: Drafter,
    target: PreTrainedModel,
    depths: Sequence[int],
    context_length: int = DEFAULT_CONTEXT_LENGTH,
    repeats: int = 5,
) -> dict[int, float]:
    """Median wall ms of one drafting step (``accept`` of a step with nothing accepted, then ``propose``) at each
    draft depth.

    One drafter per depth is built by ``drafter.at_depth`` (``drafter`` itself is not used or changed). Each is
    begun on ``context_length`` random tokens with the target's real features. A drafter whose levels each cost a
    forward (EAGLE): one untimed propose feeds the prompt's pairs; each timed call then feeds one accepted pair, as
    a decoding step with nothing accepted does, and grows the tree to the depth. A drafter that runs its whole
    block (``DraftCostKey.per_block``: DFlash, DSpark): each timed call feeds one position and runs the whole
    block, keeping ``depth`` drafts (the context grows by one per call).

    Args:
        drafter: a drafter that declares its drafting cost (:func:`draft_cost_key`), attached to ``target``.
        target: the frozen target.
        depths: draft depths d >= 1.
        context_length: prompt tokens before the draft.
        repeats: timed calls per depth.

    Returns:
        ``{depth: ms}``.

    Raises:
        ValueError: an empty ``depths``, a depth < 1, a drafter without a drafting cost, or a depth it cannot
            draft (block drafters: beyond the head's block).
    """
    depths = sorted({int(d) for d in depths})
    if not depths or depths[0] < 1:
        raise ValueError("need draft depths >= 1")
    block = draft_cost_key(drafter).per_block
    drafter.at_depth(depths[-1], target)  # refuses a depth it cannot draft before any work
    device = next(target.parameters()).device
    gen = torch.Generator().manual_seed(1)
    context = torch.randint(0, target.config.vocab_size, (context_length + 1,), generator=gen).to(device)
    verifier = Verifier(target)
    layers = drafter.info().target_layers  # EAGLE-3 heads take several layers' hidden states
    hidden = verifier.prefill(context[:-1], verifier.new_cache(), layers=layers)  # the root is not cached
    hidden = hidden[1] if layers else hidden
    greedy = SamplingConfig()

    def block_at(length: int) -> Callable[[], None]:
        at_length = drafter.at_depth(length, target)
        at_length.begin(context[:-1], hidden)
        grown = [context]

        def step() -> None:
            ctx = grown[0]
            root = DraftTree(tokens=ctx[-1:], parents=torch.tensor([-1], device=device))
            at_length.accept(AcceptedPath(root, (0,), ctx[-1:], hidden[-1:], 0))
            grown[0] = torch.cat([ctx, ctx[-1:]])  # the drafter now holds one more position
            at_length.propose(grown[0], greedy, None, DraftLimit(useful_depth=length))

        return step

    def at(depth: int) -> Callable[[], None]:
        if block:
            return block_at(depth)
        at_depth = drafter.at_depth(depth, target)
        at_depth.begin(context[:-1], hidden)
        limit = DraftLimit(useful_depth=depth)
        at_depth.propose(context, greedy, None, limit)  # feeds the prompt's pairs: the cache now holds a real context
        root = DraftTree(tokens=context[-1:], parents=torch.tensor([-1], device=device))
        accepted = AcceptedPath(root, (0,), context[-1:], hidden[-1:], 0)

        def step() -> None:
            at_depth.accept(accepted)
            at_depth.propose(context, greedy, None, limit)

        return step

    medians = interleaved_medians({d: at(d) for d in depths}, {d: repeats for d in depths}, device)
    return {d: round(ms, 4) for d, ms in medians.items()}


def draft_cost_path(drafter: Drafter, target: PreTrainedModel) -> Path:
    """Cache file of a drafter's cost by depth: the target's measurement identity and the drafter's
    :class:`~selfspec.decode.drafters.base.DraftCostKey` (the head's shapes and ``top_k``, not its weights)."""
    key = draft_cost_key(drafter)
    stem = profile_stem(cost_key(target), next(target.parameters()).device)
    return profiles_dir() / f"draft-{key.family}-{stem}-{key.shape}.json"


def get_draft_cost(
    drafter: Drafter, target: PreTrainedModel, depths: Sequence[int], refresh: bool = False
) -> dict[int, float]:
    """:func:`measure_draft_cost`, cached like :func:`get_cost_profile` (same identity plus the head's shapes:
    :func:`draft_cost_path`). A bad cache file is re-measured with a warning.

    Returns:
        ``{depth: ms}`` for every requested depth.
    """
    path = draft_cost_path(drafter, target)
    wanted = sorted({int(d) for d in depths})
    key = cost_key(target)
    cached = None if refresh else read_cached(path, DraftCost.from_dict, "draft cost profile")
    if cached is not None:
        ms = {int(d): float(v) for d, v in cached.draft_ms.items()}
        if dict(cached.key) != key:
            logger.warning("draft cost profile %s was measured for %s: measuring it again", path, cached.key)
        elif all(d in ms for d in wanted):
            return {d: ms[d] for d in wanted}
    logger.info("measuring %s drafting cost at depths %s ...", draft_cost_key(drafter).family, wanted)
    ms = measure_draft_cost(drafter, target, wanted)
    record = DraftCost(
        key=key, top_k=draft_cost_key(drafter).top_k, draft_ms={str(d): v for d, v in ms.items()}, created_utc=now_utc()
    )
    write_cached(path, record.to_dict(), "draft cost profile")
    return ms
