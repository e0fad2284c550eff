"""The real SmolLM2-135M-Instruct target (fp32): speculative greedy output equals plain generate."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence, then list three famous landmarks there.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue to a ten-year-old.",
]


def fresh_heads(model, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, num_heads=3,
                       draft_vocab_size=4096)
    heads = MedusaHeads(cfg, target_lm_head=model.lm_head.weight, draft_ids=torch.arange(4096))
    for p in heads.blocks.parameters():
        torch.nn.init.normal_(p, std=0.01)
    return heads


@pytest.mark.parametrize("method", ["medusa", "prompt_lookup"])
def test_greedy_matches_plain_generate(smollm2, method):
    model, tok = smollm2
    kwargs = {"heads": fresh_heads(model)} if method == "medusa" else {"prompt_lookup": True}
    spec = selfspec.load(model, tokenizer=tok, **kwargs)
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = spec.encode(messages)
        # An explicit attention mask: the prompt contains <|im_end|> (id 2), which is also SmolLM2's pad id,
        # and generate would otherwise mask those positions out as padding.
        ref = model.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=64,
                             do_sample=False, eos_token_id=None, top_k=None)
        ref = ref[0, ids.numel():].tolist()
        out = spec.generate(messages, max_new_tokens=64, eos_token_id=[])
        assert len(out.tokens) == 64
        assert out.tokens == ref
        assert out.stats.steps <= 64


def test_eos_and_text(smollm2):
    model, tok = smollm2
    spec = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    out = spec.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=40)
    assert out.stats.finish_reason == "stop" and out.tokens[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in out.text
