"""EAGLE-1 recipe (Li et al. 2024, arXiv:2401.15077): an fc + one decoder layer head that predicts the
target's next feature from (feature, next token) pairs, optionally with a training-time test (the head
unrolled on its own predictions, :mod:`selfspec.train.unroll`).

Run it with ``accelerate launch -m selfspec.train CONFIG.yaml head=eagle [key=value ...]``. The pair layout
and packing are in :mod:`selfspec.train.eagle_data`. The noise is EAGLE's data augmentation: ``U(-a, a)``
added elementwise to the input features only (never to the targets), ``a = eagle.noise`` in feature units
(SmolLM2's after-norm features have an RMS of about 2.0, so ``a = 0.1`` is about 5 % of it; EAGLE's
reference code uses ``U(-0.1, 0.1) * 512 / seq_len``). Only scored positions go through the lm_head (the
dominant cost), over the reduced draft vocabulary; the target's distribution is renormalised over the same
rows. The recipe supplies the head, the packed batches, :func:`eagle_step_loss` and :func:`evaluate`;
:func:`selfspec.train.loop.train_loop` does the rest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.eagle import EagleConfig, EagleHead, softcap
from selfspec.train.config import EagleOptions
from selfspec.train.eagle_data import PairRecipe, PairStore, heldout_batches
from selfspec.train.feature_store import FeatureStore
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import StepLoss, train_loop
from selfspec.train.losses import eagle_loss
from selfspec.train.online_features import feature_stores
from selfspec.train.unroll import ChainTally, UnrolledEagle, chain_metrics
from selfspec.train.warm_start import copy_head, init_head, warm_draft_ids

if TYPE_CHECKING:
    pass


@dataclass
class EagleStepLoss:
    """:func:`eagle_step_loss`'s result: ``loss`` (float32 scalar with a graph), the step-0 ``feature_loss``
    and ``ce_loss`` (detached), and ``scored`` (pairs scored in the batch)."""

    loss: torch.Tensor
    feature_loss: torch.Tensor
    ce_loss: torch.Tensor
    scored: int


def eagle_step_loss(
    unrolled: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    lm_weight: torch.Tensor,
    options: EagleOptions,
    features: torch.Tensor | None = None,
    logit_softcap: float | None = None,
) -> EagleStepLoss:
    """The EAGLE loss of one packed batch, over ``options.ttt_steps`` unrolled steps.

    Step j's loss is :func:`~selfspec.train.losses.eagle_loss` at the scored pairs that have j earlier
    pairs in their sequence (all valid pairs with ``options.score_prompt``); the steps are weighted
    ``ttt_decay ** j`` and the weights normalised to sum to 1.

    Args:
        unrolled: :class:`~selfspec.train.unroll.UnrolledEagle` (or its ``accelerate``-prepared wrapper).
        batch: :func:`~selfspec.train.eagle_data.collate`'s tensors (``tokens`` / ``positions`` /
            ``segment`` / ``scored`` / ``valid`` ``[B, T]``, ``features`` / ``targets`` ``[B, T, D]``).
        lm_weight: ``[S, D]`` float32 frozen lm_head rows of the draft vocabulary.
        options: ``ttt_steps``, ``ttt_decay``, ``ce_weight``, ``feature_weight``, ``loss`` (the token term),
            ``score_prompt``.
        features: head input features ``[B, T, D]`` (default ``batch["features"]``; pass them with noise).
        logit_softcap: the target's ``final_logit_softcapping`` (Gemma-2; :func:`~selfspec.heads.eagle.
            logit_softcap`): both the target's distribution and the draft's are ``cap * tanh(z / cap)`` of the
            lm_head logits, as the target computes its own and :meth:`EagleHead.draft_logits` drafts.
    """
    feats = batch["features"] if features is None else features
    positions = batch["positions"]
    preds = unrolled(feats, batch["tokens"], positions, batch["segment"], options.ttt_steps)
    base = batch["valid"] if options.score_prompt else batch["scored"]
    with torch.no_grad():  # every step has the same targets f_{i+1}: their logits are computed once
        tf_all = batch["targets"][base]
        tl_all = softcap(tf_all @ lm_weight.T, logit_softcap)
    loss = feature_loss = ce_loss = None
    wsum = 0.0
    for j, pred in enumerate(preds):
        later = positions >= j  # pairs with j earlier pairs in their sequence
        pf = pred[base & later]
        lj, fj, cj = eagle_loss(
            pf,
            tf_all[later[base]],
            softcap(pf @ lm_weight.T, logit_softcap),
            tl_all[later[base]],
            ce_weight=options.ce_weight,
            feature_weight=options.feature_weight,
            token_loss=options.loss,
        )
        w = options.ttt_decay**j
        loss = w * lj if loss is None else loss + w * lj
        if j == 0:
            feature_loss, ce_loss = fj, cj
        wsum += w
    return EagleStepLoss(loss / wsum, feature_loss, ce_loss, int(base.sum()))


@torch.no_grad()
def evaluate(
    head: EagleHead,
    store: PairStore,
    target_lm_head: torch.Tensor,
    k: int = 4,
    row_len: int = 512,
    rows_per_batch: int = 4,
    depth: int = 3,
) -> dict[str, Any]:
    """Held-out agreement with the target at scored positions, teacher-forced and unrolled.

    Step 0 (teacher-forced): for pair t the draft's top-k over the draft vocabulary (mapped to target ids)
    is compared with the target's greedy token ``argmax(lm_head(f_{t+1}))`` over the full vocabulary;
    top-1 is the depth-1 acceptance under greedy decoding. With ``depth`` > 1 the head is also unrolled on
    its own predicted features (:class:`UnrolledEagle`), which is how it drafts a chain: ``chain[d-1]`` is
    the share of chain starts whose first d drafts all match the target's greedy tokens, and
    ``1 + sum(chain)`` estimates the greedy chain tau (the bonus token included).

    Args:
        head: an attached :class:`~selfspec.heads.eagle.EagleHead` (unwrapped).
        store: held-out examples.
        target_lm_head: ``[V, D]`` full target lm_head.
        k: largest rank reported.
        depth: unrolled chain depth evaluated (>= 1).

    Returns:
        Raw sums ``{"positions", "hits" [k], "in_vocab", "feature_loss_sum", "chain_hits" [depth],
        "chain_counts" [depth]}`` (see :func:`summarise_eval`).
    """
    was_training = head.training
    head.eval()
    unrolled = UnrolledEagle(head)
    dtype = head.fc.weight.dtype
    hits = torch.zeros(k, dtype=torch.long)
    tally = ChainTally(depth)
    n = in_vocab = 0
    feat_loss = 0.0
    t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    t2d[head.draft_ids.cpu()] = torch.arange(head.config.n_draft)
    dev = head.fc.weight.device
    lm = target_lm_head.to(device=dev, dtype=dtype)
    for b in heldout_batches(store, row_len, rows_per_batch, dtype, dev):
        preds = unrolled(b["features"], b["tokens"], b["positions"], b["segment"], depth)
        sel = b["scored"]
        greedy_all = torch.full(sel.shape, -1, dtype=torch.long, device=dev)
        greedy_all[sel] = (b["targets"][sel] @ lm.T).argmax(-1)
        correct, usable = [], []
        for j, pred in enumerate(preds):
            use = sel & (b["positions"] >= j)
            draft = torch.full(sel.shape, -2, dtype=torch.long, device=dev)
            draft[use] = head.draft_ids[head.draft_logits(pred[use]).argmax(-1)]
            correct.append((draft == greedy_all) & use)
            usable.append(use)
        tally.add(correct, usable)
        pred, tf, greedy = preds[0][sel], b["targets"][sel], greedy_all[sel]
        top = head.draft_logits(pred).topk(min(k, head.config.n_draft), dim=-1).indices
        match = (head.draft_ids[top] == greedy.unsqueeze(1)).cpu()
        match = torch.nn.functional.pad(match.long(), (0, k - match.shape[1]))
        hits += match.cumsum(1).clamp(max=1).sum(0)
        n += pred.shape[0]
        in_vocab += int((t2d[greedy.cpu()] >= 0).sum())
        feat_loss += float(torch.nn.functional.smooth_l1_loss(pred.float(), tf.float(), reduction="sum")) / tf.shape[1]
    head.train(was_training)
    return {
        "positions": n,
        "hits": hits.tolist(),
        "in_vocab": in_vocab,
        "feature_loss_sum": feat_loss,
        "chain_hits": tally.hits,
        "chain_counts": tally.counts,
    }


def summarise_eval(raw: dict[str, Any]) -> dict[str, Any]:
    """Turn :func:`evaluate`'s sums into rates; ``chain_tau`` is
    ``1 + sum(chain)``, the greedy chain tau estimate at the evaluated depth."""
    n = max(1, raw["positions"])
    topk = [round(h / n, 4) for h in raw["hits"]]
    return {
        "positions": raw["positions"],
        "top1": topk[0],
        "topk": topk,
        "feature_loss": round(raw["feature_loss_sum"] / n, 5),
        "target_in_draft_vocab": round(raw["in_vocab"] / n, 4),
        **chain_metrics(raw["chain_hits"], raw["chain_counts"]),
    }


def warm_options(config: EagleConfig) -> dict[str, Any]:
    """The options a saved EAGLE head fixes for a run that starts from it (:mod:`selfspec.train.warm_start`)."""
    return {"draft_vocab_size": config.draft_vocab_size, "eagle": {"fc_bias": config.fc_bias}}


class EagleRecipe(PairRecipe):
    """An EAGLE-1 head trained on packed rows of :class:`~selfspec.train.eagle_data.PairStore` pairs with
    :func:`eagle_step_loss`; ``cfg.eagle`` holds its options.

    Raises:
        ValueError: no scored training position (empty data or all answers truncated away).
    """

    family = "eagle"

    def __init__(self, run: RunInputs, train: FeatureStore, held: FeatureStore, signature: str) -> None:
        cfg, target, opts = run.cfg, run.target, run.cfg.eagle
        super().__init__(run, train, held, signature, opts.batch_tokens)
        self.rank = run.accelerator.process_index
        scored = self.train.scored_positions()
        self.n_scored = int(self.train.lengths.sum()) - len(self.train) if opts.score_prompt else scored
        V = target.config.vocab_size
        warm = init_head(cfg, target)
        draft_ids = self.draft_ids() if warm is None else warm_draft_ids(warm, V)
        hcfg = EagleConfig(
            hidden_size=target.config.hidden_size,
            vocab_size=V,
            draft_vocab_size=None if draft_ids is None else draft_ids.numel(),
            fc_bias=opts.fc_bias,
            target=cfg.target,
            target_fingerprint=target_fingerprint(target),
        )
        torch.manual_seed(cfg.seed)
        self.head = EagleHead(
            hcfg, target.config, draft_ids=draft_ids, target=target, init_from_target_layer=opts.init_from_target_layer
        ).float()
        copy_head(self.head, warm)
        self._lm32: torch.Tensor | None = None  # [S, D] frozen, on the head's device once training starts

    def module(self) -> torch.nn.Module:
        return UnrolledEagle(self.head)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        feats = batch["features"]
        if self.cfg.eagle.noise:
            g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 31 + self.rank)
            noise = (torch.rand(feats.shape, generator=g) * 2 - 1) * self.cfg.eagle.noise
            feats = feats + noise.to(feats.device)
        if self._lm32 is None:
            self._lm32 = self.head.lm_weight(torch.float32).to(feats.device)
        out = eagle_step_loss(
            model, batch, self._lm32, self.cfg.eagle, features=feats, logit_softcap=self.head.logit_softcap
        )
        return StepLoss(
            out.loss,
            {"feature_loss": round(out.feature_loss.item(), 4), "ce_loss": round(out.ce_loss.item(), 4)},
            {"train_tokens": int(batch["valid"].sum()), "scored_tokens": out.scored},
        )

    def evaluate(self) -> dict[str, Any]:
        return summarise_eval(evaluate(self.head, self.held, self.lm_full, self.cfg.eval_topk, self.cfg.max_length))

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        self.head.config = dataclasses.replace(self.head.config, heldout_top1=metrics["top1"])
        self.head.save_pretrained(head_dir)
        out: dict[str, Any] = {
            "train_sequences": len(self.train),
            "scored_positions_per_epoch": self.n_scored,
            "draft_vocab_size": self.head.config.n_draft,
            "heldout": metrics,
            "options": dataclasses.asdict(self.cfg.eagle),
            **self.feature_summary(),
        }
        return self.calibrated(self.head, head_dir, out)


def train_eagle(run: RunInputs) -> Path:
    """Train an EAGLE-1 head on the frozen ``run.target``; returns the saved head directory (``<output_dir>/heads``).

    Uses ``cfg.eagle``, ``draft_vocab_size``,
    ``max_length`` (row length), ``eval_topk``, ``seed``, ``calibrate_*`` and the loop's options
    (:func:`~selfspec.train.loop.train_loop`). After saving, the head is calibrated on the last held-out
    prompts (:func:`~selfspec.train.calibrate.calibrate_head`). The features come from the store or online as
    ``cfg.features`` says (:func:`~selfspec.train.online_features.feature_stores`); features self-distillation
    captured are reused by the store.

    Raises:
        ValueError: no scored training position (empty data or all answers truncated away).
    """
    train, held, signature, _ = feature_stores(run, None, run.cfg.eagle.batch_tokens)
    return train_loop(run.cfg, run.accelerator, EagleRecipe(run, train, held, signature), run.heldout())
