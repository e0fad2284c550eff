"""``selfspec bench``: speedup, tau and exactness against plain ``transformers`` generate, in one run.

Every method runs in the same process on the same target object, interleaved per prompt (for each
prompt turn every method runs once, in an order rotated from turn to turn so none always runs first),
after a warm-up. So the speedup of a method on a prompt is the ratio of two numbers measured minutes
apart on the same machine state, and the reported speedup is the median of those per-prompt ratios
(Spec-Bench, Xia et al. 2024, reports speedups the same way, against its own baseline in its own run).

Methods (:mod:`selfspec.bench.methods`):

* ``baseline``: ``model.generate`` (``transformers``), the reference every ``speedup`` is taken against.
* ``no_draft``: selfspec's own loop and verification kernels with no drafts (one token per step), the
  engine-only baseline every ``engine_speedup`` is taken against: the gain of speculation alone.
* ``hf_prompt_lookup``: ``model.generate(prompt_lookup_num_tokens=...)`` (``transformers``' own prompt lookup).
* ``prompt_lookup``, ``draft_model``: selfspec's own drafters through the lossless verifier.
* one method per head directory (``--heads``).
* any callable ``(prompt_ids [T], settings) -> (tokens, GenerationStats | None)`` passed by code
  (:func:`run_bench` ``methods``), e.g. a deliberately wrong method in the tests.

Prompts (:mod:`selfspec.prompts`): an MT-bench / Spec-Bench JSONL file (``question_id``, ``category``,
``turns``); a multi-turn question is answered turn by turn, each later turn conditioned on the *reference
method's* answer to the previous turns, so every method sees exactly the same token ids on every turn. Or
``sharegpt-heldout``: the first user turn of every ShareGPT conversation held out by the run that trained
the heads (``<heads>/training_record.json``).

Outputs (``--out DIR``): ``report.json`` (every per-prompt number; layout: the dataclasses of
:mod:`selfspec.bench.report`, read back strictly by :func:`read_report`), ``report.md`` (tables),
``speedup.png``, ``accepted_tokens_hist.png``, ``acceptance_by_depth.png``; a short summary goes to stdout.

``--engine NAME`` runs the same prompts through another engine of the registry (:mod:`selfspec.engines.registry`,
each engine in its folder under ``selfspec/engines/``) into the same report layout: ``llamacpp`` (plain llama.cpp,
each head exported to GGUF and llama.cpp's n-gram drafters, settings swept once per machine), ``vllm`` (vLLM's CPU
build in its own venv, each head exported to the speculators layout, vLLM's own acceptance counters), ``openvino``
(OpenVINO GenAI, each EAGLE-3 head converted by optimum-intel).

Files: ``methods.py`` (settings and methods), ``run.py`` (the measured run and its aggregates),
``report.py`` (the report's dataclasses and strict reading), ``outputs.py`` (``report.md``, the summary,
writing), ``plots.py``, ``driver.py`` (the one driver every engine plugs into), ``ties.py`` (near-ties),
``batched.py`` (``--batch-size``), ``stream.py`` (``--stream``), ``fidelity.py`` (the export fidelity report),
``cli.py``.

Usage::

    selfspec bench --prompts mt_bench.jsonl --heads runs/medusa-smollm2/heads --out runs/bench
    selfspec bench --prompts sharegpt-heldout --num-prompts 20 --temperature 0.7 --dtype bfloat16
    selfspec bench --engine llamacpp --prompts mt_bench.jsonl --max-turns 1 --heads runs/eagle3-smollm2/heads
"""

from __future__ import annotations

from selfspec.base.lazy import lazy_exports

__all__ = [
    "SCHEMA_VERSION",
    "BenchMethod",
    "BenchPrompt",
    "BenchReport",
    "BenchSettings",
    "build_methods",
    "main",
    "markdown_report",
    "read_report",
    "run_bench",
    "run_llamacpp_bench",
    "run_vllm_bench",
    "summary_text",
    "write_report",
]

# Imported on first use: a module of the bench (the report's dataclasses, say) loads without the others.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "SCHEMA_VERSION": "selfspec.bench.report",
        "BenchMethod": "selfspec.bench.methods",
        "BenchPrompt": "selfspec.prompts",
        "BenchReport": "selfspec.bench.report",
        "BenchSettings": "selfspec.bench.methods",
        "build_methods": "selfspec.bench.methods",
        "main": "selfspec.bench.cli",
        "markdown_report": "selfspec.bench.outputs",
        "read_report": "selfspec.bench.report",
        "run_bench": "selfspec.bench.run",
        "run_llamacpp_bench": "selfspec.engines.llamacpp.bench",
        "run_vllm_bench": "selfspec.engines.vllm.bench",
        "summary_text": "selfspec.bench.outputs",
        "write_report": "selfspec.bench.outputs",
    },
)
