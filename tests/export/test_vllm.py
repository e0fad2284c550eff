"""vLLM's own loader and decoder judge our speculators exports (slow tier; the vllm venv,
``python -m selfspec.engine_envs vllm``): an EAGLE-3 head fitted briefly to the real SmolLM2 target decodes in vLLM's
CPU build exactly as plain vLLM does, with vLLM's counters showing accepted drafts, through the bench engine end to end;
and vLLM itself refuses a DSpark export on the CPU, as :data:`selfspec.engines.vllm.bench.CPU_REFUSED` says."""

from __future__ import annotations

import pytest
import torch

from selfspec.bench.methods import BenchSettings
from selfspec.engines.vllm.bench import VllmWorker, llm_kwargs, run_vllm_bench, worker_env
from selfspec.export.cli import export_heads
from selfspec.prompts import BenchPrompt, encode_messages
from selfspec.target import resolve_target
from tests.helpers.heads import block_head
from tests.helpers.smollm2 import PROMPTS, memorising_eagle3_head

NEW_TOKENS = 24
TARGET = "smollm2-135m-instruct"


@pytest.mark.slow
def test_vllm_decodes_our_eagle3_export_exactly_with_its_counters(smollm2, vllm_python, tmp_path):
    model, tok = smollm2
    messages = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    with torch.inference_mode():
        seqs = [
            model.generate(encode_messages(tok, m)[None], max_new_tokens=NEW_TOKENS, do_sample=False)[0]
            for m in messages
        ]
    memorising_eagle3_head(model, seqs, steps=20).save_pretrained(tmp_path / "e3")
    prompts = [BenchPrompt(str(i), "smollm2", (p,)) for i, p in enumerate(PROMPTS[:2])]
    settings = BenchSettings(max_new_tokens=NEW_TOKENS, warmup=0, target_name=TARGET, prompts_source="PROMPTS")
    report = run_vllm_bench(
        model, tok, prompts, settings, target_dir=resolve_target(TARGET), heads={"e3": tmp_path / "e3"}, threads=2
    )
    assert not report.mismatches, report.mismatches  # near-ties, if any, are reported apart
    for sample in report.samples:
        assert sample.results["vllm"].tau is None and sample.results["vllm"].new_tokens > 0
    e3 = report.summary["e3"].overall
    assert e3.acceptance_by_depth is not None and len(e3.acceptance_by_depth) == 3
    assert e3.tau is not None and e3.tau > 1.0, e3  # the head drafts what the target says: vLLM accepts some
    assert report.settings.engine == "vllm" and "method=eagle3" in report.methods["e3"].description


@pytest.mark.slow
def test_vllm_s_cpu_build_refuses_a_dspark_export_itself(smollm2, vllm_python, tmp_path):
    model, _ = smollm2
    where = resolve_target(TARGET)
    export_heads(
        block_head(model, "dspark", 4, draft=4096), "speculators", tmp_path / "dspark", target_name_or_path=where
    )
    spec = {"method": "dspark", "model": str(tmp_path / "dspark"), "num_speculative_tokens": 4}
    with pytest.raises(RuntimeError, match="Model Runner V1 does not support: dspark"):
        VllmWorker(vllm_python, llm_kwargs(where, spec, 256, 0), tmp_path / "dspark.log", worker_env(2))
