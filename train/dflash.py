"""DFlash and DSpark recipes (arXiv:2602.06036, arXiv:2607.05147) on the shared loop: a
:class:`~selfspec.heads.dflash.BlockHead` trained on random anchors of each sequence, every block of a batch in one
forward.

Run it with ``selfspec train configs/dflash-smollm2.yaml`` (or ``head=dspark``). Data: the feature store
(:func:`~selfspec.train.feature_store.target_features` with the head's layers) holds at every position t
``[h_t (the k fused target layers, k D), f_t (D: the last hidden state after the final norm)]``. For a sequence
``x_0 .. x_{T-1}`` with assistant mask ``m``:

* an anchor ``a`` (``1 <= a``, ``m_{a+1}``) opens the block ``[x_a, mask, ..]`` at positions ``a .. a + B - 1``; the
  block attends to the fused context at positions ``< a`` and to its own slots (:func:`block_mask`), exactly what
  :class:`~selfspec.decode.drafters.block.BlockDrafter` gives it when ``a`` tokens are decided and ``x_a`` is the
  root (proven by ``tests/train/test_dflash.py``);
* its k-th draft (k = 0 .. P - 1; slot ``k + 1`` for DFlash, slot k for DSpark) predicts ``x_{a+1+k}``; its label
  is the target's distribution there, ``softmax(lm_head(f_{a+k}))`` over the draft vocabulary (the greedy token for
  the cross entropy), counted where ``a + 1 + k < T`` and ``m_{a+1+k}``, with weight ``exp(-k / decay)`` (or the
  draft-confidence weights of :func:`position_weights`);
* DSpark's Markov head takes the token before each draft: ``x_a`` for the first, then the target's greedy token at
  the previous draft (what the drafter chains through when the previous draft was accepted); its confidence head
  learns each draft's survival (all drafts up to it equal the target's greedy tokens) with a BCE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from selfspec.base.fingerprint import target_fingerprint
from selfspec.base.target_shards import layer_state
from selfspec.heads.block_layers import draft_layer_config
from selfspec.heads.dflash import SIBLING_TOP_K, BlockConfig, BlockHead, default_target_layer_ids
from selfspec.heads.eagle import softcap
from selfspec.train.config import BlockOptions, TrainConfig
from selfspec.train.distill_states import CapturedStates
from selfspec.train.feature_recipe import FeatureRecipe
from selfspec.train.feature_store import FeatureStore
from selfspec.train.inputs import RunInputs
from selfspec.train.loop import StepLoss, train_loop
from selfspec.train.losses import distribution_loss
from selfspec.train.online_features import feature_stores
from selfspec.train.unroll import chain_metrics
from selfspec.train.warm_start import copy_head, init_head, warm_draft_ids

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BlockRecipe", "block_logits", "block_mask", "capture_block", "position_weights", "train_block"]


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive attention mask of N blocks per row over ``[context (T) | blocks (N B)]``.

    Args:
        anchors: Long ``[R, N]`` anchor positions (-1: no block there).
        valid: Bool ``[R, T]``: real tokens (False on padding).
        block_size: B.

    Returns:
        ``[R, 1, N B, T + N B]``: block n's slots see the context positions ``< anchors[n]`` and every slot of block n.
    """
    R, N = anchors.shape
    T = valid.shape[1]
    t = torch.arange(T, device=anchors.device)
    ctx = (t.view(1, 1, T) < anchors.unsqueeze(-1)) & valid.unsqueeze(1)  # [R, N, T]
    ctx = ctx.unsqueeze(2).expand(R, N, block_size, T).reshape(R, N * block_size, T)
    blk = torch.arange(N * block_size, device=anchors.device) // block_size
    own = (blk.view(-1, 1) == blk.view(1, -1)).unsqueeze(0).expand(R, -1, -1)
    allowed = torch.cat([ctx, own], dim=-1)
    return (
        torch.zeros(allowed.shape, dtype=dtype, device=anchors.device)
        .masked_fill_(~allowed, torch.finfo(dtype).min)
        .unsqueeze(1)
    )


def block_logits(
    head: BlockHead, states: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Every block's normed draft states in one forward: ``z`` ``[R, N, P, D]`` for the P drafts of each block.

    Args:
        head: the head.
        states: ``[R, T, k D]`` the target's states at the head's layers.
        tokens: Long ``[R, T]``; valid: Bool ``[R, T]``; anchors: Long ``[R, N]`` (-1: none; its block is padding).
    """
    cfg = head.config
    R, N = anchors.shape
    B = cfg.block_size
    T = tokens.shape[1]
    context = head.context(states, torch.arange(T, device=tokens.device).expand(R, T))
    first = tokens.gather(1, anchors.clamp(min=0))  # [R, N]
    blk = torch.full((R, N, B), cfg.mask_token_id, dtype=torch.long, device=tokens.device)
    blk[..., 0] = first
    pos = anchors.clamp(min=0).unsqueeze(-1) + torch.arange(B, device=tokens.device)
    mask = block_mask(anchors, valid, B, head.fc.weight.dtype)
    z = head(blk.view(R, N * B), pos.view(R, N * B), context, mask)
    return z.view(R, N, B, -1)[:, :, cfg.first_slot :]


def sample_anchors(loss_mask: torch.Tensor, length: int, count: int, drafts: int, generator: torch.Generator):
    """Up to ``count`` distinct anchors of one sequence, sorted: positions ``a >= 1`` whose first draft's token
    ``x_{a+1}`` is an assistant token (``loss_mask [T]``, ``length`` real tokens). Long ``[<= count]``."""
    ok = torch.zeros(length, dtype=torch.bool)
    if length > 2:
        ok[1 : length - 1] = loss_mask[2:length]
    cand = ok.nonzero().flatten()
    if cand.numel() > count:
        cand = cand[torch.randperm(cand.numel(), generator=generator)[:count]].sort().values
    return cand


class BlockTrainer(torch.nn.Module):
    """The trained module: the head, whose one forward per step is :func:`block_logits` (for ``accelerate``).

    With ``checkpointing`` (``activation_checkpointing: true``), each draft layer's activations are recomputed in the
    backward pass (``torch.utils.checkpoint``, non-reentrant) instead of kept from the forward: the same gradients,
    activation memory of one layer instead of all of them, one more forward of the layers per step.
    """

    def __init__(self, head: BlockHead, checkpointing: bool = False) -> None:
        super().__init__()
        self.head, self.checkpointing = head, checkpointing

    def forward(self, states, tokens, valid, anchors) -> torch.Tensor:
        if not (self.checkpointing and torch.is_grad_enabled()):
            return block_logits(self.head, states, tokens, valid, anchors)
        with recomputed(self.head.layers):
            return block_logits(self.head, states, tokens, valid, anchors)


@contextlib.contextmanager
def recomputed(layers: torch.nn.ModuleList) -> Iterator[None]:
    """Within the block, a call of any of ``layers`` keeps only its inputs for the backward pass and runs the layer
    again there (``torch.utils.checkpoint.checkpoint``, non-reentrant); the layers' own forwards after."""
    originals = [layer.forward for layer in layers]
    try:
        for layer, forward in zip(layers, originals, strict=True):
            layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
        yield
    finally:
        for layer, forward in zip(layers, originals, strict=True):
            layer.forward = forward


def _labels(batch: dict[str, torch.Tensor], drafts: int, D: int):
    """Per draft of every block: the position of its token ``a + 1 + k`` ``[R, N, P]``, whether it is scored, and the
    target's final state before it (``f_{a+k}``, ``[R, N, P, D]``)."""
    anchors, loss_mask, valid = batch["anchors"], batch["loss_mask"], batch["valid"]
    R, T = valid.shape
    k = torch.arange(drafts, device=anchors.device)
    pos = anchors.unsqueeze(-1) + 1 + k  # [R, N, P]
    inside = (anchors.unsqueeze(-1) >= 0) & (pos < T)
    pos_c = pos.clamp(0, T - 1)
    scored = (
        inside & loss_mask.gather(1, pos_c.view(R, -1)).view_as(pos) & valid.gather(1, pos_c.view(R, -1)).view_as(pos)
    )
    f = batch["states"][..., -D:]
    before = f.gather(1, (pos_c - 1).clamp(min=0).view(R, -1, 1).expand(-1, -1, D)).view(*pos.shape, D)
    return pos_c, scored, before


def block_step_loss(
    model: torch.nn.Module,
    head: BlockHead,
    batch: dict[str, torch.Tensor],
    lm_rows: torch.Tensor,
    options: BlockOptions,
) -> tuple[torch.Tensor, dict[str, Any], int]:
    """One batch's loss (module docstring): ``sum_k w_k L_k / sum_k w_k`` over the scored drafts, ``L`` as
    ``options.loss`` says, plus DSpark's confidence BCE.

    Args:
        model: :class:`BlockTrainer` (or its prepared wrapper); head: the same head (its config, Markov head).
        batch: :meth:`BlockRecipe.collate`'s tensors.
        lm_rows: ``[S, D]`` float32, the target's lm_head rows of the draft vocabulary (frozen).
        options: the recipe's options.

    Returns:
        ``(loss, logs, scored drafts)``; ``logs`` holds the first draft's top-1 agreement and the loss terms.
    """
    cfg = head.config
    P, D = cfg.max_drafts, cfg.hidden_size
    kD = batch["states"].shape[-1] - D
    z = model(batch["states"][..., :kD], batch["tokens"], batch["valid"], batch["anchors"])  # [R, N, P, D]
    pos, scored, before = _labels(batch, P, D)
    with torch.no_grad():
        log_p = torch.log_softmax(softcap(before.float() @ lm_rows.T, head.logit_softcap), dim=-1)  # [R, N, P, S]
        greedy = log_p.argmax(-1)  # draft ids
    q_logits = head.draft_logits(z).float()
    code = None
    markov = head.markov(_previous(batch, head, greedy))
    if markov is not None:
        q_logits = q_logits + markov[0].float()
        code = markov[1]
    log_q = torch.log_softmax(q_logits, dim=-1)
    loss_kind = options.loss if options.loss != "auto" else ("dspark" if cfg.head_type == "dspark" else "ce")
    if loss_kind == "dspark":
        per = 0.1 * distribution_loss(log_q, log_p, "ce") + 0.9 * distribution_loss(log_q, log_p, "tv")
    else:
        per = distribution_loss(log_q, log_p, loss_kind)
    w = position_weights(log_q, greedy, scored, options)
    total_w = w.sum().clamp(min=1e-9)
    loss = (per * w).sum() / total_w + 0.0 * z.sum()
    hits = (log_q.argmax(-1) == greedy) & scored
    logs: dict[str, Any] = {"top1": round(float(hits[..., 0].sum() / scored[..., 0].sum().clamp(min=1)), 4)}
    if head.confidence_head is not None and code is not None:
        survive = torch.cumprod(((log_q.argmax(-1) == greedy) | ~scored).float(), dim=-1).detach()
        conf = head.confidence_logits(z, code).float()
        bce = F.binary_cross_entropy_with_logits(conf, survive, reduction="none")
        loss = loss + (bce * scored).sum() / scored.sum().clamp(min=1)
        logs["bce"] = round(float(bce[scored].mean().detach()) if bool(scored.any()) else 0.0, 4)
    logs["loss_" + loss_kind] = round(float(loss.detach()), 4)
    return loss, logs, int(scored.sum())


def position_weights(
    log_q: torch.Tensor, greedy: torch.Tensor, scored: torch.Tensor, options: BlockOptions
) -> torch.Tensor:
    """The weight of each draft in the block loss, 0 where it is not scored.

    Args:
        log_q: ``[..., P, S]`` float32 draft log-probabilities over the draft vocabulary.
        greedy: Long ``[..., P]`` the target's greedy token at each draft (draft ids).
        scored: Bool ``[..., P]``.
        options: ``weights`` ``"decay"``: ``exp(-k / decay)`` for the k-th draft (k = 0 .. P - 1);
            ``"confidence"`` (after D-PACE, arXiv:2605.18810): ``prod_{j<k} q_j(greedy_j)``, detached (an unscored
            draft multiplies by 1).

    Returns:
        float32 ``[..., P]``.
    """
    P = log_q.shape[-2]
    if options.weights == "decay":
        w = torch.exp(-torch.arange(P, device=log_q.device, dtype=torch.float32) / options.decay)
        return w.expand_as(scored) * scored
    with torch.no_grad():
        q_greedy = log_q.gather(-1, greedy.unsqueeze(-1)).squeeze(-1).exp()
        q_greedy = torch.where(scored, q_greedy, torch.ones_like(q_greedy))
        reach = torch.cumprod(torch.cat([torch.ones_like(q_greedy[..., :1]), q_greedy[..., :-1]], dim=-1), dim=-1)
    return reach * scored


def _previous(batch: dict[str, torch.Tensor], head: BlockHead, greedy: torch.Tensor) -> torch.Tensor:
    """The token before each draft (Markov head input), target ids ``[R, N, P]``: the anchor's, then the target's
    greedy token at the previous draft."""
    anchor_tok = batch["tokens"].gather(1, batch["anchors"].clamp(min=0))  # [R, N]
    ids = head.draft_ids.to(greedy.device)[greedy]  # [R, N, P] target ids
    return torch.cat([anchor_tok.unsqueeze(-1), ids[..., :-1]], dim=-1)


@torch.no_grad()
def evaluate(
    head: BlockHead, store: FeatureStore, lm_full: torch.Tensor, anchors: int = 16, seqs_per_batch: int = 4
) -> dict[str, Any]:
    """Held-out greedy chain acceptance as the drafter decodes: drafts chained through the Markov head on the
    head's own previous drafts; ``chain[d-1]`` is the share of blocks (anchored at up to ``anchors`` assistant
    positions per held-out sequence, seeded) whose first d drafts all equal the target's greedy tokens (over the
    full vocabulary), counted over blocks whose d-th draft is scored; ``top1 = chain[0]``, ``chain_tau = 1 +
    sum(chain)``. ``siblings[k - 2][d - 1]`` (k = 2 .. :data:`SIBLING_TOP_K`): the share of those blocks whose first
    d - 1 drafts are accepted, whose d-th is not, and whose d-th target token is among that slot's next k - 1
    candidates: what a sibling leaf of the drafter's tree adds to tau there (``BlockDrafter`` with ``top_k = k``).
    ``lm_full``: ``[V, D]``."""
    was = head.training
    head.eval()
    cfg = head.config
    P, D = cfg.max_drafts, cfg.hidden_size
    dev, dtype = head.fc.weight.device, head.fc.weight.dtype
    lm = lm_full.to(device=dev, dtype=dtype)
    ids = head.draft_ids
    g = torch.Generator().manual_seed(1234)
    ks = range(2, min(SIBLING_TOP_K, cfg.n_draft) + 1)
    hits, counts, sib_hits = [0] * P, [0] * P, [[0] * P for _ in ks]
    for s in range(0, len(store), seqs_per_batch):
        batch = collate_sequences(store, list(range(s, min(len(store), s + seqs_per_batch))), anchors, P, g)
        batch = {k: v.to(dev) for k, v in batch.items()}
        kD = batch["states"].shape[-1] - D
        z = block_logits(head, batch["states"][..., :kD].to(dtype), batch["tokens"], batch["valid"], batch["anchors"])
        pos, scored, before = _labels(batch, P, D)
        greedy = softcap(before.to(dtype) @ lm.T, head.logit_softcap).argmax(-1)  # target ids [R, N, P]
        base = head.draft_logits(z).float()
        prev = batch["tokens"].gather(1, batch["anchors"].clamp(min=0))
        run = torch.ones(greedy.shape[:2], dtype=torch.bool, device=dev)
        for k in range(P):
            scores = base[:, :, k]
            markov = head.markov(prev)
            if markov is not None:
                scores = scores + markov[0].float()
            draft = ids[scores.argmax(-1)]
            use = scored[:, :, k]
            if len(ks):
                top = ids[scores.topk(ks[-1], dim=-1).indices]  # [R, N, K]: the draft first
                found = (top[..., 1:] == greedy[:, :, k].unsqueeze(-1)).cumsum(-1) > 0  # within the first k - 1
                missed = run & use & (draft != greedy[:, :, k])
                for i, row in enumerate(sib_hits):
                    row[k] += int((missed & found[..., i]).sum())
            run = run & (draft == greedy[:, :, k])
            hits[k] += int((run & use).sum())
            counts[k] += int(use.sum())
            prev = draft
    head.train(was)
    metrics = chain_metrics(hits, counts)
    siblings = [[round(h / max(1, c), 4) for h, c in zip(row, counts, strict=True)] for row in sib_hits]
    return {"positions": counts[0], "top1": metrics["chain"][0], **metrics, "siblings": siblings}


def collate_sequences(
    store: FeatureStore, items: list[int], anchors: int, drafts: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """Sequences ``items`` of ``store`` right-padded into rows, with up to ``anchors`` blocks each
    (:func:`sample_anchors`): ``tokens`` Long / ``valid`` / ``loss_mask`` Bool ``[R, T]``, ``states`` ``[R, T, W]``,
    ``anchors`` Long ``[R, N]`` (-1 padded)."""
    seqs = [store.sequence(i) for i in items]
    T = max(s[0].numel() for s in seqs)
    R, W = len(seqs), store.width
    tokens = torch.zeros(R, T, dtype=torch.long)
    states = torch.zeros(R, T, W, dtype=seqs[0][1].dtype)
    valid = torch.zeros(R, T, dtype=torch.bool)
    loss_mask = torch.zeros(R, T, dtype=torch.bool)
    chosen = []
    for r, (ids, feats, mask) in enumerate(seqs):
        n = ids.numel()
        tokens[r, :n], states[r, :n], valid[r, :n], loss_mask[r, :n] = ids, feats, True, mask.bool()
        chosen.append(sample_anchors(loss_mask[r], n, anchors, drafts, generator))
    N = max(1, max(c.numel() for c in chosen))
    anchor_t = torch.full((R, N), -1, dtype=torch.long)
    for r, c in enumerate(chosen):
        anchor_t[r, : c.numel()] = c
    return {"tokens": tokens, "states": states, "valid": valid, "loss_mask": loss_mask, "anchors": anchor_t}


def choose_mask_token(tokenizer: Any, store: FeatureStore, vocab_size: int) -> int:
    """The mask token: the tokenizer's ``mask_token_id`` when it has one, else the highest id no training sequence
    holds (its embedding is the target's, frozen: the head learns what it marks).

    Raises:
        ValueError: every id of the vocabulary occurs in the training data (pass ``block.mask_token_id``).
    """
    own = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    if isinstance(own, int) and 0 <= own < vocab_size:
        return own
    seen = torch.bincount(store.tokens, minlength=vocab_size)[:vocab_size] > 0
    free = (~seen).nonzero().flatten()
    if free.numel() == 0:
        raise ValueError("every token id occurs in the training data: set block.mask_token_id to the id to mask with")
    return int(free[-1])


class BlockRecipe(FeatureRecipe):
    """A DFlash or DSpark head (``cfg.head``) trained with :func:`block_step_loss`; ``cfg.block`` holds its options,
    ``cfg.draft_vocab_size`` its draft vocabulary (the most frequent assistant tokens; null shares the target's
    lm_head).

    Raises:
        ValueError: no anchor in the training data.
    """

    def __init__(self, run: RunInputs, train: FeatureStore, held: FeatureStore, signature: str) -> None:
        cfg, target, opts = run.cfg, run.target, run.cfg.block
        super().__init__(run, train, held, signature, opts.batch_tokens)
        self.family = cfg.head
        tc = target.config
        V, D = tc.vocab_size, tc.hidden_size
        warm = init_head(cfg, target)
        draft_ids = self.draft_ids() if warm is None else warm_draft_ids(warm, V)
        mask_id = opts.mask_token_id if opts.mask_token_id is not None else choose_mask_token(run.tokenizer, train, V)
        dspark = cfg.head == "dspark"
        hcfg = BlockConfig(
            head_type=cfg.head,
            hidden_size=D,
            vocab_size=V,
            num_target_layers=tc.num_hidden_layers,
            block_size=opts.block_size,
            num_layers=opts.num_layers,
            mask_token_id=mask_id,
            target_layer_ids=block_layers(cfg, target),
            draft_vocab_size=V if draft_ids is None else draft_ids.numel(),
            markov_rank=opts.markov_rank if dspark else 0,
            confidence=dspark and opts.confidence,
            target=cfg.target,
            target_fingerprint=target_fingerprint(target),
        )
        torch.manual_seed(cfg.seed)
        self.head = BlockHead(hcfg, draft_layer_config(tc, opts.num_layers, opts.block_size), draft_ids, target)
        if opts.init_layer is not None:
            init_from_target_layer(self.head, target, opts.init_layer)
        self.head = self.head.float()
        copy_head(self.head, warm)

    recomputes_layers = True

    def module(self) -> torch.nn.Module:
        return BlockTrainer(self.head, self.cfg.activation_checkpointing)

    def batches(self, epoch: int) -> list[list[Any]]:
        g = torch.Generator().manual_seed(self.epoch_seed(epoch))
        order = torch.randperm(len(self.train), generator=g).tolist()
        r = self.rows_per_step
        n = max(1, len(order) // r)
        return [[(i, epoch * 100003 + b) for i in order[b * r : (b + 1) * r]] for b in range(n)]

    def collate(self, items: list[Any]) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(int(items[0][1]))
        cfg = self.head.config
        return collate_sequences(self.train, [i for i, _ in items], self.cfg.block.anchors, cfg.max_drafts, g)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], step: int) -> StepLoss:
        lm_rows = self.lm_rows(self.head.draft_ids, batch["tokens"].device)
        batch = {**batch, "states": batch["states"].float()}
        loss, logs, scored = block_step_loss(model, self.head, batch, lm_rows, self.cfg.block)
        return StepLoss(loss, logs, {"train_tokens": int(batch["valid"].sum()), "scored_tokens": scored})

    def evaluate(self) -> dict[str, Any]:
        return evaluate(self.head, self.held, self.lm_full)

    def save(self, metrics: dict[str, Any], head_dir: Path) -> dict[str, Any]:
        self.head.config = dataclasses.replace(
            self.head.config,
            heldout_top1=metrics["top1"],
            heldout_chain=tuple(metrics["chain"]),
            heldout_siblings=tuple(tuple(row) for row in metrics["siblings"]),
        )
        self.head.save_pretrained(head_dir)
        return {
            "train_sequences": len(self.train),
            "draft_vocab_size": self.head.config.n_draft,
            "target_layer_ids": list(self.head.config.target_layer_ids),
            "mask_token_id": self.head.config.mask_token_id,
            "heldout": metrics,
            "options": dataclasses.asdict(self.cfg.block),
            **self.feature_summary(),
        }


@torch.no_grad()
def init_from_target_layer(head: BlockHead, target: PreTrainedModel, index: int) -> None:
    """Start every draft layer from the target's layer ``index``: each tensor whose name and shape the target's
    layer shares (projections, MLP, norms), the rest kept (Qwen3's q/k norms where the target has none)."""
    src = layer_state(target.base_model.layers[index])  # whole, where the target is sharded
    for layer in head.layers:
        own = layer.state_dict()
        layer.load_state_dict({k: v for k, v in src.items() if k in own and own[k].shape == v.shape}, strict=False)


def warm_options(config: BlockConfig) -> dict[str, Any]:
    """The options a saved DFlash / DSpark head fixes for a run that starts from it
    (:mod:`selfspec.train.warm_start`)."""
    block = {
        "block_size": config.block_size,
        "num_layers": config.num_layers,
        "target_layer_ids": tuple(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "confidence": config.confidence,
    }
    if config.markov_rank:
        block["markov_rank"] = config.markov_rank
    return {"draft_vocab_size": config.draft_vocab_size, "block": block}


def capture_block(cfg: TrainConfig, target: PreTrainedModel, budget_bytes: int) -> CapturedStates:
    """What self-distillation keeps for a DFlash / DSpark run: the states after the head's layers (as
    ``hidden_states[i + 1]``) and the last hidden state."""
    return CapturedStates(tuple(i + 1 for i in block_layers(cfg, target)), budget_bytes)


def block_layers(cfg: TrainConfig, target: PreTrainedModel) -> tuple[int, ...]:
    """The target layers the head fuses (outputs, DFlash's convention): ``cfg.block.target_layer_ids``, else
    :func:`~selfspec.heads.dflash.default_target_layer_ids`."""
    return cfg.block.target_layer_ids or default_target_layer_ids(target.config.num_hidden_layers)


def train_block(run: RunInputs) -> Path:
    """Train a DFlash or DSpark head on the frozen ``run.target``; returns the saved head directory.

    The features are the states after the head's target layers and the last hidden state at every position, from
    the feature store (cached, keyed by them) or computed online as ``cfg.features`` says
    (:func:`~selfspec.train.online_features.feature_stores`); :func:`~selfspec.train.loop.train_loop` does the rest.

    Raises:
        ValueError: no training position, or no free id to mask with.
    """
    layers = tuple(i + 1 for i in block_layers(run.cfg, run.target))
    train, held, signature, _ = feature_stores(run, layers, run.cfg.block.batch_tokens)
    return train_loop(run.cfg, run.accelerator, BlockRecipe(run, train, held, signature), run.heldout())
