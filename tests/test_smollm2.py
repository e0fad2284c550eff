"""The real SmolLM2-135M-Instruct target (fp32): speculative greedy output equals plain generate."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.verifier import Verifier
from tests.helpers.smollm2 import PROMPTS, fresh_heads, memorising_eagle_head

pytestmark = pytest.mark.slow


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
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )
        ref = ref[0, ids.numel() :].tolist()
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


def test_eagle_greedy_matches_plain_generate(smollm2):
    """EAGLE-2 dynamic trees on the real target: several (depth, top_k, total_tokens), output identical to
    plain greedy generate, with a head that accepts deep paths (tau well above 1)."""
    model, tok = smollm2
    spec0 = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    refs, seqs = [], []
    for text in PROMPTS:
        ids = spec0.encode([{"role": "user", "content": text}])
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )[0]
        refs.append((ids, ref[ids.numel() :].tolist()))
        seqs.append(ref)
    head = memorising_eagle_head(model, seqs)
    taus = []
    # The settings verify with each linear kernel at every tree size (W @ x^T; oneDNN on packed weights).
    packed = "packed" if Verifier(model).packed_available() else "weight_first"
    settings = (
        (1, 1, 1, "weight_first"),
        (3, 2, 4, "linear"),
        (5, 4, 12, packed),
        (6, 3, 24, "packed"),
        (4, 4, 8, "weight_first"),
    )
    for depth, top_k, total, kernel in settings:
        if kernel == "packed" and not Verifier(model).packed_available():
            continue
        spec = selfspec.load(model, head, tokenizer=tok, depth=depth, top_k=top_k, total_tokens=total)
        spec.verifier = Verifier(model, {n: kernel for n in range(1, 65)})
        for ids, ref in refs:
            out = spec.generate(ids, max_new_tokens=48, eos_token_id=[])
            assert out.tokens == ref, (depth, top_k, total, kernel)
            taus.append((depth, out.stats.mean_accepted_tokens))
    assert min(t for d, t in taus if d >= 3) > 2.0, taus  # deep paths were accepted and verified
