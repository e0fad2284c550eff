"""selfspec tune-tree: the CLI end to end on a tiny target (calibrate, write the profile, print the choice), and
the bench recording the budget the profile then selects."""

from __future__ import annotations

import json

import pytest

from selfspec import bench, tune
from selfspec.bench import BenchPrompt, BenchReport, BenchSettings, build_methods, run_bench
from selfspec.bench import cli as bench_cli
from selfspec.cli import main as cli_main
from selfspec.decode.tuning import calibration, costs
from tests.helpers.conversations import QUESTIONS
from tests.helpers.tokenizers import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def setup(oracle, tmp_path, monkeypatch):
    t, head = oracle
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_cli, "load_target", lambda name, dtype, device: (t, CharTokenizer()))
    monkeypatch.setattr(tune, "load_target", lambda name, dtype, device: (t, CharTokenizer()))
    prompt_file = tmp_path / "q.jsonl"
    prompt_file.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return t, head.save_pretrained(tmp_path / "eagle" / "heads"), prompt_file


def test_tune_tree_cli_writes_profile_and_prints_choice(setup, capsys):
    t, heads, prompt_file = setup
    argv = [
        "tune-tree",
        "--heads",
        str(heads),
        "--prompts",
        str(prompt_file),
        "--n-prompts",
        "2",
        "--skip-prompts",
        "1",
        "--max-new-tokens",
        "12",
        "--depth-max",
        "3",
        "--total-tokens-max",
        "6",
        "--top-k",
        "2",
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    profile = calibration.load_acceptance_profile(heads, target=t)
    assert profile is not None and (profile.depth_max, profile.total_tokens_max, profile.top_k) == (3, 6, 2)
    assert profile.prompts == 2 and profile.steps >= 2
    assert "chosen: depth" in printed and "expected speedup" in printed and str(costs.cost_profile_path(t)) in printed
    assert costs.cost_profile_path(t).is_file()
    # the bench now sizes the tree itself and records it
    settings = BenchSettings(max_new_tokens=8, warmup=0, eos_token_ids=())
    methods = build_methods(t, CharTokenizer(), settings, methods=["baseline"], heads={"eagle": heads})
    record = methods["eagle"].tree_budget
    assert record.chosen_by == "auto" and record.top_k == 2 and record.expected_tau >= 1.0
    report = run_bench(t, CharTokenizer(), methods, [BenchPrompt("a", "x", ("hello there",))], settings)
    assert BenchReport.from_dict(report.to_dict()) == report
    assert report.methods["eagle"].tree_budget == record and report.methods["baseline"].tree_budget is None
    assert report.mismatches == []
    assert "EAGLE tree depth" in bench.markdown_report(report)


def test_bench_cli_takes_explicit_or_auto_eagle_budget(setup, tmp_path):
    t, heads, prompt_file = setup
    base = [
        "--prompts",
        str(prompt_file),
        "--num-prompts",
        "1",
        "--max-turns",
        "1",
        "--max-new-tokens",
        "4",
        "--methods",
        "baseline",
        "--heads",
        f"eagle={heads}",
        "--warmup",
        "0",
    ]
    assert bench.main([*base, "--eagle-depth", "3", "--eagle-total-tokens", "5", "--out", str(tmp_path / "a")]) == 0
    record = json.loads((tmp_path / "a" / "report.json").read_text())["methods"]["eagle"]["tree_budget"]
    assert (record["depth"], record["total_tokens"], record["chosen_by"]) == (3, 5, "given")
    assert bench.main([*base, "--eagle-total-tokens", "auto", "--out", str(tmp_path / "b")]) == 0
    record = json.loads((tmp_path / "b" / "report.json").read_text())["methods"]["eagle"]["tree_budget"]
    assert record["chosen_by"] == "default" and record["expected_tau"] is None  # no profile yet
    with pytest.raises(SystemExit):
        bench.main([*base, "--eagle-depth", "deep", "--out", str(tmp_path / "c")])


def test_tune_tree_refuses_medusa_heads(tmp_path, setup):
    from selfspec.heads.medusa import MedusaConfig, MedusaHeads

    t, _, prompt_file = setup
    d = MedusaHeads(
        MedusaConfig(hidden_size=32, vocab_size=96, num_heads=2), target_lm_head=t.get_output_embeddings().weight
    ).save_pretrained(tmp_path / "medusa")
    with pytest.raises(SystemExit) as err:
        tune.main(["--heads", str(d), "--prompts", str(prompt_file)])
    assert err.value.code == 2
