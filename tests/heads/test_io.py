"""heads/io.py: the head directory layout of earlier releases still loads, writes are atomic, and every
refusal names its cause and the fix."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.base import files
from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads import io, load_heads
from selfspec.heads.eagle import DRAFT_VOCAB_NAME, EagleConfig, EagleHead
from selfspec.heads.io import CONFIG_NAME, WEIGHTS_NAME, HeadFormatError
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from tests.helpers.archs import tiny_llama

D, V = 32, 96


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def medusa(target, draft: int | None = 24, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    ids = torch.sort(torch.randperm(V)[:draft]).values if draft else None
    cfg = MedusaConfig(
        hidden_size=D,
        vocab_size=V,
        num_heads=3,
        draft_vocab_size=draft,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
    )
    heads = MedusaHeads(cfg, target_lm_head=target.lm_head.weight, draft_ids=ids)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads


def eagle(target, draft: int | None = 24, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    ids = torch.sort(torch.randperm(V)[:draft]).values if draft else None
    cfg = EagleConfig(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=draft,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
    )
    head = EagleHead(cfg, target.config, draft_ids=ids, target=target).eval()
    with torch.no_grad():
        head.layers[0].post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return head


# The writers of release 0.1.0, line for line (before heads/io.py): heads saved by them must keep loading.
def save_medusa_0_1(heads: MedusaHeads, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in heads.state_dict().items()}
    save_file(state, str(out / (WEIGHTS_NAME + ".tmp")), metadata={"format": "pt", "head_type": "medusa"})
    (out / (WEIGHTS_NAME + ".tmp")).replace(out / WEIGHTS_NAME)
    cfg = dataclasses.asdict(heads.config)
    cfg.update({"model_type": "medusa", "num_hidden_layers": heads.config.num_layers})
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))


def save_eagle_0_1(head: EagleHead, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt", "head_type": "eagle"})
    if head.config.draft_vocab_size is not None:
        save_file(
            {"draft_ids": head.draft_ids.cpu().contiguous()}, str(out / DRAFT_VOCAB_NAME), metadata={"format": "pt"}
        )
    arch = head.arch_config.to_dict()
    arch.update({"num_hidden_layers": 1, "head_type": "eagle", "selfspec": dataclasses.asdict(head.config)})
    arch.pop("_attn_implementation_autoset", None)
    (out / CONFIG_NAME).write_text(json.dumps(arch, indent=2, default=str))


def layout(d: Path) -> dict[str, object]:
    """File names, config and tensor names / shapes / dtypes of a head directory (not the metadata)."""
    out: dict[str, object] = {"files": sorted(p.name for p in d.iterdir())}
    out["config"] = json.loads((d / CONFIG_NAME).read_text())
    for p in sorted(d.glob("*.safetensors")):
        out[p.name] = {k: (tuple(t.shape), t.dtype) for k, t in load_file(str(p)).items()}
    return out


def eagle_logits(head: EagleHead) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    feats, ids = torch.randn(1, 6, D, generator=g), torch.randint(0, V, (1, 6), generator=g)
    with torch.no_grad():
        return head.draft_logits(head(feats, ids, torch.arange(6).unsqueeze(0)))


@pytest.mark.parametrize("draft", [None, 24])
def test_medusa_heads_saved_by_release_0_1_load_and_layout_is_unchanged(target, tmp_path, draft):
    heads = medusa(target, draft)
    save_medusa_0_1(heads, tmp_path / "old")
    loaded = load_heads(tmp_path / "old", target=target)
    h = torch.randn(5, D)
    assert isinstance(loaded, MedusaHeads) and torch.equal(loaded(h), heads(h))
    assert torch.equal(loaded.draft_ids, heads.draft_ids)
    heads.save_pretrained(tmp_path / "new")
    assert layout(tmp_path / "new") == layout(tmp_path / "old")


@pytest.mark.parametrize("draft", [None, 24])
def test_eagle_head_saved_by_release_0_1_loads_and_layout_is_unchanged(target, tmp_path, draft):
    head = eagle(target, draft)
    save_eagle_0_1(head, tmp_path / "old")
    loaded = load_heads(tmp_path / "old", target=target)
    assert isinstance(loaded, EagleHead) and torch.equal(eagle_logits(loaded.eval()), eagle_logits(head))
    head.save_pretrained(tmp_path / "new")
    assert layout(tmp_path / "new") == layout(tmp_path / "old")


# ------------------------------------------------------------------------------------------ atomic write
@pytest.mark.parametrize("exchange", ["renameat2", "two renames"])
def test_rewrite_keeps_side_files_and_drops_stale_head_files(target, tmp_path, monkeypatch, exchange):
    if exchange == "two renames":  # systems without an atomic exchange of two directories
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    d = tmp_path / "heads"
    eagle(target, draft=24).save_pretrained(d)
    (d / "acceptance_profile.json").write_text('{"x": 1}')
    (d / "training_record.json").write_text('{"y": 2}')
    full = eagle(target, draft=None, seed=3)
    full.save_pretrained(d)
    assert sorted(p.name for p in d.iterdir()) == [
        "acceptance_profile.json",
        CONFIG_NAME,
        WEIGHTS_NAME,
        "training_record.json",
    ]  # no stale draft vocab
    assert json.loads((d / "acceptance_profile.json").read_text()) == {"x": 1}
    assert torch.equal(eagle_logits(load_heads(d, target=target).eval()), eagle_logits(full))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # no temporary sibling left


def test_failed_write_leaves_the_old_directory_untouched(target, tmp_path, monkeypatch):
    d = tmp_path / "heads"
    old = medusa(target)
    old.save_pretrained(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io, "safetensors_bytes", disk_full)
    with pytest.raises(OSError, match="No space"):
        medusa(target, seed=1).save_pretrained(d)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]


def test_every_file_and_both_directories_are_fsynced(target, tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else str(fd))
        real(fd)

    monkeypatch.setattr(io.os, "fsync", record)
    out = eagle(target, draft=24).save_pretrained(tmp_path / "heads")
    if os.path.exists("/proc/self/fd"):
        names = {Path(p).name for p in synced}
        assert {CONFIG_NAME, WEIGHTS_NAME, DRAFT_VOCAB_NAME, tmp_path.name} <= names
        assert any(Path(p).name.startswith(".heads.tmp-") for p in synced)  # the new directory, before the rename
    else:
        assert len(synced) >= 5
    assert out == tmp_path / "heads"


def test_write_refuses_a_file_in_place_of_the_directory(tmp_path):
    (tmp_path / "heads").write_text("not a directory")
    with pytest.raises(HeadFormatError, match="is not a directory"):
        io.write_head_dir(tmp_path / "heads", {}, {WEIGHTS_NAME: {"w": torch.zeros(2)}})
    with pytest.raises(HeadFormatError, match="plain names"):
        io.write_head_dir(tmp_path / "other", {}, {"../w.safetensors": {"w": torch.zeros(2)}})


# ------------------------------------------------------------------------------------------ refusals
def _edit_weights(d: Path, fn) -> None:
    state = load_file(str(d / WEIGHTS_NAME))
    fn(state)
    save_file(state, str(d / WEIGHTS_NAME))  # a well-formed file without checksum, like release 0.1's


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


REFUSALS = {
    "no config": (lambda d: (d / CONFIG_NAME).unlink(), "has no config.json: pass the directory written by"),
    "config not json": (lambda d: (d / CONFIG_NAME).write_text("{oops"), "cannot read .*config.json.*re-export"),
    "config not an object": (lambda d: (d / CONFIG_NAME).write_text("[1, 2]"), "must hold a JSON object"),
    "unknown head type": (
        lambda d: (d / CONFIG_NAME).write_text('{"head_type": "hydra"}'),
        r"head_type 'hydra' names no selfspec head family; expected one of \[.*'dspark'.*\]",
    ),
    "weights missing": (lambda d: (d / WEIGHTS_NAME).unlink(), "the file is missing; re-export the heads"),
    "weights truncated": (
        lambda d: (d / WEIGHTS_NAME).write_bytes((d / WEIGHTS_NAME).read_bytes()[:-7]),
        r"truncated or corrupt\); re-export",
    ),
    "weights empty": (lambda d: (d / WEIGHTS_NAME).write_bytes(b""), "truncated or corrupt"),
    "weights bytes flipped": (lambda d: _flip_last_byte(d / WEIGHTS_NAME), "do not match their checksum"),
    "draft ids duplicated": (
        lambda d: _edit_weights(d, lambda s: s.update(draft_ids=torch.zeros(24, dtype=torch.long))),
        "draft_ids contain duplicates",
    ),
    "draft ids out of range": (
        lambda d: _edit_weights(d, lambda s: s.update(draft_ids=torch.arange(80, 104))),
        r"draft_ids must lie in \[0, 96\)",
    ),
    "draft ids float": (
        lambda d: _edit_weights(d, lambda s: s.update(draft_ids=s["draft_ids"].float())),
        "draft_ids must be int64",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_medusa_refusals_name_the_cause_and_the_fix(target, tmp_path, case):
    medusa(target).save_pretrained(tmp_path)
    edit, message = REFUSALS[case]
    edit(tmp_path)
    with pytest.raises(HeadFormatError, match=message):
        load_heads(tmp_path, target=target)


@pytest.mark.parametrize("case", sorted(c for c in REFUSALS if "draft ids" not in c))  # EAGLE's sit in their own file
def test_eagle_refusals_name_the_cause_and_the_fix(target, tmp_path, case):
    eagle(target).save_pretrained(tmp_path)
    edit, message = REFUSALS[case]
    edit(tmp_path)
    with pytest.raises(HeadFormatError, match=message):
        load_heads(tmp_path, target=target)


def test_all_key_mismatches_are_listed_in_one_error(target, tmp_path):
    medusa(target).save_pretrained(tmp_path)

    def edit(state):
        state.pop("blocks.1.layers.0.bias")
        state.pop("lm_heads.2.weight")
        state["extra.weight"] = torch.zeros(3)
        state["blocks.0.layers.0.weight"] = torch.zeros(D, 7)

    _edit_weights(tmp_path, edit)
    with pytest.raises(HeadFormatError) as err:
        load_heads(tmp_path, target=target)
    text = str(err.value)
    assert "missing=['blocks.1.layers.0.bias', 'lm_heads.2.weight']" in text
    assert "unexpected=['extra.weight']" in text
    assert "blocks.0.layers.0.weight: file (32, 7) vs config (32, 32)" in text
    assert text.endswith("re-export the heads with save_pretrained (or retrain them)")


def test_eagle_key_mismatches_are_listed_in_one_error(target, tmp_path):
    eagle(target).save_pretrained(tmp_path)

    def edit(state):
        state.pop("fc.bias")
        state["layers.0.input_layernorm.weight"] = torch.ones(D)  # EAGLE-1 has no input norm
        state["fc.weight"] = torch.zeros(D, D)

    _edit_weights(tmp_path, edit)
    with pytest.raises(
        HeadFormatError,
        match=r"missing=\['fc.bias'\] unexpected=\['layers.0.input_layernorm.weight'\] "
        r"wrong_shape=\[fc.weight: file \(32, 32\) vs config \(32, 64\)\]",
    ):
        load_heads(tmp_path, target=target)


def test_eagle_draft_vocab_flipped_bytes_are_refused(target, tmp_path):
    eagle(target).save_pretrained(tmp_path)
    _flip_last_byte(tmp_path / DRAFT_VOCAB_NAME)
    with pytest.raises(HeadFormatError, match=f"{DRAFT_VOCAB_NAME}: its tensors do not match their checksum"):
        load_heads(tmp_path, target=target)


@pytest.mark.parametrize("family", [medusa, eagle])
def test_heads_of_another_target_are_refused(target, tmp_path, family):
    family(target).save_pretrained(tmp_path)
    other = tiny_llama(seed=1)  # same shapes, other weights
    with pytest.raises(
        HeadFormatError,
        match=r"trained on target 'tiny' \(fingerprint v2-[0-9a-f]{16}\), not on the "
        r"target given \(fingerprint v2-[0-9a-f]{16}\); load them with their own",
    ):
        load_heads(tmp_path, target=other)


def test_heads_without_fingerprint_load_with_a_warning(target, tmp_path, caplog):
    heads = medusa(target)
    heads.config = dataclasses.replace(heads.config, target_fingerprint="")
    heads.save_pretrained(tmp_path)
    with caplog.at_level("WARNING", logger="selfspec.heads.io"):
        load_heads(tmp_path, target=target)
    assert "carry no target fingerprint" in caplog.text


def test_checksum_covers_names_dtypes_and_shapes():
    a = {"w": torch.arange(4, dtype=torch.float32)}
    assert io.tensor_digest(a) == io.tensor_digest({"w": torch.arange(4, dtype=torch.float32)})
    assert io.tensor_digest(a) != io.tensor_digest({"v": a["w"]})
    assert io.tensor_digest(a) != io.tensor_digest({"w": a["w"].view(torch.int32)})
    assert io.tensor_digest(a) != io.tensor_digest({"w": a["w"].reshape(2, 2)})
    assert io.tensor_digest({"b": torch.ones(2, dtype=torch.bfloat16)})  # dtypes numpy lacks
