"""Medusa-1 recipe (Cai et al. 2024, arXiv:2401.10774): K heads on the frozen target's last hidden state,
head k predicting the token ``k + 2`` positions ahead.

Run it with ``accelerate launch -m selfspec.train CONFIG.yaml`` (``head: medusa``) or ``selfspec train``.
The recipe supplies the heads, their batches (single positions of the shared feature store), the loss and
the held-out evaluation; :func:`selfspec.train.loop.train_loop` does the rest (schedule, ``accelerate``,
checkpoints and resume, cadence, summary, training record).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.eagle import logit_softcap, softcap
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.train.config import TrainConfig
from selfspec.train.feature_store import FeatureStore, target_features
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import Recipe, StepLoss, draft_vocabulary, train_loop
from selfspec.train.losses import IGNORE, medusa_loss, topk_hits
from selfspec.train.warm_start import copy_head, init_head, warm_draft_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def head_labels(ids: torch.Tensor, mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Medusa labels of one sequence: Long ``[T, K]``, head k at position t labelled ``x_{t+2+k}`` where that
    token exists and is an assistant token (``mask``, Bool ``[T]``), ``-100`` elsewhere."""
    T = ids.numel()
    labels = torch.full((T, num_heads), IGNORE, dtype=torch.long)
    for k in range(num_heads):
        off = 2 + k
        if T > off:
            labels[: T - off, k] = torch.where(mask[off:], ids[off:], torch.full_like(ids[off:], IGNORE))
    return labels


def position_index(store: FeatureStore, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten a store into (position, labels, future) rows: Medusa heads look at one position at a time; from the
    token ids and masks alone (no feature is read: :meth:`~selfspec.train.feature_store.FeatureStore.feature_rows`
    reads a batch's).

    Head k at position t is trained on token ``t + 2 + k`` when that token exists and is an assistant
    token (``loss_mask``); positions where no head has a label are dropped.

    Args:
        store: sequences with their target features.
        num_heads: K.

    Returns:
        ``(positions [P], labels [P, K], future [P, K])``: each row's token position in ``store.tokens``; labels are
        target token ids or ``-100``; ``future[p, k]`` is the token position ``t + 1 + k`` (whose feature's lm_head
        logits are the target's distribution of head k's label), -1 where the label is ``-100``.
    """
    ps, ys, fs = [], [], []
    for i in range(len(store)):
        o, T = int(store.offsets[i]), int(store.lengths[i])
        labels = head_labels(store.tokens[o : o + T], store.loss_mask[o : o + T], num_heads)
        here = o + torch.arange(T)
        keep = (labels != IGNORE).any(1)
        ps.append(here[keep])
        ys.append(labels[keep])
        fs.append((here.unsqueeze(1) + 1 + torch.arange(num_heads))[keep].masked_fill(labels[keep] == IGNORE, -1))
    if not ps:
        empty = torch.empty(0, num_heads, dtype=torch.long)
        return torch.empty(0, dtype=torch.long), empty, empty.clone()
    return torch.cat(ps), torch.cat(ys), torch.cat(fs)


def position_table(store: FeatureStore, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`position_index` with every row's feature read: ``(hidden [P, D], labels [P, K], future [P, K])``,
    hidden in the store's dtype (the whole table in memory: for small stores; the recipe reads per batch)."""
    positions, labels, future = position_index(store, num_heads)
    return store.feature_rows(positions), labels, future


class PositionRows:
    """The features of a store at token ``positions`` (Long ``[P]``), read by slice: ``rows[a:b]`` is
    ``[b - a, D]``; ``len(rows)`` is P."""

    def __init__(self, store: FeatureStore, positions: torch.Tensor) -> None:
        self.store, self.positions = store, positions

    def __len__(self) -> int:
        return int(self.positions.numel())

    def __getitem__(self, s: slice) -> torch.Tensor:
        return self.store.feature_rows(self.positions[s])


def to_draft_labels(labels: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Map target ids ``[P, K]`` to draft ids through ``t2d`` (Long ``[V]``, -1 outside the draft
    vocabulary): ``-100`` stays, out-of-vocabulary targets become ``-1``."""
    out = labels.clone()
    valid = labels != IGNORE
    out[valid] = t2d[labels[valid]]
    return out


def label_vocabulary(
    labels: torch.Tensor, size: int | None, vocab_size: int, warm: torch.nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The Medusa heads' draft vocabulary and its index.

    Args:
        labels: Long ``[P, K]`` target ids the heads learn (``-100``: none).
        size: ``draft_vocab_size``: the ``size`` most frequent labels (:func:`~selfspec.train.loop.draft_vocabulary`);
            None: the full vocabulary.
        vocab_size: V.
        warm: a head the run starts from (:func:`~selfspec.train.warm_start.init_head`): its own vocabulary instead.

    Returns:
        ``(draft_ids, t2d, S)``: the draft vocabulary's target ids Long ``[S]`` (``arange(V)`` for the full one), each
        target id's draft id Long ``[V]`` (-1 outside), and S.
    """
    if warm is None:
        draft_ids = draft_vocabulary(torch.bincount(labels[labels != IGNORE], minlength=vocab_size), size)
    else:
        draft_ids = warm_draft_ids(warm, vocab_size)
    n_draft = vocab_size if draft_ids is None else draft_ids.numel()
    draft_ids = torch.arange(vocab_size) if draft_ids is None else draft_ids
    t2d = torch.full((vocab_size,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(n_draft)
    return draft_ids, t2d, n_draft


def evaluate(
    heads: MedusaHeads, hidden: torch.Tensor | PositionRows, labels_draft: torch.Tensor, k: int, batch: int = 1024
) -> list[list[float]]:
    """Held-out cumulative top-1..top-k accuracy per head.

    Args:
        heads: the heads (unwrapped).
        hidden: ``[P, D]`` target features (or a store's, read ``batch`` rows at a time: :class:`PositionRows`).
        labels_draft: Long ``[P, K]`` draft ids (:func:`to_draft_labels`; -1 counts as a miss, -100 is
            not scored).
        k: largest rank.

    Returns:
        ``acc[h][j]``: share of head h's scored positions whose label is in its top-(j+1), 4 decimals.
    """
    K = labels_draft.shape[1]
    hits = torch.zeros(K, k, dtype=torch.long)
    counts = torch.zeros(K, dtype=torch.long)
    was_training = heads.training
    heads.eval()
    dev = next(heads.parameters()).device
    with torch.no_grad():
        for s in range(0, len(hidden), batch):
            logits = heads(hidden[s : s + batch].float().to(dev))
            h, c = topk_hits(logits, labels_draft[s : s + batch].to(dev), k)
            hits += h.cpu()
            counts += c.cpu()
    heads.train(was_training)
    return [[round(float(hits[h, j]) / max(1, int(counts[h])), 4) for j in range(k)] for h in range(K)]


def warm_options(config: MedusaConfig) -> dict[str, Any]:
    """The options saved Medusa heads fix for a run that starts from them (:mod:`selfspec.train.warm_start`);
    Medusa-2 (``medusa.joint``) starts from Medusa-1 heads the same way."""
    shape = {"num_heads": config.num_heads, "num_layers": config.num_layers, "own_lm_head": config.own_lm_head}
    return {"draft_vocab_size": config.draft_vocab_size, "medusa": shape}


class MedusaRecipe(Recipe):
    """Medusa-1 heads on the rows of :func:`position_table`, trained with :func:`~selfspec.train.losses.
    medusa_loss` over the draft vocabulary (out-of-vocabulary labels carry no gradient); with a distribution
    ``medusa.loss`` against the target's distribution over the draft vocabulary (its lm_head rows of the draft
    ids, renormalised), computed from the store's feature at each label's position.

    Raises:
        ValueError: no training position (empty data or all answers truncated away).
    """

    family = "medusa"

    def __init__(
        self, cfg: TrainConfig, target: PreTrainedModel, train: FeatureStore, held: FeatureStore, signature: str
    ) -> None:
        self.cfg, self.target, self.signature = cfg, target, signature
        opts = cfg.medusa
        self.store = train
        self.positions, labels, self.future = position_index(train, opts.num_heads)
        if self.positions.numel() == 0:
            raise ValueError("no training positions: check the data source and max_length")
        # a distribution loss scores each head against the target's distribution at its label's position
        self.with_future = opts.loss != "ce"
        held_positions, held_labels, _ = position_index(held, opts.num_heads)
        V = target.config.vocab_size
        warm = init_head(cfg, target)
        draft_ids, t2d, n_draft = label_vocabulary(labels, cfg.draft_vocab_size, V, warm)
        labels_draft = to_draft_labels(labels, t2d)
        self.labels = labels_draft.masked_fill(labels_draft == -1, IGNORE)  # out-of-vocab tokens: no gradient
        self.held = (PositionRows(held, held_positions), to_draft_labels(held_labels, t2d))
        mcfg = MedusaConfig(
            hidden_size=target.config.hidden_size,
            vocab_size=V,
            num_heads=opts.num_heads,
            num_layers=opts.num_layers,
            own_lm_head=opts.own_lm_head,
            draft_vocab_size=n_draft if n_draft < V else None,
            target=cfg.target,
            target_fingerprint=target_fingerprint(target),
        )
        lm_head = target.get_output_embeddings().weight.detach().float().cpu()
        self.heads = MedusaHeads(mcfg, target_lm_head=lm_head, draft_ids=draft_ids)
        copy_head(self.heads, warm)
        self._lm_rows, self._softcap = lm_head[draft_ids], logit_softcap(target.config)

    def module(self) -> torch.nn.Module:
        return self.heads

    def batches(self, epoch: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(self.epoch_seed(epoch))
        order = torch.randperm(self.positions.numel(), generator=g)
        bp = self.cfg.medusa.batch_positions
        return [order[i * bp : (i + 1) * bp].tolist() for i in range(max(1, order.numel() // bp))]

    def collate(self, items: list[int]) -> dict[str, torch.Tensor]:
        idx = torch.tensor(items, dtype=torch.long)
        batch = {"hidden": self.store.feature_rows(self.positions[idx]).float(), "labels": self.labels[idx]}
        if self.with_future:
            batch["future"] = self.store.feature_rows(self.future[idx].clamp(min=0)).float()  # [P, K, D]
        return batch

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        opts = self.cfg.medusa
        logits = model(batch["hidden"])
        log_p = None
        if "future" in batch:
            with torch.no_grad():
                rows = self._lm_rows.to(logits.device)
                log_p = torch.log_softmax(softcap(batch["future"] @ rows.T, self._softcap), dim=-1).transpose(0, 1)
        loss, per_head = medusa_loss(logits, batch["labels"], opts.head_decay, opts.loss, log_p)
        return StepLoss(
            loss,
            {"per_head_loss": [round(float(x), 4) for x in per_head]},
            {"train_tokens": int(batch["labels"].shape[0])},
        )

    def evaluate(self) -> dict[str, Any]:
        return {"topk": evaluate(self.heads, *self.held, self.cfg.eval_topk)}

    def history(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"top1": [a[0] for a in metrics["topk"]]}

    def acceptance(self, metrics: dict[str, Any]) -> list[float] | None:
        # head k's held-out top-1 stands for the acceptance at depth k + 1 (teacher-forced: an estimate)
        return [a[0] for a in metrics["topk"]]

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        self.heads.config = dataclasses.replace(self.heads.config, head_topk_accuracy=metrics["topk"])
        self.heads.save_pretrained(head_dir)
        return {"heldout_topk_accuracy": metrics["topk"]}


def train_medusa(run: RunInputs) -> Path:
    """Train Medusa heads on the frozen ``run.target``; returns the saved heads directory (``<output_dir>/heads``).

    Uses ``cfg.medusa``,
    ``draft_vocab_size``, ``max_length``, ``eval_topk``, ``seed`` and the loop's options
    (:func:`~selfspec.train.loop.train_loop`). The features come from the store (each batch's positions read from
    disk); features self-distillation captured are reused (:func:`~selfspec.train.feature_store.target_features`).

    Raises:
        ValueError: no training positions (empty data or all answers truncated away), or ``features: online``
            (Medusa draws single positions from the whole store).
    """
    if run.cfg.activation_checkpointing:
        raise ValueError("Medusa heads have no attention layer to recompute: drop activation_checkpointing")
    if run.cfg.features == "online":
        raise ValueError(
            "Medusa heads train on single positions drawn from the whole data set, so their features are not computed "
            "online: set features: store (or auto)"
        )
    train, held, signature = target_features(run)
    recipe = MedusaRecipe(run.cfg, run.target, train, held, signature)
    return train_loop(run.cfg, run.accelerator, recipe, run.heldout())
