"""``selfspec adapt``: heads adapted to a prompt file on a tiny target, in every prompt layout; the record carries no
text and no paths; the input heads are untouched; bad input is refused before any work; the CLI prints the held-out
figures before and after."""

from __future__ import annotations

import hashlib
import json

import pytest

from selfspec.adapt import ADAPTATION_FILE, adapt, main
from selfspec.heads import load_heads
from selfspec.heads.io import HeadFormatError
from selfspec.train.data import load_prompt_file
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.training import tiny_run_config

pytestmark = pytest.mark.usefixtures("one_thread")

TOPICS = ["the sea", "winter", "a cat", "bread", "rivers", "the moon", "a song", "trains", "snow", "tea", "maps", "ink"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, EAGLE-3 heads trained on it, a JSONL prompt file)."""
    from selfspec.train.__main__ import run

    root = tmp_path_factory.mktemp("adapt")
    target = root / "target"
    tiny_llama(vocab_size=96, hidden_size=32).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(24)))
    cfg = tiny_run_config(target, data, "eagle3", root / "run", epochs=2, eagle3={"batch_tokens": 96, "ttt_steps": 2})
    heads = run(cfg)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"question_id": i, "turns": [f"tell me about {t}", "and more"]}) + "\n"
            for i, t in enumerate(TOPICS)
        )
    )
    return target, heads, prompts


def digest(directory) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file())).hexdigest()


def tree(directory) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def cli(argv: list[str]) -> tuple[int, str]:
    """The real ``selfspec`` command in this process: (exit status, its stderr)."""
    import contextlib
    import io

    from selfspec.cli import main as selfspec_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = selfspec_main(argv)
    return code, err.getvalue()


OPTIONS = ("max_length=64", "calibrate_prompts=0", "eagle3.batch_tokens=128", "eval_every=2", "save_every=2")


def test_adapt_writes_heads_and_a_record_without_text_or_paths(setup, tmp_path, capsys):
    target, heads, prompts = setup
    before = digest(heads)
    out = tmp_path / "adapted"
    code = main(
        [
            str(heads),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--tokens",
            "400",
            "--max-new-tokens",
            "12",
            "--lr",
            "1e-2",
            *OPTIONS,
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "held-out chain tau estimate      before" in printed and "after" in printed
    assert digest(heads) == before  # the input heads are only read
    adapted = load_heads(out / "heads")  # the strict loader
    assert type(adapted) is type(load_heads(heads))
    record = json.loads((out / "heads" / ADAPTATION_FILE).read_text())
    assert record["prompts"] == len(TOPICS) and record["train_prompts"] + record["heldout_prompts"] == len(TOPICS)
    assert record["heldout_prompts"] >= 1 and record["answers"] == len(TOPICS)
    assert record["budget"] == {"tokens": 400, "minutes": None}
    assert record["trained_tokens"] >= 400 and record["stopped_by"] == "tokens"
    after, start = record["heldout"]["after"], record["heldout"]["before"]
    assert after["chain_tau"] >= start["chain_tau"]  # selection keeps the start when training does not beat it
    from selfspec.hub import push_heads

    pushed = push_heads(out / "heads", "me/adapted", base_model="org/tiny", dry_run=True)
    assert ADAPTATION_FILE in pushed.files  # the record travels with the heads
    card = str(pushed.card)
    assert f"Adapted on {len(TOPICS)} prompts / {record['trained_tokens']:,} trained tokens" in card
    assert "tell me about" not in card and str(prompts) not in card
    for name in (ADAPTATION_FILE, "training_record.json", "config.json"):
        text = (out / "heads" / name).read_text()
        assert str(tmp_path) not in text and str(prompts) not in text, name  # neither the run's nor the prompts' path
        assert "tell me about" not in text, name


@pytest.mark.parametrize("layout", ["sharegpt", "openai", "text", "array"])
def test_prompt_layouts_read_to_the_same_prompts(tmp_path, layout):
    path = tmp_path / "p"
    if layout == "sharegpt":
        path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": t}]}) + "\n" for t in TOPICS))
    elif layout == "openai":
        rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "x"}]} for t in TOPICS]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif layout == "array":
        path.write_text(json.dumps([{"turns": [t]} for t in TOPICS]))
    else:
        path.write_text("\n".join(TOPICS) + "\n\n")
    prompts = load_prompt_file(path)
    assert [p["messages"] for p in prompts] == [[{"role": "user", "content": t}] for t in TOPICS]
    assert all(p["id"].startswith("sha1-") for p in prompts)


def test_bad_input_is_refused_before_any_work(setup, tmp_path):
    target, heads, prompts = setup
    out = tmp_path / "out"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no prompt"):
        adapt(heads, empty, out, tokens=10)
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(ValueError, match="record 1 is in no known layout"):
        adapt(heads, odd, out, tokens=10)
    with pytest.raises(ValueError, match=r"--tokens must be an integer >= 1 \(null: no token budget\), got 0"):
        adapt(heads, prompts, out, tokens=0)
    with pytest.raises(ValueError, match="give a budget"):
        adapt(heads, prompts, out)
    long = tmp_path / "long.txt"
    long.write_text("hello\n" + " ".join(["word"] * 600) + "\n")
    with pytest.raises(ValueError, match="longer than the target's context of 512 tokens .* prompt 2"):
        adapt(heads, long, out, tokens=10)
    other = tmp_path / "other"
    tiny_llama(vocab_size=96, hidden_size=32, seed=1).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    with pytest.raises(HeadFormatError, match="pass --target"):
        adapt(heads, prompts, out, tokens=10, target=str(other))
    assert not out.exists()
    code, err = cli(["adapt", str(heads), "--prompts", str(empty), "--out", str(out), "--tokens", "5"])
    assert code == 2 and err.count("\n") == 1 and "holds no prompt" in err and not out.exists()


def test_a_killed_adapt_resumes_with_the_same_command(setup, tmp_path, monkeypatch, caplog):
    """Killed after its first checkpoint, the same command resumes there (its answers, features and steps kept),
    ends with heads that load, and leaves the input heads as they were."""
    import logging

    from selfspec.train import loop

    target, heads, prompts = setup
    before = digest(heads)
    argv = [
        str(heads),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "a"),
        "--tokens",
        "900",
        "--max-new-tokens",
        "12",
        *OPTIONS,
    ]
    real = loop.save_checkpoint

    def killed(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt  # the process dies right after a checkpoint is on disk

    monkeypatch.setattr(loop, "save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert not (tmp_path / "a" / "heads").exists() and digest(heads) == before
    monkeypatch.setattr(loop, "save_checkpoint", real)
    from selfspec import adapt as module

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # killed after training, while the heads' record is written

    monkeypatch.setattr(module, "anonymise_training_record", broken)
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert not (tmp_path / "a" / "heads").exists()  # moved into place only when complete
    monkeypatch.undo()
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert "resumed from" in caplog.text and "0 to generate" in caplog.text  # its steps and its answers
    assert load_heads(tmp_path / "a" / "heads") is not None and digest(heads) == before
    assert (tmp_path / "a" / "heads" / ADAPTATION_FILE).is_file()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".")]  # no staging left behind


BAD_FLAGS = [
    (["--tokens", "0"], r"--tokens must be an integer >= 1 \(null: no token budget\), got 0"),
    (["--tokens", "10", "--minutes", "-1"], r"--minutes must be a number > 0 \(null: no time budget\), got -1.0"),
    (["--tokens", "10", "--lr", "-1"], r"--lr must be a number in \(0, 1\], got -1.0"),
    (["--tokens", "10", "--lr", "nan"], r"--lr must be a number in \(0, 1\], got nan"),
    (["--tokens", "10", "--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--tokens", "10", "--heldout-fraction", "1.5"], r"--heldout-fraction must be a number in \(0, 1\), got 1.5"),
    (["--tokens", "10", "--heldout-fraction", "0"], r"--heldout-fraction must be a number in \(0, 1\), got 0.0"),
    (["--tokens", "10", "--threads", "0"], r"--threads must be an integer >= 1 \(null: torch's default\), got 0"),
    (["--tokens", "10", "--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--tokens", "10", "eagle3.ttt_steps"], "training overrides are key=value items"),
    (["--tokens", "10", "no_such_key=1"], "unknown config keys"),
    (["--tokens", "10", "eagle3.ttt_steps=0"], "eagle3.ttt_steps must be"),
    ([], "give a budget"),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) or "no-budget" for f, _ in BAD_FLAGS])
def test_every_option_is_refused_through_the_cli_before_any_work(setup, tmp_path, monkeypatch, flags, message):
    """Each out-of-range option exits 2 with one line naming the flag and its range, before the target loads and
    before --out is created."""
    import re

    from selfspec import adapt as module

    target, heads, prompts = setup

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the options were checked")

    monkeypatch.setattr(module, "load_target", no_target)
    before = tree(heads.parent)
    out = tmp_path / "out"
    code, err = cli(["adapt", str(heads), "--prompts", str(prompts), "--out", str(out), *flags])
    assert code == 2 and err.count("\n") == 1 and err.startswith("selfspec adapt: error: "), err
    assert re.search(message, err), err
    assert not out.exists() and tree(heads.parent) == before


def test_an_out_that_would_write_over_the_input_heads_is_refused(setup, tmp_path):
    """``--out RUN`` (the run directory the heads came from), an ``--out`` inside the heads, one whose heads hold the
    input, and the same through a symbolic link: exit 2, one line on stderr, nothing written."""
    import shutil

    target, heads, prompts = setup
    nested = tmp_path / "outer" / "heads" / "inner"
    shutil.copytree(heads, nested)
    link = tmp_path / "link"
    link.symlink_to(heads.parent, target_is_directory=True)
    cases = [
        (heads, heads.parent, "which is the input heads"),
        (heads, heads, "which lies inside the input heads"),
        (heads, heads / "deeper", "which lies inside the input heads"),
        (nested, tmp_path / "outer", "which holds the input heads"),
        (heads, link, "which is the input heads"),
        (link / heads.name, heads.parent, "which is the input heads"),
    ]
    for source, out, how in cases:
        before = tree(tmp_path), tree(heads.parent)
        argv = [str(source), "--prompts", str(prompts), "--out", str(out), "--tokens", "10"]
        code, err = cli(["adapt", *argv])
        assert code == 2 and err.count("\n") == 1 and how in err and "pass another --out" in err, (out, err)
        assert (tree(tmp_path), tree(heads.parent)) == before, out
        with pytest.raises(ValueError, match=how):
            adapt(source, prompts, out, tokens=10)
        assert (tree(tmp_path), tree(heads.parent)) == before, out


def test_heads_are_refused_on_a_fine_tune_of_their_target_that_kept_the_embeddings(setup, tmp_path):
    """One decoder layer moved a little, the embeddings as they were: another target, refused through the CLI before
    anything is written (the version-1 fingerprint, of the embeddings only, took it for the same one)."""
    import torch
    from transformers import AutoModelForCausalLM

    target, heads, prompts = setup
    tuned = AutoModelForCausalLM.from_pretrained(target)
    weight = tuned.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * weight.std() * 0.05)
    tuned.save_pretrained(tmp_path / "tuned")
    tiny_tokenizer().save_pretrained(tmp_path / "tuned")
    out = tmp_path / "out"
    argv = ["adapt", str(heads), "--prompts", str(prompts), "--out", str(out), "--tokens", "10"]
    code, err = cli([*argv, "--target", str(tmp_path / "tuned")])
    line = err.strip().splitlines()[-1]  # after the target's loading bar
    assert code == 2 and line.startswith("selfspec adapt: error: heads in") and err.count("error:") == 1, err
    assert "not on the target given" in line and "pass --target" in line
    assert not out.exists()
