"""Tiny random Llama target (tests/archs.py) and trained-looking random heads of each EAGLE family, fp32."""

from __future__ import annotations

import pytest
import torch

from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.fingerprint import target_fingerprint
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


def make_eagle(target) -> EagleHead:
    cfg = EagleConfig(32, target.config.vocab_size, target="tiny", target_fingerprint=target_fingerprint(target))
    head = EagleHead(cfg, target.config, target=target)
    _randomize(head, 2)
    return head


def inputs(width: int, T: int = 7):
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, T, width, generator=g), torch.randint(0, 96, (1, T), generator=g), torch.arange(T)[None]


@torch.no_grad()
def draft_logits(head, width: int) -> torch.Tensor:
    feats, ids, pos = inputs(width)
    return head.draft_logits(head(feats, ids, pos))
