"""The real SmolLM2-135M-Instruct target (fp32) with an EAGLE-3 head: speculative greedy output equals plain
greedy ``generate`` for several EAGLE-2 tree budgets, with the head read back from disk."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.heads import load_heads
from selfspec.heads.eagle3 import Eagle3Head
from tests.helpers.smollm2 import PROMPTS, memorising_eagle3_head

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
SETTINGS = [(1, 1, 1), (3, 2, 4), (5, 4, 12), (6, 3, 24), (4, 8, 16)]  # (depth, top_k, total_tokens)


def test_eagle3_greedy_matches_plain_generate(smollm2, tmp_path):
    """Several (depth, top_k, total_tokens) trees, each output identical to plain greedy generate over 48 new
    tokens of three chat prompts; the head drafts from the target's layers 2, 15, 27 and maps its 4,096-token
    draft vocabulary into target ids (d2t), and accepts deep paths (tau above 1.5 at depth >= 3)."""
    model, tok = smollm2
    spec0 = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    refs, seqs = [], []
    for text in PROMPTS:
        ids = spec0.encode([{"role": "user", "content": text}])
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )[0]
        refs.append((ids, ref[ids.numel() :].tolist()))
        seqs.append(ref)
    memorising_eagle3_head(model, seqs).save_pretrained(tmp_path / "heads")
    head = load_heads(tmp_path / "heads", target=model)
    assert isinstance(head, Eagle3Head) and head.target_layers == (2, 15, 27)
    taus = []
    for depth, top_k, total in SETTINGS:
        spec = selfspec.load(model, head, tokenizer=tok, depth=depth, top_k=top_k, total_tokens=total)
        for ids, ref in refs:
            out = spec.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
            assert out.tokens == ref, (depth, top_k, total)
            taus.append((depth, out.stats.mean_accepted_tokens))
    assert min(t for d, t in taus if d >= 3) > 1.5, taus
