"""``python -m benchmarks.gpu_curves``: the Medusa draft-cost rows on the tiny target of the CPU dry runs, whose
vocabulary (512) is smaller than the 8,192-token draft vocabulary of the real sizes."""

from __future__ import annotations

import torch

from benchmarks.gpu_curves import medusa_draft_cost
from benchmarks.random_targets import build_target


def test_medusa_draft_cost_fits_the_draft_vocabulary_to_a_small_target():
    model = build_target("tiny", torch.float32, "cpu")
    rows = medusa_draft_cost(model, repeats=2, warmup=1)
    assert [r["variant"] for r in rows] == ["full_vocab", "draft_vocab_256"]
    assert all(r["draft_ms"] > 0 for r in rows)
    assert rows[1]["head_params_m"] < rows[0]["head_params_m"]  # the reduced heads' own lm_head rows are fewer
