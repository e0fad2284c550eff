"""``selfspec scaling-curve`` (selfspec/scaling.py) end to end on a tiny saved target: two points of growing data
and time, each trained by ``python -m selfspec.train`` and benched by ``python -m selfspec.bench``; the table, JSON
and plot are written, the second point has more data, and a finished point is not run again."""

from __future__ import annotations

import json

import pytest

from selfspec import scaling
from selfspec.cli import main as cli_main
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer


def test_points_are_parsed_and_checked():
    assert scaling.parse_point("a:10:20:1.5") == {"name": "a", "distilled": 10, "written": 20, "minutes": 1.5}
    for bad in ("a:10:20", "a:-1:2:3", "a:1:2:0"):
        with pytest.raises(ValueError):
            scaling.parse_point(bad)
    assert [scaling.parse_point(p)["minutes"] for p in scaling.DEFAULT_POINTS] == [6, 12, 30]


@pytest.mark.slow  # two training runs and two benches, each in its own process (~2.5 min on 2 cores)
def test_two_points_train_bench_and_tabulate(tmp_path, monkeypatch):
    argv = tiny_curve(tmp_path, conversations_count=40, topics=("sea", "moon"))
    out = tmp_path / "curve"
    argv += ["--points", "small:0:10:0.02", "large:0:30:0.04", "--override", "max_steps=4"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli_main(["scaling-curve", *argv]) == 0
    rows = json.loads((out / "scaling.json").read_text())
    assert [r["name"] for r in rows] == ["small", "large"]
    assert 0 < rows[0]["feature_tokens"] < rows[1]["feature_tokens"]
    for r in rows:
        assert r["train_steps"] == 4 and r["prompts"] == 2 and r["speedup"] > 0 and r["cpu_hours"] > 0
        assert len(r["heldout_acceptance"]) == 2 and r["chain_tau_estimate"] >= 1.0
    assert (out / "scaling.png").stat().st_size > 1000
    assert "| large | 0 + 30 |" in (out / "scaling.md").read_text()
    # 4 Medusa steps of at most 16 positions each; features were computed, nothing was self-distilled
    for r in rows:
        assert 0 < r["trained_tokens"] <= 4 * 16 and r["features_s"] is not None and r["distill_s"] is None
    # a finished point is read back, not run again
    (out / "small" / "train.log").unlink()
    assert scaling.main(argv) == 0 and not (out / "small" / "train.log").exists()


def test_recipes_are_parsed_and_checked():
    assert scaling.parse_recipe("kl=") == {"name": "kl", "overrides": []}
    assert scaling.parse_recipe("e31=eagle3.fc_norm=true,eagle3.norm_output=true") == {
        "name": "e31",
        "overrides": ["eagle3.fc_norm=true", "eagle3.norm_output=true"],
    }
    for bad in ("kl", "a b=x=1", "lk=eagle3.loss"):
        with pytest.raises(ValueError, match="recipe"):
            scaling.parse_recipe(bad)


@pytest.mark.slow  # two training runs and one bench, each in its own process (~1.5 min on 2 cores)
def test_recipes_train_at_one_budget_and_bench_in_one_run(tmp_path, monkeypatch):
    argv = tiny_curve(tmp_path, conversations_count=30, topics=("sea",))
    out = tmp_path / "curve"
    argv += ["--points", "p:0:20:0.02", "--override", "max_steps=3", "--recipes", "ce=", "tv=medusa.loss=tv"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert scaling.main(argv) == 0
    rows = json.loads((out / "scaling.json").read_text())
    assert [(r["name"], r["recipe"]) for r in rows] == [("p", "ce"), ("p", "tv")]
    assert rows[0]["feature_tokens"] == rows[1]["feature_tokens"] > 0  # the same data for both recipes
    assert all(r["train_steps"] == 3 and r["prompts"] == 1 for r in rows)
    for recipe, loss in (("ce", "ce"), ("tv", "tv")):
        assert json.loads((out / "p" / recipe / "train_config.json").read_text())["medusa"]["loss"] == loss
    report = json.loads((out / "p" / "bench" / "report.json").read_text())
    assert set(report["samples"][0]["results"]) >= {"baseline", "ce", "tv"}  # one bench run, both heads
    assert "| p | tv | 0 + 20 |" in (out / "scaling.md").read_text()


def tiny_curve(tmp_path, conversations_count: int, topics: tuple[str, ...]) -> list[str]:
    """A saved tiny target, its data, one writing prompt per topic and a Medusa config: the scaling-curve arguments
    for them (``--out tmp_path/curve``, 1 thread, 8 new tokens a prompt); callers add points and overrides."""
    target_dir = tmp_path / "target"
    tiny_target("llama").save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(conversations_count)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"question_id": i, "category": "writing", "turns": [f"tell me about the {t} please"]}) + "\n"
            for i, t in enumerate(topics)
        )
    )
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"head: medusa\ntarget: {target_dir}\ndata: {data}\nself_distill: false\nmax_length: 32\n"
        "draft_vocab_size: 64\nlr: 0.003\nwarmup_steps: 1\neval_every: 1000\nsave_every: 1000\n"
        "calibrate_prompts: 0\neval_fraction: 0.2\nmedusa: {num_heads: 2, batch_positions: 16}\n"
    )
    argv = ["--config", str(config), "--out", str(tmp_path / "curve"), "--threads", "1", "--target", str(target_dir)]
    return argv + [
        "--bench-prompts",
        str(prompts),
        "--bench-num-prompts",
        str(len(topics)),
        "--bench-max-new-tokens",
        "8",
    ]
