"""Export fidelity (selfspec.bench.fidelity): acceptance per draft position read alike from every engine's report, the
table, and the verdict against selfspec beyond the binomial noise bound."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from pathlib import Path

import pytest

from selfspec.base.files import read_json
from selfspec.bench import fidelity
from selfspec.bench.driver import summarize
from selfspec.bench.report import (
    SCHEMA_VERSION,
    BenchReport,
    EnvironmentRecord,
    MethodRecord,
    Result,
    Sample,
    SettingsRecord,
)
from selfspec.engines.llamacpp.bench import depth_counts
from selfspec.engines.openvino.bench import result_of
from selfspec.engines.vllm.bench import SpecStats, vllm_result
from selfspec.llamacpp import Generation, LlamaCpp, speculative_simple


def _result(tokens: int = 8, by_depth: tuple[list[int], list[int]] | None = None, **kw) -> Result:
    """A result as the engines write one; ``by_depth``: ``(accepted_by_depth, drafted_by_depth)``."""
    fields = dict(
        new_tokens=tokens, wall_s=1.0, tokens_per_s=float(tokens), speedup=None, engine_speedup=None,
        peak_memory_mb=0.0, finish_reason="length", tau=None, steps=None, accepted_per_step=None,
        accepted_by_depth=by_depth[0] if by_depth else None, drafted_by_depth=by_depth[1] if by_depth else None,
        tree_nodes=None, prefill_s=None, draft_s=None, verify_s=None, matches_reference=True, first_diff=None,
        near_tie=None, tokens=[1] * tokens,
    )  # fmt: skip
    return Result(**{**fields, **kw})


def _report(engine: str, reference: str, results: dict[str, list[Result]]) -> BenchReport:
    """A bench report of one engine: one prompt turn per result of each method."""
    turns = len(next(iter(results.values())))
    samples = [
        Sample(f"q{i}", "writing", 1, 10, 0, {name: rs[i] for name, rs in results.items()}) for i in range(turns)
    ]
    settings = SettingsRecord(
        target="t", dtype="float32", device="cpu", threads=2, max_new_tokens=16, do_sample=False, temperature=0.0,
        top_p=1.0, top_k=0, seed=0, warmup=0, max_prompt_tokens=None, eos_token_ids=[2], reference=reference,
        engine_reference=reference, engine=engine, timing="wall", prompts_source="p.jsonl", tree_nodes=None,
        draft_model=None, memory_source="none",
    )  # fmt: skip
    return BenchReport(
        schema_version=SCHEMA_VERSION, created_utc="now", settings=settings,
        environment=EnvironmentRecord("3", "linux", "2", "5", 2, None),
        methods={n: MethodRecord("custom", n, None) for n in results}, categories=["writing"], samples=samples,
        skipped=[], mismatches=[], ties=[], summary={n: summarize(samples, n, ["writing"], False) for n in results},
        llamacpp=None,
    )  # fmt: skip


def _fake_speculative_simple(tmp_path: Path, steps: list[tuple[int, int]], drafted: int | None = None) -> LlamaCpp:
    """A ``llama-speculative-simple`` that echoes the prompt, writes ``hi`` and prints, as llama.cpp does at
    ``-lv 5``, a token piece that is not whole UTF-8, one line per verification step (``steps``: accepted,
    drafted) and its totals (``drafted``: another total than the steps' own, to break the format)."""
    tool = tmp_path / "bin" / "llama-speculative-simple"
    tool.parent.mkdir(parents=True, exist_ok=True)
    total = sum(d for _, d in steps) if drafted is None else drafted
    trace = [
        "0.03.147.870 I encoded    5 tokens in    0.010 seconds",
        *(f"0.03.147.{i:03d} D accepted {a}/{d} draft tokens, the last target token is: (42)" for i, (a, d) in
          enumerate(steps)),
        "0.03.147.870 I decoded   10 tokens in    0.100 seconds",
        f"0.03.147.871 I n_drafted = {total}",
        f"0.03.147.871 I n_accept  = {sum(a for a, _ in steps)}",
        "0.03.147.915 I spec common_specu: statistics     draft-eagle3: #calls(b,g,a) =    1      8      8, #gen "
        "drafts =      3, dur(b,g,a) = 0.000, 0.007, 0.002 ms",
    ]  # fmt: skip
    tool.write_text(
        f"#!{sys.executable}\nimport sys\nprompt = sys.argv[sys.argv.index('-p') + 1]\n"
        f"sys.stdout.write('\\n\\n' + prompt + 'hi\\n\\n\\n\\n')\nsys.stderr.write({chr(10).join(trace)!r})\n"
        "sys.stderr.flush()\nsys.stderr.buffer.write(b' - draft candidate: half a character \\xe2\\x80\\n')\n"
    )  # the debug lines print single tokens' pieces: not always whole UTF-8 characters
    os.chmod(tool, 0o755)
    return LlamaCpp(tmp_path)


def test_llama_cpp_s_per_step_lines_are_read_into_counts_per_position(tmp_path):
    steps = [(2, 3), (0, 3), (1, 2), (0, 0), (3, 3)]  # a cut draft (2 tokens) and a step without a draft among them
    g = speculative_simple(_fake_speculative_simple(tmp_path, steps), tmp_path / "t.gguf", "Q:", spec_type="x")
    assert (g.text, g.drafted, g.accepted, g.draft_calls) == ("hi", 11, 6, 8)
    assert g.draft_steps == ((2, 3), (0, 3), (1, 2), (3, 3))
    assert depth_counts(g) == ([3, 2, 1], [4, 4, 3])  # position 3: the cut draft never had it
    assert depth_counts(dataclasses.replace(g, draft_steps=())) is None
    broken = _fake_speculative_simple(tmp_path, steps, drafted=12)
    with pytest.raises(RuntimeError, match="add up to 11 drafted and 6 accepted tokens, its totals say 12 and 6"):
        speculative_simple(broken, tmp_path / "t.gguf", "Q:", spec_type="x")


def _engine_reports() -> dict[str, BenchReport]:
    """A chain of 2 in each engine, its counts written the way that engine writes them."""
    per_step = [3] * 5 + [2] * 3 + [1] * 2  # selfspec's statistics: 10 steps, 8 reached depth 1, 5 depth 2
    ours = _result(by_depth=([8, 5], [10, 10]), steps=10, accepted_per_step=per_step)
    ours = _report("selfspec", "baseline", {"baseline": [_result()], "chain2": [ours]})
    stats = SpecStats(drafts=10, draft_tokens=20, accepted=6, accepted_per_pos=[5, 1])  # vLLM's counters
    reply = {"tokens": [1] * 16, "wall_s": 1.0, "finish_reason": "length"}
    exact = dict(matches_reference=True)  # the driver's comparison, done after the engine's result
    vllm = _report(
        "vllm", "vllm", {"vllm": [_result()], "chain2": [dataclasses.replace(vllm_result(reply, stats), **exact)]}
    )
    reply = {"tokens": [5, 6, 7, 8, 2], "wall_s": 0.5, "batch_sizes": [1, 3, 1], "accepted": 2, "drafted": 4}
    ov = dataclasses.replace(result_of(reply, 2, 8, {2}), **exact)  # OpenVINO's per-iteration counts
    ov = _report("openvino", "openvino", {"openvino": [_result()], "chain2": [ov]})
    per_step = ((2, 2),) * 6 + ((1, 2),) * 3 + ((0, 2),)  # llama.cpp's per-step lines: 10 drafts of 2
    counts = depth_counts(Generation("hi", 5, 26, 1.0, 20, 15, draft_calls=10, draft_steps=per_step))
    tie = dict(matches_reference=False, near_tie=True, first_diff=3, tau=2.5, steps=10)
    llama = _report("llamacpp", "llamacpp", {"llamacpp": [_result()], "chain2": [_result(by_depth=counts, **tie)]})
    return {"selfspec": ours, "vllm": vllm, "openvino": ov, "llamacpp": llama}


def test_rows_read_acceptance_per_position_from_every_engine_s_report():
    reports = _engine_reports()
    rows = {e: fidelity.fidelity_row(r, e, 2) for e, r in reports.items()}
    assert (rows["selfspec"].accepted, rows["selfspec"].drafted, rows["selfspec"].acceptance) == (
        [8, 5], [10, 10], [0.8, 0.5],
    )  # fmt: skip
    assert (rows["vllm"].accepted, rows["vllm"].drafted, rows["vllm"].tau) == ([5, 1], [10, 10], 1.6)
    assert (rows["openvino"].accepted, rows["openvino"].drafted, rows["openvino"].tau) == ([1, 1], [2, 2], 2.0)
    assert (rows["llamacpp"].accepted, rows["llamacpp"].drafted) == ([9, 6], [10, 10])
    assert (rows["llamacpp"].exact, rows["llamacpp"].near_ties, rows["llamacpp"].outputs) == (0, 1, 1)
    assert (rows["vllm"].exact, rows["vllm"].reference) == (1, "vllm")


def test_a_row_without_counts_or_longer_than_its_chain_is_refused():
    plain = _report("llamacpp", "llamacpp", {"llamacpp": [_result()], "chain2": [_result()]})
    with pytest.raises(ValueError, match="llamacpp: method 'chain2' reported no acceptance per draft position"):
        fidelity.fidelity_row(plain, "llamacpp", 2)
    deep = _report("vllm", "vllm", {"vllm": [_result()], "chain1": [_result(by_depth=([3, 1], [4, 4]))]})
    with pytest.raises(ValueError, match="not run as a chain of 1"):
        fidelity.fidelity_row(deep, "vllm", 1)
    with pytest.raises(ValueError, match="no method 'chain3'"):
        fidelity.fidelity_row(deep, "vllm", 3)


def test_the_noise_bound_is_the_pooled_binomial_standard_error():
    # 40/50 against 20/50: p = 0.6, se = sqrt(0.24 * 0.04)
    assert fidelity.pooled_standard_error(40, 50, 20, 50) == pytest.approx(math.sqrt(0.0096))
    assert fidelity.pooled_standard_error(5, 5, 5, 5) == 0.0
    with pytest.raises(ValueError, match="drafted tokens"):
        fidelity.pooled_standard_error(1, 0, 1, 2)


def _row(engine: str, accepted: list[int], drafted: list[int]) -> fidelity.FidelityRow:
    rates = [a / n if n else None for a, n in zip(accepted, drafted, strict=True)]
    return fidelity.FidelityRow(engine, len(drafted), drafted, accepted, rates, 1.5, 2, 2, 0, "plain")


def test_only_a_shortfall_beyond_the_bound_is_noted():
    rows = [
        _row("selfspec", [40, 30], [50, 50]),
        _row("vllm", [36, 30], [50, 50]),  # 0.08 below at 1: under two standard errors (0.085 each)
        _row("openvino", [20, 31], [50, 50]),  # 0.40 below at 1: 4.1 standard errors; above at 2
        _row("llamacpp", [0, 0], [0, 0]),  # drafted nothing: nothing to compare
    ]
    (found,) = fidelity.shortfalls(rows)
    assert (found.engine, found.chain_length, found.position) == ("openvino", 2, 1)
    assert (found.selfspec_rate, found.engine_rate) == (0.8, 0.4)
    assert found.z == pytest.approx(0.4 / math.sqrt(0.0096))
    assert fidelity.shortfalls(rows, z=5.0) == []
    assert fidelity.shortfalls([_row("vllm", [1, 1], [2, 2])]) == []  # no selfspec row: nothing to compare


def test_the_report_and_its_table(tmp_path):
    reports = _engine_reports()
    report = fidelity.build_report(reports, [2], head="runs/e3/heads", target="t", prompts="p.jsonl")
    assert [(r.engine, r.chain_length) for r in report.rows] == [
        ("selfspec", 2), ("llamacpp", 2), ("vllm", 2), ("openvino", 2),
    ]  # fmt: skip
    # vLLM's 1/10 at position 2 against selfspec's 5/10: p = 0.3, se = sqrt(0.21 * 0.2) = 0.205, 1.95 se: noise
    assert [(s.engine, s.position) for s in report.shortfalls] == []
    assert (report.num_turns, report.max_new_tokens, report.z) == (1, 16, 2.0)
    json_path, md_path = fidelity.write_fidelity(report, tmp_path)
    assert read_json(json_path)["rows"][2]["accepted"] == [5, 1]
    table = md_path.read_text()
    assert "| engine | k | pos 1 | pos 2 | tau | drafted | accepted | exact |" in table
    assert "| selfspec | 2 | 0.80 (8/10) | 0.50 (5/10) | 2.30 | 20 | 13 | 1/1 |" in table
    assert "| llamacpp | 2 | 0.90 (9/10) | 0.60 (6/10) | 2.50 | 20 | 15 | 0/1 (+1 near-tie) |" in table
    assert "| vllm | 2 | 0.50 (5/10) | 0.10 (1/10) | 1.60 | 20 | 6 | 1/1 |" in table
    assert "No engine accepts less than selfspec beyond that bound." in table
    worse = dataclasses.replace(report, shortfalls=fidelity.shortfalls(report.rows, z=1.0))
    notes = [line for line in fidelity.fidelity_markdown(worse).splitlines() if line.startswith("- **")]
    assert notes == [
        "- **vllm**, chain of 2, position 1: 0.50 against selfspec's 0.80, 1.4 standard errors (0.213) below: the "
        "engine computes the head differently here (vocabulary map, a norm, the fused layers, rotary positions).",
        "- **vllm**, chain of 2, position 2: 0.10 against selfspec's 0.50, 2.0 standard errors (0.205) below: the "
        "engine computes the head differently here (vocabulary map, a norm, the fused layers, rotary positions).",
    ]


def test_an_engine_not_built_is_a_clear_error_naming_its_build(monkeypatch, capsys):
    monkeypatch.setattr("selfspec.llamacpp.find_llamacpp", lambda: None)

    def missing() -> Path:
        raise RuntimeError("build it once with `python -m selfspec.engine_envs vllm`")

    monkeypatch.setattr("selfspec.engines.vllm.bench.require_env", missing)
    assert set(fidelity.missing_engines(["selfspec", "llamacpp", "vllm"])) == {"llamacpp", "vllm"}
    with pytest.raises(SystemExit) as stop:
        fidelity.main(["--heads", "h", "--prompts", "p.jsonl", "--engines", "selfspec", "llamacpp", "vllm"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "python -m selfspec.llamacpp" in err and "python -m selfspec.engine_envs vllm" in err
    assert "--engines selfspec" in err


def test_selfspec_decodes_the_head_as_chains_of_each_length_exactly(tmp_path):
    """selfspec's own engine (a tiny target, a random EAGLE-3 head saved as --heads DIR is): one method per chain
    length, each drafting exactly k positions per step, every output the plain output."""
    from selfspec.bench.methods import BenchSettings
    from selfspec.prompts import BenchPrompt
    from tests.helpers.archs import tiny_target
    from tests.helpers.heads import make_eagle3
    from tests.helpers.tokenizers import CharTokenizer

    target, tokenizer = tiny_target("llama"), CharTokenizer()
    head_dir = str(make_eagle3(target).save_pretrained(tmp_path / "head"))
    settings = BenchSettings(max_new_tokens=12, warmup=0, eos_token_ids=())
    prompts = [BenchPrompt("a", "x", ("hello there, hello",))]
    report = fidelity.run_engine_chains(
        "selfspec", target, tokenizer, head_dir, prompts, settings, [1, 3], target_name="tiny"
    )
    assert list(report.summary) == ["baseline", "no_draft", "chain1", "chain3"]
    rows = [fidelity.fidelity_row(report, "selfspec", k) for k in (1, 3)]
    assert [len(r.drafted) for r in rows] == [1, 3] and all(r.exact == r.outputs == 1 for r in rows)
    steps = [report.samples[0].results[f"chain{k}"].steps for k in (1, 3)]
    assert rows[0].drafted == [steps[0]] and rows[1].drafted[0] == steps[1]  # every step drafts its chain
    with pytest.raises(ValueError, match="greedily"):
        fidelity.run_engine_chains(
            "selfspec", target, tokenizer, head_dir, prompts, dataclasses.replace(settings, temperature=1.0), [1],
            target_name="tiny",
        )  # fmt: skip
