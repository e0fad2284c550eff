"""Near-ties of the target: where two greedy decoders may part without either being wrong.

An engine that computes the target with other kernels (llama.cpp, vLLM, OpenVINO GenAI) can pick the second-best
token where the target's two best logits are within float rounding of each other; such a difference from the
engine's plain reference is reported apart (``BenchReport.ties``), never counted as a mismatch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["TIE_MARGIN", "is_near_tie"]

TIE_MARGIN = 0.5
"""Logit margin (top-1 minus top-2 of the target, fp32) under which an engine's plain choice is a near-tie."""


def is_near_tie(target: PreTrainedModel, prompt_ids: torch.Tensor, reference: list[int], position: int) -> bool:
    """Whether the target's two best next-token logits after ``prompt + reference[:position]`` are within
    :data:`TIE_MARGIN` (fp32, one forward).

    Args:
        target: the target model.
        prompt_ids: Long ``[T]``, the prompt (any device).
        reference: the reference output's token ids.
        position: how many of them precede the compared token.
    """
    ids = torch.cat([prompt_ids.cpu(), torch.tensor(reference[:position], dtype=torch.long)]).unsqueeze(0)
    device = next(target.parameters()).device
    with torch.inference_mode():
        logits = target(input_ids=ids.to(device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1]) < TIE_MARGIN
