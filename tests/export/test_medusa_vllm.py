"""Medusa heads in vLLM's ``MedusaModel`` layout (``--format sglang`` for Medusa): the written contract, the round
trip, and bad input. No vLLM runs here; the contract is read from vLLM's code:

* ``vllm/model_executor/models/medusa.py``: ``ResidualBlock`` (``blocks.{h}.layers.{l}`` = ``nn.Linear(D, D,
  bias=config.medusa_fc_bias)``, ``x = x + SiLU(layer(x))``); ``Medusa.__init__`` (``lm_heads.{h}`` of
  ``truncated_vocab_size`` rows, or one ``lm_head`` with ``original_lm_head``); ``compute_logits`` (with a
  ``token_map``: logits over ``vocab_size`` filled with ``-inf``, ``logits[..., token_map] = lm_head(h)``);
  ``load_weights`` (``token_map`` read when ``truncated_vocab_size < vocab_size``, a larger lm_head cut to its rows,
  ``medusa_heads.`` stripped, other unknown names skipped; ``assert truncated == vocab or token_map``).
* ``vllm/transformers_utils/configs/medusa.py``: ``MedusaConfig`` (``model_type`` ``medusa``, ``hidden_size``,
  ``vocab_size``, ``num_heads``, ``num_hidden_layers``, ``max_paths``, ``topk``, ``truncated_vocab_size``,
  ``architectures`` default ``["MedusaModel"]``; ``from_pretrained`` renames keys holding ``num`` + ``heads`` /
  ``num`` + ``layers``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from selfspec.export import ExportError
from selfspec.export.cli import export_heads
from selfspec.export.importer import read_foreign_head
from selfspec.export.medusa_vllm import export_vllm_medusa
from selfspec.heads import HeadFormatError, MedusaHeads
from tests.helpers.heads import inputs, make_eagle, make_medusa, medusa_logits

D, V, S, K, L = 32, 96, 40, 3, 2


def contract(own: bool, reduced: bool) -> dict[str, tuple[int, ...]]:
    rows = S if reduced else V
    c = {f"blocks.{h}.layers.{i}.{p}": (D, D) if p == "weight" else (D,) for h in range(K) for i in range(L)
         for p in ("weight", "bias")}  # fmt: skip
    if own:
        c.update({f"lm_heads.{h}.weight": (rows, D) for h in range(K)})
    else:
        c["lm_head.weight"] = (rows, D)
    if reduced:
        c["token_map"] = (S,)
    return c


def shapes(d) -> dict[str, tuple[int, ...]]:
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def vllm_logits(d) -> torch.Tensor:
    """vLLM's ``Medusa.forward`` + ``compute_logits`` on the written file, as its code reads: ``[K, 1, T, V]``."""
    cfg = json.loads((d / "config.json").read_text())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        w = {k: f.get_tensor(k) for k in f.keys()}
    h = inputs(D)[0]
    out = []
    for k in range(cfg["num_heads"]):
        x = h
        for i in range(cfg["num_hidden_layers"]):
            x = x + torch.nn.functional.silu(
                torch.nn.functional.linear(x, w[f"blocks.{k}.layers.{i}.weight"], w[f"blocks.{k}.layers.{i}.bias"])
            )
        lm = w["lm_head.weight"] if cfg["original_lm_head"] else w[f"lm_heads.{k}.weight"]
        logits = torch.nn.functional.linear(x, lm)
        if cfg["truncated_vocab_size"] < cfg["vocab_size"]:
            full = torch.full((*logits.shape[:-1], cfg["vocab_size"]), -torch.inf)
            full[..., w["token_map"]] = logits
            logits = full
        out.append(logits)
    return torch.stack(out)


def as_full(heads: MedusaHeads, logits: torch.Tensor) -> torch.Tensor:
    full = torch.full((*logits.shape[:-1], V), -torch.inf)
    full[..., heads.draft_ids] = logits
    return full


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("reduced", [True, False])
def test_layout_matches_vllm_and_round_trips(target, tmp_path, own, reduced):
    heads = make_medusa(target, own_lm_head=own, draft=S if reduced else None)
    out = export_heads(heads, "sglang", tmp_path / "medusa", target_name_or_path="tiny-dir")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert shapes(out) == contract(own, reduced)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MedusaModel"] and cfg["model_type"] == "medusa"
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["num_heads"], cfg["num_hidden_layers"]) == (D, V, K, L)
    assert cfg["truncated_vocab_size"] == (S if reduced else V)
    assert cfg["medusa_fc_bias"] is True and cfg["original_lm_head"] is (not own)
    assert cfg["target_model"] == "tiny-dir"
    # MedusaConfig.from_pretrained renames every key holding "num" and "heads" / "layers": only the two it means
    assert [k for k in cfg if "num" in k] == ["num_heads", "num_hidden_layers"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        if reduced:
            assert f.get_tensor("token_map").dtype == torch.int64
            assert torch.equal(f.get_tensor("token_map"), heads.draft_ids)
    ours = medusa_logits(heads)
    # what vLLM computes from the file; within float rounding (matmul kernels differ by CPU: AVX2 here, AVX-512 in CI)
    torch.testing.assert_close(vllm_logits(out), as_full(heads, ours), rtol=1e-5, atol=1e-5)
    back = read_foreign_head(out, "sglang", target)
    assert isinstance(back, MedusaHeads) and back.config.own_lm_head is own
    assert torch.equal(back.draft_ids, heads.draft_ids)
    assert back.config.head_topk_accuracy == heads.config.head_topk_accuracy
    assert (medusa_logits(back) - ours).abs().max().item() == 0.0


def test_foreign_vllm_checkpoints_read_as_vllm_reads_them(target, tmp_path):
    """No bias (``medusa_fc_bias`` unset: vLLM's default), ``medusa_num_heads`` (renamed), full-vocabulary lm_heads
    cut by the token map."""
    heads = make_medusa(target, draft=S)
    with torch.no_grad():
        for blocks in heads.blocks:
            for layer in blocks.layers:
                layer.bias.zero_()
    full = torch.randn(V, D)
    state = {f"blocks.{h}.layers.{i}.weight": heads.blocks[h].layers[i].weight.detach() for h in range(K)
             for i in range(L)}  # fmt: skip
    state.update({f"lm_heads.{h}.weight": full.clone() for h in range(K)})
    state["token_map"] = heads.draft_ids
    d = tmp_path / "foreign"
    d.mkdir()
    save_file(state, str(d / "model.safetensors"))
    cfg = {"model_type": "medusa", "hidden_size": D, "vocab_size": V, "medusa_num_heads": K, "medusa_num_layers": L}
    (d / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": S}))
    back = read_foreign_head(d, "sglang", target)
    with torch.no_grad():
        for lm in heads.lm_heads:
            lm.weight.copy_(full[heads.draft_ids])
    assert (medusa_logits(back) - medusa_logits(heads)).abs().max().item() == 0.0
    # a trainer prefix is refused with the fix, though vLLM would strip this one
    save_file({f"medusa_heads.{k}": v for k, v in state.items()}, str(d / "model.safetensors"))
    with pytest.raises(HeadFormatError, match="trainer prefix 'medusa_heads.'.*strip it"):
        read_foreign_head(d, "sglang", target)
    # a reduced vocabulary without its token map: vLLM asserts; we say what is missing
    save_file({k: v for k, v in state.items() if k != "token_map"}, str(d / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=r"missing=\['token_map'\]"):
        read_foreign_head(d, "sglang", target)


def test_bad_medusa_exports(target, tmp_path):
    with pytest.raises(ExportError, match="MedusaModel layout holds Medusa heads, not eagle"):
        export_vllm_medusa(make_eagle(target), tmp_path / "x", target_name_or_path="t")
    detached = make_medusa(target, own_lm_head=False)
    detached._shared = None  # as loaded without its target
    with pytest.raises(ExportError, match=r"load them with load_heads\(DIR, target\)"):
        export_heads(detached, "sglang", tmp_path / "x", target_name_or_path="t")
    with pytest.raises(ExportError, match="wrapping a selfspec head.*head._orig_mod"):
        export_heads(torch.compile(make_medusa(target)), "sglang", tmp_path / "x", target_name_or_path="t")
    assert not (tmp_path / "x").exists()


def test_a_tensor_the_layout_does_not_name_is_an_error_at_export(target, tmp_path):
    for head, fmt in ((make_medusa(target), r"sglang \(vLLM MedusaModel\)"), (make_eagle(target), "sglang")):
        state = head.state_dict()
        head.state_dict = lambda state=state: {**state, "extra_norm.weight": torch.ones(D)}
        with pytest.raises(ExportError, match=rf"tensors \['extra_norm.weight'\]: the {fmt} layout has no name"):
            export_heads(head, "sglang", tmp_path / "x", target_name_or_path="t")
    assert not (tmp_path / "x").exists()
