"""selfspec tune-tree: the CLI end to end on tiny targets for every head family with a tree budget (EAGLE and
EAGLE-3: calibrate, write the profile, print the choice; Medusa: the node count from the heads' accuracies), the
bench recording the budget the profile then selects, and the one calibration default."""

from __future__ import annotations

import json

import pytest

from selfspec import bench, tune
from selfspec.api import make_drafter
from selfspec.base.fingerprint import target_fingerprint
from selfspec.bench import BenchPrompt, BenchReport, BenchSettings, build_methods, run_bench
from selfspec.bench import cli as bench_cli
from selfspec.cli import main as cli_main
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.tuning import budget as tree_budget
from selfspec.decode.tuning import calibration, costs, draft_costs
from selfspec.heads import load_heads
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import QUESTIONS
from tests.helpers.heads import make_eagle3, make_medusa
from tests.helpers.tokenizers import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _serve(t, tmp_path, monkeypatch):
    """tune-tree and the bench load ``t`` (with a character tokenizer) whatever --target says, costs are cached
    under ``tmp_path``; returns a prompt file."""
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_cli, "load_target", lambda name, dtype, device: (t, CharTokenizer()))
    monkeypatch.setattr(tune, "load_target", lambda name, dtype, device: (t, CharTokenizer()))
    prompt_file = tmp_path / "q.jsonl"
    prompt_file.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return prompt_file


def _tune_argv(heads, prompt_file, *extra: str) -> list[str]:
    sizes = ["--n-prompts", "2", "--max-new-tokens", "10", "--depth-max", "3", "--total-tokens-max", "6"]
    return ["--heads", str(heads), "--prompts", str(prompt_file), *sizes, "--top-k", "2", *extra]


@pytest.fixture
def setup(oracle, tmp_path, monkeypatch):
    t, head = oracle
    prompt_file = _serve(t, tmp_path, monkeypatch)
    return t, head.save_pretrained(tmp_path / "eagle" / "heads"), prompt_file


def test_tune_tree_cli_writes_profile_and_prints_choice(setup, capsys):
    t, heads, prompt_file = setup
    argv = ["tune-tree", *_tune_argv(heads, prompt_file, "--skip-prompts", "1", "--max-new-tokens", "12")]
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


@pytest.fixture
def three_layers(tmp_path, monkeypatch):
    """A 3-layer tiny target (EAGLE-3 fuses three of its layers) that tune-tree and the bench load, and a prompt
    file."""
    t = tiny_llama(layers=3, seed=4)
    return t, _serve(t, tmp_path, monkeypatch)


def test_tune_tree_sizes_an_eagle3_head(three_layers, tmp_path, capsys):
    """The README's command on an EAGLE-3 head: its profile is written, the budget printed is the one the profile
    and the cached costs give, and the bench then decodes with it."""
    t, prompt_file = three_layers
    heads = make_eagle3(t).eval().save_pretrained(tmp_path / "eagle3" / "heads")
    assert tune.main(_tune_argv(heads, prompt_file)) == 0
    printed = capsys.readouterr().out
    assert (heads / calibration.ACCEPTANCE_PROFILE_NAME).is_file()
    profile = calibration.load_acceptance_profile(heads, target=t)
    assert (profile.depth_max, profile.total_tokens_max, profile.top_k, profile.prompts) == (3, 6, 2, 2)
    assert profile.head_type == "eagle3"
    assert profile.steps >= 2 and all(1.0 <= x <= d + 1 for d, row in enumerate(profile.tau, 1) for x in row)
    assert f"({profile.steps} steps over 2 prompts, top_k 2)" in printed
    # the costs are cached: measuring them again here reads the very numbers tune-tree chose from
    head = load_heads(heads, target=t).eval()
    cost = costs.get_cost_profile(t)
    draft = draft_costs.get_draft_cost(EagleDrafter(head, t, 3, 2, 6), t, range(1, 4))
    assert any(p.name.startswith("draft-eagle3-") for p in (tmp_path / "cache" / "profiles").iterdir())
    budget = tree_budget.choose_tree(cost, tree_budget.eagle_trees(profile, draft))
    assert tree_budget.tree_table_text(budget) in printed
    shape = budget.shape
    assert f"chosen: depth {shape.depth}, total_tokens {shape.tokens}, top_k 2: expected tau" in printed
    settings = BenchSettings(max_new_tokens=6, warmup=0, eos_token_ids=())
    methods = build_methods(t, CharTokenizer(), settings, methods=["baseline"], heads={"eagle3": heads})
    record = methods["eagle3"].tree_budget
    assert (record.chosen_by, record.depth, record.total_tokens) == ("auto", shape.depth, shape.tokens)
    assert record.expected_tau == pytest.approx(budget.expected_tau)


def test_tune_tree_sizes_a_medusa_tree(three_layers, tmp_path, capsys):
    """Medusa heads: no prompt is decoded and no profile written; the node count printed is the one
    the one tree chooser gives over Medusa's greedy trees (from the heads' accuracies and the cost profile), and the
    one selfspec.load uses."""
    t, prompt_file = three_layers
    medusa = make_medusa(t)
    heads = medusa.save_pretrained(tmp_path / "medusa")
    assert tune.main(["--heads", str(heads), "--prompts", str(tmp_path / "no-such-file.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert not (heads / calibration.ACCEPTANCE_PROFILE_NAME).exists()
    trees = tree_budget.medusa_trees(medusa.config.head_topk_accuracy)
    size = tree_budget.choose_tree(costs.get_cost_profile(t), trees)
    assert 2 <= size.shape.nodes <= 32
    assert tree_budget.tree_table_text(size) in printed
    assert f"chosen: Medusa tree of {size.shape.nodes} nodes: expected tau {size.expected_tau:.2f}" in printed
    assert str(costs.cost_profile_path(t)) in printed
    assert len(make_drafter(t, heads).tree.paths) + 1 == size.shape.nodes


def test_tune_tree_explains_how_medusa_trees_are_sized_without_accuracies(three_layers, tmp_path, capsys):
    t, prompt_file = three_layers
    cfg = MedusaConfig(hidden_size=32, vocab_size=96, num_heads=2, target_fingerprint=target_fingerprint(t))
    heads = MedusaHeads(cfg, target_lm_head=t.get_output_embeddings().weight).save_pretrained(tmp_path / "medusa")
    with pytest.raises(SystemExit) as err:
        tune.main(["--heads", str(heads), "--prompts", str(prompt_file)])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "Medusa trees are sized from the heads' held-out top-k accuracies (head_topk_accuracy" in message
    assert "tree_nodes=N" in message


def test_tune_tree_refuses_a_directory_of_no_head_family(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"head_type": "hydra"}))
    with pytest.raises(SystemExit) as err:
        tune.main(["--heads", str(tmp_path)])
    assert err.value.code == 2
    assert "holds 'hydra' heads; tune-tree sizes the trees of ['medusa', 'eagle', 'eagle3'] heads" in (
        capsys.readouterr().err
    )
    (tmp_path / "config.json").write_text(json.dumps({"head_type": "dspark"}))
    with pytest.raises(SystemExit):
        tune.main(["--heads", str(tmp_path)])
    assert "DSpark heads, whose tree selfspec.load sizes by itself (block heads: from the held-out chain" in (
        capsys.readouterr().err
    )


def test_training_and_tune_tree_calibrate_the_same_largest_budget():
    """One default (README: depth 6, 48 draft tokens) for the calibration after training and for tune-tree."""
    from selfspec.train import calibrate

    assert (calibration.CALIBRATION_DEPTH_MAX, calibration.CALIBRATION_TOTAL_TOKENS_MAX) == (6, 48)
    args = tune.build_parser().parse_args(["--heads", "h"])
    assert (args.depth_max, args.total_tokens_max) == (6, 48)
    assert (calibrate.CALIBRATION_DEPTH_MAX, calibrate.CALIBRATION_TOTAL_TOKENS_MAX) == (6, 48)
