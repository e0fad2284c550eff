"""The target fingerprint names the weights, not the dtype: fp32, bf16 and fp16 loads of the same weights (random
weights of every tested architecture, a checkpoint saved in any of the three, values at rounding boundaries,
fp16 underflow and overflow) are the same target; a fine-tune that changed any one layer, the embeddings or the
lm_head is another. Heads saved with the version-1 fingerprint still load on their target, checked the old way
with a warning saying so; a PEFT model's base part is its bare base's."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from selfspec.base.fingerprint import (
    PREFIX,
    TargetFingerprint,
    fingerprint_as_stored,
    fingerprint_version,
    target_fingerprint,
)
from selfspec.heads import load_heads
from selfspec.heads.io import HeadFormatError, check_fingerprint
from tests.helpers.archs import ARCHS, SERVED_ARCHS, tiny_llama, tiny_target
from tests.helpers.heads import make_eagle3

DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("arch", ARCHS + SERVED_ARCHS)
def test_random_weights_cast_to_each_dtype_are_the_same_target(arch):
    model = tiny_target(arch)
    fp = target_fingerprint(model)
    assert fp.startswith(PREFIX) and len(fp) == len(PREFIX) + 16 and fingerprint_version(fp) == 2
    for dtype in DTYPES:
        cast = copy.deepcopy(model).to(dtype)
        assert target_fingerprint(cast) == fp, dtype
        assert target_fingerprint(copy.deepcopy(cast).float()) == fp, dtype  # and back


def test_values_at_rounding_boundaries_underflow_and_overflow_keep_the_fingerprint():
    """Weights set to bf16 / fp16 rounding midpoints, to values fp16 flushes to zero (of either sign) or rounds to
    infinity, and signed zeros: each dtype rounds them differently, the fingerprint does not move."""
    model = tiny_llama()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            n = flat.numel()
            kinds = torch.randint(0, 6, (n,), generator=g)
            sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
            mantissa = 1 + torch.randint(0, 128, (n,), generator=g).float() / 128
            midpoint = sign * (mantissa + 1 / 256)  # halfway between two bf16 values
            values = torch.stack(
                [
                    flat,
                    midpoint,
                    sign * (mantissa + 1 / 2048),  # halfway between two fp16 values
                    sign * 1e-9,  # below fp16's smallest subnormal: a signed zero in fp16
                    sign * 1e6,  # above fp16's largest value: a signed infinity in fp16
                    sign * 0.0,
                ]
            )
            flat.copy_(values.gather(0, kinds[None]).squeeze(0))
    fp = target_fingerprint(model)
    for dtype in DTYPES:
        assert target_fingerprint(copy.deepcopy(model).to(dtype)) == fp, dtype


@pytest.mark.parametrize("saved", ["float32", "bfloat16", "float16"])
def test_a_checkpoint_loaded_in_each_dtype_is_the_same_target(tmp_path, saved):
    from selfspec.target import load_target
    from tests.helpers.tokenizers import tiny_tokenizer

    model = tiny_llama().to(getattr(torch, saved))
    model.save_pretrained(tmp_path / "t")
    tiny_tokenizer().save_pretrained(tmp_path / "t")
    fps = {
        dtype: target_fingerprint(load_target(str(tmp_path / "t"), dtype=dtype)[0])
        for dtype in (torch.float32, *DTYPES)
    }
    assert len(set(fps.values())) == 1, fps


def changed(model, name: str, scale: float = 5e-2):
    """``model`` with the tensor ``name`` moved by ``scale`` times its own spread (seeded): a small fine-tune (a
    move of s flips about s / pi of the signs: some 16 of a tiny layer's 1,024 weights at 5 %; in SmolLM2's
    576 x 576 projections, some 20 of the 65,536 sampled at 1e-3)."""
    other = copy.deepcopy(model)
    p = dict(other.named_parameters())[name]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return other


def test_a_fine_tune_of_any_one_layer_is_another_target():
    model = tiny_llama(layers=3)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
    fp = target_fingerprint(model)
    names = [n for n, p in model.named_parameters() if p.dim() == 2]  # embeddings, every projection, the lm_head
    assert len(names) == 1 + 3 * 7 + 1
    for name in names:
        other = changed(model, name)
        assert target_fingerprint(other) != fp, name
        assert target_fingerprint(other).legacy == fp.legacy or name.startswith("model.embed")  # version 1 saw none


def test_heads_with_a_version_1_fingerprint_load_on_their_target_checked_the_old_way(tmp_path, caplog):
    target = tiny_llama(layers=3)
    head = make_eagle3(target)
    head.config = dataclasses.replace(head.config, target_fingerprint=target_fingerprint(target).legacy)
    head.save_pretrained(tmp_path / "old")
    with caplog.at_level(logging.WARNING):
        assert load_heads(tmp_path / "old", target) is not None
    assert "carry a version-1 target fingerprint" in caplog.text and "checked the old way" in caplog.text
    with pytest.raises(HeadFormatError, match="not on the target given"):
        load_heads(tmp_path / "old", tiny_llama(layers=3, seed=1))
    caplog.clear()
    head.config = dataclasses.replace(head.config, target_fingerprint=target_fingerprint(target))
    head.save_pretrained(tmp_path / "new")
    with caplog.at_level(logging.WARNING):
        assert load_heads(tmp_path / "new", copy.deepcopy(target).to(torch.bfloat16)) is not None
    assert "version-1" not in caplog.text
    with pytest.raises(HeadFormatError, match="not on the target given"):
        load_heads(tmp_path / "new", changed(target, "model.layers.1.mlp.down_proj.weight"))


def test_the_fingerprint_survives_copies_and_plain_strings_compare_as_they_are():
    import pickle

    fp = target_fingerprint(tiny_llama())
    for twin in (copy.deepcopy(fp), pickle.loads(pickle.dumps(fp))):
        assert isinstance(twin, TargetFingerprint) and twin == fp and twin.legacy == fp.legacy
    assert fingerprint_as_stored(fp.legacy, fp) == fp.legacy and fingerprint_as_stored(str(fp), fp) is fp
    assert fingerprint_as_stored(fp.legacy, str(fp)) == str(fp)  # a plain string carries no version 1
    check_fingerprint("here", fp.legacy, fp)
    with pytest.raises(HeadFormatError):
        check_fingerprint("here", fp.legacy, str(fp))


def test_a_peft_model_is_named_by_its_bare_base_and_its_adapter():
    from peft import LoraConfig, get_peft_model

    from selfspec.base.adapter import merge_adapter

    base = tiny_llama()
    bare = target_fingerprint(base)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # a trained adapter
    fp = target_fingerprint(peft_model)
    base_part, plus, adapter_part = fp.partition("+")
    assert plus and base_part == bare and len(adapter_part) == 16
    merged = merge_adapter(peft_model)
    assert target_fingerprint(merged) == fp  # the merged model is named by the base before the merge
    assert target_fingerprint(merged.to(torch.bfloat16)) == fp
    saved_as_new = copy.deepcopy(merged)  # the merged weights saved as a new model: another target
    assert target_fingerprint(saved_as_new).partition("+")[0] != bare
