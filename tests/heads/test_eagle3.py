"""heads/eagle3.py: published tensor names and shapes, layer choice, vocabulary maps, init options, exact
save/load round trip, strict refusal of wrong or corrupt files; the EAGLE-3.1 options (``fc_norm``, ``norm_output``):
their function, files, and head directories written before them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads import load_heads
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_target_layers, vocab_maps
from selfspec.heads.io import WEIGHTS_NAME, HeadFormatError
from tests.helpers.archs import tiny_llama

D, V = 32, 96
IDS = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 55, 89])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=3)


def make_head(target, ids=IDS, seed: int = 0, fc_norm: bool = False, norm_output: bool = False, **init) -> Eagle3Head:
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=ids.numel(),
        num_target_layers=3,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
        fc_norm=fc_norm,
        norm_output=norm_output,
    )
    head = Eagle3Head(cfg, target.config, draft_ids=ids, target=target, **init).eval()
    with torch.no_grad():  # non-trivial norms so a dropped or swapped tensor would show
        fused = list(head.fc_norm) if fc_norm else []
        for norm in (head.norm, head.layers[0].input_layernorm.embed_norm, head.layers[0].input_layernorm.hidden_norm):
            norm.weight.uniform_(0.5, 1.5)
        for norm in fused:
            norm.weight.uniform_(0.5, 1.5)
    return head


def logits(head, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    feats, ids = torch.randn(1, 7, 3 * D, generator=g), torch.randint(0, V, (1, 7), generator=g)
    with torch.no_grad():
        out = head(feats, ids, torch.arange(7)[None])
        return head.draft_logits(out), head.draft_logits(head(out, ids, torch.arange(7)[None]))


def test_default_layers_published_and_clamped():
    assert default_target_layers(30) == (2, 15, 27)  # SmolLM2-135M
    assert default_target_layers(32) == (2, 16, 29)
    assert default_target_layers(3) == (0, 1, 2) and default_target_layers(2) == (0, 1, 1)
    assert default_target_layers(1) == (0, 0, 0)
    with pytest.raises(ValueError):
        Eagle3Config(hidden_size=D, vocab_size=V, draft_vocab_size=4, num_target_layers=3, target_layers=(0, 1, 3))


def test_file_layout_names_and_shapes(target, tmp_path):
    head = make_head(target)
    head.save_pretrained(tmp_path)
    w = load_file(str(tmp_path / WEIGHTS_NAME))
    shapes = {k: tuple(v.shape) for k, v in w.items()}
    assert shapes["fc.weight"] == (D, 3 * D) and shapes["lm_head.weight"] == (10, D) and shapes["norm.weight"] == (D,)
    assert shapes["layers.0.hidden_norm.weight"] == (D,) and shapes["layers.0.input_layernorm.weight"] == (D,)
    for name in ("q", "k", "v"):
        assert shapes[f"layers.0.self_attn.{name}_proj.weight"][1] == 2 * D
    assert shapes["layers.0.self_attn.o_proj.weight"] == (D, D)
    assert w["d2t"].dtype == torch.long and shapes["d2t"] == (10,) and w["t2d"].dtype == torch.bool
    assert (torch.arange(10) + w["d2t"]).tolist() == IDS.tolist() and w[
        "t2d"
    ].nonzero().flatten().tolist() == IDS.tolist()
    assert not any("embed" in k for k in w) and "fc.bias" not in w
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["head_type"] == "eagle3" and cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 10
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def test_vocab_maps_refuse_bad_ids():
    d2t, t2d = vocab_maps(torch.tensor([3, 4, 90]), V)
    assert d2t.tolist() == [3, 3, 88] and int(t2d.sum()) == 3
    for bad in ([3, 3, 5], [5, 4, 6], [0, 1, 96], [-1, 0, 1]):
        with pytest.raises(HeadFormatError):
            vocab_maps(torch.tensor(bad), V)


def test_init_options_copy_the_target(target):
    head = make_head(target, init_layer=-1, init_lm_head=True)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[IDS])
    src = target.model.layers[-1]
    q = head.layers[0].self_attn.q_proj.weight
    assert torch.equal(q[:, D:], src.self_attn.q_proj.weight) and not torch.equal(q[:, :D], torch.zeros_like(q[:, :D]))
    assert torch.equal(head.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight)
    random = make_head(target)
    assert not torch.equal(random.lm_head.weight, target.lm_head.weight[IDS])


@pytest.mark.parametrize("ids", [IDS, torch.arange(V)])
def test_round_trip_identical_logits(target, tmp_path, ids):
    head = make_head(target, ids=ids, seed=5)
    head.save_pretrained(tmp_path)
    for loaded in (load_heads(tmp_path, target=target), Eagle3Head.from_pretrained(tmp_path, target=target)):
        assert isinstance(loaded, Eagle3Head) and torch.equal(loaded.draft_ids, ids)
        for a, b in zip(logits(loaded.eval()), logits(head), strict=True):
            assert torch.equal(a, b)


def _edit_weights(path, fn):
    state = load_file(str(path / WEIGHTS_NAME))
    fn(state)
    save_file(state, str(path / WEIGHTS_NAME))


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


BAD_EDITS = {
    "truncated weights": lambda p: (p / WEIGHTS_NAME).write_bytes((p / WEIGHTS_NAME).read_bytes()[:300]),
    "flipped byte": lambda p: (p / WEIGHTS_NAME).write_bytes(
        (b := bytearray((p / WEIGHTS_NAME).read_bytes())) and bytes(b[:-5] + bytes([b[-5] ^ 0xFF]) + b[-4:])
    ),
    "missing tensor": lambda p: _edit_weights(p, lambda s: s.pop("layers.0.hidden_norm.weight")),
    "unexpected tensor": lambda p: _edit_weights(p, lambda s: s.update({"embed_tokens.weight": torch.zeros(V, D)})),
    "wrong shape": lambda p: _edit_weights(p, lambda s: s.update({"fc.weight": torch.zeros(D, 2 * D)})),
    "d2t out of order": lambda p: _edit_weights(p, lambda s: s["d2t"].__setitem__(9, 7)),
    "d2t out of range": lambda p: _edit_weights(p, lambda s: s["d2t"].__setitem__(9, 200)),
    "t2d disagrees": lambda p: _edit_weights(p, lambda s: s["t2d"].__setitem__(3, True)),
    "unknown selfspec key": lambda p: _edit_config(p, lambda c: c["selfspec"].update({"heads": 3})),
    "wrong head type": lambda p: _edit_config(p, lambda c: c.update({"head_type": "eagle"})),
    "draft size disagrees": lambda p: _edit_config(p, lambda c: c.update({"draft_vocab_size": 11})),
    "corrupt config": lambda p: (p / "config.json").write_text("{not json"),
}


@pytest.mark.parametrize("edit", sorted(BAD_EDITS))
def test_bad_files_are_refused(target, tmp_path, edit):
    make_head(target).save_pretrained(tmp_path)
    BAD_EDITS[edit](tmp_path)
    with pytest.raises(HeadFormatError):
        load_heads(tmp_path, target=target)


def test_other_target_is_refused(target, tmp_path):
    make_head(target).save_pretrained(tmp_path)
    with pytest.raises(HeadFormatError, match="fingerprint"):
        load_heads(tmp_path, target=tiny_llama(layers=3, seed=1))
    with pytest.raises(HeadFormatError, match="layers"):
        Eagle3Head.from_pretrained(tmp_path).attach_target(tiny_llama(layers=2))


# ------------------------------------------------------------------------------------------- EAGLE-3.1
EAGLE31 = [dict(fc_norm=True, norm_output=True), dict(fc_norm=True), dict(norm_output=True)]


@pytest.mark.parametrize("flags", EAGLE31, ids=lambda f: "+".join(f))
def test_eagle31_is_the_published_function(target, flags):
    """arXiv:2605.09992 as speculators' ``Eagle3DraftModel`` computes it, built from the EAGLE-3 head with the same
    tensors: ``fc_norm`` norms each D-wide slice of the fused layers before ``fc``; ``norm_output`` makes the output
    (what the next draft step takes) ``norm(o)``, and the logits stay ``lm_head(norm(o))``. Exact (same ops)."""
    new = make_head(target, seed=3, **flags)
    plain = Eagle3Head(dataclasses.replace(new.config, fc_norm=False, norm_output=False), target.config, IDS, target)
    plain.load_state_dict({k: v for k, v in new.state_dict().items() if not k.startswith("fc_norm.")})
    g = torch.Generator().manual_seed(4)
    feats, ids, pos = (
        torch.randn(1, 7, 3 * D, generator=g) * 5,
        torch.randint(0, V, (1, 7), generator=g),
        torch.arange(7)[None],
    )
    with torch.no_grad():
        x = feats
        if new.config.fc_norm:
            x = torch.cat([n(c) for n, c in zip(new.fc_norm, feats.chunk(3, -1), strict=True)], -1)
            assert not torch.allclose(x, feats)
        o = plain(x, ids, pos)
        y = new(feats, ids, pos)
        assert torch.equal(y, plain.norm(o) if new.config.norm_output else o)
        assert torch.equal(new.draft_logits(y), plain.draft_logits(o))
        o2 = plain(y, ids, pos)  # the next draft step: D-wide, no fc and no fc_norm
        y2 = new(y, ids, pos)
        assert torch.equal(y2, plain.norm(o2) if new.config.norm_output else o2)
        if new.config.norm_output:
            assert not torch.allclose(o2, plain(o, ids, pos))  # feeding norm(o) is not feeding o


def test_eagle31_files_and_round_trip(target, tmp_path):
    head = make_head(target, seed=5, fc_norm=True, norm_output=True)
    assert head.config.eagle31_flags == ("fc_norm", "norm_output") and make_head(target).config.eagle31_flags == ()
    head.save_pretrained(tmp_path)
    w = load_file(str(tmp_path / WEIGHTS_NAME))
    assert {k: tuple(v.shape) for k, v in w.items() if k.startswith("fc_norm.")} == {
        f"fc_norm.{i}.weight": (D,) for i in range(3)
    }
    ours = json.loads((tmp_path / "config.json").read_text())["selfspec"]
    assert ours["fc_norm"] is True and ours["norm_output"] is True
    loaded = load_heads(tmp_path, target=target).eval()
    assert (loaded.config.fc_norm, loaded.config.norm_output) == (True, True)
    for a, b in zip(logits(loaded), logits(head), strict=True):
        assert torch.equal(a, b)


def test_head_dirs_written_before_eagle31_load_as_eagle3(target, tmp_path):
    """A head directory whose ``selfspec`` object has no ``fc_norm`` / ``norm_output`` (written before they existed)
    loads as the EAGLE-3 head it was, with the same logits."""
    head = make_head(target, seed=6)
    head.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: [c["selfspec"].pop(k) for k in ("fc_norm", "norm_output")])
    loaded = load_heads(tmp_path, target=target).eval()
    assert loaded.config.eagle31_flags == () and loaded.fc_norm is None
    for a, b in zip(logits(loaded), logits(head), strict=True):
        assert torch.equal(a, b)


EAGLE31_EDITS = {
    "flag not a boolean": lambda p: _edit_config(p, lambda c: c["selfspec"].update({"fc_norm": "yes"})),
    "flag as a number": lambda p: _edit_config(p, lambda c: c["selfspec"].update({"norm_output": 1})),
    "flag selfspec does not compute": lambda p: _edit_config(
        p, lambda c: c["selfspec"].update({"norm_before_fc": True})
    ),
    "fc_norm false, its tensors present": lambda p: _edit_config(p, lambda c: c["selfspec"].update({"fc_norm": False})),
    "a fused norm missing": lambda p: _edit_weights(p, lambda s: s.pop("fc_norm.2.weight")),
    "a fused norm misshaped": lambda p: _edit_weights(p, lambda s: s.update({"fc_norm.0.weight": torch.ones(3 * D)})),
}


@pytest.mark.parametrize("edit", sorted(EAGLE31_EDITS))
def test_bad_eagle31_files_are_refused(target, tmp_path, edit):
    make_head(target, fc_norm=True, norm_output=True).save_pretrained(tmp_path)
    EAGLE31_EDITS[edit](tmp_path)
    with pytest.raises(HeadFormatError):
        load_heads(tmp_path, target=target)


def test_fc_norm_set_on_an_eagle3_dir_is_refused(target, tmp_path):
    make_head(target).save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c["selfspec"].update({"fc_norm": True}))
    with pytest.raises(HeadFormatError, match=r"fc_norm\.0\.weight"):
        load_heads(tmp_path, target=target)
