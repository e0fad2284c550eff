"""The vLLM side of ``selfspec bench --engine vllm``: one process holding one ``vllm.LLM`` for its whole life, speaking
JSON lines. Run by the ``vllm`` venv's Python (:mod:`selfspec.engine_envs`) as a script, never imported there as part
of selfspec: it imports nothing but the standard library and, inside :func:`main`, vLLM.

Protocol (:mod:`selfspec.engines.vllm.bench` is the other side):

* ``python -I vllm_worker.py CONFIG_JSON`` (``-I``: this folder, which holds selfspec's vLLM modules, must not
  shadow the ``vllm`` package): ``CONFIG_JSON`` is ``{"llm": {...}}``, the keyword arguments of
  ``vllm.LLM`` (``model``, ``dtype``, ``speculative_config``, ...). vLLM's own logs and prints go to stderr; the
  protocol alone to stdout.
* after loading, one line ``{"ready": true, "vllm": VERSION, "load_s": SECONDS}``, or ``{"error": TEXT}`` and exit
  status 1 when vLLM refuses or fails to load;
* then per stdin line ``{"ids": [...], "max_tokens": N, "stop_ids": [...], "temperature": T, "top_p": P,
  "seed": S}`` one line ``{"tokens": [...], "finish_reason": "stop" | "length", "wall_s": SECONDS, "prefill_s":
  SECONDS | null, "peak_rss_mb": MIB, "counters": {...}}`` (:func:`spec_counters`, vLLM's cumulative totals after the
  call), or ``{"error": TEXT}`` and exit status 1. A request with ``"prompts": [[...], ...]`` instead of ``"ids"``
  is one batched call: ``{"outputs": [{"tokens", "finish_reason"}, ...], "wall_s", "peak_rss_mb"}``.
  End of stdin ends the process (status 0).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Iterable
from typing import Any

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}
"""vLLM's speculative-decoding counters (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``) as
``LLM.get_metrics()`` returns them (``vllm/v1/metrics/reader.py``: ``Counter.value``, ``Vector.values``) -> the names
this protocol gives them."""


def spec_counters(metrics: Iterable[Any]) -> dict[str, Any]:
    """vLLM's cumulative speculative-decoding counters, summed over their label sets (engines).

    Args:
        metrics: ``LLM.get_metrics()``: objects with ``name`` and ``value`` (a counter) or ``values`` (a vector).

    Returns:
        ``{"drafts": int, "draft_tokens": int, "accepted": int, "accepted_per_pos": [int, ...]}`` for those vLLM
        reported; empty without speculative decoding.
    """
    found: dict[str, Any] = {}
    for metric in metrics:
        key = SPEC_COUNTERS.get(metric.name)
        if key is None:
            continue
        if key == "accepted_per_pos":
            values = [int(v) for v in metric.values]
            known = found.get(key, [0] * len(values))
            width = max(len(known), len(values))
            known, values = known + [0] * (width - len(known)), values + [0] * (width - len(values))
            found[key] = [a + b for a, b in zip(known, values, strict=True)]
        else:
            found[key] = found.get(key, 0) + int(metric.value)
    return found


def _send(out: Any, message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _generate(llm: Any, sampling_params: Any, request: dict[str, Any]) -> dict[str, Any]:
    params = sampling_params(
        max_tokens=int(request["max_tokens"]),
        temperature=float(request.get("temperature", 0.0)),
        top_p=float(request.get("top_p", 1.0)),
        seed=request.get("seed"),
        stop_token_ids=list(request.get("stop_ids", [])),
        detokenize=False,
    )
    start = time.perf_counter()
    (output,) = llm.generate([{"prompt_token_ids": list(request["ids"])}], params, use_tqdm=False)
    wall = time.perf_counter() - start
    completion = output.outputs[0]
    latency = getattr(output.metrics, "first_token_latency", None) if output.metrics is not None else None
    return {
        "tokens": [int(t) for t in completion.token_ids],
        "finish_reason": "length" if completion.finish_reason == "length" else "stop",
        "wall_s": wall,
        "prefill_s": float(latency) if latency else None,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "counters": spec_counters(llm.get_metrics()),
    }


def _generate_batch(llm: Any, sampling_params: Any, request: dict[str, Any]) -> dict[str, Any]:
    """One ``LLM.generate`` over many prompts (``"prompts"``: token id lists), batched by the engine; the reply's
    ``outputs`` in the prompts' order (self-distillation, :mod:`selfspec.distill`)."""
    params = sampling_params(
        max_tokens=int(request["max_tokens"]),
        temperature=float(request.get("temperature", 0.0)),
        top_p=float(request.get("top_p", 1.0)),
        seed=request.get("seed"),
        stop_token_ids=list(request.get("stop_ids", [])),
        detokenize=False,
    )
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in request["prompts"]], params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {
        "outputs": [
            {"tokens": [int(t) for t in o.outputs[0].token_ids], "finish_reason": o.outputs[0].finish_reason}
            for o in outputs
        ],
        "wall_s": wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }


def main(argv: list[str]) -> int:
    """Load ``vllm.LLM(**config["llm"])`` and answer requests (the module docstring). Returns the exit status."""
    config = json.loads(argv[1])
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM prints goes to stderr; the protocol has stdout alone
    try:
        start = time.perf_counter()
        import vllm

        llm = vllm.LLM(**config["llm"])
        _send(out, {"ready": True, "vllm": vllm.__version__, "load_s": time.perf_counter() - start})
        for line in sys.stdin:
            if line.strip():
                request = json.loads(line)
                reply = _generate_batch if "prompts" in request else _generate
                _send(out, reply(llm, vllm.SamplingParams, request))
    except Exception as err:  # noqa: BLE001 - every failure is reported to the parent, then the process ends
        print(traceback.format_exc(), file=sys.stderr)
        _send(out, {"error": f"{type(err).__name__}: {err}"})
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
