"""Medusa-1 recipe: setup (target, data, features) -> train (heads only) -> save.

Run it with ``accelerate launch -m selfspec.train CONFIG.yaml [key=value ...]`` or ``selfspec train``.
The target is frozen: its features are computed once under ``inference_mode`` and cached; only the
heads receive gradients. Each process handles its own shard of conversations; gradients are averaged
by ``accelerate`` (DDP). Checkpoints (heads, optimiser, scheduler, step) are written atomically every
``save_every`` steps and a killed run resumes from the last one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.train.config import TrainConfig
from selfspec.train.losses import IGNORE, medusa_loss, topk_hits

logger = logging.getLogger(__name__)


def position_table(examples: list[dict], feats: list[torch.Tensor], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten examples into (hidden, labels) rows: Medusa heads look at one position at a time.

    Head k at position t is trained on token ``t + 2 + k`` when that token exists and is an assistant
    token (``loss_mask``); positions where no head has a label are dropped.

    Args:
        examples: dicts with ``input_ids`` LongTensor ``[T]`` and ``loss_mask`` BoolTensor ``[T]``.
        feats: target hidden states ``[T, D]`` per example.
        num_heads: K.

    Returns:
        ``(hidden [P, D], labels [P, K])``; labels are target token ids or ``-100``.
    """
    hs, ys = [], []
    for ex, h in zip(examples, feats):
        ids, mask = ex["input_ids"], ex["loss_mask"]
        T = ids.numel()
        labels = torch.full((T, num_heads), IGNORE, dtype=torch.long)
        for k in range(num_heads):
            off = 2 + k
            if T > off:
                lab = torch.where(mask[off:], ids[off:], torch.full_like(ids[off:], IGNORE))
                labels[: T - off, k] = lab
        keep = (labels != IGNORE).any(1)
        hs.append(h[keep])
        ys.append(labels[keep])
    D = feats[0].shape[-1] if feats else 0
    if not hs:
        return torch.empty(0, D), torch.empty(0, num_heads, dtype=torch.long)
    return torch.cat(hs), torch.cat(ys)


def to_draft_labels(labels: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Map target ids to draft ids: ``-100`` stays, out-of-vocabulary targets become ``-1``."""
    out = labels.clone()
    valid = labels != IGNORE
    out[valid] = t2d[labels[valid]]
    return out


def _lr_lambda(cfg: TrainConfig, total_steps: int):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / max(1, cfg.warmup_steps)
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def lr_factor(cfg: TrainConfig, step: int, total_steps: int, elapsed_s: float) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay over whichever runs out first, the steps
    (``total_steps``) or the time (``cfg.max_train_minutes``, by ``elapsed_s`` of optimisation), so a run
    stopped by its time budget still ends with an annealed rate on any machine."""
    f = _lr_lambda(cfg, total_steps)(step)
    if cfg.max_train_minutes and step >= cfg.warmup_steps:
        by_time = elapsed_s / (cfg.max_train_minutes * 60.0)
        by_step = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if by_time > by_step:
            f = 0.5 * (1.0 + math.cos(math.pi * min(1.0, by_time)))
    return f


def apply_lr(cfg: TrainConfig, optim, step: int, total_steps: int, elapsed_s: float) -> float:
    """Set every param group's rate for the coming optimiser step and return it.

    With ``cfg.max_train_minutes`` the rate is ``cfg.lr * lr_factor(...)`` (annealed by time or steps,
    whichever ends first); otherwise the step scheduler's current rate is left as it is."""
    if cfg.max_train_minutes:
        for group in optim.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, step, total_steps, elapsed_s)
    return float(optim.param_groups[0]["lr"])


class TrainClock:
    """Optimisation time of a run in seconds, counting the time recorded by the checkpoint it resumes from
    (so a time budget and a time-annealed LR carry over a kill and resume).

    Args:
        checkpoint: the run's checkpoint directory.
        resumed: whether the run starts from that checkpoint (step > 0).
    """

    def __init__(self, checkpoint: Path, resumed: bool) -> None:
        self.before = resumed_elapsed(checkpoint) if resumed else 0.0
        self._t0 = time.perf_counter() - self.before

    def elapsed(self) -> float:
        """Seconds of optimisation so far, resumed runs included."""
        return time.perf_counter() - self._t0

    def session(self) -> float:
        """Seconds of optimisation in this process only."""
        return self.elapsed() - self.before

    def out_of_time(self, cfg: TrainConfig) -> bool:
        """Whether ``cfg.max_train_minutes`` (if set) has run out."""
        return bool(cfg.max_train_minutes) and self.elapsed() / 60 > cfg.max_train_minutes


def resumed_elapsed(checkpoint: Path) -> float:
    """Optimisation seconds recorded in a checkpoint's ``trainer_state.json`` (0 when absent)."""
    state = checkpoint / "trainer_state.json"
    return float(json.loads(state.read_text()).get("train_elapsed_s", 0.0)) if state.exists() else 0.0


def _save_atomic(accelerator, out: Path, step: int, elapsed_s: float | None = None) -> None:
    tmp = out.with_name(out.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"step": step} if elapsed_s is None else {"step": step, "train_elapsed_s": round(elapsed_s, 3)}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def prepare_and_resume(cfg: TrainConfig, accelerator, module, optim, local_steps_per_epoch: int, out_dir: Path):
    """Shared recipe plumbing: schedule length, ``accelerate`` wrapping, and resume from the last checkpoint.

    Every process runs the same number of steps per epoch (the minimum over processes, as DDP needs).

    Returns:
        ``(model, optim, sched, core, steps_per_epoch, total_steps, start_step, checkpoint_dir)``;
        ``core`` is the unwrapped module.
    """
    local = torch.tensor([max(1, local_steps_per_epoch)], device=accelerator.device)
    steps_per_epoch = int(accelerator.gather(local).min())
    total = steps_per_epoch * cfg.epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(cfg, total))
    model, optim, sched = accelerator.prepare(module, optim, sched)
    ckpt = out_dir / "checkpoint"
    step = 0
    if (ckpt / "trainer_state.json").exists():
        accelerator.load_state(str(ckpt))
        step = json.loads((ckpt / "trainer_state.json").read_text())["step"]
        logger.info("resumed from %s at step %d", ckpt, step)
    return model, optim, sched, accelerator.unwrap_model(model), steps_per_epoch, total, step, ckpt


def optimizer_step(accelerator, model, optim, sched, loss: torch.Tensor, grad_clip: float) -> None:
    """Backward, optional gradient-norm clipping, optimiser and scheduler step, zero the gradients."""
    accelerator.backward(loss)
    if grad_clip:
        accelerator.clip_grad_norm_(model.parameters(), grad_clip)
    optim.step()
    sched.step()
    optim.zero_grad(set_to_none=True)


def evaluate(heads, hidden: torch.Tensor, labels_draft: torch.Tensor, k: int, batch: int = 1024) -> list[list[float]]:
    """Held-out cumulative top-1..top-k accuracy per head (out-of-vocabulary labels count as misses)."""
    K = labels_draft.shape[1]
    hits = torch.zeros(K, k, dtype=torch.long)
    counts = torch.zeros(K, dtype=torch.long)
    heads.eval()
    with torch.no_grad():
        for s in range(0, hidden.shape[0], batch):
            logits = heads(hidden[s : s + batch].float())
            h, c = topk_hits(logits, labels_draft[s : s + batch], k)
            hits += h
            counts += c
    heads.train()
    return [[round(float(hits[h, j]) / max(1, int(counts[h])), 4) for j in range(k)] for h in range(K)]


def train_medusa(cfg: TrainConfig, accelerator, target, tokenizer, train_convs: list[dict], eval_convs: list[dict]) -> Path:
    """Train Medusa heads on the frozen ``target``; returns the saved heads directory.

    ``train_convs`` / ``eval_convs`` are this process's shards.

    Raises:
        ValueError: no training positions (empty data or all answers truncated away).
    """
    from safetensors.torch import load_file, save_file

    from selfspec.heads.config import draft_vocab_from_counts
    from selfspec.heads.medusa import MedusaConfig, MedusaHeads
    from selfspec.heads.fingerprint import target_fingerprint
    from selfspec.train.data import build_training_examples
    from selfspec.train.features import hidden_features

    out_dir = Path(cfg.output_dir)
    rank, world = accelerator.process_index, accelerator.num_processes
    quiet = not accelerator.is_local_main_process
    feat_file = out_dir / "features" / f"rank{rank}-of{world}.safetensors"
    if feat_file.exists():
        t = load_file(str(feat_file))
        H, Y, He, Ye = t["hidden"], t["labels"], t["eval_hidden"], t["eval_labels"]
        logger.info("loaded cached features %s (%d positions)", feat_file, H.shape[0])
    else:
        t0 = time.perf_counter()
        ex = build_training_examples(tokenizer, train_convs, cfg.max_length)
        H, Y = position_table(ex, hidden_features(target, ex, disable_progress=quiet), cfg.num_heads)
        ex_e = build_training_examples(tokenizer, eval_convs, cfg.max_length)
        He, Ye = position_table(ex_e, hidden_features(target, ex_e, disable_progress=quiet), cfg.num_heads)
        n_tok = sum(e["input_ids"].numel() for e in ex + ex_e)
        logger.info("target features: %d tokens in %.1fs (%.0f tokens/s)", n_tok, time.perf_counter() - t0,
                    n_tok / max(1e-9, time.perf_counter() - t0))
        feat_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = feat_file.with_suffix(".tmp")
        save_file({"hidden": H.contiguous(), "labels": Y, "eval_hidden": He.contiguous(), "eval_labels": Ye}, str(tmp))
        os.replace(tmp, feat_file)
    if H.shape[0] == 0:
        raise ValueError("no training positions: check the data source and max_length")

    # Draft vocabulary: the most frequent label tokens over all processes (identical everywhere).
    V = target.config.vocab_size
    counts = torch.bincount(Y[Y != IGNORE], minlength=V).to(accelerator.device)
    counts = accelerator.reduce(counts, reduction="sum").cpu()
    n_draft = cfg.draft_vocab_size if cfg.draft_vocab_size and cfg.draft_vocab_size < V else V
    draft_ids = draft_vocab_from_counts(counts, n_draft) if n_draft < V else torch.arange(V)
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(n_draft)
    Yd, Yde = to_draft_labels(Y, t2d), to_draft_labels(Ye, t2d)
    Yd_train = Yd.masked_fill(Yd == -1, IGNORE)  # out-of-vocab tokens carry no gradient

    lm_head = target.get_output_embeddings().weight.detach().float().cpu()
    mcfg = MedusaConfig(
        hidden_size=target.config.hidden_size,
        vocab_size=V,
        num_heads=cfg.num_heads,
        num_layers=cfg.num_layers,
        own_lm_head=cfg.own_lm_head,
        draft_vocab_size=n_draft if n_draft < V else None,
        target=cfg.target,
        target_fingerprint=target_fingerprint(target),
    )
    heads = MedusaHeads(mcfg, target_lm_head=lm_head, draft_ids=draft_ids)
    params = [p for p in heads.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)

    heads, optim, sched, core, steps_per_epoch, total, step, ckpt = prepare_and_resume(
        cfg, accelerator, heads, optim, H.shape[0] // cfg.batch_positions, out_dir
    )

    hist: list[dict] = []
    clock = TrainClock(ckpt, resumed=step > 0)
    pos_seen = 0
    bar = tqdm(total=total, initial=step, desc="train medusa", disable=quiet)
    heads.train()
    while step < total:
        epoch, within = divmod(step, steps_per_epoch)
        g = torch.Generator().manual_seed(cfg.seed * 1000 + epoch * 7 + rank)
        order = torch.randperm(H.shape[0], generator=g)
        idx = order[within * cfg.batch_positions : (within + 1) * cfg.batch_positions]
        h = H[idx].float().to(accelerator.device)
        y = Yd_train[idx].to(accelerator.device)
        logits = heads(h)
        loss, per_head = medusa_loss(logits, y, cfg.head_decay)
        used_lr = apply_lr(cfg, optim, step, total, clock.elapsed())
        optimizer_step(accelerator, heads, optim, sched, loss, cfg.grad_clip)
        step += 1
        pos_seen += idx.numel()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % cfg.eval_every == 0 or step == total:
            acc = evaluate(core, He, Yde, cfg.eval_topk)
            rec = {"step": step, "loss": round(loss.item(), 4), "per_head_loss": [round(float(x), 4) for x in per_head],
                   "top1": [a[0] for a in acc], "lr": used_lr}
            hist.append(rec)
            if accelerator.is_main_process:
                logger.info("step %d loss %.4f top1 per head %s", step, rec["loss"], rec["top1"])
        if step % cfg.save_every == 0 and step < total:
            _save_atomic(accelerator, ckpt, step, clock.elapsed())
        if clock.out_of_time(cfg):
            logger.info("max_train_minutes reached at step %d", step)
            break
    bar.close()
    elapsed = clock.session()
    acc = evaluate(core, He, Yde, cfg.eval_topk)
    final_dir = out_dir / "heads"
    if accelerator.is_main_process:
        import dataclasses

        core.config = dataclasses.replace(core.config, head_topk_accuracy=acc)
        core.save_pretrained(final_dir)
        summary = {
            "step": step,
            "train_s": round(elapsed, 1),
            "positions_per_s": round(pos_seen * world / max(elapsed, 1e-9), 1),
            "heldout_topk_accuracy": acc,
            "history": hist,
        }
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("saved heads to %s; held-out top-1 per head %s", final_dir, [a[0] for a in acc])
    accelerator.wait_for_everyone()
    return final_dir
