"""The real SmolLM2-135M-Instruct target (fp32): every row of a ragged batch equals plain greedy generate of
its prompt alone, for Medusa, EAGLE and prompt lookup."""

from __future__ import annotations

import pytest
import torch

import selfspec
from tests.helpers.smollm2 import PROMPTS, fresh_heads, memorising_eagle_head

pytestmark = pytest.mark.slow

BATCH = PROMPTS[:2] + ["Name two prime numbers, please.", "Translate 'good morning' into French and Spanish."]
NEW_TOKENS = 40


def plain(model, ids: torch.Tensor) -> list[int]:
    out = model.generate(
        ids[None],
        attention_mask=torch.ones_like(ids[None]),  # <|im_end|> is also SmolLM2's pad id
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        top_k=None,
    )
    return out[0, ids.numel() :].tolist()


@pytest.mark.parametrize("method", ["medusa", "eagle", "prompt_lookup"])
def test_every_batch_row_equals_plain_generate(smollm2, method):
    model, tok = smollm2
    base = selfspec.load(model, tokenizer=tok, prompt_lookup=True, tune="off")
    ids = [base.encode([{"role": "user", "content": text}]) for text in BATCH]
    assert len({i.numel() for i in ids}) == len(ids)  # every row a different length
    refs = [plain(model, i) for i in ids]
    if method == "medusa":
        spec = selfspec.load(model, fresh_heads(model), tokenizer=tok, tune="off")
    elif method == "eagle":
        seqs = [torch.cat([i, torch.tensor(r)]) for i, r in zip(ids, refs, strict=True)]
        head = memorising_eagle_head(model, seqs)
        spec = selfspec.load(model, head, tokenizer=tok, depth=5, top_k=4, total_tokens=12, tune="off")
    else:
        spec = base
    rows = spec.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
    assert [r.tokens for r in rows] == refs
    if method == "eagle":  # the memorising head accepts long paths: rows advance unevenly
        assert min(r.stats.mean_accepted_tokens for r in rows) > 2.0
