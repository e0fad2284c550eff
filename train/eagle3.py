"""EAGLE-3 recipe (Li et al. 2025, arXiv:2503.01840) on the shared loop: an :class:`~selfspec.heads.eagle3.Eagle3Head`
trained with a training-time test against the target's distribution over the draft vocabulary.

Run it with ``accelerate launch -m selfspec.train CONFIG.yaml head=eagle3 [key=value ...]``. Data layout: the
feature store (:func:`~selfspec.train.feature_store.target_features` with ``layers``) holds at every position t
``[g_t (3D: the three target layers), f_t (D: the last hidden state after the final norm)]``; the pairs of
:mod:`selfspec.train.eagle_data` then give, for pair t (head position t):

* input ``(g_t, x_{t+1})``; target distribution ``p_t = softmax(lm_head(f_{t+1}))`` over the draft vocabulary
  (the target's rows ``draft_ids``, renormalised), which is the target's distribution of ``x_{t+2}``;
* scored iff ``x_{t+2}`` is an assistant token (``m_{t+2}``), the shift proven in ``tests/train/test_eagle3.py``.

Training-time test (:class:`UnrolledEagle3`): step 0 is the teacher-forced forward; at step i >= 1 pair t's input
is the head's own step-(i-1) output at pair t-1 (the D-wide output it drafts from: :meth:`Eagle3Head.forward`'s,
post-norm for EAGLE-3.1's ``norm_output``, what the drafter feeds), its token stays ``x_{t+1}``,
and its attention is :func:`~selfspec.train.unroll.unrolled_mask` over one growing KV cache, exactly what the
depth-(i+1) draft node of a chain starting at pair t-i sees while decoding. The loss is
``sum_i ttt_decay**i * L_i`` with ``L_i`` the forward KL ``KL(p || q_i)`` (or the cross entropy against the
target's greedy draft-vocabulary token, ``eagle3.loss: ce``) at the scored pairs with i earlier pairs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.eagle import softcap
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_target_layers
from selfspec.train.config import Eagle3Options, TrainConfig
from selfspec.train.distill_states import CapturedStates
from selfspec.train.eagle_data import PairRecipe, PairStore, heldout_batches
from selfspec.train.feature_store import FeatureStore
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import StepLoss, train_loop
from selfspec.train.losses import distribution_loss
from selfspec.train.online_features import feature_stores
from selfspec.train.unroll import ChainTally, chain_metrics, unrolled_mask
from selfspec.train.warm_start import copy_head, init_head, warm_draft_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class UnrolledEagle3(torch.nn.Module):
    """The training-time test of an EAGLE-3 head (see the module docstring); one forward per optimiser step for
    ``accelerate`` / DDP, returning only the selected positions' draft logits (``[B, T, S]`` for every step would
    not fit at S = 8192)."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.head = head

    def forward(
        self,
        layers: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segment: torch.Tensor,
        steps: int,
        select: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Args: ``layers`` ``[B, T, 3D]`` the target layers at each pair, ``tokens`` / ``positions`` / ``segment``
        Long ``[B, T]`` (:func:`~selfspec.train.eagle_data.collate`), ``steps`` >= 1, ``select`` Bool ``[B, T]``.

        Returns:
            ``steps`` float tensors; step i is ``[P_i, S]``, the draft logits at ``select & (positions >= i)`` in
            row-major order."""
        head = self.head
        dtype = head.fc.weight.dtype
        cache = DynamicCache(config=head.arch_config)
        x, logits = layers, []
        for i in range(steps):
            out = head(x, tokens, positions, unrolled_mask(segment, i, dtype), cache)
            logits.append(head.draft_logits(out[select & (positions >= i)]))
            if i + 1 < steps:  # pair t's next input: the output at pair t-1 (pair 0's is never attended by a query)
                x = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        return logits


def split_features(batch: dict[str, torch.Tensor], hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layers [B, T, 3D] at pair t, f_{t+1} [B, T, D])`` of a collated batch whose store features are
    ``[g (3D), f (D)]`` (the inputs come from ``features`` = position t, the targets from ``targets`` = t+1)."""
    D = hidden_size
    return batch["features"][..., : 3 * D], batch["targets"][..., 3 * D :]


def eagle3_step_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    lm_rows: torch.Tensor,
    options: Eagle3Options,
    hidden_size: int,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, list[float], int]:
    """The EAGLE-3 loss of one packed batch: ``sum_i ttt_decay**i * L_i`` (module docstring).

    Args:
        model: :class:`UnrolledEagle3` (or its prepared wrapper).
        batch: :func:`~selfspec.train.eagle_data.collate`'s tensors over a store of ``[g, f]`` features.
        lm_rows: ``[S, D]`` float32, the target's lm_head rows of the draft vocabulary (frozen).
        options: ``ttt_steps``, ``ttt_decay``, ``loss``, ``score_prompt``.
        logit_softcap: the target's ``final_logit_softcapping`` (applied to its logits as it does itself).

    Returns:
        ``(loss, per-step losses, scored pairs)``: a float32 scalar with a graph (0 with one when nothing is
        scored), the detached ``L_i`` and the count of step-0 positions.
    """
    layers, f_next = split_features(batch, hidden_size)
    positions = batch["positions"]
    base = batch["valid"] if options.score_prompt else batch["scored"]
    logits = model(layers, batch["tokens"], positions, batch["segment"], options.ttt_steps, base)
    with torch.no_grad():
        target_logits = softcap(f_next[base].float() @ lm_rows.T, logit_softcap)  # [P, S]
        log_p = torch.log_softmax(target_logits, dim=-1)
    later_pos = positions[base]
    loss = sum(q.float().sum() * 0.0 for q in logits)
    per_step = []
    for i, q in enumerate(logits):
        if q.shape[0] == 0:
            per_step.append(0.0)
            continue
        lp = log_p[later_pos >= i]
        li = distribution_loss(torch.log_softmax(q.float(), dim=-1), lp, options.loss).mean()
        per_step.append(round(float(li.detach()), 4))
        loss = loss + options.ttt_decay**i * li
    return loss, per_step, int(base.sum())


@torch.no_grad()
def evaluate(
    head: Eagle3Head,
    store: PairStore,
    target_lm_head: torch.Tensor,
    depth: int = 3,
    row_len: int = 512,
    rows_per_batch: int = 4,
) -> dict[str, Any]:
    """Held-out agreement with the target's greedy tokens at scored pairs: ``top1`` (teacher-forced, step 0, the
    depth-1 acceptance of greedy decoding) and ``chain[d-1]``, the share of chain starts whose first d drafts
    (the head unrolled on its own outputs, :class:`UnrolledEagle3`) all equal the target's greedy tokens, i.e.
    the per-position greedy chain acceptance; ``chain_tau = 1 + sum(chain)``. ``target_lm_head``: ``[V, D]``."""
    was_training = head.training
    head.eval()
    unrolled = UnrolledEagle3(head)
    D, dev, dtype = head.config.hidden_size, head.fc.weight.device, head.fc.weight.dtype
    lm = target_lm_head.to(device=dev, dtype=dtype)
    ids = head.draft_ids
    tally = ChainTally(depth)
    for b in heldout_batches(store, row_len, rows_per_batch, dtype, dev):
        sel = b["scored"]
        layers, f_next = split_features(b, D)
        greedy = softcap(f_next @ lm.T, head.logit_softcap).argmax(-1)  # [B, T] target ids
        logits = unrolled(layers, b["tokens"], b["positions"], b["segment"], depth, sel)
        correct, usable = [], []
        for i, q in enumerate(logits):
            use = sel & (b["positions"] >= i)
            hit = torch.zeros_like(use)
            hit[use] = ids[q.argmax(-1)] == greedy[use]
            correct.append(hit)
            usable.append(use)
        tally.add(correct, usable)
    head.train(was_training)
    metrics = chain_metrics(tally.hits, tally.counts)
    return {"positions": tally.counts[0], "top1": metrics["chain"][0], **metrics}


class Eagle3Recipe(PairRecipe):
    """An EAGLE-3 head trained on packed rows of ``[g, f]`` features with :func:`eagle3_step_loss`; ``cfg.eagle3``
    holds its options, ``cfg.draft_vocab_size`` its draft vocabulary (the most frequent assistant tokens).

    Raises:
        ValueError: no scored training position.
    """

    family = "eagle3"

    def __init__(self, run: RunInputs, train: FeatureStore, held: FeatureStore, signature: str) -> None:
        cfg, target, opts = run.cfg, run.target, run.cfg.eagle3
        super().__init__(run, train, held, signature, opts.batch_tokens)
        V, D = target.config.vocab_size, target.config.hidden_size
        warm = init_head(cfg, target)
        draft_ids = self.draft_ids() if warm is None else warm_draft_ids(warm, V)
        hcfg = Eagle3Config(
            hidden_size=D,
            vocab_size=V,
            draft_vocab_size=V if draft_ids is None else draft_ids.numel(),
            num_target_layers=target.config.num_hidden_layers,
            target_layers=head_layers(cfg, target),
            target=cfg.target,
            target_fingerprint=target_fingerprint(target),
            fc_norm=opts.fc_norm,
            norm_output=opts.norm_output,
        )
        torch.manual_seed(cfg.seed)
        self.head = Eagle3Head(
            hcfg,
            target.config,
            draft_ids=draft_ids,
            target=target,
            init_layer=opts.init_layer,
            init_lm_head=opts.init_lm_head,
        ).float()
        copy_head(self.head, warm)

    def module(self) -> torch.nn.Module:
        return UnrolledEagle3(self.head)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        lm_rows = self.lm_rows(self.head.draft_ids, batch["tokens"].device)
        loss, per_step, scored = eagle3_step_loss(
            model, batch, lm_rows, self.cfg.eagle3, self.target.config.hidden_size, self.head.logit_softcap
        )
        return StepLoss(
            loss, {"step_loss": per_step}, {"train_tokens": int(batch["valid"].sum()), "scored_tokens": scored}
        )

    def evaluate(self) -> dict[str, Any]:
        return evaluate(self.head, self.held, self.lm_full, min(3, self.cfg.eagle3.ttt_steps), self.cfg.max_length)

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        self.head.config = dataclasses.replace(self.head.config, heldout_top1=metrics["top1"])
        self.head.save_pretrained(head_dir)
        out: dict[str, Any] = {
            "train_sequences": len(self.train),
            "draft_vocab_size": self.head.config.n_draft,
            "target_layers": list(self.head.target_layers),
            "heldout": metrics,
            "options": dataclasses.asdict(self.cfg.eagle3),
            **self.feature_summary(),
        }
        return self.calibrated(self.head, head_dir, out)


def warm_options(config: Eagle3Config) -> dict[str, Any]:
    """The options a saved EAGLE-3 head fixes for a run that starts from it (:mod:`selfspec.train.warm_start`)."""
    return {
        "draft_vocab_size": config.draft_vocab_size,
        "eagle3": {
            "target_layers": tuple(config.target_layers),
            "fc_norm": config.fc_norm,
            "norm_output": config.norm_output,
        },
    }


def head_layers(cfg: TrainConfig, target: PreTrainedModel) -> tuple[int, ...]:
    """The three target layers the head fuses: ``cfg.eagle3.target_layers``, else the published default."""
    return cfg.eagle3.target_layers or default_target_layers(target.config.num_hidden_layers)


def capture_eagle3(cfg: TrainConfig, target: PreTrainedModel, budget_bytes: int) -> CapturedStates | None:
    """What self-distillation keeps for an EAGLE-3 run: the head's three layers and the last hidden state
    (:func:`head_layers`), or nothing with ``features: online`` (no store to fill)."""
    if cfg.features == "online":
        return None
    return CapturedStates(head_layers(cfg, target), budget_bytes)


def train_eagle3(run: RunInputs) -> Path:
    """Train an EAGLE-3 head on the frozen ``run.target``; returns the saved head directory (``<output_dir>/heads``).

    The features are the three layers and the last hidden state at every position, from the feature store
    (cached, keyed by them) or computed online as batches are built, as ``cfg.features`` says
    (:func:`~selfspec.train.online_features.feature_stores`); the loop
    (:func:`~selfspec.train.loop.train_loop`) does the rest; afterwards the head is calibrated
    on held-out prompts when ``cfg.calibrate_prompts`` > 0 and a tokenizer is given. Features self-distillation
    captured are reused by the store (and dropped when the features are computed online).

    Raises:
        ValueError: no scored training position.
    """
    train, held, signature, _ = feature_stores(run, head_layers(run.cfg, run.target), run.cfg.eagle3.batch_tokens)
    return train_loop(run.cfg, run.accelerator, Eagle3Recipe(run, train, held, signature), run.heldout())
