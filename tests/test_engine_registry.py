"""The engine registry: every built-in engine has a whole record, and an engine defined only under tests/
(``tests/helpers/toy_engine.py``) runs in ``selfspec bench --engine`` (its own flag, its own record beside the report,
its title in the report) and in the export fidelity report beside selfspec, with no edit outside its own file."""

from __future__ import annotations

import json

import pytest

from selfspec.bench import cli, fidelity
from selfspec.bench.report import read_report
from selfspec.engine_envs import ENGINE_ENVS
from selfspec.engines.registry import BUILTIN_ENGINES, engine, engine_title, registered_engines
from selfspec.families import EXPORT_FORMATS, registered_families
from selfspec.prompts import BenchPrompt
from tests.helpers.archs import tiny_target
from tests.helpers.heads import make_eagle3
from tests.helpers.tokenizers import CharTokenizer
from tests.helpers.toy_engine import NAME, PLAIN, RECORD_FILE, oracle_chain_stats

PROMPTS = [BenchPrompt("a", "x", ("hello there, hello",)), BenchPrompt("b", "y", ("abc abc abc",))]


def test_every_built_in_engine_has_a_whole_record():
    assert registered_engines()[: len(BUILTIN_ENGINES)] == tuple(BUILTIN_ENGINES)
    for name in BUILTIN_ENGINES:
        record = engine(name)
        assert record.name == name and record.title and record.help.startswith(name)
        assert record.env is None or record.env in ENGINE_ENVS
        assert record.export_format is None or record.export_format in EXPORT_FORMATS
        assert set(record.families) <= set(registered_families())
        assert record.missing is not None and record.chains is not None
    assert [engine_title(n) for n in BUILTIN_ENGINES] == ["selfspec", "llama.cpp", "vLLM", "OpenVINO GenAI"]
    assert engine_title("elsewhere") == "elsewhere"  # a report from an engine not registered here
    with pytest.raises(ValueError, match="unknown engine 'nope'; choose one of"):
        engine("nope")


def test_the_oracle_chain_statistics_count_every_position():
    assert oracle_chain_stats(8, 3) == {
        "tau": 3.5,
        "steps": 2,
        "accepted_per_step": [4, 3],
        "accepted_by_depth": [2, 2, 2],
        "drafted_by_depth": [2, 2, 2],
    }


@pytest.fixture
def tiny(monkeypatch):
    """The tiny target and its tokenizer given to every command in place of the real loaders."""
    target, tokenizer = tiny_target("llama"), CharTokenizer()
    monkeypatch.setattr("selfspec.target.load_target", lambda *a, **k: (target, tokenizer))
    monkeypatch.setattr(cli, "load_target", lambda *a, **k: (target, tokenizer))
    monkeypatch.setattr("selfspec.prompts.load_prompts", lambda *a, **k: PROMPTS)
    monkeypatch.setattr(cli, "load_prompts", lambda *a, **k: PROMPTS)
    return target, tokenizer


def test_a_test_only_engine_runs_in_the_bench_cli(tiny, tmp_path, capsys):
    args = ["--engine", NAME, "--heads", "h=unused", "--toy-chain", "3", "--max-new-tokens", "8", "--warmup", "0"]
    assert cli.main([*args, "--out", str(tmp_path)]) == 0
    report = read_report(tmp_path / "report.json")
    assert report.settings.engine == NAME and report.settings.reference == PLAIN
    assert list(report.methods) == [PLAIN, "h"] and {m.kind for m in report.methods.values()} == {NAME}
    for sample in report.samples:  # the oracle's tokens are the plain ones, every draft accepted
        h, plain = sample.results["h"], sample.results[PLAIN]
        assert h.matches_reference and h.tokens == plain.tokens and plain.steps is None
        stats = oracle_chain_stats(h.new_tokens, 3)  # the engine's own counts reach the report as they are
        assert (h.steps, h.accepted_by_depth, h.drafted_by_depth) == (
            stats["steps"], stats["accepted_by_depth"], stats["drafted_by_depth"]
        )  # fmt: skip
    assert json.loads((tmp_path / RECORD_FILE).read_text()) == {"chain_lengths": {"h": 3}}
    assert (tmp_path / "report.md").read_text().startswith("# Toy engine bench")
    assert str(tmp_path / RECORD_FILE) in capsys.readouterr().out
    with pytest.raises(SystemExit):  # selfspec's own methods are not the toy engine's
        cli.main([*args, "--methods", "prompt_lookup", "--out", str(tmp_path)])


def test_a_test_only_engine_is_compared_in_the_fidelity_report(tiny, tmp_path):
    target, _ = tiny
    head_dir = str(make_eagle3(target).save_pretrained(tmp_path / "head"))
    assert NAME in fidelity.fidelity_engines()
    out = tmp_path / "fidelity"
    args = ["--heads", head_dir, "--prompts", "p.jsonl", "--engines", "selfspec", NAME, "--chain-lengths", "1", "2"]
    assert fidelity.main([*args, "--max-new-tokens", "8", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads((out / "fidelity.json").read_text())
    rows = {(r["engine"], r["chain_length"]): r for r in report["rows"]}
    assert set(rows) == {("selfspec", 1), ("selfspec", 2), (NAME, 1), (NAME, 2)}
    for k in (1, 2):
        toy = rows[(NAME, k)]
        assert toy["acceptance"][0] == 1.0 and toy["exact"] == toy["outputs"] == len(PROMPTS)
        assert len(rows[("selfspec", k)]["drafted"]) == k
    assert not [s for s in report["shortfalls"] if s["engine"] == NAME]  # the oracle accepts every draft
    assert (out / NAME / "report.json").is_file() and read_report(out / NAME / "report.json").settings.engine == NAME
