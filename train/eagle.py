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
from selfspec.train.medusa import TrainClock, _save_atomic, apply_lr, optimizer_step, prepare_and_resume

logger = logging.getLogger(__name__)

# EAGLE knobs not (yet) in TrainConfig; a TrainConfig field ``eagle_<name>`` overrides each.
EAGLE_DEFAULTS: dict[str, Any] = {
    "ce_weight": 0.1,  # weight of the token CE vs the target distribution (EAGLE: 0.1)
    "feature_weight": 1.0,  # weight of SmoothL1 on features (EAGLE: 1.0)
    "noise": 0.1,  # half-width a of the uniform noise U(-a, a) on input features
    "batch_tokens": 2048,  # head positions (pairs) per optimiser step, packed in rows of max_length
    "fc_bias": True,
    "init_from_target_layer": False,  # start layers.0 from the target's last layer instead of random
    "ttt_steps": 1,  # training-time test: unrolled drafting steps per position (1 = plain EAGLE-1)
    "ttt_decay": 0.8,  # loss weight of unrolled step j is ttt_decay ** j
    "score_prompt": False,  # also score pairs whose drafted token is a prompt token (more data, same cost)
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
        ``valid`` Bool ``[B, S]`` (False on padding), ``segment`` Long ``[B, S]`` (sequence index within its
        row, -1 on padding).
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
            "mask": mask, "valid": valid, "segment": segment}


def epoch_rows(store: FeatureStore, row_len: int, seed: int) -> list[list[int]]:
    """This epoch's rows: sequences shuffled with ``seed``, then packed (deterministic, so resume is exact)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(store), generator=g).tolist()
    lengths = [int(store.lengths[i]) - 1 for i in order]
    return [[order[j] for j in row] for row in pack_rows(lengths, row_len)]


# ------------------------------------------------------------------------------------------ training-time test
def unrolled_mask(segment: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Attention mask of unrolled step ``step`` over the keys of steps ``0 .. step`` (concatenated).

    Query i at step j stands for a depth-(j+1) draft node whose chain starts at pair ``i - j``: exactly
    what it would see while drafting, it sees the step-0 keys (target features) of pairs ``<= i - j`` and
    the step-s key of pair ``i - j + s`` for s = 1 .. j (its draft ancestors, then itself), all within its
    own sequence. Queries without ``j`` earlier pairs in their sequence see only their own key.

    Args:
        segment: Long ``[B, S]`` sequence index per packed position (-1 on padding), from :func:`collate`.
        step: j >= 0.
        dtype: float dtype of the additive mask.

    Returns:
        Additive mask ``[B, 1, S, (step + 1) * S]`` (0 attend, dtype-min blocked).
    """
    B, S = segment.shape
    same = segment.unsqueeze(2) == segment.unsqueeze(1)  # [B, S, S]
    i = torch.arange(S, device=segment.device).view(1, S, 1)
    k = torch.arange(S, device=segment.device).view(1, 1, S)
    blocks = [same & (k <= i - step)]
    for s in range(1, step + 1):
        blocks.append(same & (k == i - step + s))
    allowed = torch.cat(blocks, dim=-1)
    allowed[:, :, step * S :] |= torch.eye(S, dtype=torch.bool, device=segment.device)  # own key, always
    return torch.zeros(B, 1, S, (step + 1) * S, dtype=dtype, device=segment.device).masked_fill_(
        ~allowed.unsqueeze(1), torch.finfo(dtype).min
    )


class UnrolledEagle(torch.nn.Module):
    """Training-time test for an EAGLE-1 head (as in EAGLE-3, Li et al. 2025, arXiv:2503.01840, and HASS):
    the head is run ``steps`` times, step j feeding on its own predicted features of step j-1, so it learns
    to draft at depth > 1 from features it predicted itself rather than only from the target's.

    Step 0 is the plain teacher-forced forward. At step j >= 1, pair i's input feature is the step-(j-1)
    prediction at pair i-1 (a prediction of ``f_i``), its token stays ``x_{i+1}``, its target stays
    ``f_{i+1}``, and its attention follows :func:`unrolled_mask` through one growing KV cache, so every
    query sees exactly the keys its draft-tree node would see at decoding time.

    The wrapper exists so ``accelerate`` / DDP sees one forward per optimiser step.
    """

    def __init__(self, head) -> None:
        super().__init__()
        self.head = head

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, segment: torch.Tensor, steps: int
    ) -> list[torch.Tensor]:
        """Args: ``features`` ``[B, S, D]``, ``tokens`` / ``positions`` / ``segment`` Long ``[B, S]`` (from
        :func:`collate`), ``steps`` >= 1. Returns ``steps`` predictions ``[B, S, D]``; in step j only
        positions with ``positions >= j`` are meaningful."""
        from transformers import DynamicCache

        dtype = self.head.fc.weight.dtype
        cache = DynamicCache(config=self.head.arch_config)
        outs: list[torch.Tensor] = []
        x = features
        for j in range(steps):
            pred = self.head(x, tokens, positions, unrolled_mask(segment, j, dtype), cache)
            outs.append(pred)
            if j + 1 < steps:
                x = torch.cat([features[:, :1], pred[:, :-1]], dim=1)
        return outs


def chain_hits(correct: list[torch.Tensor], usable: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Greedy chain acceptance from per-step correctness of an unrolled forward.

    Args:
        correct: per step j, Bool ``[B, S]``: the step-j draft at pair i equals the target's greedy token.
        usable: per step j, Bool ``[B, S]``: that comparison is defined (scored, enough history).

    Returns:
        ``(hits, counts)`` per depth d = 1 .. len(correct): over chain starts t where pairs
        ``t .. t+d-1`` are usable at steps ``0 .. d-1``, how many have all d drafts correct.
    """
    hits, counts = [], []
    B, S = correct[0].shape
    all_ok = torch.ones(B, S, dtype=torch.bool, device=correct[0].device)
    all_use = torch.ones_like(all_ok)
    for j, (c, u) in enumerate(zip(correct, usable)):
        shifted_c = torch.zeros_like(all_ok)
        shifted_u = torch.zeros_like(all_ok)
        shifted_c[:, : S - j] = c[:, j:]
        shifted_u[:, : S - j] = u[:, j:]
        all_ok = all_ok & shifted_c
        all_use = all_use & shifted_u
        hits.append(int((all_ok & all_use).sum()))
        counts.append(int(all_use.sum()))
    return hits, counts


# ------------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(
    head, store: FeatureStore, target_lm_head: torch.Tensor, k: int = 4, row_len: int = 512, rows_per_batch: int = 4,
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
    c_hits, c_counts = [0] * depth, [0] * depth
    n = in_vocab = 0
    feat_loss = 0.0
    t2d = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    t2d[head.draft_ids.cpu()] = torch.arange(head.config.n_draft)
    rows = pack_rows([int(x) - 1 for x in store.lengths], row_len)
    dev = head.fc.weight.device
    lm = target_lm_head.to(device=dev, dtype=dtype)
    for s in range(0, len(rows), rows_per_batch):
        b = {key: v.to(dev) for key, v in collate(store, rows[s : s + rows_per_batch], dtype).items()}
        preds = unrolled(b["features"], b["tokens"], b["positions"], b["segment"], depth)
        sel = b["scored"]
        if not bool(sel.any()):
            continue
        greedy_all = torch.full(sel.shape, -1, dtype=torch.long, device=dev)
        greedy_all[sel] = (b["targets"][sel] @ lm.T).argmax(-1)
        correct, usable = [], []
        for j, pred in enumerate(preds):
            use = sel & (b["positions"] >= j)
            draft = torch.full(sel.shape, -2, dtype=torch.long, device=dev)
            draft[use] = head.draft_ids[head.draft_logits(pred[use]).argmax(-1)]
            correct.append((draft == greedy_all) & use)
            usable.append(use)
        h, c = chain_hits(correct, usable)
        c_hits = [a + x for a, x in zip(c_hits, h)]
        c_counts = [a + x for a, x in zip(c_counts, c)]
        pred, tf, greedy = preds[0][sel], b["targets"][sel], greedy_all[sel]
        top = head.draft_logits(pred).topk(min(k, head.config.n_draft), dim=-1).indices
        match = (head.draft_ids[top] == greedy.unsqueeze(1)).cpu()
        match = torch.nn.functional.pad(match.long(), (0, k - match.shape[1]))
        hits += match.cumsum(1).clamp(max=1).sum(0)
        n += pred.shape[0]
        in_vocab += int((t2d[greedy.cpu()] >= 0).sum())
        feat_loss += float(torch.nn.functional.smooth_l1_loss(pred.float(), tf.float(), reduction="sum")) / tf.shape[1]
    head.train(was_training)
    return {"positions": n, "hits": hits.tolist(), "in_vocab": in_vocab, "feature_loss_sum": feat_loss,
            "chain_hits": c_hits, "chain_counts": c_counts}


def summarise_eval(raw: dict[str, Any]) -> dict[str, Any]:
    """Turn :func:`evaluate`'s sums (possibly reduced over processes) into rates; ``chain_tau`` is
    ``1 + sum(chain)``, the greedy chain tau estimate at the evaluated depth."""
    n = max(1, raw["positions"])
    topk = [round(h / n, 4) for h in raw["hits"]]
    chain = [round(h / max(1, c), 4) for h, c in zip(raw["chain_hits"], raw["chain_counts"])]
    return {"positions": raw["positions"], "top1": topk[0], "topk": topk,
            "feature_loss": round(raw["feature_loss_sum"] / n, 5), "target_in_draft_vocab": round(raw["in_vocab"] / n, 4),
            "chain": chain, "chain_tau": round(1 + sum(chain), 4)}


def _reduce_eval(accelerator, raw: dict[str, Any]) -> dict[str, Any]:
    if accelerator.num_processes == 1:
        return raw
    d, k = len(raw["chain_hits"]), len(raw["hits"])
    v = torch.tensor([raw["positions"], raw["in_vocab"], raw["feature_loss_sum"], *raw["hits"], *raw["chain_hits"],
                      *raw["chain_counts"]], dtype=torch.float64, device=accelerator.device)
    v = accelerator.reduce(v, reduction="sum").cpu()
    return {"positions": int(v[0]), "in_vocab": int(v[1]), "feature_loss_sum": float(v[2]),
            "hits": [int(x) for x in v[3 : 3 + k]], "chain_hits": [int(x) for x in v[3 + k : 3 + k + d]],
            "chain_counts": [int(x) for x in v[3 + k + d :]]}


# ------------------------------------------------------------------------------------------ recipe
def feature_signature(cfg: TrainConfig, target, train_convs: list[dict], eval_convs: list[dict]) -> str:
    """What a feature cache was computed from (target fingerprint, ``max_length``, every conversation's
    ids and text), as 16 hex digits stored in the cache file's metadata; a cache with another signature is
    recomputed, never reused."""
    import hashlib

    from selfspec.heads.fingerprint import target_fingerprint

    h = hashlib.sha256(f"{target_fingerprint(target)}|{cfg.max_length}".encode())
    for conv in [*train_convs, None, *eval_convs]:
        h.update(b"\0" if conv is None else json.dumps(conv, sort_keys=True).encode())
    return h.hexdigest()[:16]


def _features(
    cfg: TrainConfig, accelerator, target, tokenizer, train_convs, eval_convs
) -> tuple[FeatureStore, FeatureStore]:
    """Target features for this process's shard, computed once and cached in ``features/rank{r}-of{w}.safetensors``."""
    from safetensors.torch import load_file, save_file

    from safetensors import safe_open

    from selfspec.train.data import build_training_examples
    from selfspec.train.features import hidden_features

    rank, world = accelerator.process_index, accelerator.num_processes
    feat_file = Path(cfg.output_dir) / "features" / f"eagle-rank{rank}-of{world}.safetensors"
    signature = feature_signature(cfg, target, train_convs, eval_convs)
    if feat_file.exists():
        with safe_open(str(feat_file), "pt") as fh:
            cached_sig = (fh.metadata() or {}).get("signature")
        if cached_sig == signature:
            t = load_file(str(feat_file))
            train, held = FeatureStore.from_tensors(t), FeatureStore.from_tensors(t, "eval_")
            logger.info("loaded cached features %s (%d train / %d held-out sequences)", feat_file, len(train), len(held))
            return train, held
        logger.warning("cached features %s were computed from other data (signature %s, now %s): recomputing",
                       feat_file, cached_sig, signature)
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
    save_file({**train.tensors(), **held.tensors("eval_")}, str(tmp), metadata={"signature": signature})
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
    from selfspec.train.calibrate import calibrate_head
    from selfspec.heads.fingerprint import target_fingerprint

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
    ttt_steps, ttt_decay = int(eagle_option(cfg, "ttt_steps")), float(eagle_option(cfg, "ttt_decay"))
    score_prompt = bool(eagle_option(cfg, "score_prompt"))
    if ttt_steps < 1:
        raise ValueError(f"eagle_ttt_steps must be >= 1, got {ttt_steps}")
    if score_prompt:
        n_scored = int(train.lengths.sum()) - len(train)
    unrolled = UnrolledEagle(head)
    params = [p for p in head.parameters() if p.requires_grad]
    # fused AdamW: one kernel instead of ~10 elementwise passes per step (+20 % tokens/s on 2 CPU cores)
    fused = accelerator.device.type in ("cpu", "cuda")
    optim = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, fused=fused)

    row_len = cfg.max_length
    rows_per_step = max(1, int(eagle_option(cfg, "batch_tokens")) // row_len)
    n_rows = len(epoch_rows(train, row_len, 0))
    model, optim, sched, wrapper, steps_per_epoch, total, step, ckpt = prepare_and_resume(
        cfg, accelerator, unrolled, optim, n_rows // rows_per_step, out_dir
    )
    core = wrapper.head

    ce_w, feat_w = float(eagle_option(cfg, "ce_weight")), float(eagle_option(cfg, "feature_weight"))
    noise = float(eagle_option(cfg, "noise"))
    lm32 = core.lm_weight(torch.float32)  # [N, D] frozen
    lm_full = target.get_output_embeddings().weight.detach()
    hist: list[dict] = []
    clock = TrainClock(ckpt, resumed=step > 0)
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
        preds = model(feats.to(dev), b["tokens"].to(dev), b["positions"].to(dev), b["segment"].to(dev), ttt_steps)
        base = (b["valid"] if score_prompt else b["scored"]).to(dev)
        targets, positions = b["targets"].to(dev), b["positions"].to(dev)
        loss = fl = cl = None
        wsum = 0.0
        with torch.no_grad():  # every step has the same targets f_{i+1}: their logits are computed once
            tf_all = targets[base]
            tl_all = tf_all @ lm32.T
        for j, pred in enumerate(preds):
            later = positions >= j  # pairs with j earlier pairs in their sequence
            pf = pred[base & later]
            tf, tl = tf_all[later[base]], tl_all[later[base]]
            lj, fj, cj = eagle_loss(pf, tf, pf @ lm32.T, tl, ce_weight=ce_w, feature_weight=feat_w)
            w = ttt_decay**j
            loss = w * lj if loss is None else loss + w * lj
            if j == 0:
                fl, cl = fj, cj
            wsum += w
        loss = loss / wsum
        # anneal by time when the time budget, not the step count, ends the run
        used_lr = apply_lr(cfg, optim, step, total, clock.elapsed())
        optimizer_step(accelerator, model, optim, sched, loss, cfg.grad_clip)
        step += 1
        pairs_seen += int(b["valid"].sum())
        scored_seen += int(base.sum())
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", feat=f"{fl.item():.3f}", ce=f"{cl.item():.2f}")
        if step % cfg.eval_every == 0 or step == total:
            ev = summarise_eval(_reduce_eval(accelerator, evaluate(core, held, lm_full, cfg.eval_topk, row_len)))
            rec = {"step": step, "loss": round(loss.item(), 4), "feature_loss": round(fl.item(), 4),
                   "ce_loss": round(cl.item(), 4), "heldout_top1": ev["top1"], "heldout_chain": ev["chain"],
                   "heldout_chain_tau": ev["chain_tau"], "lr": used_lr}
            hist.append(rec)
            if accelerator.is_main_process:
                logger.info("step %d loss %.4f (feature %.4f, ce %.3f) held-out top-1 %.3f, chain %s (tau %.3f)", step,
                            rec["loss"], rec["feature_loss"], rec["ce_loss"], ev["top1"], ev["chain"], ev["chain_tau"])
        if step % cfg.save_every == 0 and step < total:
            _save_atomic(accelerator, ckpt, step, clock.elapsed())
        if clock.out_of_time(cfg):
            logger.info("max_train_minutes reached at step %d", step)
            break
    bar.close()
    elapsed = clock.session()
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
        if cfg.calibrate_prompts > 0:
            summary["acceptance_profile"] = calibrate_head(cfg, core, target, tokenizer, eval_convs, final_dir)
        (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2))
        logger.info("saved EAGLE head to %s; held-out top-1 %.3f (top-%d %.3f); %.0f train tokens/s", final_dir,
                    ev["top1"], len(ev["topk"]), ev["topk"][-1], summary["train_tokens_per_s"])
    accelerator.wait_for_everyone()
    return final_dir

