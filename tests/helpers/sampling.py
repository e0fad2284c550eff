"""The sampling settings of the seeded distribution tests, and the target's processed next-token law."""

from __future__ import annotations

import torch

from selfspec.decode.sampling import SamplingConfig, probs_from_logits, process_logits

N_SAMPLES = 400


SAMPLING = SamplingConfig(do_sample=True, temperature=0.7, top_k=6)


def processed_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(ids[None]).logits[0, -1:].float()
    return probs_from_logits(process_logits(logits, ids[None], SAMPLING))[0]
