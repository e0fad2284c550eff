"""The vLLM bench engine without vLLM: the speculative config of an export and the refusals, vLLM's counters read
and differenced, a worker speaking the protocol (a stand-in ``vllm`` package under the worker script), and the
report a run makes from rigged workers. vLLM itself runs in the slow tier (tests/export/test_vllm.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfspec.bench.cli import build_parser
from selfspec.bench.driver import run_engine
from selfspec.bench.methods import BenchSettings
from selfspec.bench.outputs import markdown_report, write_report
from selfspec.bench.report import read_report
from selfspec.engines.vllm import bench as engine_mod
from selfspec.engines.vllm.vllm_worker import spec_counters
from selfspec.export.common import ExportError
from selfspec.prompts import BenchPrompt
from tests.helpers.archs import tiny_llama
from tests.helpers.tokenizers import tiny_tokenizer


def _export(tmp_path: Path, kind: str, tokens: int = 3) -> Path:
    config = {
        "speculators_model_type": kind,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": tokens}]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_an_eagle3_export_is_named_eagle3_with_its_own_draft_length(tmp_path):
    spec = engine_mod.speculative_config(_export(tmp_path, "eagle3", 5))
    assert spec == {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 5}
    assert engine_mod.speculative_config(tmp_path, 2)["num_speculative_tokens"] == 2
    assert engine_mod.speculative_config(_export(tmp_path, "dflash", 7))["method"] == "dflash"


def test_dspark_is_refused_naming_vllm_s_code(tmp_path):
    with pytest.raises(ExportError, match=r"vllm/config/vllm\.py.*CPUModelRunner"):
        engine_mod.speculative_config(_export(tmp_path, "dspark"))


@pytest.mark.parametrize("kind", ["mtp", None])
def test_other_speculators_types_are_refused(tmp_path, kind):
    with pytest.raises(ExportError, match="selfspec export --format speculators"):
        engine_mod.speculative_config(_export(tmp_path, kind))


def test_a_draft_length_below_one_is_refused(tmp_path):
    with pytest.raises(ExportError, match=">= 1"):
        engine_mod.speculative_config(_export(tmp_path, "eagle3"), 0)


def test_the_worker_runs_vllm_in_process_offline_with_statistics():
    env = engine_mod.worker_env(2, base={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert engine_mod.worker_env(None, base={})["VLLM_CPU_KVCACHE_SPACE"] == engine_mod.KV_CACHE_GIB
    kwargs = engine_mod.llm_kwargs("/t", {"method": "eagle3"}, 512, 0)
    assert kwargs["disable_log_stats"] is False and kwargs["dtype"] == "float32"
    assert kwargs["speculative_config"] == {"method": "eagle3"} and kwargs["max_model_len"] == 512


def test_counters_are_summed_over_engines_and_differenced_per_call():
    def metric(name, value=None, values=None):
        return SimpleNamespace(name=name, value=value, values=values)

    metrics = [
        metric("vllm:spec_decode_num_drafts", 10),
        metric("vllm:spec_decode_num_drafts", 2),
        metric("vllm:spec_decode_num_draft_tokens", 36),
        metric("vllm:spec_decode_num_accepted_tokens", 9),
        metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 3]),
        metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 0, 0]),
        metric("vllm:num_requests_running", 1),
    ]
    after = spec_counters(metrics)
    assert after == {"drafts": 12, "draft_tokens": 36, "accepted": 9, "accepted_per_pos": [6, 3, 0]}
    assert spec_counters([metric("vllm:num_requests_running", 1)]) == {}
    before = {"drafts": 2, "draft_tokens": 6, "accepted": 1, "accepted_per_pos": [1, 0, 0]}
    stats = engine_mod.spec_stats(before, after)
    assert stats == engine_mod.SpecStats(10, 30, 8, [5, 3, 0])
    assert engine_mod.spec_stats({}, {}) is None
    result = engine_mod.vllm_result({"tokens": [1] * 20, "wall_s": 0.5, "finish_reason": "length"}, stats)
    assert result.tau == pytest.approx(1.8) and result.steps == 10 and result.tokens_per_s == 40.0
    assert result.accepted_by_depth == [5, 3, 0] and result.drafted_by_depth == [10, 10, 10]
    assert result.tree_nodes == 40
    plain = engine_mod.vllm_result({"tokens": [1], "wall_s": 0.1, "finish_reason": "stop"}, None)
    assert plain.tau is None and plain.accepted_by_depth is None


FAKE_VLLM = """
import json, os, sys
from types import SimpleNamespace
__version__ = "0.0-fake"
class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
class LLM:
    def __init__(self, **kw):
        if kw.get("model") == "refuse":
            raise ValueError("no such model")
        print("vLLM chatter on stdout")
        self.spec, self.drafts = kw.get("speculative_config"), 0
    def generate(self, prompts, params, use_tqdm=False):
        self.drafts += 4
        ids = prompts[0]["prompt_token_ids"]
        out = SimpleNamespace(token_ids=ids[::-1][: params.kw["max_tokens"]], finish_reason="length")
        return [SimpleNamespace(outputs=[out], metrics=SimpleNamespace(first_token_latency=0.01))]
    def get_metrics(self):
        if self.spec is None:
            return []
        n = SimpleNamespace
        return [n(name="vllm:spec_decode_num_drafts", value=self.drafts),
                n(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[self.drafts // 2, 0])]
"""


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """An interpreter stand-in: runs the worker script with a fake ``vllm`` package first on its path."""
    (tmp_path / "fake" / "vllm").mkdir(parents=True)
    (tmp_path / "fake" / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    runner = tmp_path / "runner.py"
    runner.write_text(
        f"import runpy, sys\nsys.path.insert(0, {str(tmp_path / 'fake')!r})\nsys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift\nexec {sys.executable} {runner} "$@"\n')  # drops -I
    python.chmod(0o755)
    return python


def test_a_worker_answers_over_json_lines_and_its_counters_are_per_call(fake_python, tmp_path):
    kwargs = engine_mod.llm_kwargs("t", {"method": "eagle3"}, 64, 0)
    worker = engine_mod.VllmWorker(fake_python, kwargs, tmp_path / "w.log", {"PATH": "/usr/bin:/bin"})
    try:
        assert worker.version == "0.0-fake"
        for _ in range(2):  # the second call's counters are its own, not the running totals
            reply, stats = worker.generate({"ids": [1, 2, 3], "max_tokens": 2, "stop_ids": []})
            assert reply["tokens"] == [3, 2] and reply["prefill_s"] == 0.01
            assert stats == engine_mod.SpecStats(4, 0, 0, [2, 0])
    finally:
        worker.close()
    assert "vLLM chatter on stdout" in (tmp_path / "w.log").read_text()


def test_a_worker_that_cannot_load_raises_with_vllm_s_message(fake_python, tmp_path):
    kwargs = engine_mod.llm_kwargs("refuse", None, 64, 0)
    with pytest.raises(RuntimeError, match="vLLM failed: ValueError: no such model"):
        engine_mod.VllmWorker(fake_python, kwargs, tmp_path / "w.log", {"PATH": "/usr/bin:/bin"})


def test_a_missing_venv_names_the_command_that_builds_it(monkeypatch):
    monkeypatch.setattr(engine_mod, "env_works", lambda name: False)
    with pytest.raises(RuntimeError, match="python -m selfspec.engine_envs vllm"):
        engine_mod.require_env()
    args = build_parser().parse_args(["--engine", "vllm", "--spec-tokens", "2"])
    assert args.engine == "vllm" and args.spec_tokens == 2


class RiggedWorker:
    """A worker that answers from fixed outputs: ``tokens`` and, for a head, 2 of 3 positions accepted per step."""

    version = "0.32.0"

    def __init__(self, tokens: list[int], spec: bool) -> None:
        self.tokens, self.spec = tokens, spec

    def generate(self, request):
        reply = {"tokens": self.tokens[: request["max_tokens"]], "wall_s": 0.1 if self.spec else 0.2}
        reply.update(finish_reason="length", peak_rss_mb=100.0)
        return reply, engine_mod.SpecStats(4, 12, 6, [4, 2, 0]) if self.spec else None


def test_a_rigged_run_makes_the_engines_report(tmp_path):
    target, tok = tiny_llama(), tiny_tokenizer()
    settings = BenchSettings(max_new_tokens=6, warmup=0, target_name="tiny", prompts_source="given")
    workers = {
        "vllm": RiggedWorker([10, 11, 12, 13, 14, 15], False),
        "e3": RiggedWorker([10, 11, 12, 13, 14, 15], True),
    }
    workers["bad"] = RiggedWorker([10, 11, 20, 13, 14, 15], True)
    specs = {name: {"method": "eagle3", "num_speculative_tokens": 3} for name in ("e3", "bad")}
    engine = engine_mod.VllmEngine(target, tok, settings, workers, specs, threads=2)
    prompts = [BenchPrompt("q1", "writing", ("hello world",)), BenchPrompt("q2", "coding", ("world",))]
    report = run_engine(engine, target, tok, prompts, settings)
    overall = report.summary["e3"].overall
    assert report.settings.engine == "vllm" and report.settings.reference == "vllm"
    assert overall.speedup == pytest.approx(2.0) and overall.tau == pytest.approx(2.5)
    assert overall.acceptance_by_depth == [1.0, 0.5, 0.0] and overall.mismatches == 0
    bad = report.summary["bad"].overall
    assert bad.mismatches + bad.near_ties == 2 and {m.first_diff for m in report.mismatches + report.ties} == {2}
    paths = write_report(report, tmp_path)
    assert read_report(paths["json"]).settings.engine == "vllm"
    text = markdown_report(report)
    assert "# vLLM bench" in text and "method=eagle3" in text
    # plain vLLM is both the reference and the engine-only baseline: one speedup column, rows as wide as the header
    overall_table = text.split("## Overall")[1].split("\n\n")[1].splitlines()
    assert overall_table[0].count("speedup vs vllm") == 1
    assert {line.count("|") for line in overall_table} == {overall_table[0].count("|")}
    assert "| e3 | 2 | " in text and "| 2.00x | 2.50 | 1.00 / 0.50 / 0.00 |" in text
