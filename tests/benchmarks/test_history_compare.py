"""The served-history replay of ``benchmarks/history_compare.py`` (the Arctic Inference side runs in its own venv)."""

from __future__ import annotations

from benchmarks.history_compare import replay_served_history, windows


def test_the_replay_counts_the_steps_a_history_saves():
    """``benchmarks.history_compare``'s replay: a repeated request is drafted from its earlier output."""
    stream = [([1, 2, 3], [4, 5, 6, 7, 8, 9]), ([1, 2, 3], [4, 5, 6, 7, 8, 9]), ([5, 5], [4, 5, 6, 7, 1, 1])]
    steps = replay_served_history(stream, draft=8)
    assert steps == [6, 3, 4]  # alone; after "4 5" the history has the rest; after "4 5" again, "6 7" then a miss
    assert windows(stream, {"ours": steps}, 2) == [
        {"first": 1, "last": 2, "ours": round(12 / 9, 3)},
        {"first": 3, "last": 3, "ours": 1.5},
    ]
