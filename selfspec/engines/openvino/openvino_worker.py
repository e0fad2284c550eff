"""Run by the ``openvino`` venv's own Python (``python -P``), never imported by selfspec: one OpenVINO GenAI pipeline
per process, serving generate calls as JSON lines.

``python -P openvino_worker.py TARGET_IR DRAFT_IR|- PROPERTIES_JSON`` builds ``openvino_genai.LLMPipeline(TARGET_IR,
"CPU", **properties)`` (with ``draft_model=draft_model(DRAFT_IR, "CPU", **properties)`` unless ``-``), prints
``{"ready": true, "load_s": s}``, then answers each request line ``{"ids": [...], "max_new_tokens": n,
"num_assistant_tokens": k | null, "stop_ids": [...]}`` (greedy, one sequence) with one line::

    {"tokens": [...], "wall_s": s, "batch_sizes": [...] | null, "accepted": n | null, "drafted": n | null}

``wall_s`` is the generate call (prefill included, perf_counter); ``batch_sizes`` the main model's tokens per
iteration (``extended_perf_metrics.main_model_metrics.raw_metrics.m_batch_sizes``: the prefill's first, then one per
verification), ``accepted`` / ``drafted`` OpenVINO's own speculative counters. An empty line ends the worker.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as og


def build(target: str, draft: str, properties: dict) -> og.LLMPipeline:
    """The pipeline: plain, or speculative with the EAGLE-3 draft at ``draft``."""
    if draft == "-":
        return og.LLMPipeline(target, "CPU", **properties)
    return og.LLMPipeline(target, "CPU", draft_model=og.draft_model(draft, "CPU", **properties), **properties)


def generate(pipe: og.LLMPipeline, request: dict) -> dict:
    """One greedy generate call on token ids."""
    config = og.GenerationConfig(max_new_tokens=request["max_new_tokens"], do_sample=False)
    config.stop_token_ids = set(request["stop_ids"])
    if request.get("num_assistant_tokens"):
        config.num_assistant_tokens = request["num_assistant_tokens"]
    ids = ov.Tensor(np.array([request["ids"]], dtype=np.int64))
    start = time.perf_counter()
    result = pipe.generate(ids, config)
    wall = time.perf_counter() - start
    reply = {"tokens": [int(t) for t in result.tokens[0]], "wall_s": wall}
    metrics = result.extended_perf_metrics
    if metrics is not None and hasattr(metrics, "get_num_accepted_tokens"):
        reply["batch_sizes"] = [int(b) for b in metrics.main_model_metrics.raw_metrics.m_batch_sizes]
        reply["accepted"] = int(metrics.get_num_accepted_tokens())
        reply["drafted"] = int(metrics.get_num_draft_tokens())
    return reply


def main(argv: list[str]) -> None:
    """Serve requests from stdin until an empty line."""
    start = time.perf_counter()
    pipe = build(argv[0], argv[1], json.loads(argv[2]))
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print(json.dumps(generate(pipe, json.loads(line))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
