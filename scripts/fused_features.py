"""Recipe experiment: does an EAGLE-1 head learn faster when it also sees low/mid/high target layers?

    python scripts/fused_features.py extract FEATURES.safetensors OUT_DIR [--layers 4,15,26]
    python scripts/fused_features.py train FEATURES.safetensors OUT_DIR --name NAME [--fuse] [--hard-labels]
        [--minutes 10] [--threads 1]

``FEATURES.safetensors`` is a finished run's feature cache (``<output_dir>/features/rank0-of1.safetensors``,
SmolLM2-135M-Instruct). ``extract`` runs the target once more over every
cached sequence and stores ``hidden_states[l]`` for the given layers, each RMS-normalised, as float16
(``OUT_DIR/extra.safetensors``). ``train`` then trains a head from ``configs/eagle-smollm2.yaml``'s recipe
(learning rate, warm-up, time-annealed cosine, clipping, noise, 2,048 pairs a step, 8,192-token draft
vocabulary) for ``--minutes`` with the recipe's own loss step (:func:`selfspec.train.eagle.eagle_step_loss`)
and prints held-out top-1 / top-k and greedy chain acceptance every 100 steps and at the end
(:func:`selfspec.train.eagle.evaluate`), also written to ``OUT_DIR/NAME.json``:

* ``--fuse``: the head's input feature becomes ``g_t = f_t + W [h_a; h_b; h_c]`` (``W`` ``[D, 3D]``,
  zero-initialised, trained with the head), a residual form of EAGLE-3's multi-layer fusion (Li et al.
  2025, arXiv:2503.01840) that starts as the plain head and keeps drafting deeper levels on predicted
  ``f`` unchanged;
* ``--hard-labels``: the token term is cross-entropy against the target's greedy token over the draft
  vocabulary instead of its full distribution.

Run the variants at the same time with the same ``--threads`` so they share the machine equally; the
round-6 table in docs/RESULTS.md came from three at once, 1 thread each.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from selfspec.decode.kv import backbone
from selfspec.heads.config import draft_vocab_from_counts
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.target import load_target
from selfspec.train.clock import lr_factor
from selfspec.train.config import load_config
from selfspec.train.eagle import eagle_step_loss, evaluate, summarise_eval
from selfspec.train.eagle_data import PairStore, collate, epoch_rows, shift_pairs
from selfspec.train.unroll import UnrolledEagle

TARGET = "smollm2-135m-instruct"


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def extract(features: str, out_dir: Path, layers: list[int]) -> None:
    t = load_file(features)
    model, _ = load_target(TARGET)
    out, t0 = {}, time.perf_counter()
    for prefix in ("", "eval_"):
        store = PairStore.from_tensors(t, prefix)
        parts = []
        with torch.inference_mode():
            for i in range(len(store)):
                o, n = int(store.offsets[i]), int(store.lengths[i])
                hs = backbone(model)(
                    input_ids=store.tokens[o : o + n].unsqueeze(0), use_cache=False, output_hidden_states=True
                ).hidden_states
                if not torch.allclose(hs[-1][0], store.features[o : o + n], atol=1e-4):
                    raise SystemExit(f"sequence {i}: the cached features are not this target's last hidden states")
                parts.append(torch.cat([_rms(hs[layer][0]) for layer in layers], -1).half())
        out[prefix + "extra"] = torch.cat(parts)
        shape = tuple(out[prefix + "extra"].shape)
        print(f"{prefix or 'train'}: {shape} after {time.perf_counter() - t0:.0f} s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "extra.safetensors"), metadata={"layers": ",".join(map(str, layers))})


class _FusedStore(PairStore):
    """A store whose head inputs are ``G`` (fused features) while its targets stay the target's ``f``."""

    def __init__(self, base: PairStore, inputs: torch.Tensor) -> None:
        super().__init__(base.tokens, base.features, base.loss_mask, base.lengths)
        self.inputs = inputs

    def pairs(self, i: int):
        o, n = int(self.offsets[i]), int(self.lengths[i])
        tok, _, tgt, scored = shift_pairs(self.tokens[o : o + n], self.features[o : o + n], self.loss_mask[o : o + n])
        return tok, self.inputs[o : o + n - 1], tgt, scored


def _extra_rows(store: PairStore, extra: torch.Tensor, rows: list[list[int]], width: int) -> torch.Tensor:
    """The extras of each pair's input position, packed like :func:`collate` packs rows: ``[B, T, width]``."""
    T = max(sum(int(store.lengths[i]) - 1 for i in row) for row in rows)
    out = torch.zeros(len(rows), T, width)
    for b, row in enumerate(rows):
        o = 0
        for i in row:
            off, n = int(store.offsets[i]), int(store.lengths[i])
            out[b, o : o + n - 1] = extra[off : off + n - 1].float()
            o += n - 1
    return out


def train(features: str, out_dir: Path, name: str, fuse_on: bool, hard: bool, minutes: float) -> None:
    cfg = load_config("configs/eagle-smollm2.yaml", [f"max_train_minutes={minutes}"])
    t = load_file(features)
    store, held = PairStore.from_tensors(t), PairStore.from_tensors(t, "eval_")
    ex = load_file(str(out_dir / "extra.safetensors"))
    target, _ = load_target(TARGET)
    D, V = target.config.hidden_size, target.config.vocab_size
    counts = torch.bincount(store.tokens[store.loss_mask], minlength=V)
    draft_ids = draft_vocab_from_counts(counts, cfg.draft_vocab_size)
    torch.manual_seed(cfg.seed)
    head = EagleHead(
        EagleConfig(hidden_size=D, vocab_size=V, draft_vocab_size=cfg.draft_vocab_size),
        target.config,
        draft_ids=draft_ids,
        target=target,
    ).float()
    width = ex["extra"].shape[-1]
    fuse = torch.nn.Linear(width, D, bias=False)
    torch.nn.init.zeros_(fuse.weight)
    params = [p for p in head.parameters() if p.requires_grad] + (list(fuse.parameters()) if fuse_on else [])
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=True)
    lm = head.lm_weight(torch.float32)
    lm_full = target.get_output_embeddings().weight.detach()
    unrolled = UnrolledEagle(head)
    rows_per_step = max(1, cfg.eagle.batch_tokens // cfg.max_length)
    steps_per_epoch = max(1, len(epoch_rows(store, cfg.max_length, 0)) // rows_per_step)
    noise = cfg.eagle.noise

    def held_out() -> dict:
        with torch.no_grad():
            inputs = held.features + fuse(ex["eval_extra"].float()) if fuse_on else held.features
        return summarise_eval(evaluate(head, _FusedStore(held, inputs), lm_full, 8, cfg.max_length))

    history, step, pairs, t0 = [], 0, 0, time.perf_counter()
    rows: list[list[int]] = []
    while (elapsed := time.perf_counter() - t0) < minutes * 60:
        epoch, within = divmod(step, steps_per_epoch)
        if within == 0:
            rows = epoch_rows(store, cfg.max_length, cfg.seed * 1000 + epoch * 7)
        batch_rows = rows[within * rows_per_step : (within + 1) * rows_per_step]
        b = collate(store, batch_rows)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 31)
        feats = b["features"] + (torch.rand(b["features"].shape, generator=g) * 2 - 1) * noise
        if fuse_on:
            feats = feats + fuse(_extra_rows(store, ex["extra"], batch_rows, width))
        loss = eagle_step_loss(unrolled, b, lm, cfg.eagle, features=feats, hard_labels=hard).loss
        for group in optim.param_groups:
            group["lr"] = cfg.lr * lr_factor(cfg, step, 10**9, elapsed)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optim.step()
        step += 1
        pairs += int(b["valid"].sum())
        if step % 100 == 0:
            ev = held_out()
            history.append(
                {
                    "step": step,
                    "minutes": round(elapsed / 60, 2),
                    "top1": ev["top1"],
                    "topk": ev["topk"],
                    "chain": ev["chain"],
                    "chain_tau": ev["chain_tau"],
                }
            )
            print(json.dumps(history[-1]), flush=True)
    ev = held_out()
    result = {
        "name": name,
        "fuse": fuse_on,
        "hard_labels": hard,
        "minutes": minutes,
        "steps": step,
        "pairs_per_s": round(pairs / (time.perf_counter() - t0), 1),
        "final": ev,
        "history": history,
    }
    print(
        "final",
        json.dumps(
            {k: result[k] for k in ("name", "steps", "pairs_per_s")}
            | {k: ev[k] for k in ("top1", "topk", "chain", "chain_tau")}
        ),
        flush=True,
    )
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("extract", "train"))
    p.add_argument("features")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", default="4,15,26", help="hidden_states indices (0 = embeddings)")
    p.add_argument("--name", default="run")
    p.add_argument("--fuse", action="store_true")
    p.add_argument("--hard-labels", action="store_true")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.command == "extract":
        extract(args.features, args.out_dir, [int(x) for x in args.layers.split(",")])
    else:
        train(args.features, args.out_dir, args.name, args.fuse, args.hard_labels, args.minutes)


if __name__ == "__main__":
    main()
