"""train/features.py: the feature store's length-sorted, right-padded batches give each example the states it gets
alone, on targets with sliding-window layers too, in the examples' order."""

from __future__ import annotations

import pytest
import torch

from selfspec.train.config import TrainConfig
from selfspec.train.features import hidden_features
from tests.helpers.archs import WINDOW, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def examples(n: int, seed: int = 0) -> list[dict]:
    """``n`` random sequences of 3 to 40 tokens (longer than the sliding window), in random length order."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (n,), generator=g)
    assert int(lengths.max()) > 3 * WINDOW
    return [{"input_ids": torch.randint(1, 96, (int(t),), generator=g)} for t in lengths]


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral"])
@pytest.mark.parametrize("layers", [None, (0, 2)])
def test_batched_equals_one_at_a_time(arch, layers):
    target = tiny_target(arch)
    ex = examples(13)
    single = hidden_features(target, ex, True, layers, batch_tokens=0)
    batched = hidden_features(target, ex, True, layers, batch_tokens=100)  # 2-8 rows a batch, padded
    width = 32 * (len(layers) + 1 if layers else 1)
    for e, a, b in zip(ex, single, batched, strict=True):
        assert a.shape == b.shape == (e["input_ids"].numel(), width)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # one at a time is one plain forward per example: bit-equal to calling the backbone directly
    from selfspec.decode.kv import backbone

    with torch.inference_mode():
        ref = backbone(target)(input_ids=ex[5]["input_ids"][None], use_cache=False).last_hidden_state[0]
    assert torch.equal(single[5][:, -32:], ref)


def test_an_example_longer_than_the_budget_runs_alone():
    target = tiny_target("llama")
    ex = examples(6, seed=1)
    longest = max(e["input_ids"].numel() for e in ex)
    batched = hidden_features(target, ex, True, batch_tokens=longest - 1)
    single = hidden_features(target, ex, True)
    for a, b in zip(single, batched, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_feature_batch_tokens_is_validated():
    with pytest.raises(ValueError, match="feature_batch_tokens must be >= 0"):
        TrainConfig(feature_batch_tokens=-1)
