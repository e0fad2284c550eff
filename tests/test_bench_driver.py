"""The one bench driver (selfspec.bench.driver) with an engine that needs no model: what any engine plugged into it
gets (interleaving, warm-up, the exactness check against the engine's reference, speedups against both baselines,
skipped turns, later turns conditioned on the reference's answer, a report that reads back strictly)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import pytest
import torch

from selfspec.bench.driver import BenchEngine, Outcome, Turn, run_engine, settings_record
from selfspec.bench.methods import BenchSettings
from selfspec.bench.report import BenchReport, MethodRecord, Result, SettingsRecord
from selfspec.prompts import BenchPrompt, Message

TOKENS_PER_S = {"plain": 10.0, "loop": 20.0, "fast": 40.0, "off": 5.0}


def result(tokens: list[int], tokens_per_s: float) -> Result:
    return Result.of_call(tokens, len(tokens) / tokens_per_s, "length")


class ToyEngine(BenchEngine):
    """Prompts are their characters' codes; every method answers ``[1, 2, 3, 4]`` at its own speed, except ``off``,
    which parts from the others at position 2. Every call is recorded."""

    def __init__(self) -> None:
        self.names = list(TOKENS_PER_S)
        self.reference, self.engine_reference = "plain", "loop"
        self.device = torch.device("cpu")
        self.calls: list[tuple[str, str, int, bool]] = []

    def prompt(self, messages: Sequence[Message]) -> tuple[torch.Tensor, str | None]:
        text = "|".join(m["content"] for m in messages)
        return torch.tensor([ord(c) for c in text]), text

    def run(self, name: str, turn: Turn, settings: BenchSettings) -> Outcome:
        self.calls.append((name, turn.text, settings.seed, turn.warmup))
        tokens = [1, 2, 9, 4] if name == "off" else [1, 2, 3, 4]
        return Outcome(result(tokens, TOKENS_PER_S[name]), f"answer of {name}")

    def answer(self, outcome: Outcome, tokenizer: object) -> str:
        return outcome.text

    def method_records(self) -> dict[str, MethodRecord]:
        return {name: MethodRecord("custom", f"the toy method {name}", None) for name in self.names}

    def settings_record(self, settings: BenchSettings) -> SettingsRecord:
        record = settings_record(settings, torch.nn.Linear(1, 1), self.device, set())
        return dataclasses.replace(record, reference=self.reference, engine_reference=self.engine_reference)


def test_any_engine_gets_the_whole_bench_from_the_driver():
    engine = ToyEngine()
    settings = BenchSettings(max_new_tokens=4, warmup=1, eos_token_ids=(), max_prompt_tokens=30, seed=5)
    too_long = "a prompt far too long for the limit of 30"
    prompts = [BenchPrompt("1", "a", ("hi", "more")), BenchPrompt("2", "b", (too_long,))]
    report = run_engine(engine, torch.nn.Linear(1, 1), None, prompts, settings)

    warmup = [c for c in engine.calls if c[3]]
    assert [c[0] for c in warmup] == engine.names and {c[1] for c in warmup} == {"hi"}
    measured = [c for c in engine.calls if not c[3]]
    assert [c[0] for c in measured] == ["plain", "loop", "fast", "off", "loop", "fast", "off", "plain"]  # rotated
    assert [c[2] for c in measured] == [5] * 4 + [6] * 4  # each turn its own seed
    assert {c[1] for c in measured[4:]} == {"hi|answer of plain|more"}  # conditioned on the reference's answer

    assert [(s.question_id, s.turn) for s in report.samples] == [("1", 1), ("1", 2)]
    assert [(s.question_id, s.turn) for s in report.skipped] == [("2", 1)]
    fast = report.summary["fast"].overall
    assert (fast.speedup, fast.engine_speedup, fast.mismatches) == (4.0, 2.0, 0)
    assert report.summary["off"].overall.mismatches == 2
    assert [(m.method, m.first_diff, m.reference_token, m.method_token) for m in report.mismatches] == [
        ("off", 2, 3, 9),
        ("off", 2, 3, 9),
    ]
    assert list(report.methods) == engine.names and report.llamacpp is None
    assert BenchReport.from_dict(report.to_dict()) == report


def test_an_engine_call_s_result_leaves_the_driver_s_fields_unset():
    r = Result.of_call([5, 6, 7, 8], 2.0, "length", tau=1.5, steps=2, accepted_by_depth=[1])
    assert (r.new_tokens, r.tokens_per_s, r.peak_memory_mb, r.tokens, r.tau, r.steps) == (
        4,
        2.0,
        0.0,
        [5, 6, 7, 8],
        1.5,
        2,
    )
    assert (r.speedup, r.engine_speedup, r.matches_reference, r.first_diff, r.near_tie, r.draft_s) == (None,) * 6
    assert Result.of_call([], 0.0, "stop").tokens_per_s == 0.0
    with pytest.raises(TypeError, match="no fields \\['acceptance'\\]"):
        Result.of_call([1], 1.0, "stop", acceptance=0.5)


def test_the_driver_shows_prompts_done_of_all_with_the_time_left_on_stderr(capsys):
    settings = BenchSettings(max_new_tokens=4, warmup=0, eos_token_ids=(), seed=5)
    prompts = [BenchPrompt(str(i), "a", ("hi",)) for i in range(3)]
    run_engine(ToyEngine(), torch.nn.Linear(1, 1), None, prompts, settings)
    out, err = capsys.readouterr()
    assert out == "" and "bench (4 methods)" in err
    assert re.search(r" 3/3 \[\d\d:\d\d<\d\d:\d\d", err), err  # done of all [elapsed<left]
