"""The prompts every engine's settings sweep measures on (llama.cpp's settings, OpenVINO GenAI's draft length).

Fixed, so a cached sweep answers the same question on every run, and shared, so two engines' sweeps are measured on
the same text.
"""

from __future__ import annotations

__all__ = ["CALIBRATION_PROMPTS", "CALIBRATION_TOKENS"]

CALIBRATION_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h? Show the steps.",
    "Rewrite this sentence in a formal tone: we gotta finish the report by friday or the boss will be mad.",
)
"""The sweep's prompts (one each of explanation, code, arithmetic, rewriting)."""
CALIBRATION_TOKENS = 64
"""New tokens of every calibration call."""
