"""selfspec/export/gguf_block.py: DFlash and DSpark heads as llama.cpp ``dflash`` GGUF drafts, proven by llama.cpp.

The fast test checks the refusal of a scaled-embedding target. The slow ones take the cached llama.cpp build (the
tests never build it), convert a SmolLM2 head fitted for a few seconds to llama.cpp's own greedy continuations with
llama.cpp's converter, and run ``llama-speculative-simple --spec-type draft-dflash`` / ``draft-dspark`` with the
target's Q4_1 GGUF: the greedy text equals llama.cpp's own without drafts, and llama.cpp accepts more than one token
per step; a head whose tensors, layers, positions or vocabulary map did not round-trip would get almost none.
"""

from __future__ import annotations

import json

import pytest

from selfspec.export.common import ExportError
from selfspec.export.gguf_block import check_block_gguf, export_gguf_block, spec_type
from tests.helpers.archs import tiny_target
from tests.helpers.heads import block_head

NEW_TOKENS = 64
PROMPTS = ["Write a short poem about the sea.", "Explain in three sentences why the sky is blue."]


def test_a_target_with_scaled_embeddings_is_refused(tmp_path):
    """Gemma-2 scales its embeddings inside its embedding module; llama.cpp's DFlash graph reads raw rows unless
    told the scale, which this export does not write: refused before anything is converted."""
    target = tiny_target("gemma2")
    (tmp_path / "t").mkdir()
    c = target.config
    (tmp_path / "t" / "config.json").write_text(
        json.dumps({"hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_hidden_layers": 3})
    )

    class NoBuild:
        def convert(self, *a):
            raise AssertionError("the converter must not run")

    with pytest.raises(ExportError, match="scaled"):
        head = block_head(target, "dflash", 4)
        export_gguf_block(head, tmp_path / "out", target_dir=tmp_path / "t", llamacpp=NoBuild())


@pytest.mark.slow
@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_llamacpp_runs_our_block_head_exactly(smollm2, smollm2_gguf, llamacpp, tmp_path, head_type):
    from selfspec.llamacpp import completion, speculative_simple
    from selfspec.target import resolve_target
    from tests.helpers.smollm2 import memorising_block_head

    model, tok = smollm2
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in PROMPTS
    ]
    plains = [completion(llamacpp, smollm2_gguf, text, n_predict=NEW_TOKENS, threads=1) for text in texts]
    seqs = [
        tok(text + plain.text, return_tensors="pt", add_special_tokens=False).input_ids[0]
        for text, plain in zip(texts, plains, strict=True)
    ]
    head = memorising_block_head(model, seqs, head_type)
    path = export_gguf_block(head, tmp_path / "gguf", target_dir=resolve_target("smollm2-135m-instruct"), name="draft")
    check_block_gguf(path, head)
    for text, plain in zip(texts, plains, strict=True):
        ours = speculative_simple(
            llamacpp, smollm2_gguf, text, spec_type=spec_type(head), draft=path, n_predict=NEW_TOKENS, threads=1,
            draft_max=head.config.max_drafts,
        )  # fmt: skip
        assert plain.prompt_tokens == ours.prompt_tokens
        assert ours.text.startswith(plain.text), (ours.text, plain.text)
        assert ours.drafted > 0 and ours.tokens_per_step > 1.5, ours
