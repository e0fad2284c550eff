"""``selfspec export`` / ``selfspec import`` end to end on a tiny target directory (weights only, no tokenizer: the
commands never tokenize), and ``import_heads`` writing its directory strictly: every bad file is an error that names
the fix, and nothing is written then."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import selfspec.family_records as family_records
from selfspec.cli import main
from selfspec.export.cli import export_heads
from selfspec.export.importer import import_heads
from selfspec.heads import Eagle3Head, EagleHead, HeadFormatError, MedusaHeads, load_heads
from selfspec.heads.dflash import BlockHead
from tests.helpers.archs import tiny_target
from tests.helpers.heads import (
    block_head,
    block_logits,
    draft_logits,
    make_eagle,
    make_eagle3,
    make_medusa,
    medusa_logits,
)


@pytest.fixture(scope="module")
def target_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("target") / "tiny-llama"
    target.save_pretrained(d)
    return d


def logits(head) -> torch.Tensor:
    if isinstance(head, MedusaHeads):
        return medusa_logits(head)
    if isinstance(head, BlockHead):
        return torch.cat([x.reshape(-1) for x in block_logits(head) if x is not None])
    return draft_logits(head, 32 if isinstance(head, EagleHead) else 96)  # EAGLE-1 takes D, EAGLE-3 3D features


CASES = {
    "eagle3-speculators": (lambda t: make_eagle3(t), "speculators"),
    "eagle3-sglang": (lambda t: make_eagle3(t), "sglang"),
    "eagle-reduced-sglang": (lambda t: make_eagle(t, draft=40), "sglang"),
    "medusa-shared-sglang": (lambda t: make_medusa(t, own_lm_head=False, draft=40), "sglang"),
    "dspark-reduced-speculators": (
        lambda t: block_head(t, "dspark", 4, draft=40, target_layer_ids=(0, 1)),
        "speculators",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_export_then_import_commands(case, target, target_dir, tmp_path, capsys):
    make, fmt = CASES[case]
    head = make(target)
    head.save_pretrained(tmp_path / "heads")
    argv = [str(tmp_path / "heads"), "--format", fmt, "--out", str(tmp_path / "out"), "--target", str(target_dir)]
    assert main(["export", *argv]) == 0
    assert f"as {fmt} to {tmp_path / 'out'}" in capsys.readouterr().out
    argv = [str(tmp_path / "out"), "--format", fmt, "--out", str(tmp_path / "back"), "--target", str(target_dir)]
    assert main(["import", *argv]) == 0
    back = load_heads(tmp_path / "back", target)  # a selfspec head directory again, read by the strict loader
    assert type(back) is type(head)
    # EAGLE trees are sized from an acceptance profile the import cannot bring: it says how to make one
    hint = f"selfspec tune-tree --heads {tmp_path / 'back'} --target {target_dir}"
    assert (hint in capsys.readouterr().out) == case.startswith(("eagle3", "eagle-"))
    assert (logits(back) - logits(head)).abs().max().item() == 0.0


def test_command_errors_name_the_fix(target, target_dir, tmp_path, capsys):
    make_eagle(target).save_pretrained(tmp_path / "heads")
    common = ["--out", str(tmp_path / "out"), "--target", str(target_dir)]
    assert main(["export", str(tmp_path / "heads"), "--format", "onnx", *common]) == 2
    assert (
        "unknown export format 'onnx'; choose one of ['speculators', 'sglang', 'gguf', 'openvino']"
        in capsys.readouterr().err
    )
    assert main(["export", str(tmp_path / "heads"), "--format", "speculators", *common]) == 2
    assert "holds EAGLE-3, DFlash and DSpark heads, not eagle; export with --format sglang" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "heads"), "--format", "gguf", *common]) == 2  # refused before llama.cpp
    assert "the gguf format holds EAGLE-3, DFlash and DSpark heads" in capsys.readouterr().err
    other = tmp_path / "other-target"
    tiny_target("llama", seed=7).save_pretrained(other)
    argv = [str(tmp_path / "heads"), "--format", "sglang", "--out", str(tmp_path / "out"), "--target", str(other)]
    assert main(["export", *argv]) == 2
    assert "fingerprint" in capsys.readouterr().err
    argv = [str(tmp_path / "heads"), "--format", "sglang", "--out", str(tmp_path / "out"), "--target", "./nowhere"]
    assert main(["export", *argv]) == 2
    assert "cannot load the target './nowhere'" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "heads"), "--format", "gguf", *common]) == 2
    assert "unknown import format 'gguf'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_gguf_dispatches_to_llamacpp_export(target, target_dir, tmp_path, monkeypatch):
    seen = {}

    def fake_export_gguf(head, out_dir, *, target_dir):
        seen.update(head=head, out_dir=out_dir, target_dir=target_dir)
        return tmp_path / "out" / "x.gguf"

    monkeypatch.setattr(family_records, "export_gguf", fake_export_gguf)  # the gguf exporter of the EAGLE-3 family
    head = make_eagle3(target)
    written = export_heads(head, "gguf", tmp_path / "out", target_name_or_path=str(target_dir))
    assert written == tmp_path / "out" / "x.gguf"
    assert seen == {"head": head, "out_dir": tmp_path / "out", "target_dir": str(target_dir)}


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("missing", lambda s, d: s.pop("norm.weight"), r"missing=\['norm.weight'\]"),
        ("unexpected", lambda s, d: s.__setitem__("extra.weight", torch.ones(3)), r"unexpected tensors \['extra"),
        ("misshaped", lambda s, d: s.__setitem__("norm.weight", torch.ones(31)), r"norm.weight: file \(31,\)"),
        ("prefixed", lambda s, d: s.__setitem__("module.fc.weight", s.pop("fc.weight")), "trainer prefix 'module.'"),
    ],
)
def test_import_heads_is_strict_and_writes_nothing(target, tmp_path, name, edit, message):
    src = export_heads(make_eagle3(target), "sglang", tmp_path / "sg", target_name_or_path="t")
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_bytes((src / "config.json").read_bytes())
    state = load_file(str(src / "model.safetensors"))
    edit(state, d)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(HeadFormatError, match=message):
        import_heads(d, "sglang", tmp_path / "heads", target)
    assert not (tmp_path / "heads").exists()


def test_import_heads_refuses_a_truncated_file_and_keeps_the_old_output(target, tmp_path):
    head = make_eagle3(target)
    src = export_heads(head, "sglang", tmp_path / "sg", target_name_or_path="t")
    out = import_heads(src, "sglang", tmp_path / "heads", target)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["config.json", "model.safetensors"]
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HeadFormatError, match="truncated or corrupt"):
        import_heads(src, "sglang", out, target)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the previous import is untouched
    assert (draft_logits(load_heads(out, target), 96) - draft_logits(head, 96)).abs().max().item() == 0.0


@pytest.mark.slow
def test_commands_on_the_smollm2_alias(smollm2, tmp_path):
    """The real target by its alias (D 576, V 49152): Medusa heads with a reduced vocabulary and an EAGLE-3 head go
    out through ``selfspec export`` and back through ``selfspec import`` with identical draft logits."""
    from selfspec.base.fingerprint import target_fingerprint
    from selfspec.heads.eagle3 import Eagle3Config
    from selfspec.heads.medusa import MedusaConfig

    model, _ = smollm2
    D, V, L = model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers
    fp, ids = target_fingerprint(model), torch.arange(0, V, 7)
    g = torch.Generator().manual_seed(0)
    medusa = MedusaHeads(
        MedusaConfig(
            D, V, num_heads=2, draft_vocab_size=ids.numel(), target="smollm2-135m-instruct", target_fingerprint=fp
        ),
        target_lm_head=model.get_output_embeddings().weight,
        draft_ids=ids,
    )
    eagle3 = Eagle3Head(
        Eagle3Config(D, V, ids.numel(), L, target_fingerprint=fp), model.config, draft_ids=ids, target=model
    )
    feats = torch.randn(1, 5, D, generator=g)
    for head in (medusa, eagle3):
        with torch.no_grad():
            for p in head.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        name = type(head).__name__
        head.save_pretrained(tmp_path / name)
        argv = ["--format", "sglang", "--target", "smollm2-135m-instruct"]
        assert main(["export", str(tmp_path / name), *argv, "--out", str(tmp_path / f"{name}-sg")]) == 0
        assert main(["import", str(tmp_path / f"{name}-sg"), *argv, "--out", str(tmp_path / f"{name}-back")]) == 0
        back = load_heads(tmp_path / f"{name}-back", model)
        with torch.no_grad():
            if isinstance(head, MedusaHeads):
                ours, theirs = head(feats), back(feats)
            else:
                x, tok, pos = (
                    torch.randn(1, 5, 3 * D, generator=g),
                    torch.randint(0, V, (1, 5), generator=g),
                    torch.arange(5)[None],
                )
                ours, theirs = head.draft_logits(head(x, tok, pos)), back.draft_logits(back(x, tok, pos))
        assert (theirs - ours).abs().max().item() == 0.0, name
