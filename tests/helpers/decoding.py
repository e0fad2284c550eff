"""Prompts, plain-``generate`` references and Medusa tree shapes for the decode tests (tiny targets, V = 96)."""

from __future__ import annotations

import torch

V = 96  # the vocabulary of every tiny target (tests/helpers/archs.py)


def plain_greedy(model, ids, n, **kw):
    out = model.generate(ids[None], max_new_tokens=n, do_sample=False, pad_token_id=0, top_k=None, **kw)
    return out[0, ids.numel() :].tolist()


TREES = [
    [(0,)],
    [(0,), (0, 0), (0, 0, 0)],
    [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    [(1,), (0,), (1, 1), (1, 0), (1, 1, 2), (1, 1, 0), (1, 1, 1)],
]


def prompts(n: int, length: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (length,), generator=g) for _ in range(n)]


def reference(target, ids: torch.Tensor, n: int) -> list[int]:
    out = target.generate(ids.unsqueeze(0), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, ids.numel() :].tolist()
