"""heads/eagle.py: structure, EAGLE-1 file layout, exact save/load round trip, strict refusal of bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads import load_heads
from selfspec.heads.config import HeadFormatError
from selfspec.heads.eagle import DRAFT_VOCAB_NAME, WEIGHTS_NAME, EagleConfig, EagleHead
from tests.helpers.archs import tiny_llama

D, V = 32, 96


@pytest.fixture(scope="module")
def target():
    return tiny_llama()


def make_head(target, draft: int | None = None, seed: int = 0, fc_bias: bool = True) -> EagleHead:
    torch.manual_seed(seed)
    ids = torch.sort(torch.randperm(V)[:draft]).values if draft else None
    cfg = EagleConfig(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=draft,
        fc_bias=fc_bias,
        target="tiny",
        target_fingerprint=target_fingerprint(target),
    )
    head = EagleHead(cfg, target.config, draft_ids=ids, target=target).eval()
    with torch.no_grad():  # non-trivial norm weights so a dropped tensor would show
        head.layers[0].post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return head


def sample_inputs(T: int = 7, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, D, generator=g), torch.randint(0, V, (1, T), generator=g), torch.arange(T).unsqueeze(0)


def draft_logits(head, feats, ids, pos):
    with torch.no_grad():
        return head.draft_logits(head(feats, ids, pos))


def test_structure_follows_eagle1(target):
    head = make_head(target)
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert type(head.layers[0]) is type(target.model.layers[0])
    names = set(head.state_dict())
    assert {"fc.weight", "fc.bias"} <= names and all(n.startswith(("fc.", "layers.0.")) for n in names)
    assert head.fc.weight.shape == (D, 2 * D)
    assert not any(n.startswith("layers.0.input_layernorm") for n in names)
    assert "fc.bias" not in make_head(target, fc_bias=False).state_dict()


def test_reduced_vocab_logits_are_rows_of_full(target):
    full = make_head(target, seed=3)
    small = make_head(target, draft=20, seed=3)
    small.load_state_dict(full.state_dict())
    args = sample_inputs()
    lf, ls = draft_logits(full, *args), draft_logits(small, *args)
    assert ls.shape[-1] == 20
    torch.testing.assert_close(ls, lf[..., small.draft_ids], rtol=0, atol=1e-6)
    # no extra norm: logits are lm_head(predicted feature)
    with torch.no_grad():
        pred = full(*args)
    torch.testing.assert_close(lf, target.lm_head(pred), rtol=1e-6, atol=1e-6)


def test_cached_incremental_forward_equals_full(target):
    from transformers import DynamicCache

    head = make_head(target)
    feats, ids, pos = sample_inputs(T=9)
    with torch.no_grad():
        full = head(feats, ids, pos)
        cache = DynamicCache(config=head.arch_config)
        a = head(
            feats[:, :5],
            ids[:, :5],
            pos[:, :5],
            torch.zeros(1, 1, 5, 5).masked_fill(
                ~torch.ones(5, 5, dtype=torch.bool).tril(), torch.finfo(torch.float32).min
            ),
            cache,
        )
        b = head(
            feats[:, 5:],
            ids[:, 5:],
            pos[:, 5:],
            torch.zeros(1, 1, 4, 9).masked_fill(
                ~torch.ones(4, 9, dtype=torch.bool).tril(5), torch.finfo(torch.float32).min
            ),
            cache,
        )
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft", [None, 24])
def test_round_trip_identical_draft_logits(target, tmp_path, draft):
    head = make_head(target, draft=draft, seed=5)
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["head_type"] == "eagle" and cfg["model_type"] == "llama"
    assert cfg["hidden_size"] == D and cfg["selfspec"]["draft_vocab_size"] == draft
    weights = load_file(str(tmp_path / WEIGHTS_NAME))
    assert set(weights) == set(head.state_dict()) and "draft_ids" not in weights  # EAGLE-1 engine layout
    assert (tmp_path / DRAFT_VOCAB_NAME).exists() == (draft is not None)
    for loaded in (
        EagleHead.from_pretrained(tmp_path, target=target, target_fingerprint=target_fingerprint(target)),
        load_heads(tmp_path, target=target),
    ):
        assert torch.equal(loaded.draft_ids, head.draft_ids)
        args = sample_inputs()
        assert torch.equal(draft_logits(loaded.eval(), *args), draft_logits(head, *args))
    # Without a target it loads (no forward possible until attached).
    bare = EagleHead.from_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="attach_target"):
        bare(*sample_inputs())
    bare.attach_target(target)
    assert torch.equal(draft_logits(bare.eval(), *sample_inputs()), draft_logits(head, *sample_inputs()))


def _saved(target, tmp_path, draft=24):
    make_head(target, draft=draft).save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(path, fn):
    state = load_file(str(path / WEIGHTS_NAME))
    fn(state)
    save_file(state, str(path / WEIGHTS_NAME))


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


BAD_EDITS = {
    "truncated weights": lambda p: (p / WEIGHTS_NAME).write_bytes((p / WEIGHTS_NAME).read_bytes()[:200]),
    "missing weights": lambda p: (p / WEIGHTS_NAME).unlink(),
    "missing tensor": lambda p: _edit_weights(p, lambda s: s.pop("fc.bias")),
    "unexpected tensor": lambda p: _edit_weights(p, lambda s: s.update({"embed_tokens.weight": torch.zeros(V, D)})),
    "wrong shape": lambda p: _edit_weights(p, lambda s: s.update({"fc.weight": torch.zeros(D, D)})),
    "unknown selfspec key": lambda p: _edit_config(p, lambda c: c["selfspec"].update({"heads": 3})),
    "no selfspec object": lambda p: _edit_config(p, lambda c: c.pop("selfspec")),
    "two layers": lambda p: _edit_config(p, lambda c: c.update({"num_hidden_layers": 2})),
    "corrupt config": lambda p: (p / "config.json").write_text("{not json"),
    "missing draft vocab": lambda p: (p / DRAFT_VOCAB_NAME).unlink(),
    "duplicate draft ids": lambda p: save_file(
        {"draft_ids": torch.zeros(24, dtype=torch.long)}, str(p / DRAFT_VOCAB_NAME)
    ),
    "draft ids out of range": lambda p: save_file({"draft_ids": torch.arange(80, 104)}, str(p / DRAFT_VOCAB_NAME)),
    "draft vocab size mismatch": lambda p: save_file({"draft_ids": torch.arange(10)}, str(p / DRAFT_VOCAB_NAME)),
}


@pytest.mark.parametrize("edit", sorted(BAD_EDITS))
def test_bad_files_are_refused(target, tmp_path, edit):
    d = _saved(target, tmp_path)
    BAD_EDITS[edit](d)
    with pytest.raises(HeadFormatError):
        load_heads(d, target=target)


def test_other_target_is_refused(target, tmp_path):
    d = _saved(target, tmp_path)
    other = tiny_llama(seed=1)  # same shapes, other weights: fingerprint differs
    with pytest.raises(HeadFormatError, match="fingerprint"):
        load_heads(d, target=other)
    bigger = tiny_llama(hidden_size=64)
    with pytest.raises(HeadFormatError):
        EagleHead.from_pretrained(d).attach_target(bigger)


def test_head_saved_with_a_sliding_layer_loads_with_full_attention(tmp_path):
    """A head directory whose config still names the target's sliding first layer (as heads were saved before
    the head's own attention was made full-context) loads as a full-attention layer."""
    from tests.helpers.archs import WINDOW, tiny_target

    target = tiny_target("gemma2")
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=32, vocab_size=96), target.config, target=target).eval()
    head.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["layer_types"] == ["full_attention"] and raw["sliding_window"] is None
    raw.update(layer_types=["sliding_attention"], sliding_window=WINDOW)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    again = load_heads(tmp_path, target=target)
    assert again.arch_config.layer_types == ["full_attention"] and again.arch_config.sliding_window is None
    assert again.layers[0].self_attn.sliding_window is None
    x, ids, pos = torch.randn(1, 2 * WINDOW, 32), torch.randint(0, 96, (1, 2 * WINDOW)), torch.arange(2 * WINDOW)[None]
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x, ids, pos), head(x, ids, pos), rtol=0, atol=0)
