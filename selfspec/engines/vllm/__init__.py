"""vLLM's CPU build as an engine of the bench: its record (:mod:`selfspec.engines.vllm.engine`), its bench
(:mod:`selfspec.engines.vllm.bench`) and the worker that runs in its venv (``selfspec/engines/vllm/vllm_worker.py``)."""
