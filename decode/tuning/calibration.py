"""Acceptance calibration: what every EAGLE-2 tree budget of a head accepts, from one greedy run.

:class:`AcceptanceProfile` holds ``tau[d][N]``, the mean tokens per step (accepted drafts + the bonus
token) under greedy verification, for every depth d <= ``depth_max`` and ``total_tokens`` N <=
``total_tokens_max``, measured by ONE greedy run with the largest budget (:func:`calibrate_acceptance`);
it is stored next to the head as ``acceptance_profile.json``.

Why one big run tells what every smaller budget would have accepted: EAGLE-2 candidates at depth <= d do
not depend on ``total_tokens`` nor on deeper levels, and :func:`~selfspec.decode.drafters.eagle.select_nodes`
keeps the N best of them by cumulative draft log-probability with a stable sort, in which a parent
always ranks before its children. Greedy verification accepts the unique path that follows the target's
argmax. So a budget (d, N) keeps exactly the candidates of depth <= d whose rank among them is < N, and
accepts the big run's accepted path up to its first node outside that set (see :func:`step_acceptance`).
(Li et al. 2024, "EAGLE-2", arXiv:2406.16858.)
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from selfspec.base.files import now_utc, read_dataclass, read_json, write_json
from selfspec.base.fingerprint import fingerprint_as_stored, target_fingerprint
from selfspec.decode.drafters.eagle import EagleDrafter, num_candidates
from selfspec.decode.loop import speculative_generate
from selfspec.decode.verifier import Verifier
from selfspec.heads.config import HeadFormatError, read_safetensors

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

ACCEPTANCE_PROFILE_NAME = "acceptance_profile.json"
PROFILE_VERSION = 1
_ACCEPTANCE_FORMAT = "selfspec-acceptance-profile"
_ACCEPTANCE_HEADER = {"format": _ACCEPTANCE_FORMAT, "version": PROFILE_VERSION, "verification": "greedy"}
_HEAD_FILES = ("model.safetensors", "draft_vocab.safetensors")

# The largest budget a calibration run drafts with, so the extent of its table (README, "Tree budget sized to the
# machine": depth 6, 48 draft tokens), for training's post-training calibration (train/calibrate.py) and
# `selfspec tune-tree` alike.
CALIBRATION_DEPTH_MAX = 6
CALIBRATION_TOTAL_TOKENS_MAX = 48


def candidate_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth (>= 1) of each candidate. ``parents``: LongTensor ``[M]`` (-1 = child of the root, else an
    earlier index) -> LongTensor ``[M]``."""
    p = parents.tolist()
    depth = [0] * len(p)
    for i, parent in enumerate(p):
        depth[i] = 1 if parent < 0 else depth[parent] + 1
    return torch.tensor(depth, dtype=torch.long)


def step_acceptance(
    candidates: Mapping[str, torch.Tensor],
    accepted_nodes: torch.Tensor,
    next_token: int,
    depth_max: int,
    total_tokens_max: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft tokens that each smaller budget would have accepted in one greedy step of a big-budget drafter.

    Let ``p_1 .. p_a`` be the accepted path (as candidates) and ``rank_d(c)`` the position of candidate c
    in the stable descending sort of the scores of the candidates of depth <= d (what
    :func:`~selfspec.decode.drafters.eagle.select_nodes` does). Budget (d, N) keeps ``{c : depth(c) <= d,
    rank_d(c) < N}`` and, since ancestors rank first, accepts ``#{i <= min(a, d) : rank_d(p_i) < N}``
    drafts. One more when it keeps ``c*``, the candidate child of ``p_a`` whose token is the big step's
    bonus token (the target's argmax at ``p_a``): the big tree dropped it, a smaller one may not. Beyond
    ``c*`` the target's argmax is unknown, so when the budget also keeps a child of ``c*`` the count is a
    lower bound, flagged in ``inexact``. This happens only when the budget keeps a candidate the big tree
    dropped, i.e. never for ``d = depth_max``.

    Args:
        candidates: ``EagleDrafter.last_candidates`` of the step: ``tokens`` (target ids), ``parents``,
            ``scores`` (cumulative draft log-probabilities), ``kept`` (candidate index of tree node i + 1),
            each ``[M]``.
        accepted_nodes: LongTensor ``[A]`` of accepted tree nodes, root first (``VerifyResult``).
        next_token: the bonus token of the step (argmax of the target at the last accepted node).
        depth_max, total_tokens_max: the table's extent (the big budget the step was drafted with).

    Returns:
        ``(accepted, inexact)``: LongTensor ``[depth_max, total_tokens_max]`` of accepted drafts (bonus token
        not counted), ``accepted[d - 1, N - 1]`` for budget (d, N); BoolTensor of the same shape.
    """
    scores = candidates["scores"].detach().float().cpu()
    parents = candidates["parents"].cpu()
    tokens = candidates["tokens"].cpu()
    kept = candidates["kept"].cpu()
    depth = candidate_depths(parents)
    path = kept[accepted_nodes.cpu()[1:] - 1]  # candidate index of each accepted draft, depth 1, 2, ...
    last = int(path[-1]) if path.numel() else -1
    match = ((parents == last) & (tokens == int(next_token))).nonzero().flatten()
    c_star = int(match[0]) if match.numel() else None
    m = scores.numel()
    budgets = torch.arange(1, total_tokens_max + 1)
    accepted = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    inexact = torch.zeros(depth_max, total_tokens_max, dtype=torch.bool)
    for d in range(1, depth_max + 1):
        in_d = depth <= d
        idx = in_d.nonzero().flatten()
        order = torch.sort(-scores[idx], stable=True).indices
        rank = torch.full((m,), m, dtype=torch.long)
        rank[idx[order]] = torch.arange(idx.numel())
        path_ranks = rank[path[:d]]
        accepted[d - 1] = (path_ranks.unsqueeze(0) < budgets.unsqueeze(1)).sum(1)
        if c_star is not None and int(depth[c_star]) <= d:
            hit = int(rank[c_star]) < budgets
            accepted[d - 1] += hit.long()
            kids = (parents == c_star) & in_d
            if bool(kids.any()):
                inexact[d - 1] = hit & (int(rank[kids].min()) < budgets)
    return accepted, inexact


@dataclass(frozen=True)
class AcceptanceProfile:
    """Measured greedy acceptance of one EAGLE head for every smaller tree budget.

    Attributes:
        top_k: the drafter's ``top_k`` (candidates depend on it: the table holds for this value only).
        tau: ``tau[d - 1][N - 1]``, mean tokens per verification step (accepted drafts + the bonus
            token) with depth d and ``total_tokens`` N, ``[depth_max][total_tokens_max]``, each in ``[1, d + 1]``.
        inexact_steps: ``[depth_max][total_tokens_max]`` steps whose count is a lower bound (see
            :func:`step_acceptance`); 0 = exact for the steps of the calibration run.
        steps: verification steps measured.
        prompts: prompts decoded.
        max_new_tokens: cap per prompt during calibration.
        head_type: the head family measured, ``"eagle"`` (EAGLE-1) or ``"eagle3"``. Profiles written before it was
            recorded say ``"eagle"`` for EAGLE-3 heads too and read back as such (the type is informational: the
            ``head_digest`` ties a profile to its head's weights).
        target_fingerprint: the target's :func:`~selfspec.base.fingerprint.target_fingerprint`.
        head_digest: :func:`head_files_digest` of the head directory when saved there ("" = unknown).
        created_utc: ISO 8601 time.

    Approximation: a smaller budget accepts differently, so its later steps start from other contexts;
    the table is the per-step mean over the big run's contexts (exact step by step, not run by run).
    """

    top_k: int
    tau: tuple[tuple[float, ...], ...]
    inexact_steps: tuple[tuple[int, ...], ...]
    steps: int
    prompts: int
    max_new_tokens: int
    head_type: Literal["eagle", "eagle3"] = "eagle"
    target_fingerprint: str = ""
    head_digest: str = ""
    created_utc: str = ""

    @property
    def depth_max(self) -> int:
        return len(self.tau)

    @property
    def total_tokens_max(self) -> int:
        return len(self.tau[0])

    def tau_at(self, depth: int, total_tokens: int) -> float:
        """tau of budget (depth, total_tokens); ``total_tokens`` beyond the candidates a depth creates is
        the same tree as all of them. Raises ValueError outside the table."""
        n = min(total_tokens, num_candidates(self.top_k, depth))
        if not (1 <= depth <= self.depth_max and 1 <= n <= self.total_tokens_max):
            raise ValueError(
                f"budget (depth {depth}, total_tokens {total_tokens}) is outside the measured "
                f"table (depth <= {self.depth_max}, total_tokens <= {self.total_tokens_max})"
            )
        return self.tau[depth - 1][n - 1]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _ACCEPTANCE_FORMAT,
            "version": PROFILE_VERSION,
            "head_type": self.head_type,
            "verification": "greedy",
            "top_k": self.top_k,
            "depth_max": self.depth_max,
            "total_tokens_max": self.total_tokens_max,
            "steps": self.steps,
            "prompts": self.prompts,
            "max_new_tokens": self.max_new_tokens,
            "target_fingerprint": self.target_fingerprint,
            "head_digest": self.head_digest,
            "created_utc": self.created_utc,
            "tau": [list(row) for row in self.tau],
            "inexact_steps": [list(row) for row in self.inexact_steps],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "acceptance profile") -> AcceptanceProfile:
        """Parse :meth:`to_dict`'s layout strictly.

        Raises:
            HeadFormatError: any missing, unknown, mistyped or inconsistent field; the message names it and
                says how to regenerate the file.
        """
        try:
            profile = read_dataclass(cls, data, header=_ACCEPTANCE_HEADER, derived=("depth_max", "total_tokens_max"))
            _check_tables(profile, data["depth_max"], data["total_tokens_max"])
        except ValueError as err:
            raise HeadFormatError(
                f"{where}: {err}. Regenerate it with `selfspec tune-tree --target TARGET --heads HEAD_DIR` "
                f"(or delete it to decode with the default tree budget)."
            ) from err
        return replace(profile, tau=tuple(tuple(float(x) for x in row) for row in profile.tau))


def _check_tables(profile: AcceptanceProfile, depth_max: Any, n_max: Any) -> None:
    """What the types of an :class:`AcceptanceProfile` read from a file cannot say. Raises ValueError."""
    for name in ("top_k", "steps", "prompts", "max_new_tokens"):
        if getattr(profile, name) < 1:
            raise ValueError(f"{name} must be a positive integer")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in (depth_max, n_max)):
        raise ValueError("depth_max and total_tokens_max must be positive integers")
    for name in ("tau", "inexact_steps"):
        table = getattr(profile, name)
        if len(table) != depth_max or any(len(row) != n_max for row in table):
            raise ValueError(f"{name} must be a [depth_max={depth_max}][total_tokens_max={n_max}] list of lists")
    for d, row in enumerate(profile.tau, start=1):
        if not all(math.isfinite(x) for x in row):
            raise ValueError(f"tau[{d - 1}] must hold finite numbers")
        if any(not 1.0 - 1e-9 <= x <= d + 1 + 1e-9 for x in row):
            raise ValueError(f"tau[{d - 1}] (depth {d}) must lie in [1, {d + 1}]")
        if any(b < a - 1e-9 for a, b in zip(row, row[1:], strict=False)):
            raise ValueError(f"tau[{d - 1}] must not decrease with total_tokens")
    for d, row in enumerate(profile.inexact_steps):
        if any(not 0 <= x <= profile.steps for x in row):
            raise ValueError(f"inexact_steps[{d}] must hold integers in [0, steps={profile.steps}]")


def head_files_digest(head_dir: str | Path) -> str:
    """sha256 (16 hex characters) of the tensors in a head directory's weight files (names, dtypes, shapes,
    bytes; not the files' bytes, whose safetensors header order varies between saves of the same weights),
    so that a profile does not outlive a retraining.

    Raises:
        HeadFormatError: a weight file exists but cannot be read.
    """
    h = hashlib.sha256()
    for name in _HEAD_FILES:
        path = Path(head_dir) / name
        if not path.is_file():
            continue
        h.update(name.encode())
        tensors = read_safetensors(path)
        for key in sorted(tensors):
            t = tensors[key]
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def save_acceptance_profile(profile: AcceptanceProfile, head_dir: str | Path) -> Path:
    """Write ``<head_dir>/acceptance_profile.json`` (atomically), stamped with the head files' digest.

    The head loaders read only their own named files, so the extra file does not disturb them.

    Returns:
        The file's path.
    """
    stamped = replace(profile, head_digest=head_files_digest(head_dir))
    return write_json(Path(head_dir) / ACCEPTANCE_PROFILE_NAME, stamped.to_dict())


def load_acceptance_profile(head_dir: str | Path, target: PreTrainedModel | None = None) -> AcceptanceProfile | None:
    """Read ``<head_dir>/acceptance_profile.json``.

    Args:
        head_dir: the head directory.
        target: when given, a profile measured on another target is ignored (with a warning).

    Returns:
        The profile; None when there is none, or (with a warning) when it was measured for other head
        weights than the directory now holds (the head was retrained) or for another target.

    Raises:
        HeadFormatError: the file exists but is not a valid profile (the message says how to regenerate it).
    """
    path = Path(head_dir) / ACCEPTANCE_PROFILE_NAME
    if not path.is_file():
        return None
    try:
        data = read_json(path)
    except (OSError, ValueError) as err:
        raise HeadFormatError(
            f"cannot read {path} ({err}). Regenerate it with `selfspec tune-tree --target TARGET --heads {head_dir}` "
            "(or delete it to decode with the default tree budget)."
        ) from err
    profile = AcceptanceProfile.from_dict(data, where=str(path))
    if profile.head_digest and profile.head_digest != head_files_digest(head_dir):
        logger.warning(
            "%s was measured for other head weights (retrained since?): ignoring it; "
            "rerun `selfspec tune-tree --heads %s`",
            path,
            head_dir,
        )
        return None
    if target is not None and profile.target_fingerprint:
        stored = profile.target_fingerprint
        if stored != fingerprint_as_stored(stored, target_fingerprint(target)):
            logger.warning("%s was measured on another target: ignoring it", path)
            return None
    return profile


def calibrate_acceptance(
    target: PreTrainedModel | Verifier,
    drafter: EagleDrafter,
    prompts_ids: Sequence[torch.Tensor],
    max_new_tokens: int = 64,
    total_tokens_max: int = CALIBRATION_TOTAL_TOKENS_MAX,
    depth_max: int = CALIBRATION_DEPTH_MAX,
    eos_token_id: int | Sequence[int] | None = None,
) -> AcceptanceProfile:
    """Measure ``tau[d][N]`` for every budget up to (``depth_max``, ``total_tokens_max``) in one greedy run.

    Builds one drafter with the big budget from ``drafter``'s head and ``top_k`` (``drafter`` itself is
    not changed), decodes every prompt greedily with it
    (:func:`~selfspec.decode.loop.speculative_generate`), and turns each step into the accepted count
    of every smaller budget with :func:`step_acceptance` (exact per step; see there for the lower-bound
    case). ``tau`` is the mean over all steps of all prompts of accepted drafts + 1. Cost: one big-tree
    decode of ``max_new_tokens`` per prompt.

    Args:
        target: the frozen target, or its :class:`~selfspec.decode.verifier.Verifier` (faster kernels).
        drafter: an :class:`~selfspec.decode.drafters.eagle.EagleDrafter` on the target (its head and ``top_k``
            are profiled).
        prompts_ids: LongTensors ``[T]``, one per prompt (e.g. chat-templated held-out prompts).
        max_new_tokens: new tokens per prompt.
        total_tokens_max: N_max, largest ``total_tokens`` in the table.
        depth_max: largest depth in the table.
        eos_token_id: stop ids (as in decoding), None = none.

    Returns:
        :class:`AcceptanceProfile` (``head_digest`` empty: :func:`save_acceptance_profile` stamps it).

    Raises:
        ValueError: no prompts, non-positive sizes, or no verification step ran (every prompt stopped at
            its first token).
    """
    if not prompts_ids:
        raise ValueError("calibrate_acceptance needs at least one prompt")
    if depth_max < 1 or total_tokens_max < 1:
        raise ValueError("depth_max and total_tokens_max must be >= 1")
    model = target.target if isinstance(target, Verifier) else target
    big = EagleDrafter(drafter.head, model, depth_max, drafter.top_k, total_tokens_max)
    accepted = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    inexact = torch.zeros(depth_max, total_tokens_max, dtype=torch.long)
    steps = 0

    def on_step(row, tree, result) -> None:
        nonlocal steps
        a, x = step_acceptance(
            big.last_candidates, result.accepted_nodes, result.next_token, depth_max, total_tokens_max
        )
        accepted.add_(a)
        inexact.add_(x.long())
        steps += 1

    for ids in prompts_ids:
        speculative_generate(
            target, big, ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, step_callback=on_step
        )
    if steps == 0:
        raise ValueError("no verification step ran: raise max_new_tokens (every prompt stopped at its first token)")
    tau = 1.0 + accepted.double() / steps
    return AcceptanceProfile(
        top_k=big.top_k,
        tau=tuple(tuple(float(x) for x in row) for row in tau.tolist()),
        inexact_steps=tuple(tuple(int(x) for x in row) for row in inexact.tolist()),
        steps=steps,
        prompts=len(prompts_ids),
        max_new_tokens=max_new_tokens,
        head_type=drafter.head.config.head_type,
        target_fingerprint=target_fingerprint(model),
        created_utc=now_utc(),
    )
