"""train/tracking.py through a whole run: loss, learning rate, tokens/s and the held-out acceptance by depth and chain
tau estimate, read back from TensorBoard's event files (and from W&B's offline run); a missing tracker is refused
before any work. The run self-distils every turn of two-turn conversations (``distill_turns: all``) on the way."""

from __future__ import annotations

import importlib.util
import json

import pytest

from selfspec.train.__main__ import run
from selfspec.train.tracking import check_tracker, eval_scalars
from tests.helpers.archs import tiny_llama
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer
from tests.helpers.training import tiny_run_config

pytestmark = pytest.mark.usefixtures("one_thread")

EAGLE3 = {"batch_tokens": 96, "ttt_steps": 2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(target dir, a JSONL file of 24 conversations, every third of them two exchanges long)."""
    root = tmp_path_factory.mktemp("tracking")
    target = root / "target"
    tiny_llama(vocab_size=96, hidden_size=32).save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    convs = conversations(23)
    for c in convs[::3]:
        c["messages"] += [{"role": "user", "content": "and the night"}, {"role": "assistant", "content": "it was"}]
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    return target, data


def config(setup, out, **over):
    target, data = setup
    options = dict(epochs=2, eagle3=EAGLE3, self_distill=True, distill_conversations=12, distill_max_new_tokens=6)
    return tiny_run_config(target, data, "eagle3", out, **{**options, **over})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the tensorboard extra")
def test_tensorboard_event_files_hold_the_runs_figures(setup, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    run(config(setup, out, report_to="tensorboard", distill_turns="all", distill_max_prompt_tokens=40))
    summary = json.loads((out / "train_summary.json").read_text())
    records = [json.loads(line) for f in sorted((out / "distill").glob("train-*.jsonl")) for line in f.open()]
    assert len(records) == 12 and any(len(r["messages"]) == 4 for r in records)  # the second turns regenerated
    (events,) = (out / "logs" / "selfspec-eagle3").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/tokens_per_s", "eval/chain_tau_estimate"} <= tags
    assert {"eval/acceptance_depth_1", "eval/acceptance_depth_2"} <= tags
    steps = summary["step"]
    loss = {e.step: e.value for e in acc.Scalars("train/loss")}
    assert sorted(loss) == list(range(1, steps + 1))  # every optimiser step
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_s"))
    tau = {e.step: e.value for e in acc.Scalars("eval/chain_tau_estimate")}
    depth1 = {e.step: e.value for e in acc.Scalars("eval/acceptance_depth_1")}
    evaluated = [h for h in summary["history"] if "chain_tau_estimate" in h]
    assert sorted(tau) == [h["step"] for h in evaluated] and len(evaluated) >= 2
    for h in evaluated:  # the history rounds to 4 digits; the event file holds float32
        assert tau[h["step"]] == pytest.approx(h["chain_tau_estimate"], abs=1e-4)
        assert depth1[h["step"]] == pytest.approx(h["acceptance"][0], abs=1e-4)
        assert loss[h["step"]] == pytest.approx(h["loss"], abs=1e-4)
        assert {e.step: e.value for e in acc.Scalars("train/lr")}[h["step"]] == pytest.approx(h["lr"], rel=1e-6)


def test_no_tracker_by_default_and_a_missing_one_is_refused_before_any_work(setup, tmp_path, monkeypatch):
    out = tmp_path / "never"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(
        ValueError, match=r"report_to: mlflow needs the mlflow package: pip install 'selfspec\[mlflow\]'"
    ):
        run(config(setup, out, report_to="mlflow"))
    assert not out.exists()
    with pytest.raises(ValueError, match="report_to must be one of"):
        check_tracker("neptune")
    check_tracker("none")
    scalars = eval_scalars({"acceptance": [0.5], "top1": 0.25, "topk": [0.1, 0.2], "note": "x"}, [0.5, 0.25], 1.6)
    assert scalars == {
        "eval/top1": 0.25,
        "eval/topk_1": 0.1,
        "eval/topk_2": 0.2,
        "eval/acceptance_depth_1": 0.5,
        "eval/acceptance_depth_2": 0.25,
        "eval/chain_tau_estimate": 1.6,
    }


def wandb_history(path) -> list[dict]:
    """The history rows of an offline W&B run file (``run-*.wandb``: LevelDB log framing, 32 KiB blocks of records
    with a 7-byte header, after a 7-byte file header; each record a ``wandb_internal_pb2.Record``)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, records, partial = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        partial = chunk if kind in (1, 2) else partial + chunk
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(partial)
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the wandb extra")
def test_wandb_offline_run_holds_the_runs_figures(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    run(config(setup, out, report_to="wandb"))
    summary = json.loads((out / "train_summary.json").read_text())
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows = {row["_step"]: row for row in wandb_history(run_file)}
    assert sorted(rows) == list(range(1, summary["step"] + 1))
    evaluated = [h for h in summary["history"] if "chain_tau_estimate" in h]
    assert len(evaluated) >= 2
    for h in evaluated:
        row = rows[h["step"]]
        assert row["eval/chain_tau_estimate"] == pytest.approx(h["chain_tau_estimate"], abs=1e-4)
        assert row["eval/acceptance_depth_1"] == pytest.approx(h["acceptance"][0], abs=1e-4)
        assert row["train/loss"] == pytest.approx(h["loss"], abs=1e-4) and row["train/lr"] == pytest.approx(h["lr"])
