"""EAGLE-1 recipe: setup (target features, draft vocabulary) -> train (the head only) -> save.

Run it with ``accelerate launch -m selfspec.train CONFIG.yaml head=eagle [key=value ...]``.

Data layout (0-based; proven by ``tests/train/test_eagle_train.py`` on a hand-made 8-token sequence).
For tokens ``x_0 .. x_{T-1}``, target features ``f_0 .. f_{T-1}`` (after the final norm; ``f_t`` gives the
distribution of ``x_{t+1}``) and the assistant mask ``m_t`` ("``x_t`` is an assistant token"):

* pair t (t = 0 .. T-2) is the head input ``(f_t + noise, x_{t+1})`` at head position t;
* its target is ``f_{t+1}`` (and the target's distribution ``softmax(lm_head(f_{t+1}))``);
* it is scored iff ``m_{t+2}``: ``f_{t+1}`` is what drafts ``x_{t+2}``, so the loss is counted exactly where
  the token the head's prediction proposes is an assistant token. The last pair (t = T-2) predicts past
  the end and is never scored. (The bug class this avoids: shifting tokens/features but not the mask.)

The noise is EAGLE's data augmentation: ``U(-a, a)`` added elementwise to the input features only (never
to the targets), ``a = noise`` in feature units (SmolLM2's after-norm features have an RMS of about 2.0,
so ``a = 0.1`` is about 5 % of it; EAGLE's reference code uses ``U(-0.1, 0.1) * 512 / seq_len``).

Batches pack whole sequences into rows of at most ``max_length`` pairs with a block-diagonal causal mask
and per-sequence position ids (no padding waste, one layer forward per row). Only scored positions go
through the lm_head (the dominant cost), over the reduced draft vocabulary; the target's distribution is
renormalised over the same rows. Features are cached per rank (safetensors); checkpoints and resume work
exactly like :mod:`selfspec.train.medusa`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from selfspec.train.config import TrainConfig
from selfspec.train.losses import eagle_loss
from selfspec.train.medusa import _save_atomic, optimizer_step, prepare_and_resume

logger = logging.getLogger(__name__)

# EAGLE knobs not (yet) in TrainConfig; a TrainConfig field ``eagle_<name>`` overrides each.
EAGLE_DEFAULTS: dict[str, Any] = {
    "ce_weight": 0.1,  # weight of the token CE vs the target distribution (EAGLE: 0.1)
    "feature_weight": 1.0,  # weight of SmoothL1 on features (EAGLE: 1.0)
    "noise": 0.1,  # half-width a of the uniform noise U(-a, a) on input features
    "batch_tokens": 2048,  # head positions (pairs) per optimiser step, packed in rows of max_length
    "fc_bias": True,
    "init_from_target_layer": False,  # start layers.0 from the target's last layer instead of random
}


def eagle_option(cfg: TrainConfig, name: str) -> Any:
    """``cfg.eagle_<name>`` when TrainConfig has it, else :data:`EAGLE_DEFAULTS`."""
    value = getattr(cfg, f"eagle_{name}", None)
    return EAGLE_DEFAULTS[name] if value is None else value


# ------------------------------------------------------------------------------------------ data layout
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


class FeatureStore:
    """Concatenated examples: ``tokens`` ``[ΣT]``, ``features`` ``[ΣT, D]``, ``loss_mask`` ``[ΣT]``, ``lengths`` ``[E]``."""

    def __init__(
        self, tokens: torch.Tensor, features: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor
    ) -> None:
        self.tokens, self.features, self.loss_mask, self.lengths = tokens, features, loss_mask.bool(), lengths.long()
        starts = torch.cat([self.lengths.new_zeros(1), self.lengths.cumsum(0)[:-1]])
        self.offsets = starts if self.lengths.numel() else self.lengths

    @classmethod
    def from_examples(cls, examples: list[dict], feats: list[torch.Tensor], hidden_size: int) -> FeatureStore:
        keep = [(e, f) for e, f in zip(examples, feats) if e["input_ids"].numel() >= 2]
        if not keep:
            return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, hidden_size), torch.zeros(0, dtype=torch.bool),
                       torch.zeros(0, dtype=torch.long))
        return cls(
            torch.cat([e["input_ids"] for e, _ in keep]),
            torch.cat([f for _, f in keep]),
            torch.cat([e["loss_mask"] for e, _ in keep]),
            torch.tensor([e["input_ids"].numel() for e, _ in keep]),
        )

    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        return {prefix + "tokens": self.tokens, prefix + "features": self.features.contiguous(),
                prefix + "loss_mask": self.loss_mask, prefix + "lengths": self.lengths}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str = "") -> FeatureStore:
        return cls(t[prefix + "tokens"], t[prefix + "features"], t[prefix + "loss_mask"], t[prefix + "lengths"])

    def __len__(self) -> int:
        return int(self.lengths.numel())

    def pairs(self, i: int):
        """:func:`shift_pairs` of example i."""
        o, T = int(self.offsets[i]), int(self.lengths[i])
        return shift_pairs(self.tokens[o : o + T], self.features[o : o + T], self.loss_mask[o : o + T])

    def scored_positions(self) -> int:
        return sum(int(self.pairs(i)[3].sum()) for i in range(len(self)))


def collate(store: FeatureStore, rows: list[list[int]], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Build a packed batch: ``B`` rows of sequences, each sequence causal within itself only.

    Returns:
        ``tokens`` ``[B, S]``, ``features`` / ``targets`` ``[B, S, D]`` (``dtype``), ``scored`` Bool ``[B, S]``,
        ``positions`` ``[B, S]`` (restarting at 0 per sequence), ``mask`` additive ``[B, 1, S, S]``,
        ``valid`` Bool ``[B, S]`` (False on padding).
    """
    parts = [[store.pairs(i) for i in row] for row in rows]
    S = max(sum(p[0].numel() for p in row) for row in parts)
    B, D = len(rows), store.features.shape[-1]
    tokens = torch.zeros(B, S, dtype=torch.long)
    feats = torch.zeros(B, S, D, dtype=dtype)
    targets = torch.zeros(B, S, D, dtype=dtype)
    scored = torch.zeros(B, S, dtype=torch.bool)
    positions = torch.zeros(B, S, dtype=torch.long)
    segment = torch.full((B, S), -1, dtype=torch.long)
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
    idx = torch.arange(S)
    allowed = (segment.unsqueeze(2) == segment.unsqueeze(1)) & (idx.view(1, 1, S) <= idx.view(1, S, 1))
    allowed |= torch.eye(S, dtype=torch.bool).unsqueeze(0)  # padding rows see themselves (no empty softmax)
    mask = torch.zeros(B, 1, S, S, dtype=dtype).masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)
    return {"tokens": tokens, "features": feats, "targets": targets, "scored": scored, "positions": positions,
            "mask": mask, "valid": valid}


def epoch_rows(store: FeatureStore, row_len: int, seed: int) -> list[list[int]]:
    """This epoch's rows: sequences shuffled with ``seed``, then packed (deterministic, so resume is exact)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(store), generator=g).tolist()
    lengths = [int(store.lengths[i]) - 1 for i in order]
    return [[order[j] for j in row] for row in pack_rows(lengths, row_len)]


# ------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(
    head, store: FeatureStore, target_lm_head: torch.Tensor, k: int = 4, row_len: int = 512, rows_per_batch: int = 4
) -> dict[str, Any]:
    """Held-out teacher-forced next-token agreement with the target, at scored positions.

    For pair t the draft's top-k over the draft vocabulary (mapped to target ids) is compared with the
    target's greedy token ``argmax(lm_head(f_{t+1}))`` over the full vocabulary: top-1 is the depth-1
    chain acceptance under greedy decoding.

    Args:
        head: an attached :class:`~selfspec.heads.eagle.EagleHead` (unwrapped).
        store: held-out examples.
        target_lm_head: ``[V, D]`` full target lm_head.
        k: largest rank reported.

    Returns:
        ``{"positions", "top1", "topk": [top-1 .. top-k], "feature_loss", "target_in_draft_vocab"}``
        (counts are raw sums; see :func:`summarise_eval`).
    """
    was_training = head.training
    head.eval()
    dtype = head.fc.weight.dtype
    hits = torch.zeros(k, dtype=torch.long)
    n = in_vocab = 0
    feat_loss = 0.0
    t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    t2d[head.draft_ids.cpu()] = torch.arange(head.config.n_draft)
    rows = pack_rows([int(x) - 1 for x in store.lengths], row_len)
    dev = head.fc.weight.device
    lm = target_lm_head.to(device=dev, dtype=dtype)
    for s in range(0, len(rows), rows_per_batch):
        b = {key: v.to(dev) for key, v in collate(store, rows[s : s + rows_per_batch], dtype).items()}
        pred = head(b["features"], b["tokens"], b["positions"], b["mask"])[b["scored"]]
        if pred.shape[0] == 0:
            continue
        tf = b["targets"][b["scored"]]
        greedy = (tf @ lm.T).argmax(-1)
        top = head.draft_logits(pred).topk(min(k, head.config.n_draft), dim=-1).indices
        match = (head.draft_ids[top] == greedy.unsqueeze(1)).cpu()
        match = torch.nn.functional.pad(match.long(), (0, k - match.shape[1]))
        hits += match.cumsum(1).clamp(max=1).sum(0)
        n += pred.shape[0]
        in_vocab += int((t2d[greedy.cpu()] >= 0).sum())
        feat_loss += float(torch.nn.functional.smooth_l1_loss(pred.float(), tf.float(), reduction="sum")) / tf.shape[1]
    head.train(was_training)
    return {"positions": n, "hits": hits.tolist(), "in_vocab": in_vocab, "feature_loss_sum": feat_loss}


def summarise_eval(raw: dict[str, Any]) -> dict[str, Any]:
    """Turn :func:`evaluate`'s sums (possibly reduced over processes) into rates."""
    n = max(1, raw["positions"])
    topk = [round(h / n, 4) for h in raw["hits"]]
    return {"positions": raw["positions"], "top1": topk[0], "topk": topk,
            "feature_loss": round(raw["feature_loss_sum"] / n, 5), "target_in_draft_vocab": round(raw["in_vocab"] / n, 4)}


def _reduce_eval(accelerator, raw: dict[str, Any]) -> dict[str, Any]:
    if accelerator.num_processes == 1:
        return raw
    v = torch.tensor([raw["positions"], raw["in_vocab"], raw["feature_loss_sum"], *raw["hits"]],
                     dtype=torch.float64, device=accelerator.device)
    v = accelerator.reduce(v, reduction="sum").cpu()
    return {"positions": int(v[0]), "in_vocab": int(v[1]), "feature_loss_sum": float(v[2]),
            "hits": [int(x) for x in v[3:]]}


# ------------------------------------------------------------------------------------------ recipe
def _features(
    cfg: TrainConfig, accelerator, target, tokenizer, train_convs, eval_convs
) -> tuple[FeatureStore, FeatureStore]:
    """Target features for this process's shard, computed once and cached in ``features/rank{r}-of{w}.safetensors``."""
    from safetensors.torch import load_file, save_file

    from selfspec.train.data import build_training_examples
    from selfspec.train.features import hidden_features

    rank, world = accelerator.process_index, accelerator.num_processes
    feat_file = Path(cfg.output_dir) / "features" / f"eagle-rank{rank}-of{world}.safetensors"
    if feat_file.exists():
        t = load_file(str(feat_file))
        train, held = FeatureStore.from_tensors(t), FeatureStore.from_tensors(t, "eval_")
        logger.info("loaded cached features %s (%d train / %d held-out sequences)", feat_file, len(train), len(held))
        return train, held
    quiet = not accelerator.is_local_main_process
    t0 = time.perf_counter()
    D = target.config.hidden_size
    ex = build_training_examples(tokenizer, train_convs, cfg.max_length)
    train = FeatureStore.from_examples(ex, hidden_features(target, ex, disable_progress=quiet), D)
    ex_e = build_training_examples(tokenizer, eval_convs, cfg.max_length)
    held = FeatureStore.from_examples(ex_e, hidden_features(target, ex_e, disable_progress=quiet), D)
    n_tok = int(train.lengths.sum() + held.lengths.sum())
    dt = time.perf_counter() - t0
    logger.info("target features: %d tokens in %.1fs (%.0f tokens/s)", n_tok, dt, n_tok / max(dt, 1e-9))
    feat_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = feat_file.with_suffix(".tmp")
    save_file({**train.tensors(), **held.tensors("eval_")}, str(tmp))
    os.replace(tmp, feat_file)
    return train, held


def train_eagle(cfg: TrainConfig, accelerator, target, tokenizer, train_convs: list[dict], eval_convs: list[dict]) -> Path:
    """Train an EAGLE-1 head on the frozen ``target``; returns the saved head directory (``<output_dir>/heads``).

    ``train_convs`` / ``eval_convs`` are this process's shards. Uses ``cfg.lr``, ``betas``, ``weight_decay``,
    ``warmup_steps`` (+ cosine), ``grad_clip``, ``epochs`` / ``max_steps`` / ``max_train_minutes``,
    ``draft_vocab_size``, ``max_length`` (row length), ``eval_every`` / ``save_every``, ``eval_topk``,
    ``seed``, and the EAGLE options in :data:`EAGLE_DEFAULTS`.

    Raises:
        ValueError: no scored training position (empty data or all answers truncated away).
    """
    from selfspec.heads.config import draft_vocab_from_counts
    from selfspec.heads.eagle import EagleConfig, EagleHead
    from selfspec.target import target_fingerprint

    out_dir = Path(cfg.output_dir)
    rank, world = accelerator.process_index, accelerator.num_processes
    quiet = not accelerator.is_local_main_process
    train, held = _features(cfg, accelerator, target, tokenizer, train_convs, eval_convs)
    n_scored = train.scored_positions()
    if n_scored == 0:
        raise ValueError("no training positions: check the data source and max_length")

    # Draft vocabulary: the most frequent assistant tokens over all processes (identical everywhere).
    V = target.config.vocab_size
    counts = torch.bincount(train.tokens[train.loss_mask], minlength=V).to(accelerator.device)
    counts = accelerator.reduce(counts, reduction="sum").cpu()
    n_draft = cfg.draft_vocab_size if cfg.draft_vocab_size and cfg.draft_vocab_size < V else V
    draft_ids = draft_vocab_from_counts(counts, n_draft) if n_draft < V else None

    hcfg = EagleConfig(
        hidden_size=target.config.hidden_size,
        vocab_size=V,
        draft_vocab_size=n_draft if n_draft < V else None,
        fc_bias=bool(eagle_option(cfg, "fc_bias")),
        target=cfg.target,
        target_fingerprint=target_fingerprint(target),
    )
    torch.manual_seed(cfg.seed)
    head = EagleHead(hcfg, target.config, draft_ids=draft_ids, target=target,
                     init_from_target_layer=bool(eagle_option(cfg, "init_from_target_layer"))).float()
    params = [p for p in head.parameters() if p.requires_grad]
    # fused AdamW: one kernel instead of ~10 elementwise passes per step (+20 % tokens/s on 2 CPU cores)
    fused = accelerator.device.type in ("cpu", "cuda")
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)

    row_len = cfg.max_length
    rows_per_step = max(1, int(eagle_option(cfg, "batch_tokens")) // row_len)
    n_rows = len(epoch_rows(train, row_len, 0))
    model, optim, sched, core, steps_per_epoch, total, step, ckpt = prepare_and_resume(
        cfg, accelerator, head, optim, n_rows // rows_per_step, out_dir
    )

    ce_w, feat_w = float(eagle_option(cfg, "ce_weight")), float(eagle_option(cfg, "feature_weight"))
    noise = float(eagle_option(cfg, "noise"))
    lm32 = core.lm_weight(torch.float32)  # [N, D] frozen
    lm_full = target.get_output_embeddings().weight.detach()
    hist: list[dict] = []
    t_start = time.perf_counter()
    pairs_seen = scored_seen = 0
    cached_epoch, rows = -1, []
    bar = tqdm(total=total, initial=step, desc="train eagle", disable=quiet)
    model.train()
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        if epoch != cached_epoch:
            rows, cached_epoch = epoch_rows(train, row_len, cfg.seed * 1000 + epoch * 7 + rank), epoch
        b = collate(train, rows[within * rows_per_step : (within + 1) * rows_per_step])
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 31 + rank)
        feats = b["features"]
        if noise:
            feats = feats + (torch.rand(feats.shape, generator=g) * 2 - 1) * noise
        dev = accelerator.device
        pred = model(feats.to(dev), b["tokens"].to(dev), b["positions"].to(dev), b["mask"].to(dev))
        sel = b["scored"].to(dev)
        pf, tf = pred[sel], b["targets"].to(dev)[sel]
        with torch.no_grad():
            tl = tf @ lm32.T
        loss, fl, cl = eagle_loss(pf, tf, pf @ lm32.T, tl, ce_weight=ce_w, feature_weight=feat_w)
        optimizer_step(accelerator, model, optim, sched, loss, cfg.grad_clip)
        step += 1
        pairs_seen += int(b["valid"].sum())
        scored_seen += int(sel.sum())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", feat=f"{fl.item():.3f}", ce=f"{cl.item():.2f}")
        if step % cfg.eval_every == 0 or step == total:
            ev = summarise_eval(_reduce_eval(accelerator, evaluate(core, held, lm_full, cfg.eval_topk, row_len)))
            rec = {"step": step, "loss": round(loss.item(), 4), "feature_loss": round(fl.item(), 4),
                   "ce_loss": round(cl.item(), 4), "heldout_top1": ev["top1"], "lr": sched.get_last_lr()[0]}
            hist.append(rec)
            if accelerator.is_main_process:
                logger.info("step %d loss %.4f (feature %.4f, ce %.3f) held-out top-1 %.3f", step, rec["loss"],
                            rec["feature_loss"], rec["ce_loss"], ev["top1"])
        if step % cfg.save_every == 0 and step < total:
            _save_atomic(accelerator, ckpt, step)
        if cfg.max_train_minutes and (time.perf_counter() - t_start) / 60 > cfg.max_train_minutes:
            logger.info("max_train_minutes reached at step %d", step)
            break
    bar.close()
    elapsed = time.perf_counter() - t_start
    ev = summarise_eval(_reduce_eval(accelerator, evaluate(core, held, lm_full, cfg.eval_topk, row_len)))
    final_dir = out_dir / "heads"
    if accelerator.is_main_process:
        core.config = dataclasses.replace(core.config, heldout_top1=ev["top1"])
        core.save_pretrained(final_dir)
        summary = {
            "head": "eagle",
            "step": step,
            "train_s": round(elapsed, 1),
            "train_tokens_per_s": round(pairs_seen * world / max(elapsed, 1e-9), 1),
            "scored_tokens_per_s": round(scored_seen * world / max(elapsed, 1e-9), 1),
            "train_sequences": len(train) * world,
            "scored_positions_per_epoch": n_scored * world,
            "draft_vocab_size": hcfg.n_draft,
            "heldout": ev,
            "options": {k: eagle_option(cfg, k) for k in EAGLE_DEFAULTS},
            "history": hist,
        }
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("saved EAGLE head to %s; held-out top-1 %.3f (top-%d %.3f); %.0f train tokens/s", final_dir,
                    ev["top1"], len(ev["topk"]), ev["topk"][-1], summary["train_tokens_per_s"])
    accelerator.wait_for_everyone()
    return final_dir

