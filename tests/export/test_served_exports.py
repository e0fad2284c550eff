"""EAGLE-3 heads of the served architectures in the layouts whose engines serve them. The engines' EAGLE-3 drafts for
DeepSeek, Kimi, Qwen3-MoE and gpt-oss targets are ``LlamaForCausalLMEagle3`` (SGLang, SpecForge) / speculators'
``Eagle3DraftModel`` with a Llama layer: a head with ``draft_layer: "llama"`` (DeepSeek-V3 and LFM2 by default, any
target on request) exports to both with exactly the tensors a Llama target's head has (its own KV heads), and
speculators' own loader computes its draft logits (slow tier); a head with the target's own MoE layer is refused by
the Llama-only layouts, naming its model type."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from selfspec.export import ExportError
from selfspec.export.cli import export_heads
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from tests.helpers.archs import tiny_target
from tests.helpers.engines import run_engine_script
from tests.helpers.heads import draft_logits, inputs

D, V, S = 32, 96, 40


def head_of(arch: str, draft_layer: str = "auto") -> Eagle3Head:
    t = tiny_target(arch)
    ids = torch.sort(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:S]).values
    head = Eagle3Head(Eagle3Config(D, V, S, 3, draft_layer=draft_layer), t.config, draft_ids=ids, target=t)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return head.eval()


def layout(d) -> dict[str, tuple[int, ...]]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize("arch, draft_layer", [("deepseek_v3", "auto"), ("lfm2", "auto"), ("qwen3_moe", "llama")])
def test_a_llama_layer_head_exports_as_a_llama_targets_head(arch, draft_layer, fmt, tmp_path):
    head = head_of(arch, draft_layer)
    assert head.config.draft_layer == "llama"
    ours = export_heads(head, fmt, tmp_path / "ours", target_name_or_path="tiny")
    llama = export_heads(head_of("llama"), fmt, tmp_path / "llama", target_name_or_path="tiny")
    mine, theirs = layout(ours), layout(llama)
    assert set(mine) == set(theirs)
    kv = head.arch_config.num_key_value_heads * head.arch_config.head_dim  # DeepSeek's tiny config: 4 KV heads
    for name, shape in mine.items():
        want = (kv, 2 * D) if name.endswith(("k_proj.weight", "v_proj.weight")) else theirs[name]
        assert shape == want, name
    cfg, ref = (json.loads((d / "config.json").read_text()) for d in (ours, llama))
    if fmt == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    else:
        assert cfg["transformer_layer_config"]["model_type"] == "llama"
        assert cfg["transformer_layer_config"]["head_dim"] == ref["transformer_layer_config"]["head_dim"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_head_of_the_targets_moe_layer_is_refused_by_llama_layouts(arch, tmp_path):
    with pytest.raises(ExportError, match=f"Llama decoder layer; this head has model_type '{arch}'"):
        export_heads(head_of(arch), "sglang", tmp_path / "x", target_name_or_path="tiny")


SCRIPT = r"""
import sys, torch
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig
d, io = sys.argv[1], torch.load(sys.argv[2])
cfg = Eagle3SpeculatorConfig.from_pretrained(d)
cfg.transformer_layer_config._attn_implementation = "eager"  # CPU: speculators' default is flex attention
model = Eagle3DraftModel.from_pretrained(d, config=cfg).eval()
model.load_verifier_weights()
got = []
model.lm_head.register_forward_hook(lambda mod, i, o: got.append(o))
with torch.no_grad():
    model(io["features"], io["ids"], torch.zeros_like(io["ids"]), position_ids=io["pos"], ttt_steps=1)
torch.save(got, sys.argv[3])
"""


@pytest.mark.slow  # the speculators venv
def test_speculators_computes_a_deepseek_head(spec_python, tmp_path):
    """speculators' own ``Eagle3DraftModel`` loads the DeepSeek-V3 head's export (a Llama layer, the embeddings read
    from the saved DeepSeek target) and gives its draft logits (fp32, 1e-5)."""
    head = head_of("deepseek_v3")
    head_target = tiny_target("deepseek_v3")
    head_target.save_pretrained(tmp_path / "target")
    out = export_heads(head, "speculators", tmp_path / "spec", target_name_or_path=str(tmp_path / "target"))
    features, ids, pos = inputs(3 * D)
    (theirs,) = run_engine_script(spec_python, SCRIPT, out, {"features": features, "ids": ids, "pos": pos}, tmp_path)
    assert float((theirs - draft_logits(head, 3 * D)).abs().max()) < 1e-5
