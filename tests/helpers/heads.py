"""Random heads of each family for the tiny targets (decode tests: ``random_heads``, ``random_head``; export
tests: ``make_medusa``, ``make_eagle``, ``make_eagle3``, trained-looking weights), and an EAGLE head that nearly
reproduces its target (``build_oracle``)."""

from __future__ import annotations

import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.block_layers import draft_layer_config
from selfspec.heads.dflash import BlockConfig, BlockHead
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from tests.helpers.archs import tiny_llama

D, V = 32, 96  # hidden size and vocabulary of tiny_llama


def random_heads(model, num_heads=4, seed=0, draft_vocab=None):
    torch.manual_seed(seed)
    cfg = MedusaConfig(
        hidden_size=model.config.hidden_size, vocab_size=V, num_heads=num_heads, draft_vocab_size=draft_vocab
    )
    ids = torch.randperm(V)[:draft_vocab].sort().values if draft_vocab else None
    heads = MedusaHeads(cfg, target_lm_head=model.lm_head.weight, draft_ids=ids)
    for p in heads.blocks.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


def random_head(target, seed: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(EagleConfig(hidden_size=D, vocab_size=V), target.config, target=target).eval()


def build_oracle():
    """A one-layer target whose embeddings all have RMS 1, and a head that nearly reproduces it.

    ``input_layernorm(e) = e * w`` for every embedding row e, so ``fc = [diag(w), 0]`` followed by a
    copy of the target's layer (without input norm) computes the target's pre-norm hidden state of token
    ``x_{t+1}`` from the pairs (RoPE is relative: the head's one-position shift cancels); only the first
    prompt token x_0 is missing from its context. With unit final-norm weights its argmax is (nearly always)
    the target's greedy token, so acceptance is high and accepted paths run through non-first branches
    (node indices 1, k+1, ...).
    """
    t = tiny_llama(layers=1, seed=3)
    with torch.no_grad():
        emb = t.get_input_embeddings().weight
        emb[0] = torch.randn(D)  # the zero padding row cannot be rescaled
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())  # RMS 1: soft enough logits to sample from
    head = EagleHead(EagleConfig(hidden_size=D, vocab_size=V), t.config, target=t).eval()
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.bias.zero_()
        head.fc.weight[:, :D] = torch.diag(t.model.layers[0].input_layernorm.weight)
        layer = {k: v for k, v in t.model.layers[0].state_dict().items() if not k.startswith("input_layernorm.")}
        head.layers[0].load_state_dict(layer)
    return t, head


class SecondBestHead(EagleHead):
    """Rigged: the oracle's best token is demoted to rank 2, so the right path is never the first branch."""

    def draft_logits(self, predicted):
        logits = super().draft_logits(predicted).clone()
        top2 = logits.topk(2, dim=-1)
        best = top2.indices[..., :1]
        logits.scatter_(-1, best, top2.values[..., 1:] - 1e-3)
        return logits


def _randomize(head: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_eagle3(target, draft: int = 40, **flags: bool) -> Eagle3Head:
    """A random EAGLE-3 head of a tiny 3-layer target (``flags``: EAGLE-3.1's ``fc_norm`` / ``norm_output``)."""
    V = target.config.vocab_size
    ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:draft]).values
    cfg = Eagle3Config(32, V, draft, 3, target="tiny", target_fingerprint=target_fingerprint(target), **flags)
    head = Eagle3Head(cfg, target.config, draft_ids=ids, target=target)
    _randomize(head, 1)
    return head


def _draft_ids(V: int, draft: int) -> torch.Tensor:
    return torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:draft]).values


def make_eagle(target, draft: int | None = None) -> EagleHead:
    V = target.config.vocab_size
    cfg = EagleConfig(32, V, draft_vocab_size=draft, target="tiny", target_fingerprint=target_fingerprint(target))
    ids = None if draft is None else _draft_ids(V, draft)
    head = EagleHead(cfg, target.config, draft_ids=ids, target=target)
    _randomize(head, 2)
    return head


def make_medusa(target, own_lm_head: bool = True, draft: int | None = None) -> MedusaHeads:
    V = target.config.vocab_size
    cfg = MedusaConfig(
        32,
        V,
        num_heads=3,
        num_layers=2,
        own_lm_head=own_lm_head,
        draft_vocab_size=draft,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
        head_topk_accuracy=[[0.5, 0.6], [0.3, 0.4], [0.2, 0.25]],
    )
    lm = target.get_output_embeddings().weight
    heads = MedusaHeads(cfg, target_lm_head=lm, draft_ids=None if draft is None else _draft_ids(V, draft))
    _randomize(heads, 4)
    return heads


def inputs(width: int, T: int = 7):
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, T, width, generator=g), torch.randint(0, 96, (1, T), generator=g), torch.arange(T)[None]


@torch.no_grad()
def medusa_logits(heads: MedusaHeads) -> torch.Tensor:
    """``[K, 1, T, S]`` draft logits of every head on fixed hidden states."""
    return heads(inputs(32)[0])


@torch.no_grad()
def draft_logits(head, width: int) -> torch.Tensor:
    feats, ids, pos = inputs(width)
    return head.draft_logits(head(feats, ids, pos))


def block_head(
    target,
    head_type: str,
    block_size: int,
    draft: int | None = None,
    seed: int = 3,
    target_layer_ids: tuple[int, ...] | None = None,
    draft_ids: torch.Tensor | None = None,
) -> BlockHead:
    """A random DFlash / DSpark head of two layers (wide init: varied drafts, some accepted, most rejected);
    ``target_layer_ids`` default :func:`~selfspec.heads.dflash.default_target_layer_ids`; ``draft_ids``: its draft
    vocabulary (default: every ``V // draft``-th id, or the full vocabulary)."""
    c = target.config
    draft = draft if draft_ids is None else draft_ids.numel()
    cfg = BlockConfig(
        head_type=head_type,
        hidden_size=c.hidden_size,
        vocab_size=target.config.vocab_size,
        num_target_layers=c.num_hidden_layers,
        block_size=block_size,
        num_layers=2,
        mask_token_id=target.config.vocab_size - 1,
        draft_vocab_size=draft,
        markov_rank=8 if head_type == "dspark" else 0,
        confidence=head_type == "dspark",
        target_layer_ids=target_layer_ids,
    )
    torch.manual_seed(seed)
    ids = (
        None if draft is None else torch.arange(0, target.config.vocab_size, target.config.vocab_size // draft)[:draft]
    )
    ids = ids if draft_ids is None else draft_ids
    head = BlockHead(cfg, draft_layer_config(c, 2, block_size), ids, target)
    for p in head.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    return head.eval()


ANCHOR = 5  # the anchor position of block_logits' block (in a sequence of 12)


def block_inputs(head: BlockHead, T: int = 12):
    """Fixed target features ``[1, T, k D]``, ids ``[1, T]`` (never the mask token) and positions ``[1, T]``."""
    g = torch.Generator().manual_seed(7)
    k, D = len(head.config.target_layer_ids), head.config.hidden_size
    return torch.randn(1, T, k * D, generator=g), torch.randint(0, 95, (1, T), generator=g), torch.arange(T)[None]


@torch.no_grad()
def block_logits(head: BlockHead, context: int = ANCHOR) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft logits ``[B, S]`` of the full block anchored at :data:`ANCHOR` on :func:`block_inputs` (DSpark:
    with the Markov bias of the true previous tokens, as in training) and DSpark's confidence logits ``[B]`` (None
    without the head); the block attends the first ``context`` positions' features (the anchor's own: ``ANCHOR + 1``,
    a control that must differ)."""
    feats, ids, pos = block_inputs(head)
    B = head.config.block_size
    ctx = head.context(feats[:, :context], pos[:, :context])
    tokens = torch.full((1, B), head.config.mask_token_id)
    tokens[0, 0] = ids[0, ANCHOR]
    z = head(tokens, pos[:, ANCHOR : ANCHOR + B], ctx)[0]
    logits = head.draft_logits(z)
    markov = head.markov(ids[0, ANCHOR : ANCHOR + B])
    if markov is None:
        return logits, None
    return logits + markov[0], head.confidence_logits(z, markov[1])


def assert_same_block_outputs(head: BlockHead, back: BlockHead) -> None:
    """``back`` (a head read back from an engine's layout) gives exactly ``head``'s :func:`block_logits`, and DSpark's
    confidence logits exactly where ``head`` has a confidence head (none for DFlash, none invented)."""
    (logits, confidence), (back_logits, back_confidence) = block_logits(head), block_logits(back)
    assert torch.equal(logits, back_logits)
    assert (confidence is None, back_confidence is None) == (head.confidence_head is None,) * 2
    if confidence is not None:
        assert torch.equal(confidence, back_confidence)
