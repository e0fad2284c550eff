"""Tiny random Llama target (tests/archs.py) and trained-looking random heads of each family, fp32."""

from __future__ import annotations

import pytest
import torch

from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.fingerprint import target_fingerprint
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from tests.archs import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _randomize(head: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def make_eagle3(target, draft: int = 40) -> Eagle3Head:
    V = target.config.vocab_size
    ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:draft]).values
    cfg = Eagle3Config(32, V, draft, 3, target="tiny", target_fingerprint=target_fingerprint(target))
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
