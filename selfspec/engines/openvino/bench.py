"""``selfspec bench --engine openvino``: the same prompts, report and plots as the selfspec bench, decoded by OpenVINO
GenAI.

Methods, interleaved per prompt turn in one run (the order rotated from turn to turn):

* ``openvino``: plain OpenVINO GenAI (``LLMPipeline`` on the target's IR), the reference and the engine reference;
* each EAGLE-3 head, converted with the target by optimum-intel's exporter
  (:func:`selfspec.export.openvino.prepare_openvino`, cached per head), as OpenVINO GenAI's speculative pipeline
  with the draft length chosen by measurement (:mod:`selfspec.engines.openvino.settings`, cached).

OpenVINO GenAI builds one pipeline per process and only in its own venv, so every method is a worker process of that
venv (:mod:`selfspec.engines.openvino.openvino_worker`) kept for the whole run, fed token ids (the target
tokenizer's chat template, as the selfspec engine's) and greedy settings; every model is compiled with
:data:`selfspec.export.openvino.FP32_PROPERTIES` (the bf16 default changes plain decoding). tokens/s is the generate
call's wall time in the worker, prefill included. Acceptance per draft position comes from OpenVINO's own
per-iteration token counts (:func:`per_position`). Exactness: every output's tokens against plain OpenVINO's; a
difference where the target's two best logits after the reference's prefix are within
:data:`selfspec.bench.ties.TIE_MARGIN` is a near-tie, reported apart (:func:`selfspec.bench.ties.is_near_tie`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, compare_to_reference, run_engine, settings_record
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import BenchReport, MethodRecord, Mismatch, Result, Sample, SettingsRecord
from selfspec.bench.ties import TIE_MARGIN, is_near_tie
from selfspec.engines.openvino import settings as tuning
from selfspec.engines.worker import EngineWorker
from selfspec.export.openvino import FP32_PROPERTIES, OpenVINOModels, openvino_python, prepare_openvino
from selfspec.heads import load_heads
from selfspec.prompts import BenchPrompt, Message, encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

PLAIN = "openvino"
WORKER = Path(__file__).with_name("openvino_worker.py")


def per_position(batch_sizes: Sequence[int], k: int, max_new_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """Acceptance per draft position from OpenVINO GenAI's tokens per main-model iteration.

    OpenVINO drafts a chain of ``min(k, max_new_tokens - generated - 1)`` tokens per cycle (none once one token is
    left) and a cycle yields its accepted drafts plus one token of the target, so ``batch_sizes[0]`` is the prefill's
    token and each later entry ``1 + accepted``.

    Args:
        batch_sizes: ``m_batch_sizes`` of the main model (the prefill's first).
        k: ``num_assistant_tokens``.
        max_new_tokens: the call's limit.

    Returns:
        ``(accepted_per_step, accepted_by_depth, drafted_by_depth)``: tokens per verification step; per depth d,
        the steps whose accepted chain reached d + 1 and those that drafted a token at d + 1 (lists of length k).

    Raises:
        RuntimeError: a step accepted more than it can have drafted (OpenVINO's counts are not what this reads).
    """
    accepted_by, drafted_by = [0] * k, [0] * k
    generated = batch_sizes[0] if batch_sizes else 0
    steps = list(batch_sizes[1:])
    for size in steps:
        accepted = size - 1
        drafted = max(min(k, max_new_tokens - generated - 1), accepted)
        if accepted < 0 or accepted > k:
            raise RuntimeError(f"an OpenVINO step yielded {size} tokens with num_assistant_tokens {k}: {batch_sizes}")
        for d in range(drafted):
            drafted_by[d] += 1
        for d in range(accepted):
            accepted_by[d] += 1
        generated += size
    return steps, accepted_by, drafted_by


def result_of(reply: dict, k: int | None, max_new_tokens: int, eos: set[int]) -> Result:
    """One worker reply as the report's :class:`Result` (speedups and the comparison filled later)."""
    tokens = reply["tokens"][:max_new_tokens]
    stats = per_position(reply["batch_sizes"], k, max_new_tokens) if k else None
    steps = len(stats[0]) if stats else None
    return Result.of_call(
        tokens,
        reply["wall_s"],
        "stop" if tokens and tokens[-1] in eos else "length",
        tau=(sum(stats[0]) / steps if steps else None) if stats else None,
        steps=steps,
        accepted_per_step=stats[0] if stats else None,
        accepted_by_depth=stats[1] if stats else None,
        drafted_by_depth=stats[2] if stats else None,
        tree_nodes=(steps + sum(stats[2])) if stats else None,
    )


class Worker(EngineWorker):
    """One OpenVINO GenAI pipeline in a process of the ``openvino`` venv
    (:mod:`selfspec.engines.openvino.openvino_worker`), an
    :class:`~selfspec.engines.worker.EngineWorker` stopped between its requests.

    Args:
        python: the venv's interpreter. target: the target's IR. draft: the head's IR (None: plain).
        properties: compile properties of both models.
        log: the file the worker's stderr goes to (its end is quoted in errors).

    Raises:
        RuntimeError: the pipeline could not be built (with the end of the worker's stderr).
    """

    def __init__(self, python: Path, target: Path, draft: Path | None, properties: dict[str, str], log: Path) -> None:
        cmd = [str(python), "-P", str(WORKER), str(target), str(draft or "-"), json.dumps(properties)]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1"}
        super().__init__(cmd, env, log, f"building the OpenVINO GenAI pipeline ({target}, draft {draft})")

    def generate(self, ids: list[int], max_new_tokens: int, k: int | None, stop_ids: Sequence[int]) -> dict:
        """One greedy generate call: the worker's reply (:mod:`selfspec.engines.openvino.openvino_worker`)."""
        request = {"ids": ids, "max_new_tokens": max_new_tokens, "num_assistant_tokens": k, "stop_ids": list(stop_ids)}
        return self.request(request, "an OpenVINO GenAI generate call")


class OpenVINOEngine(BenchEngine):
    """OpenVINO GenAI's methods (the module docstring) on the bench driver.

    Args:
        target, tokenizer: the target as ``transformers`` loads it (near-ties, chat template, stop ids).
        settings: greedy settings.
        workers: method -> its worker (:data:`PLAIN` the plain pipeline).
        lengths: speculative method -> its ``num_assistant_tokens``.
        models: speculative method -> its converted models.
    """

    def __init__(
        self,
        target: PreTrainedModel,
        tokenizer: Any,
        settings: BenchSettings,
        workers: Mapping[str, Worker],
        lengths: Mapping[str, int],
        models: Mapping[str, OpenVINOModels],
    ) -> None:
        self.target, self.tokenizer, self.workers = target, tokenizer, workers
        self.lengths, self.models = dict(lengths), dict(models)
        self.names = [PLAIN, *lengths]
        self.reference = self.engine_reference = PLAIN
        self.device = torch.device("cpu")
        self.eos = set(settings.stop_ids(target, tokenizer))
        self.counters = {name: [0, 0] for name in lengths}  # OpenVINO's own accepted / drafted, summed

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        return encode_messages(self.tokenizer, messages).cpu(), None

    def turn_seed(self, settings: BenchSettings, index: int) -> int:
        """``settings.seed``: greedy, no turn samples."""
        return settings.seed

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        k = self.lengths.get(name)
        reply = self.workers[name].generate(turn.ids.tolist(), settings.max_new_tokens, k, sorted(self.eos))
        if k and not turn.warmup:
            self.counters[name][0] += reply["accepted"]
            self.counters[name][1] += reply["drafted"]
        return Outcome(result_of(reply, k, settings.max_new_tokens, self.eos))

    def compare(
        self, sample: Sample, turn: Turn, outcomes: dict[str, Outcome], settings: BenchSettings
    ) -> tuple[Sample, list[Mismatch], list[Mismatch]]:
        """Tokens against plain OpenVINO's, a difference at a near-tie of the target reported apart."""
        reference = outcomes[PLAIN].result.tokens
        near = lambda i: is_near_tie(self.target, turn.ids, reference, i)  # noqa: E731
        return compare_to_reference(sample, PLAIN, PLAIN, False, near_tie=near)

    def method_records(self) -> dict[str, MethodRecord]:
        methods = {PLAIN: MethodRecord("openvino", "plain OpenVINO GenAI LLMPipeline (fp32), no drafts", None)}
        for name, k in self.lengths.items():
            ids = self.models[name].layer_ids
            text = f"OpenVINO GenAI EAGLE-3 speculative pipeline, num_assistant_tokens {k}, hidden_layers_list {ids}"
            methods[name] = MethodRecord("openvino", text, None)
        return methods

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        return dataclasses.replace(
            settings_record(settings, self.target, torch.device("cpu"), self.eos),
            dtype="float32",
            threads=os.cpu_count() or 0,
            reference=PLAIN,
            engine_reference=PLAIN,
            engine="openvino",
            timing="wall time of the generate call in the worker process, prefill included (time.perf_counter)",
            memory_source="not measured (OpenVINO runs in its own processes)",
        )


def run_openvino_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    *,
    target_dir: Path,
    heads: Mapping[str, str | Path],
    given: Mapping[str, int] | None = None,
    fresh_sweep: bool = False,
) -> tuple[BenchReport, dict[str, Any]]:
    """Run plain OpenVINO GenAI and each EAGLE-3 head on every prompt turn, interleaved.

    Args:
        target, tokenizer: the target as ``transformers`` loads it and its tokenizer.
        prompts: the questions; later turns are conditioned on plain OpenVINO's answers.
        settings: greedy settings (``max_new_tokens``, ``warmup``, ``max_prompt_tokens``, report metadata).
        target_dir: the target's local Hugging Face directory (converted once, cached).
        heads: method name -> EAGLE-3 head directory.
        given: method -> a fixed ``num_assistant_tokens`` instead of the sweep's.
        fresh_sweep: measure the draft lengths again even when a sweep is cached.

    Returns:
        ``(report, record)``: the :class:`BenchReport` (``settings.engine == "openvino"``) and the engine's record
        (layer ids, the draft lengths and their sweep, OpenVINO's own counters), which the CLI writes as
        ``openvino.json``.

    Raises:
        ValueError: sampling asked for, no heads, a taken name, no prompt turn fits.
        selfspec.export.common.ExportError: a head OpenVINO would not run or would misread.
        RuntimeError: the ``openvino`` venv is missing (the message names the command), a conversion or a pipeline
            failed. Nothing falls back to another engine.
    """
    if settings.do_sample:
        raise ValueError("the OpenVINO bench decodes greedily (its EAGLE-3 pipeline is greedy only): --temperature 0")
    if not heads or PLAIN in heads:
        raise ValueError(f"--engine openvino needs --heads (EAGLE-3 heads), none named {PLAIN!r}")
    python = openvino_python()
    models = {name: prepare_openvino(load_heads(path, target), target_dir) for name, path in heads.items()}
    target_ir = next(iter(models.values())).target
    version = subprocess.run(
        [str(python), "-P", "-c", "import openvino_genai; print(openvino_genai.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    workers: dict[str, Worker] = {}
    logs = tempfile.TemporaryDirectory(prefix="selfspec-openvino-")
    try:
        workers[PLAIN] = Worker(python, target_ir, None, FP32_PROPERTIES, Path(logs.name) / f"{PLAIN}.log")
        for name, m in models.items():
            workers[name] = Worker(python, m.target, m.draft, m.properties, Path(logs.name) / f"{name}.log")
        eos = sorted(settings.stop_ids(target, tokenizer))
        if given is not None and set(given) >= set(heads):
            choice, chosen_by = tuning.DraftLengthChoice(tuning.SWEEP_VERSION, "given", dict(given), {}), "given"
        else:
            calib = [
                encode_messages(tokenizer, [{"role": "user", "content": p}]).tolist()
                for p in tuning.CALIBRATION_PROMPTS
            ]

            def call(method: str, ids: list[int], k: int | None) -> dict:
                return workers[method or PLAIN].generate(ids, tuning.CALIBRATION_TOKENS, k, eos)

            key = tuning.cache_key(version, os.cpu_count(), target_ir, {n: m.draft for n, m in models.items()})
            choice, chosen_by = tuning.choose_draft_lengths(key, list(heads), calib, call, fresh=fresh_sweep)
        lengths = {name: choice.chosen[name] for name in heads}
        engine = OpenVINOEngine(target, tokenizer, settings, workers, lengths, models)
        report = run_engine(engine, target, tokenizer, prompts, settings)
    finally:
        for worker in workers.values():
            worker.close()
        logs.cleanup()
    record = {
        "openvino_genai": version,
        "target_ir": str(target_ir),
        "heads": {
            name: {
                "draft_ir": str(m.draft),
                "target_layers": m.target_layers,
                "hidden_layers_list": m.layer_ids,
                "num_assistant_tokens": lengths[name],
                "openvino_accepted_drafted": engine.counters[name],
                "acceptance_by_position": report.summary[name].overall.acceptance_by_depth,
                "speedup": report.summary[name].overall.speedup,
            }
            for name, m in models.items()
        },
        "properties": FP32_PROPERTIES,
        "chosen_by": chosen_by,
        "sweep": {name: [dataclasses.asdict(p) for p in pts] for name, pts in choice.sweep.items()},
        "tie_margin": TIE_MARGIN,
    }
    return report, record
