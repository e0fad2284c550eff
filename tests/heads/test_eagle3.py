"""heads/eagle3.py: published tensor names and shapes, layer choice, vocabulary maps, init options, exact
save/load round trip, strict refusal of wrong or corrupt files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.heads import load_heads
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head, default_target_layers, vocab_maps
from selfspec.heads.fingerprint import target_fingerprint
from selfspec.heads.io import WEIGHTS_NAME, HeadFormatError
from tests.helpers.archs import tiny_llama

D, V = 32, 96
IDS = torch.tensor([0, 1, 2, 5, 8, 13, 21, 34, 55, 89])


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=3)


def make_head(target, ids=IDS, seed: int = 0, **init) -> Eagle3Head:
    torch.manual_seed(seed)
    cfg = Eagle3Config(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=ids.numel(),
        num_target_layers=3,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
    )
    head = Eagle3Head(cfg, target.config, draft_ids=ids, target=target, **init).eval()
    with torch.no_grad():  # non-trivial norms so a dropped or swapped tensor would show
        for norm in (head.norm, head.layers[0].input_layernorm.embed_norm, head.layers[0].input_layernorm.hidden_norm):
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
