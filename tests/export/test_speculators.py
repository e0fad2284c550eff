"""The speculators package (0.9.0) itself loads our EAGLE-3 export and computes the same draft logits.

Runs in the separate environment of :mod:`selfspec.export.speculators_env` (speculators pins transformers<=5.19):
``Eagle3DraftModel.from_pretrained`` (``speculators/models/eagle3/core.py``) + ``load_verifier_weights``
(``speculators/model.py``), one training-time-test step of its own ``forward`` on fixed inputs, the logits read at
its ``lm_head``. Tolerance 1e-5 (fp32; measured 1.8e-7).
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from selfspec.export.cli import export_heads
from selfspec.export.speculators_env import build_env
from tests.helpers.engines import engine_missing
from tests.helpers.heads import draft_logits, inputs, make_eagle3

pytestmark = pytest.mark.slow  # the speculators venv (built once per machine, about a minute)

SCRIPT = r"""
import sys, torch
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
d, io = sys.argv[1], torch.load(sys.argv[2])
cfg = Eagle3SpeculatorConfig.from_pretrained(d)
cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: speculators' default is flex attention
model = Eagle3DraftModel.from_pretrained(d, config=cfg).eval()
model.load_verifier_weights()
got = {}
model.lm_head.register_forward_hook(lambda mod, i, o: got.__setitem__("logits", o))
with torch.no_grad():
    model(io["features"], io["ids"], torch.zeros_like(io["ids"]), position_ids=io["pos"], ttt_steps=1)
torch.save(got["logits"], sys.argv[3])
"""


@pytest.fixture(scope="module")
def spec_python():
    try:
        return build_env()
    except (RuntimeError, OSError) as err:
        engine_missing(
            f"the speculators environment cannot be built here ({err}); run python -m selfspec.export.speculators_env"
        )


@pytest.mark.parametrize("draft", [40, 96])
def test_speculators_loads_our_export(spec_python, target, tmp_path, draft):
    target.save_pretrained(tmp_path / "target")
    head = make_eagle3(target, draft=draft)
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path=str(tmp_path / "target"))
    features, ids, pos = inputs(96)
    torch.save({"features": features, "ids": ids, "pos": pos}, tmp_path / "io.pt")
    (tmp_path / "run.py").write_text(SCRIPT)
    cmd = [str(spec_python), str(tmp_path / "run.py"), str(out), str(tmp_path / "io.pt"), str(tmp_path / "out.pt")]
    done = subprocess.run(cmd, capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    ours = draft_logits(head, 96)
    assert theirs.shape == ours.shape == (1, 7, draft)
    diff = (theirs - ours).abs().max().item()
    print(f"speculators vs selfspec draft logits, S={draft}: max |diff| = {diff:.3e}")
    assert diff < 1e-5
