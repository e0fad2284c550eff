"""selfspec -> format -> selfspec gives the same draft logits, for every family each format holds, and the layouts
match the contracts read from the engines' code (no engine runs here):

* SGLang EAGLE-3: sglang ``python/sglang/srt/models/llama_eagle3.py`` (``LlamaForCausalLMEagle3``: ``fc``,
  ``midlayer.*``, ``norm``, ``lm_head [draft_vocab_size, D]``, ``d2t`` -> ``hot_token_id``, ``t2d``; lm_head =
  embed_tokens when ``tie_word_embeddings``) and SpecForge ``configs/llama3-8B-eagle3.json`` / ``to_sglang.py``.
* SGLang EAGLE-1: sglang ``python/sglang/srt/models/llama_eagle.py`` (``fc`` with bias, ``layers.0.*`` without
  ``input_layernorm``).
* speculators: ``speculators/models/eagle3/core.py`` + ``model_definitions.py`` (0.9.0), vLLM
  ``vllm/transformers_utils/configs/speculators/base.py`` (``validate_speculators_config``); EAGLE-3.1's flags from
  ``speculators/models/eagle3/config.py`` (``Eagle3SpeculatorConfig``) and ``Eagle3DraftModel.fc_norm``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from selfspec.export import ExportError
from selfspec.export.cli import export_heads
from selfspec.export.importer import import_heads, read_foreign_head
from selfspec.heads import HeadFormatError
from selfspec.heads.eagle import EagleConfig, EagleHead
from tests.helpers.archs import tiny_target
from tests.helpers.heads import draft_logits, inputs, make_eagle, make_eagle3, make_medusa

D, V, S, F, KV = 32, 96, 40, 64, 16  # hidden, vocab, draft vocab, intermediate, kv heads * head_dim
LAYER = {
    "self_attn.q_proj.weight": (D, 2 * D),
    "self_attn.k_proj.weight": (KV, 2 * D),
    "self_attn.v_proj.weight": (KV, 2 * D),
    "self_attn.o_proj.weight": (D, D),
    "post_attention_layernorm.weight": (D,),
    "mlp.gate_proj.weight": (F, D),
    "mlp.up_proj.weight": (F, D),
    "mlp.down_proj.weight": (D, F),
    "input_layernorm.weight": (D,),
    "hidden_norm.weight": (D,),
}


def eagle3_contract(prefix: str) -> dict[str, tuple[int, ...]]:
    c = {f"{prefix}{k}": v for k, v in LAYER.items()}
    c.update({"fc.weight": (D, 3 * D), "norm.weight": (D,), "lm_head.weight": (S, D), "d2t": (S,), "t2d": (V,)})
    return c


def shapes(d) -> dict[str, tuple[int, ...]]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_sglang_eagle3_layout_and_roundtrip(target, tmp_path):
    head = make_eagle3(target)
    out = export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="tiny")
    assert shapes(out) == eagle3_contract("midlayer.")  # no embed_tokens: SGLang uses the target's
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["draft_vocab_size"], cfg["vocab_size"]) == (1, S, V)
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 10000.0
    assert "eagle_config" not in cfg  # layers (0, 1, 2) of a 3-layer target are SGLang's default {2, 1, 0}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("d2t") + torch.arange(S), head.draft_ids)  # SGLang's hot_token_id
    back = read_foreign_head(out, "sglang", target)
    assert torch.equal(back.draft_ids, head.draft_ids)
    diff = (draft_logits(back, 3 * D) - draft_logits(head, 3 * D)).abs().max().item()
    assert diff == 0.0


def test_sglang_eagle1_layout_and_roundtrip(target, tmp_path):
    head = make_eagle(target)
    out = export_heads(head, "sglang", tmp_path / "sg1", target_name_or_path="tiny")
    qkv = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}
    want = {f"layers.0.{k}": (v[0], D) if k in qkv else v for k, v in LAYER.items()}
    del want["layers.0.input_layernorm.weight"], want["layers.0.hidden_norm.weight"]
    want.update({"fc.weight": (D, 2 * D), "fc.bias": (D,)})
    assert shapes(out) == want
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle"]
    back = read_foreign_head(out, "sglang", target)
    assert (draft_logits(back, D) - draft_logits(head, D)).abs().max().item() == 0.0


def test_speculators_layout_and_roundtrip(target, tmp_path):
    head = make_eagle3(target)
    out = export_heads(head, "speculators", tmp_path / "sp", target_name_or_path="tiny-dir")
    assert shapes(out) == {**eagle3_contract("layers.0."), "embed_tokens.weight": (V, D)}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3DraftModel"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == "tiny-dir"
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    assert cfg["transformer_layer_config"]["vocab_size"] == V and cfg["draft_vocab_size"] == S
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and cfg["norm_before_residual"] is False
    back = read_foreign_head(out, "speculators", target)
    assert (draft_logits(back, 3 * D) - draft_logits(head, 3 * D)).abs().max().item() == 0.0


def test_speculators_bf16_checkpoint_imports(target, tmp_path):
    """speculators' trainer saves bf16 checkpoints: the target's embedding rounded to bf16 is the target's; another
    embedding is still refused."""
    from safetensors.torch import load_file, save_file

    out = export_heads(make_eagle3(target), "speculators", tmp_path / "sp", target_name_or_path="tiny-dir")
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(out / "model.safetensors").items()
    }
    save_file(state, out / "model.safetensors")
    assert read_foreign_head(out, "speculators", target) is not None
    state["embed_tokens.weight"] = state["embed_tokens.weight"] + 1
    save_file(state, out / "model.safetensors")
    with pytest.raises(HeadFormatError, match="embed_tokens.weight is not the target's"):
        read_foreign_head(out, "speculators", target)


def test_full_vocabulary_eagle3_roundtrip(target, tmp_path):
    head = make_eagle3(target, draft=V)
    out = export_heads(head, "speculators", tmp_path / "sp", target_name_or_path="t")
    assert "d2t" not in shapes(out)  # speculators registers None buffers for a full vocabulary
    back = read_foreign_head(out, "speculators", target)
    assert (draft_logits(back, 3 * D) - draft_logits(head, 3 * D)).abs().max().item() == 0.0


def test_bad_input(target, tmp_path):
    head = make_eagle3(target)
    with pytest.raises(HeadFormatError, match="unknown export format 'onnx'"):
        export_heads(head, "onnx", tmp_path / "x", target_name_or_path="t")
    with pytest.raises(ExportError, match="holds EAGLE-3, DFlash and DSpark heads, not eagle"):
        export_heads(make_eagle(target), "speculators", tmp_path / "x", target_name_or_path="t")
    qwen = tiny_target("qwen3")
    from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head

    q = Eagle3Head(Eagle3Config(32, 96, 40, 3), qwen.config, target=qwen)
    with pytest.raises(ExportError, match="Llama decoder layer.*model_type 'qwen3'"):
        export_heads(q, "sglang", tmp_path / "x", target_name_or_path="t")
    assert not (tmp_path / "x").exists()
    out = export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="t")
    other = tiny_target("llama", seed=7)
    with pytest.raises(HeadFormatError, match="fingerprint"):
        read_foreign_head(out, "sglang", other)
    with pytest.raises(HeadFormatError, match="unknown import format"):
        read_foreign_head(out, "gguf", target)
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(HeadFormatError, match="truncated or corrupt"):
        read_foreign_head(out, "sglang", target)


def test_sglang_eagle1_reduced_vocabulary_writes_the_token_map(target, tmp_path):
    """SGLang's FR-Spec path (``load_token_map`` in ``python/sglang/srt/speculative/spec_utils.py``;
    ``EAGLEWorker.__init__``: ``head.data[hot_token_id]`` of the target's lm_head) on the written files."""
    head = make_eagle(target, draft=S)
    out = export_heads(head, "sglang", tmp_path / "sg1", target_name_or_path="tiny")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "speculative_token_map.pt"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["selfspec_speculative_token_map"] == "speculative_token_map.pt"
    assert cfg["tie_word_embeddings"] is False  # SGLang's set_embed_and_head cannot hold a tied lm_head
    hot = torch.tensor(torch.load(out / "speculative_token_map.pt", weights_only=True), dtype=torch.int64)
    assert torch.equal(hot, head.draft_ids)
    feats, ids, pos = inputs(D)
    with torch.no_grad():
        predicted = head(feats, ids, pos)
        sglang = predicted @ target.get_output_embeddings().weight[hot].T
        assert torch.equal(sglang, head.draft_logits(predicted))
    back = read_foreign_head(out, "sglang", target)
    assert torch.equal(back.draft_ids, head.draft_ids) and back.config.draft_vocab_size == S
    assert (draft_logits(back, D) - draft_logits(head, D)).abs().max().item() == 0.0
    # a full-vocabulary head exported over it: the directory is replaced whole, no stale token map is left
    export_heads(make_eagle(target), "sglang", out, target_name_or_path="tiny")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    # a config naming a token map that is not there
    export_heads(head, "sglang", out, target_name_or_path="tiny")
    (out / "speculative_token_map.pt").unlink()
    with pytest.raises(HeadFormatError, match="names the token map speculative_token_map.pt, which is missing"):
        read_foreign_head(out, "sglang", target)


def test_trainer_prefix_and_foreign_directory_refused_at_export(target, tmp_path):
    head = make_eagle3(target)
    state = head.state_dict()
    head.state_dict = lambda: {f"module.{k}": v for k, v in state.items()}  # as a DDP wrapper names them
    for fmt in ("sglang", "speculators"):
        with pytest.raises(ExportError, match="trainer prefix 'module.'.*strip it"):
            export_heads(head, fmt, tmp_path / "x", target_name_or_path="t")
    with pytest.raises(ExportError, match="wrapping a selfspec head.*head._orig_mod"):
        export_heads(torch.compile(make_eagle3(target)), "sglang", tmp_path / "x", target_name_or_path="t")
    assert not (tmp_path / "x").exists()
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"holds files an export does not write \(\['notes.txt'\]\)"):
        export_heads(make_eagle3(target), "sglang", home, target_name_or_path="t")
    assert sorted(p.name for p in home.iterdir()) == ["notes.txt"]
    # an import's --out must not be the source it reads
    out = export_heads(make_eagle3(target), "sglang", tmp_path / "sg", target_name_or_path="t")
    with pytest.raises(HeadFormatError, match="is the source directory"):
        import_heads(out, "sglang", out, target)


def test_refusals_name_a_format_that_takes_the_head(target, tmp_path):
    """A refusal points at a format that exports the head, never at another refusal."""
    cases = [(make_eagle(target), "--format sglang"), (make_medusa(target), "--format sglang")]
    no_bias = EagleHead(EagleConfig(32, V, fc_bias=False), target.config, target=target)
    cases.append((no_bias, "selfspec's own format"))
    for head, fix in cases:
        with pytest.raises(ExportError, match=f"export with {fix}") as refused:
            export_heads(head, "speculators", tmp_path / "x", target_name_or_path="t")
        if fix.startswith("--format"):
            export_heads(head, fix.split()[-1], tmp_path / "ok", target_name_or_path="t")  # the named format takes it
        else:
            with pytest.raises(ExportError, match="fc.bias"):
                export_heads(head, "sglang", tmp_path / "x", target_name_or_path="t")
            assert "fc_bias=True" in str(refused.value)  # the fix a head without fc.bias has: retrain with one


# ------------------------------------------------------------------------------------------------ EAGLE-3.1
def two_steps(head) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits of a first step (3D fused features) and of the step after it (the head's own D-wide outputs):
    the second exercises ``norm_output``."""
    feats, ids, pos = inputs(3 * D)
    with torch.no_grad():
        out = head(feats, ids, pos)
        return head.draft_logits(out), head.draft_logits(head(out, ids, pos))


def test_speculators_eagle31_layout_and_roundtrip(target, tmp_path):
    """An EAGLE-3.1 head writes speculators' flags and ``fc_norm.{0,1,2}.weight`` (``Eagle3DraftModel.fc_norm``,
    ``speculators/models/eagle3/core.py``) and reads back to the same head, both draft steps exact."""
    head = make_eagle3(target, fc_norm=True, norm_output=True)
    out = export_heads(head, "speculators", tmp_path / "sp", target_name_or_path="tiny-dir")
    fc_norm = {f"fc_norm.{i}.weight": (D,) for i in range(3)}
    assert shapes(out) == {**eagle3_contract("layers.0."), "embed_tokens.weight": (V, D), **fc_norm}
    cfg = json.loads((out / "config.json").read_text())
    flags = {k: cfg[k] for k in ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")}
    assert flags == {"fc_norm": True, "norm_output": True, "norm_before_fc": False, "norm_before_residual": False}
    back = read_foreign_head(out, "speculators", target)
    assert back.config.eagle31_flags == ("fc_norm", "norm_output")
    for a, b in zip(two_steps(back), two_steps(head), strict=True):
        assert (a - b).abs().max().item() == 0.0
    only = export_heads(make_eagle3(target, norm_output=True), "speculators", tmp_path / "no", target_name_or_path="t")
    assert not any(k.startswith("fc_norm.") for k in shapes(only))
    assert read_foreign_head(only, "speculators", target).config.eagle31_flags == ("norm_output",)


def _config_edit(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"norm_before_fc": True}, r"\['norm_before_fc'\] set; selfspec's EAGLE-3 head computes"),
        ({"norm_before_residual": True}, r"\['norm_before_residual'\] set"),
        ({"fc_norm": "true"}, r"\['fc_norm'\] must be true or false"),
        ({"norm_output": 1}, r"\['norm_output'\] must be true or false"),
        ({"fc_norm": False}, r"unexpected tensors \['fc_norm.0.weight'"),  # flag off, its tensors there
    ],
)
def test_speculators_import_refuses_what_the_head_cannot_compute(target, tmp_path, fields, match):
    out = export_heads(make_eagle3(target, fc_norm=True), "speculators", tmp_path / "sp", target_name_or_path="t")
    _config_edit(out, **fields)
    with pytest.raises(HeadFormatError, match=match):
        read_foreign_head(out, "speculators", target)


def test_sglang_refuses_eagle31_both_ways(target, tmp_path):
    """SGLang's ``llama_eagle3.py`` computes neither option: an EAGLE-3.1 head is not exported to its layout (nothing
    written), and an SGLang-layout config that sets one is not imported."""
    for flags in ({"fc_norm": True}, {"norm_output": True}):
        with pytest.raises(ExportError, match=f"EAGLE-3.1 head \\({next(iter(flags))}=true\\).*--format speculators"):
            export_heads(make_eagle3(target, **flags), "sglang", tmp_path / "x", target_name_or_path="t")
    assert not (tmp_path / "x").exists()
    out = export_heads(make_eagle3(target), "sglang", tmp_path / "sg", target_name_or_path="t")
    _config_edit(out, norm_output=False)  # written false: still the EAGLE-3 head
    assert read_foreign_head(out, "sglang", target).config.eagle31_flags == ()
    _config_edit(out, norm_output=True)
    with pytest.raises(HeadFormatError, match=r"\['norm_output'\] set; SGLang's LlamaForCausalLMEagle3 computes none"):
        read_foreign_head(out, "sglang", target)
