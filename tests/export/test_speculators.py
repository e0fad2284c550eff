"""The speculators package (0.9.0) itself loads our EAGLE-3 and EAGLE-3.1 exports and computes the same draft logits.

Runs in the separate environment of :mod:`selfspec.engine_envs` (speculators pins transformers<=5.19):
``Eagle3DraftModel.from_pretrained`` (``speculators/models/eagle3/core.py``) + ``load_verifier_weights``
(``speculators/model.py``), training-time-test steps of its own ``forward`` on fixed inputs, the logits read at its
``lm_head``. Tolerance 1e-5 (fp32; measured 3.3e-7 for EAGLE-3, 7.2e-7 for EAGLE-3.1's second step).

EAGLE-3.1 (``fc_norm``, ``norm_output``; arXiv:2605.09992) runs two steps: at step 1 speculators feeds position i its
own step-0 output (``norm(o)`` with ``norm_output``) with token ``ids[i + 1]`` at position ``pos[i] + 1``, attending
the step-0 keys up to i and itself; that is selfspec's training-time test (:class:`UnrolledEagle3`) at pair i + 1,
whose logits equal the EAGLE drafter's (``tests/train/test_eagle3.py``).
"""

from __future__ import annotations

import pytest
import torch

from selfspec.export.cli import export_heads
from selfspec.train.eagle3 import UnrolledEagle3
from tests.helpers.engines import run_engine_script
from tests.helpers.heads import draft_logits, inputs, make_eagle3

pytestmark = pytest.mark.slow  # the speculators venv (built once per machine, about a minute)

SCRIPT = r"""
import sys, torch
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
d, io, steps = sys.argv[1], torch.load(sys.argv[2]), int(sys.argv[4])
cfg = Eagle3SpeculatorConfig.from_pretrained(d)
cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: speculators' default is flex attention
model = Eagle3DraftModel.from_pretrained(d, config=cfg).eval()
model.load_verifier_weights()
assert (model.fc_norm is not None, model.config.norm_output) == (cfg.fc_norm, cfg.norm_output)
got = []
model.lm_head.register_forward_hook(lambda mod, i, o: got.append(o))
with torch.no_grad():
    model(io["features"], io["ids"], torch.zeros_like(io["ids"]), position_ids=io["pos"], ttt_steps=steps)
torch.save(got, sys.argv[3])
"""


def speculators_logits(spec_python, head, target, tmp_path, steps: int) -> list[torch.Tensor]:
    """Export ``head``, run ``steps`` training-time-test steps of speculators' own model on :func:`inputs`, and
    return its ``lm_head`` outputs, one ``[1, T, S]`` per step."""
    target.save_pretrained(tmp_path / "target")
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path=str(tmp_path / "target"))
    features, ids, pos = inputs(96)
    return run_engine_script(
        spec_python, SCRIPT, out, {"features": features, "ids": ids, "pos": pos}, tmp_path, str(steps)
    )


@pytest.mark.parametrize("draft", [40, 96])
def test_speculators_loads_our_export(spec_python, target, tmp_path, draft):
    head = make_eagle3(target, draft=draft)
    (theirs,) = speculators_logits(spec_python, head, target, tmp_path, steps=1)
    ours = draft_logits(head, 96)
    assert theirs.shape == ours.shape == (1, 7, draft)
    diff = (theirs - ours).abs().max().item()
    print(f"speculators vs selfspec draft logits, S={draft}: max |diff| = {diff:.3e}")
    assert diff < 1e-5


@pytest.mark.parametrize("flags", [dict(fc_norm=True, norm_output=True), dict(norm_output=True)], ids="+".join)
def test_speculators_computes_our_eagle31_head(spec_python, target, tmp_path, flags):
    """Both steps of an EAGLE-3.1 export, in speculators' own model, against selfspec's training-time test."""
    head = make_eagle3(target, **flags).eval()
    theirs = speculators_logits(spec_python, head, target, tmp_path, steps=2)
    features, ids, pos = inputs(96)
    T = ids.shape[1]
    with torch.no_grad():
        ours = UnrolledEagle3(head)(
            features, ids, pos, torch.zeros_like(ids), 2, torch.ones_like(ids, dtype=torch.bool)
        )
    assert [tuple(x.shape) for x in theirs] == [(1, T, 40), (1, T, 40)]
    assert tuple(ours[0].shape) == (T, 40) and tuple(ours[1].shape) == (T - 1, 40)  # step 1: pairs 1 .. T-1
    diffs = [(theirs[0][0] - ours[0]).abs().max().item(), (theirs[1][0, : T - 1] - ours[1]).abs().max().item()]
    print(f"speculators vs selfspec EAGLE-3.1 {flags}: max |diff| per step = {diffs}")
    assert max(diffs) < 1e-5
    plain = make_eagle3(target)  # the same tensors without the flags: another function
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("fc_norm.")})
    with torch.no_grad():
        other = UnrolledEagle3(plain)(
            features, ids, pos, torch.zeros_like(ids), 2, torch.ones_like(ids, dtype=torch.bool)
        )
    assert (theirs[1][0, : T - 1] - other[1]).abs().max().item() > 1e-3
