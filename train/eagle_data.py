"""EAGLE training data layout: shifted (feature, token) pairs of a sequence, packed into rows.

Layout (0-based; proven by ``tests/train/test_eagle.py`` on a hand-made 8-token sequence).
For tokens ``x_0 .. x_{T-1}``, target features ``f_0 .. f_{T-1}`` (after the final norm; ``f_t`` gives the
distribution of ``x_{t+1}``) and the assistant mask ``m_t`` ("``x_t`` is an assistant token"):

* pair t (t = 0 .. T-2) is the head input ``(f_t + noise, x_{t+1})`` at head position t;
* its target is ``f_{t+1}`` (and the target's distribution ``softmax(lm_head(f_{t+1}))``);
* it is scored iff ``m_{t+2}``: ``f_{t+1}`` is what drafts ``x_{t+2}``, so the loss is counted exactly where
  the token the head's prediction proposes is an assistant token. The last pair (t = T-2) predicts past
  the end and is never scored. (The bug class this avoids: shifting tokens/features but not the mask.)

Batches pack whole sequences into rows of at most ``max_length`` pairs with a block-diagonal causal mask
and per-sequence position ids (no padding waste, one layer forward per row).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.target_shards import is_sharded
from selfspec.train.calibrate import calibrate_head
from selfspec.train.feature_recipe import FeatureRecipe
from selfspec.train.feature_store import FeatureStore

if TYPE_CHECKING:
    from selfspec.train.inputs import RunInputs

logger = logging.getLogger(__name__)


def shift_pairs(
    input_ids: torch.Tensor, features: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Head inputs, targets and scored positions of one sequence (see the module docstring).

    Args:
        input_ids: LongTensor ``[T]``.
        features: ``[T, D]`` target features after the final norm.
        loss_mask: BoolTensor ``[T]``, True at assistant tokens.

    Returns:
        ``(in_tokens [T-1], in_features [T-1, D], target_features [T-1, D], scored [T-1])`` with
        ``in_tokens[t] = x_{t+1}``, ``in_features[t] = f_t``, ``target_features[t] = f_{t+1}``,
        ``scored[t] = m_{t+2}`` (False for the last pair).

    Raises:
        ValueError: fewer than 2 tokens or mismatched lengths.
    """
    T = input_ids.numel()
    if T < 2 or features.shape[0] != T or loss_mask.numel() != T:
        raise ValueError(
            f"need T >= 2 and matching lengths, got ids {T}, features {features.shape[0]}, mask {loss_mask.numel()}"
        )
    scored = torch.cat([loss_mask[2:].bool(), loss_mask.new_zeros(1, dtype=torch.bool)])
    return input_ids[1:], features[:-1], features[1:], scored


def pack_rows(lengths: list[int], row_len: int) -> list[list[int]]:
    """Greedy packing, in the given order, of sequences (by pair count) into rows of at most ``row_len``.

    A sequence longer than ``row_len`` gets a row of its own. Returns lists of sequence indices.
    """
    rows: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if rows and used + n <= row_len:
            rows[-1].append(i)
            used += n
        else:
            rows.append([i])
            used = n
    return rows


class PairStore(FeatureStore):
    """A :class:`~selfspec.train.feature_store.FeatureStore` read as EAGLE pairs (:func:`shift_pairs`)."""

    def pairs(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`shift_pairs` of sequence i."""
        return shift_pairs(*self.sequence(i))

    def scored_positions(self) -> int:
        """Pairs scored over the whole store (``m_{t+2}`` true; from the masks alone, no feature is read)."""
        spans = zip(self.offsets.tolist(), self.lengths.tolist(), strict=True)
        return sum(int(self.loss_mask[o + 2 : o + n].sum()) for o, n in spans)


def collate(store: PairStore, rows: list[list[int]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Build a packed batch: ``B`` rows of sequences, each sequence causal within itself only.

    Returns:
        ``tokens`` ``[B, T]``, ``features`` / ``targets`` ``[B, T, D]`` (``dtype``), ``scored`` Bool ``[B, T]``,
        ``positions`` ``[B, T]`` (restarting at 0 per sequence), ``mask`` additive ``[B, 1, T, T]``,
        ``valid`` Bool ``[B, T]`` (False on padding), ``segment`` Long ``[B, T]`` (sequence index within its
        row, -1 on padding).
    """
    parts = [[store.pairs(i) for i in row] for row in rows]
    T = max(sum(p[0].numel() for p in row) for row in parts)
    B, D = len(rows), store.width
    tokens = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, D, dtype=dtype)
    targets = torch.zeros(B, T, D, dtype=dtype)
    scored = torch.zeros(B, T, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.long)
    segment = torch.full((B, T), -1, dtype=torch.long)
    for b, row in enumerate(parts):
        o = 0
        for s, (tok, fin, ftg, sc) in enumerate(row):
            n = tok.numel()
            tokens[b, o : o + n] = tok
            feats[b, o : o + n] = fin.to(dtype)
            targets[b, o : o + n] = ftg.to(dtype)
            scored[b, o : o + n] = sc
            positions[b, o : o + n] = torch.arange(n)
            segment[b, o : o + n] = s
            o += n
    valid = segment >= 0
    idx = torch.arange(T)
    allowed = (segment.unsqueeze(2) == segment.unsqueeze(1)) & (idx.view(1, 1, T) <= idx.view(1, T, 1))
    allowed |= torch.eye(T, dtype=torch.bool).unsqueeze(0)  # padding rows see themselves (no empty softmax)
    mask = torch.zeros(B, 1, T, T, dtype=dtype).masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
    return {
        "tokens": tokens,
        "features": feats,
        "targets": targets,
        "scored": scored,
        "positions": positions,
        "mask": mask,
        "valid": valid,
        "segment": segment,
    }


def epoch_rows(store: PairStore, row_len: int, seed: int) -> list[list[int]]:
    """This epoch's rows: sequences shuffled with ``seed``, then packed (deterministic, so resume is exact)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(store), generator=g).tolist()
    lengths = [int(store.lengths[i]) - 1 for i in order]
    return [[order[j] for j in row] for row in pack_rows(lengths, row_len)]


def heldout_batches(
    store: PairStore, row_len: int, rows_per_batch: int, dtype: torch.dtype, device: torch.device
) -> Iterator[dict[str, torch.Tensor]]:
    """The held-out evaluation's batches: ``store`` packed in rows of ``row_len`` pairs, ``rows_per_batch`` rows
    each (:func:`collate`, features in ``dtype``, on ``device``), skipping batches with no scored pair."""
    rows = pack_rows([int(x) - 1 for x in store.lengths], row_len)
    for s in range(0, len(rows), rows_per_batch):
        batch = {k: v.to(device) for k, v in collate(store, rows[s : s + rows_per_batch], dtype).items()}
        if bool(batch["scored"].any()):
            yield batch


class PairRecipe(FeatureRecipe):
    """What the EAGLE-1 and EAGLE-3 recipes share beyond :class:`~selfspec.train.feature_recipe.FeatureRecipe`:
    packed rows of :class:`PairStore` pairs and the post-training calibration
    (:func:`~selfspec.train.calibrate.calibrate_head`).

    Raises:
        ValueError: no scored training position (empty data or all answers truncated away).
    """

    def __init__(
        self, run: RunInputs, train: FeatureStore, held: FeatureStore, signature: str, batch_tokens: int
    ) -> None:
        super().__init__(run, train, held, signature, batch_tokens)
        self.train, self.held = (
            s if isinstance(s, PairStore) else PairStore(s.tokens, s.rows, s.loss_mask, s.lengths, s.starts)
            for s in (train, held)
        )
        if self.train.scored_positions() == 0:
            raise ValueError("no training positions: check the data source and max_length")

    def batches(self, epoch: int) -> list[list[list[int]]]:
        rows = epoch_rows(self.train, self.cfg.max_length, self.epoch_seed(epoch))
        r = self.rows_per_step
        return [rows[i * r : (i + 1) * r] for i in range(max(1, len(rows) // r))]

    def collate(self, items: list[list[int]]) -> dict[str, torch.Tensor]:
        return collate(self.train, items)

    def calibrated(self, head: torch.nn.Module, head_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
        """``summary`` with the saved head's acceptance profile and the conversations it decoded, when
        ``cfg.calibrate_prompts`` > 0 and a tokenizer is given, and the target is whole in this process (a sharded
        one decodes only in lockstep with the others: ``selfspec tune-tree`` calibrates the head where it is served)."""
        if is_sharded(self.target):
            logger.info("the target is sharded across processes: no acceptance profile (run selfspec tune-tree)")
            return summary
        if self.cfg.calibrate_prompts > 0 and self.tokenizer is not None:
            profile = calibrate_head(self.cfg, head, self.target, self.tokenizer, self.eval_convs, head_dir)
            summary["acceptance_profile"] = profile
            summary["calibration_ids"] = profile.pop("ids", [])  # the prompts that fit
        return summary
