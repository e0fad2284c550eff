"""``python -m benchmarks.sets``: per prompt set, the median per-prompt speedup and the mean tau of each method."""

from __future__ import annotations

import json

from benchmarks.sets import main, set_table


def _sample(category: str, base: float, head: float, tau: float) -> dict:
    return {
        "category": category,
        "results": {"baseline": {"tokens_per_s": base, "tau": None}, "head": {"tokens_per_s": head, "tau": tau}},
    }


REPORT = {
    "samples": [
        _sample("mt_bench/writing", 10.0, 15.0, 1.5),
        _sample("mt_bench/coding", 10.0, 20.0, 2.5),
        _sample("mt_bench/math", 10.0, 12.0, 1.0),
        _sample("gsm8k", 8.0, 16.0, 3.0),
    ]
}


def test_set_table_gives_medians_per_set_and_their_mean():
    lines = set_table(REPORT).splitlines()
    assert lines[0] == "| set | n | head |"
    assert lines[2] == "| mt_bench | 3 | 1.500x (tau 1.67) |"  # median of 1.5, 2.0, 1.2; mean tau of 1.5, 2.5, 1.0
    assert lines[3] == "| gsm8k | 1 | 2.000x (tau 3.00) |"
    assert lines[4] == "| mean of sets | | 1.750x |"


def test_main_prints_the_table(tmp_path, capsys):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(REPORT))
    assert main([str(path)]) == 0
    assert capsys.readouterr().out.strip() == set_table(REPORT)
