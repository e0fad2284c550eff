"""The real SmolLM2-135M-Instruct target with a random LoRA adapter (fp32, slow): greedy speculative output
equals the adapted model's own plain greedy ``generate`` (merged and unmerged), for Medusa heads fingerprinted
on the adapted target and for prompt lookup, with the default CPU tuning on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import selfspec
from selfspec.base.fingerprint import target_fingerprint
from tests.helpers.smollm2 import PROMPTS, fresh_heads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def adapter_dir(smollm2, tmp_path_factory):
    """A random LoRA (r 8) on SmolLM2's attention projections, B drawn so that it changes the outputs."""
    import copy

    from peft import LoraConfig, get_peft_model

    model, _ = smollm2
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    out = tmp_path_factory.mktemp("smollm2-lora")
    peft_model.save_pretrained(out)
    return out


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    ref = model.generate(
        input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=n, do_sample=False,
        eos_token_id=None, top_k=None,
    )  # fmt: skip
    return ref[0, ids.numel() :].tolist()


def test_greedy_matches_the_adapted_models_generate(smollm2, adapter_dir):
    from peft import PeftModel

    from selfspec.target import load_target

    base, tok = smollm2
    merged, _ = load_target("smollm2-135m-instruct", adapter=adapter_dir)
    heads = fresh_heads(merged)
    heads.config = dataclasses.replace(heads.config, target_fingerprint=target_fingerprint(merged))
    assert "+" in heads.config.target_fingerprint
    unmerged = PeftModel.from_pretrained(load_target("smollm2-135m-instruct")[0], str(adapter_dir)).eval()
    changed = 0
    for kwargs in ({"heads": heads}, {"prompt_lookup": True}):
        spec = selfspec.load(merged, tokenizer=tok, **kwargs)
        for text in PROMPTS:
            ids = spec.encode([{"role": "user", "content": text}])
            ref = greedy(merged, ids, 48)
            assert spec.generate(ids, max_new_tokens=48, eos_token_id=[]).tokens == ref
            if kwargs.get("prompt_lookup"):
                assert greedy(unmerged, ids, 48) == ref  # merged weights decode as the two-matmul adapter does
                changed += greedy(base, ids, 48) != ref
    assert changed >= 1  # the adapter changes the output: the test is not vacuous
