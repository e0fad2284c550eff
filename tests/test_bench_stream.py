"""``selfspec bench --stream``: a prompt file served in order by no drafts, the frozen head, the head adapting online
and the hybrid with the served history; every request of every method equals no drafts' tokens, windows carry tau,
speed over no drafts and the adaptation's seconds, and the table, JSON and plot are written."""

from __future__ import annotations

import json

import pytest

from selfspec.bench.stream import STREAM_METHODS, build_stream_models, run_stream, write_stream
from selfspec.prompts import BenchPrompt
from selfspec.train.online import OnlineOptions
from tests.helpers.archs import tiny_llama
from tests.helpers.heads import make_eagle3
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def test_stream_windows_are_exact_and_carry_every_method(tmp_path):
    target = tiny_llama(vocab_size=96, hidden_size=32, layers=3)
    tokenizer = tiny_tokenizer()
    heads = make_eagle3(target).save_pretrained(tmp_path / "heads")
    online = OnlineOptions(
        window=2, steps_per_request=2, batch_tokens=64, max_length=64, cpu_share=0.99, heldout_every=2
    )
    models = build_stream_models(target, tokenizer, str(heads), list(STREAM_METHODS), online)
    words = ["hello there", "the cat", "hello there", "a b c", "the cat", "hello there"]
    prompts = [BenchPrompt(str(i), "x", (w,)) for i, w in enumerate(words)]
    report = run_stream(models, prompts, window=3, max_new_tokens=10)
    assert report["requests"] == 6 and [(r["first"], r["last"]) for r in report["rows"]] == [(1, 3), (4, 6)]
    for row in report["rows"]:
        assert set(row["methods"]) == set(STREAM_METHODS)
        for m in row["methods"].values():
            assert m["mismatches"] == [] and m["tau"] >= 1.0 and m["tokens_per_s"] > 0
            assert 0.0 <= m["drafting_off"] <= 1.0  # the share of steps the live tree rule switched drafting off
        assert row["methods"]["no_draft"]["vs_no_draft"] == 1.0 and row["methods"]["no_draft"]["tau"] == 1.0
    assert sum(r["methods"]["online"]["adapt_s"] for r in report["rows"]) > 0
    assert models["hybrid_history"].history.num_outputs == 6
    paths = write_stream(report, tmp_path / "out")
    assert [p.name for p in paths] == ["stream.json", "stream.md", "stream.png"]
    assert json.loads(paths[0].read_text())["rows"][1]["last"] == 6
    assert paths[1].read_text().startswith("| requests | head tau | head vs no_draft | head off |")
    with pytest.raises(ValueError, match="unknown stream methods"):
        build_stream_models(target, tokenizer, str(heads), ["no_draft", "medusa"], online)
