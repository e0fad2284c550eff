"""``selfspec bench --engine vllm``: the same prompts, report and plots as the selfspec bench, decoded by vLLM's CPU
build in its own venv (``python -m selfspec.engine_envs vllm``).

Methods, interleaved per prompt turn in one run (the order rotated from turn to turn):

* ``vllm``: plain vLLM (``vllm.LLM`` on the target, no speculative config), the reference and the engine-only
  baseline at once: vLLM without drafts is plain vLLM;
* each head, exported to the speculators layout by :func:`selfspec.export.cli.export_heads` and given to vLLM as
  ``speculative_config={"method": ..., "model": EXPORT_DIR, "num_speculative_tokens": k}`` (:func:`speculative_config`):
  EAGLE-3 and EAGLE-3.1 heads as ``eagle3``, DFlash heads as ``dflash``. The method is named explicitly: without it
  vLLM would take the folder for a plain draft model. DSpark heads are refused (:data:`CPU_REFUSED`).

Each method is one long-lived worker process in the vLLM venv (:mod:`selfspec.engines.vllm.vllm_worker`, JSON lines over
its stdin and stdout) holding its ``vllm.LLM``, loaded once; prompts go in as token ids (the target's chat template,
rendered here), greedy or sampled as the settings say, fp32, eager mode (no ``torch.compile``). tokens/s is the
whole ``LLM.generate`` call, prefill included. Acceptance is vLLM's own counters
(``vllm:spec_decode_num_drafts``, ``..._num_accepted_tokens_per_pos``: :func:`spec_stats`), read after every call.

Exactness (greedy): every output's token ids against plain vLLM's. vLLM's batched verification does other arithmetic
than its one-token decode, so where the target's two best logits (``transformers``, fp32, after the reference's
prefix) are within :data:`~selfspec.bench.ties.TIE_MARGIN`, a difference is a near-tie: reported apart, not
counted as a mismatch, as in the llama.cpp engine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, compare_to_reference, prompt_limit, run_engine
from selfspec.bench.driver import settings_record as base_settings_record
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import BenchReport, MethodRecord, Mismatch, Result, Sample, SettingsRecord
from selfspec.bench.ties import is_near_tie
from selfspec.decode.drafters.base import context_length
from selfspec.engine_envs import env_python, env_works
from selfspec.engines.worker import EngineWorker
from selfspec.export.cli import export_heads
from selfspec.export.common import ExportError
from selfspec.heads import load_heads
from selfspec.prompts import BenchPrompt, Message, encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

PLAIN = "vllm"
VLLM_VERSION = "0.32.0"
WORKER = Path(__file__).with_name("vllm_worker.py")
VLLM_METHODS = {"eagle3": "eagle3", "dflash": "dflash"}
"""speculators ``speculators_model_type`` -> vLLM's ``speculative_config["method"]`` for the heads vLLM's CPU platform
computes."""
CPU_REFUSED = {
    "dspark": (
        f"vLLM {VLLM_VERSION} runs DSpark only in its V2 GPU model runner: vllm/config/vllm.py, "
        "VllmConfig._get_v1_model_runner_unsupported_features ('DSpark is implemented only by the V2 GPU model "
        "runner'), and the CPU platform runs the V1 runner (vllm/v1/worker/cpu_model_runner.py, CPUModelRunner, a "
        "subclass of vllm/v1/worker/gpu_model_runner.py GPUModelRunner; vllm/config/vllm.py: 'Model Runner V2 "
        "requires Triton'); bench the DSpark head in selfspec or llama.cpp (--engine llamacpp)"
    ),
}
"""speculators ``speculators_model_type`` -> why vLLM's CPU build cannot run it (read from vLLM's code)."""
KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` of each worker unless set already (GiB; vLLM's CPU KV cache is allocated up front)."""


def speculative_config(export_dir: str | Path, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """vLLM's ``speculative_config`` for a head exported to the speculators layout.

    Args:
        export_dir: the export (its ``config.json`` names ``speculators_model_type``).
        num_speculative_tokens: draft tokens per step; None: the export's own
            (``speculators_config.proposal_methods[0].speculative_tokens``).

    Returns:
        ``{"method", "model", "num_speculative_tokens"}``.

    Raises:
        ExportError: a family vLLM's CPU build does not run (:data:`CPU_REFUSED`, naming vLLM's code), or one that is
            not a speculators head; ``num_speculative_tokens < 1``.
    """
    config = json.loads((Path(export_dir) / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind in CPU_REFUSED:
        raise ExportError(f"vLLM's CPU build cannot run a {kind} head: {CPU_REFUSED[kind]}")
    if kind not in VLLM_METHODS:
        raise ExportError(
            f"{export_dir} is a speculators {kind!r} head; the vLLM bench runs {sorted(VLLM_METHODS)} heads exported "
            "with `selfspec export --format speculators`"
        )
    if num_speculative_tokens is None:
        methods = config.get("speculators_config", {}).get("proposal_methods") or [{}]
        num_speculative_tokens = int(methods[0].get("speculative_tokens", 3))
    if num_speculative_tokens < 1:
        raise ExportError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    return {"method": VLLM_METHODS[kind], "model": str(export_dir), "num_speculative_tokens": num_speculative_tokens}


def llm_kwargs(target_dir: str | Path, spec: Mapping[str, Any] | None, max_model_len: int, seed: int) -> dict:
    """The keyword arguments of ``vllm.LLM`` for one method: the target fp32, eager (no ``torch.compile``: minutes
    on 2 cores), statistics on (``LLM.get_metrics`` holds the speculative counters only then), ``spec`` or None."""
    return {
        "model": str(target_dir),
        "dtype": "float32",
        "max_model_len": max_model_len,
        "seed": seed,
        "enforce_eager": True,
        "disable_log_stats": False,
        "speculative_config": dict(spec) if spec is not None else None,
    }


def worker_env(threads: int | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: ``base`` (default this process's) with vLLM's engine core in the worker's own
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no second process polling the 2 cores), offline, no usage
    reports, :data:`KV_CACHE_GIB` unless set, and vLLM's OpenMP threads bound to cores ``0 .. threads - 1``
    (None: vLLM's own choice, every core)."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    return env


@dataclasses.dataclass(frozen=True)
class SpecStats:
    """vLLM's speculative counters over one call (the difference of the cumulative totals after and before it).

    Attributes:
        drafts: verification steps with drafts (``vllm:spec_decode_num_drafts``).
        draft_tokens: tokens drafted.
        accepted: drafted tokens accepted.
        accepted_per_pos: ``[d]``: steps whose draft at position d+1 was accepted (vLLM accepts a prefix, so this is
            also the steps whose accepted path reached depth d+1).
    """

    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: list[int]


def spec_stats(before: Mapping[str, Any], after: Mapping[str, Any]) -> SpecStats | None:
    """The counters of one call from the worker's cumulative totals (``counters`` of
    :mod:`selfspec.engines.vllm.vllm_worker`) before and after it; None when vLLM reported none (no speculative
    decoding)."""
    if "drafts" not in after:
        return None
    per_after = list(after.get("accepted_per_pos", []))
    per_before = list(before.get("accepted_per_pos", [])) + [0] * len(per_after)
    return SpecStats(
        drafts=after["drafts"] - before.get("drafts", 0),
        draft_tokens=after.get("draft_tokens", 0) - before.get("draft_tokens", 0),
        accepted=after.get("accepted", 0) - before.get("accepted", 0),
        accepted_per_pos=[a - b for a, b in zip(per_after, per_before, strict=False)],
    )


def vllm_result(reply: Mapping[str, Any], stats: SpecStats | None) -> Result:
    """One worker reply as the report's :class:`Result` (speedups and the comparison filled later): ``steps`` vLLM's
    drafting steps, ``tau`` tokens per such step (``1 + accepted / drafts``), ``accepted_by_depth`` its per-position
    counts, ``drafted_by_depth`` the steps (every step drafts every position), ``tree_nodes`` drafts plus roots."""
    tokens = list(reply["tokens"])
    wall = float(reply["wall_s"])
    spec = stats is not None and stats.drafts > 0
    return Result.of_call(
        tokens,
        wall,
        reply["finish_reason"],
        peak_memory_mb=float(reply.get("peak_rss_mb") or 0.0),
        tau=1.0 + stats.accepted / stats.drafts if spec else None,
        steps=stats.drafts if spec else None,
        accepted_by_depth=list(stats.accepted_per_pos) if spec else None,
        drafted_by_depth=[stats.drafts] * len(stats.accepted_per_pos) if spec else None,
        tree_nodes=stats.draft_tokens + stats.drafts if spec else None,
        prefill_s=reply.get("prefill_s"),
    )


class VllmWorker(EngineWorker):
    """One :mod:`selfspec.engines.vllm.vllm_worker` process (an :class:`~selfspec.engines.worker.EngineWorker`, stopped
    between its requests): its ``vllm.LLM`` loaded once, a request per call.

    Args:
        python: the vLLM venv's interpreter.
        kwargs: ``vllm.LLM``'s keyword arguments (:func:`llm_kwargs`).
        log: the file vLLM's own output goes to (its end is quoted in errors).
        env: the worker's environment (:func:`worker_env`).

    Raises:
        RuntimeError: vLLM refused or failed to load (its message and the end of its log).
    """

    def __init__(self, python: Path, kwargs: Mapping[str, Any], log: Path, env: Mapping[str, str]) -> None:
        self.counters: dict[str, Any] = {}
        # -I: the worker's folder (with this module, named vllm) must not shadow the vllm package
        cmd = [str(python), "-I", str(WORKER), json.dumps({"llm": dict(kwargs)})]
        super().__init__(cmd, env, log, "vLLM")
        self.version, self.load_s = self.ready["vllm"], self.ready["load_s"]

    def generate(self, request: Mapping[str, Any]) -> tuple[dict[str, Any], SpecStats | None]:
        """One ``LLM.generate`` (the worker's request fields); returns its reply and the call's
        :class:`SpecStats`."""
        reply = self.request(request, "vLLM")
        stats = spec_stats(self.counters, reply["counters"])
        self.counters = reply["counters"]
        return reply, stats


def _render(tokenizer: Any, messages: Sequence[Message]) -> tuple[torch.Tensor, None]:
    """The chat template's token ids (vLLM is given ids, never text)."""
    return encode_messages(tokenizer, messages), None


class VllmEngine(BenchEngine):
    """vLLM's methods (the module docstring) on the bench driver: one :class:`VllmWorker` per method, exactness by
    token ids against :data:`PLAIN` with near-ties of the target allowed.

    Args:
        target: the target as ``transformers`` loads it (the near-tie check, the stop ids).
        tokenizer: its tokenizer (the chat template).
        settings: the run's settings (the stop ids).
        workers: method name -> its worker, :data:`PLAIN` among them.
        specs: head method name -> its ``speculative_config``.
        threads: vLLM's OpenMP threads (None: vLLM's default).
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: Any,
        settings: BenchSettings,
        workers: Mapping[str, VllmWorker],
        specs: Mapping[str, Mapping[str, Any]],
        threads: int | None,
    ) -> None:
        self.target, self.tokenizer, self.workers, self.specs = target, tokenizer, dict(workers), dict(specs)
        self.names = [PLAIN, *specs]
        self.reference = self.engine_reference = PLAIN
        self.device = torch.device("cpu")
        self.threads = threads
        self.eos = sorted(set(settings.stop_ids(target, tokenizer)))

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        return _render(self.tokenizer, messages)

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        """One ``LLM.generate`` in the method's worker."""
        request = {
            "ids": turn.ids.tolist(),
            "max_tokens": settings.max_new_tokens,
            "stop_ids": self.eos,
            "temperature": settings.temperature if settings.do_sample else 0.0,
            "top_p": settings.top_p,
            "seed": settings.seed,
        }
        reply, stats = self.workers[name].generate(request)
        return Outcome(vllm_result(reply, stats))

    def compare(
        self, sample: Sample, turn: Turn, outcomes: dict[str, Outcome], settings: BenchSettings
    ) -> tuple[Sample, list[Mismatch], list[Mismatch]]:
        """Token ids against plain vLLM's, a difference at a near-tie of the target (:func:`is_near_tie`) reported
        apart."""
        reference = outcomes[PLAIN].result.tokens
        return compare_to_reference(
            sample,
            PLAIN,
            PLAIN,
            settings.do_sample,
            near_tie=lambda i: is_near_tie(self.target, turn.ids, reference, i),
        )

    def method_records(self) -> dict[str, MethodRecord]:
        version = self.workers[PLAIN].version
        methods = {PLAIN: MethodRecord("vllm", f"plain vLLM {version} (vllm.LLM, fp32, eager), no drafts", None)}
        for name, spec in self.specs.items():
            methods[name] = MethodRecord(
                "vllm",
                f"vLLM {version} speculative_config method={spec['method']}, num_speculative_tokens="
                f"{spec['num_speculative_tokens']}, the head exported to the speculators layout",
                None,
            )
        return methods

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        """The selfspec run's record (:func:`selfspec.bench.driver.settings_record`) with what vLLM does otherwise."""
        return dataclasses.replace(
            base_settings_record(settings, self.target, self.device, set(self.eos)),
            threads=self.threads or os.cpu_count() or 0,
            reference=PLAIN,
            engine_reference=PLAIN,
            engine="vllm",
            timing="wall time of the whole vllm.LLM.generate call in the worker, prefill included",
            memory_source="the method's vLLM worker process's peak RSS (ru_maxrss), loading included",
        )


def require_env() -> Path:
    """The vLLM venv's interpreter.

    Raises:
        RuntimeError: the venv is not built (or fails its probe); the message names the command that builds it.
    """
    if not env_works("vllm"):
        raise RuntimeError(
            f"the vLLM bench needs vLLM's CPU build in its own environment ({env_python('vllm').parent.parent}), "
            "which is missing or broken: build it once with `python -m selfspec.engine_envs vllm` (about 2 minutes)"
        )
    return env_python("vllm")


def run_vllm_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    *,
    target_dir: str | Path,
    heads: Mapping[str, str | Path] | None = None,
    num_speculative_tokens: int | Mapping[str, int] | None = None,
    threads: int | None = None,
) -> BenchReport:
    """Run plain vLLM and each head in vLLM on every prompt turn, interleaved (the module docstring).

    Args:
        target: the target as ``transformers`` loads it (the near-tie check, the context limit, the stop ids).
        tokenizer: its tokenizer (chat template).
        prompts: the questions; later turns are conditioned on plain vLLM's answers.
        settings: generation settings and report metadata.
        target_dir: the target's local Hugging Face directory, which vLLM loads.
        heads: method name -> head directory (EAGLE-3, EAGLE-3.1 or DFlash heads of this target).
        num_speculative_tokens: draft tokens per step for every head, or head method name -> its own; None: each
            export's own.
        threads: vLLM's OpenMP threads (None: vLLM's default, every core).

    Returns:
        The :class:`BenchReport` (``settings.engine == "vllm"``).

    Raises:
        RuntimeError: the vLLM venv is missing (:func:`require_env`), or vLLM failed to load or decode (its message
            and the end of its log). Nothing falls back to another engine.
        ValueError: a taken method name, no prompt turn fits.
        selfspec.export.common.ExportError: a head the speculators layout or vLLM's CPU build cannot hold
            (:func:`speculative_config`), before anything is measured.
    """
    python = require_env()
    heads = dict(heads or {})
    if PLAIN in heads:
        raise ValueError(f"head method name {PLAIN!r} is taken; pass it as NAME=DIR with another name")
    limit = prompt_limit(target, settings)
    context = context_length(target) or (limit or 2048) + settings.max_new_tokens
    max_model_len = min(context, (limit or context) + settings.max_new_tokens + 64)
    env = worker_env(threads)
    with tempfile.TemporaryDirectory(prefix="selfspec-vllm-") as tmp:
        specs = {}
        for name, path in heads.items():  # every head exported and checked before anything is measured
            out = Path(tmp) / name
            export_heads(load_heads(path, target), "speculators", out, target_name_or_path=str(target_dir))
            k = (
                num_speculative_tokens.get(name)
                if isinstance(num_speculative_tokens, Mapping)
                else num_speculative_tokens
            )
            specs[name] = speculative_config(out, k)
        workers: dict[str, VllmWorker] = {}
        try:
            for name, spec in {PLAIN: None, **specs}.items():
                kwargs = llm_kwargs(target_dir, spec, max_model_len, settings.seed)
                workers[name] = VllmWorker(python, kwargs, Path(tmp) / f"{name}.log", env)
                logger.info("vLLM %s loaded in %.1f s", name, workers[name].load_s)
            engine = VllmEngine(target, tokenizer, settings, workers, specs, threads)
            return run_engine(engine, target, tokenizer, prompts, settings)
        finally:
            for worker in workers.values():
                worker.close()
