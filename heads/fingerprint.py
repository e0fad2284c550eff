"""Which target a head was trained on: a short fingerprint stored with every head and checked on load."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def target_fingerprint(model: PreTrainedModel) -> str:
    """A short, stable fingerprint of a target: architecture, sizes and a hash of a few weight slices.

    Heads store it so that loading them onto a different target is refused.

    Returns:
        16 hex characters.
    """
    cfg = model.config
    h = hashlib.sha256()
    h.update(json.dumps([cfg.model_type, cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers]).encode())
    emb = model.get_input_embeddings().weight
    sample = emb[:: max(1, emb.shape[0] // 64), :8].detach().to(torch.float32).cpu()
    h.update(sample.numpy().round(3).tobytes())
    return h.hexdigest()[:16]
