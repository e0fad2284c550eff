"""The llama.cpp bench engine without llama.cpp: the settings sweep on rigged timers, its cache, the cost
decomposition and verdicts, and the report a run makes (plain, a head, an n-gram drafter) from rigged
generations. The real llama.cpp runs are in the slow tier (tests/export/test_gguf.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from selfspec.bench.methods import BenchSettings
from selfspec.bench.outputs import markdown_report, summary_text, write_report
from selfspec.bench.report import BenchReport, read_report
from selfspec.engines.llamacpp import bench as engine_mod
from selfspec.engines.llamacpp import settings as tuning
from selfspec.llamacpp import Generation, LlamaCpp
from selfspec.prompts import BenchPrompt
from tests.helpers.archs import tiny_llama
from tests.helpers.tokenizers import tiny_tokenizer

PLAIN_TPS = 100.0
DRAFT_GAIN = {1: 0.0, 2: 0.25, 3: 0.1, 4: 0.0, 6: -0.3}


def rigged_speed(setting) -> float:
    """Tokens/s a setting gets: best at q8_0, draft length 2, p_min 0.5, the target's threads."""
    if setting.spec_type != tuning.HEAD_SPEC_TYPE:
        return PLAIN_TPS * (0.8 + 0.05 * (setting.ngram_size == 3) + 0.02 * (setting.draft_max == 4))
    gain = 1.0 + 0.1 * (setting.outtype == "q8_0") + DRAFT_GAIN[setting.draft_max] + 0.05 * (setting.p_min == 0.5)
    return PLAIN_TPS * (gain - 0.02 * (setting.draft_threads == 1))


def generation(tps: float, text: str = "x", drafted: int = 0, accepted: int = 0, **kw) -> Generation:
    return Generation(text, 5, 64, 64 / tps, drafted, accepted, **kw)


@pytest.fixture
def rigged(monkeypatch, tmp_path):
    """A build that is never run: plain decoding and llama-bench answer from fixed numbers."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "completion", lambda *a, **k: generation(PLAIN_TPS))
    monkeypatch.setattr(
        tuning, "forward_costs", lambda *a, max_tokens, **k: (10.0, [10.0 + 2 * k for k in range(max_tokens)])
    )
    calls = []

    def run(name, setting, text):
        calls.append((name, setting))
        return generation(rigged_speed(setting), drafted=40, accepted=30, draft_calls=20, draft_seconds=0.1)

    return LlamaCpp(tmp_path / "build"), tmp_path / "t.Q4_1.gguf", calls, run


def test_the_sweep_finds_the_best_setting_and_caches_it(rigged):
    build, gguf, calls, run = rigged
    gguf.write_bytes(b"gguf")
    head = gguf.with_name("head.gguf")
    head.write_bytes(b"head")
    methods = {"eagle3": (tuning.HEAD_SPEC_TYPE, head), "ngram_simple": ("ngram-simple", None)}
    choice, source = tuning.choose_settings(build, gguf, ["a", "b"], methods, run, threads=2)
    assert source == "sweep"
    assert choice.chosen["eagle3"] == tuning.head_setting(draft_max=2, p_min=0.5, outtype="q8_0")
    assert choice.chosen["ngram_simple"] == tuning.ngram_setting("ngram-simple", draft_max=4, ngram_size=3)
    points = choice.sweep["eagle3"]
    # 2 GGUF types + 4 new draft lengths + 4 new p_min + 1 new thread count, each measured once
    assert len(points) == len({p.setting for p in points}) == 11
    best = max(points, key=lambda p: p.speedup)
    assert best.speedup == pytest.approx(1.0 + 0.1 + 0.25 + 0.05)
    assert best.tokens_per_step == pytest.approx(64 / 34) and best.acceptance == pytest.approx(0.75)
    assert best.draft_ms_per_cycle == pytest.approx(5.0)  # 0.1 s over 20 calls
    assert choice.forward_ms == [10.0, 12.0, 14.0, 16.0, 18.0] and choice.token_ms == 10.0  # draft_max 4 + 1
    # the second call reads the cache: nothing runs
    n = len(calls)
    again, source = tuning.choose_settings(build, gguf, ["a", "b"], methods, run, threads=2)
    assert source == "cache" and again == choice and len(calls) == n
    # another head file is another question
    head.write_bytes(b"other head")
    _, source = tuning.choose_settings(build, gguf, ["a", "b"], methods, run, threads=2)
    assert source == "sweep"
    # a corrupt cache file is measured again, not trusted
    key = tuning.cache_key(build, gguf, 2, {m: h for m, (_, h) in methods.items()})
    tuning.cache_path(key).write_text('{"version": 1}')
    assert tuning.read_cached(key) is None


def test_setting_args_are_llama_cpp_flags():
    assert tuning.setting_args(tuning.head_setting(draft_max=2, p_min=0.5, draft_threads=1), 2) == [
        "--spec-draft-n-max", "2", "--spec-draft-p-min", "0.5", "--spec-draft-threads", "1",
        "--spec-draft-threads-batch", "1",
    ]  # fmt: skip
    assert tuning.setting_args(tuning.ngram_setting("ngram-mod", 8, 3), 2) == [
        "--spec-ngram-mod-n-match", "3", "--spec-ngram-mod-n-max", "8", "--spec-ngram-mod-n-min", "1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown llama.cpp spec type"):
        tuning.setting_args(dataclasses.replace(tuning.head_setting(), spec_type="medusa"), 2)


def test_the_cost_decomposition_and_a_losing_verdict():
    st = tuning.head_setting(draft_max=3)
    choice = tuning.SettingsChoice(1, "k", {"eagle3": st}, {}, 10.0, [10.0, 11.0, 12.0, 13.0], {"eagle3": 9.0})
    costs = tuning.decomposition(choice, {"eagle3": 15.0})
    assert costs.verify_units == [1.0, 1.1, 1.2, 1.3] and costs.draft_units == {"eagle3": 1.5}
    assert costs.break_even_tau == {"eagle3": pytest.approx(2.8)}  # 4 tokens verified (1.3) + draft (1.5)
    text = engine_mod._verdict("eagle3", 0.64, 1.7, costs, st)
    assert "no setting swept beats plain llama.cpp" in text and "2.80 plain steps" in text and "1.70 tokens" in text
    assert engine_mod._verdict("eagle3", 1.2, 2.5, costs, st).startswith("1.20x plain llama.cpp")


def test_text_difference_counts_the_reference_tokens_before_the_first_differing_character():
    tok = tiny_tokenizer()
    assert engine_mod.text_difference("the sea is blue", "the sea is blue and", tok) is None  # a prefix agrees
    assert engine_mod.text_difference("the sea is blue", "the sea was blue", tok) == 2  # "the sea ", then "is"


class FakeEngine:
    """Plain llama.cpp answers "the sea is blue ..."; the head agrees; the n-gram drafter parts at word 2."""

    def __init__(self, tmp: Path, tokenizer) -> None:
        self.build, self.target_gguf, self.threads, self.tok = LlamaCpp(tmp), tmp / "t.Q4_1.gguf", 2, tokenizer

    def _prompt(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False).input_ids)

    def plain(self, text: str, n: int) -> Generation:
        return Generation("the sea is blue and cold", self._prompt(text), 6, 0.06, 0, 0, 0.01, 0.5)

    def no_draft(self, text: str, n: int) -> Generation:
        return Generation("the sea is blue and cold", self._prompt(text), 6, 0.08, 0, 0, 0.01, 0.5)

    def speculative(self, name, setting, text, n) -> Generation:
        words = "the sea is blue and cold" if name == "eagle3" else "the sea was blue and cold"
        return Generation(words, self._prompt(text), 6, 0.04, 6, 4, 0.01, 0.5, draft_calls=2, draft_seconds=0.01)


def test_the_report_of_a_llama_cpp_run(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    target = tiny_llama()
    monkeypatch.setattr(engine_mod, "is_near_tie", lambda target, ids, reference, i: True)
    kinds = {"eagle3": (tuning.HEAD_SPEC_TYPE, None), "ngram_simple": ("ngram-simple", None)}
    chosen = {"eagle3": tuning.head_setting(draft_max=2), "ngram_simple": tuning.ngram_setting("ngram-simple")}
    choice = tuning.SettingsChoice(1, "k", chosen, {}, 10.0, [10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0, 24.0, 26.0], {})
    prompts = [BenchPrompt("1", "writing", ["tell me about the sea"]), BenchPrompt("2", "math", ["what is two", "why"])]
    settings = BenchSettings(max_new_tokens=6, warmup=1, eos_token_ids=(), prompts_source="q.jsonl")
    report = engine_mod._measure(target, tok, prompts, settings, FakeEngine(tmp_path, tok), choice, "given", kinds)
    s = report.settings
    assert (s.engine, s.reference, s.engine_reference) == ("llamacpp", "llamacpp", "llamacpp_loop")
    assert list(report.methods) == ["llamacpp", "llamacpp_loop", "eagle3", "ngram_simple"] and len(report.samples) == 3
    overall = {n: s.overall for n, s in report.summary.items()}
    assert overall["llamacpp"].speedup == 1.0 and overall["llamacpp_loop"].engine_speedup == 1.0
    assert overall["llamacpp"].mismatches == 0  # the two tools agree here
    assert overall["eagle3"].speedup == pytest.approx(1.5) and overall["eagle3"].engine_speedup == pytest.approx(2.0)
    assert overall["eagle3"].tau == pytest.approx(3.0)
    assert overall["eagle3"].mismatches == 0 and overall["ngram_simple"].mismatches == 0  # a near-tie, not counted
    assert overall["ngram_simple"].near_ties == 3 and [t.first_diff for t in report.ties] == [2, 2, 2]
    assert report.llamacpp.costs.break_even_tau["eagle3"] == pytest.approx(1.4 + 0.5)  # 3 tokens + 5 ms draft
    assert report.llamacpp.verdicts["eagle3"].startswith("1.50x plain llama.cpp")
    paths = write_report(report, tmp_path / "out")
    assert read_report(paths["json"]) == report and BenchReport.from_dict(report.to_dict()) == report
    md = markdown_report(report)
    assert "# llama.cpp bench" in md and "## llama.cpp" in md and "Cost decomposition" in md
    assert "near-tie" in md and "eagle3: 1.50x plain llama.cpp" in summary_text(report)
    assert json.loads(paths["json"].read_text())["llamacpp"]["chosen_by"] == "given"


def test_the_llama_cpp_bench_refuses_what_it_cannot_run(tmp_path):
    tok = tiny_tokenizer()
    sampling = BenchSettings(temperature=0.7)
    kw = dict(build=LlamaCpp(tmp_path), target_gguf=tmp_path / "t.gguf", target_dir=tmp_path)
    with pytest.raises(ValueError, match="decodes greedily"):
        engine_mod.run_llamacpp_bench(tiny_llama(), tok, [], sampling, **kw)
    with pytest.raises(ValueError, match="unknown llama.cpp n-gram methods"):
        engine_mod.run_llamacpp_bench(tiny_llama(), tok, [], BenchSettings(), ngram=["ngram_cache"], **kw)
    with pytest.raises(ValueError, match="is taken"):
        engine_mod.run_llamacpp_bench(tiny_llama(), tok, [], BenchSettings(), heads={"llamacpp": "x"}, **kw)


def test_bench_cli_refuses_a_missing_llama_cpp_build(tmp_path, monkeypatch, capsys):
    from selfspec.bench import cli

    monkeypatch.setattr("selfspec.llamacpp.find_llamacpp", lambda: None)
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: (tiny_llama(), tiny_tokenizer()))
    monkeypatch.setattr(cli, "load_prompts", lambda *a, **k: [BenchPrompt("1", "c", ["hi"])])
    with pytest.raises(SystemExit):
        cli.main(["--engine", "llamacpp", "--out", str(tmp_path)])
    assert "run `python -m selfspec.llamacpp` once" in capsys.readouterr().err
