"""The streamed feature store (train/store_shards.py, train/feature_rows.py, train/feature_store.py): every family
reads from the shards on disk the batches it read from the whole store in memory, bit for bit, and trains the same
head; a store of another target, another layer choice or a stopped write is never read as valid, and a stopped write
resumes; a process's peak memory does not grow with the store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from selfspec.train.config import TrainConfig
from selfspec.train.feature_store import (
    FeatureStore,
    load_features,
    save_features,
    store_identity,
    store_path,
    target_features,
    training_examples,
)
from selfspec.train.features import features_reusing
from selfspec.train.inputs import RunInputs
from selfspec.train.store_shards import MANIFEST, StoreIdentity, read_manifest
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

SHARD_MB = 4096 / 2**20  # 4 KiB shards: a tiny run writes dozens


def config(out, head: str = "eagle3", **kw) -> TrainConfig:
    base = dict(
        head=head,
        target="tiny",
        self_distill=False,
        max_length=32,
        draft_vocab_size=64,
        lr=3e-3,
        warmup_steps=1,
        max_steps=3,
        max_train_minutes=None,
        eval_every=2,
        save_every=1000,
        seed=0,
        calibrate_prompts=0,
        output_dir=str(out),
        features="store",
        feature_shard_mb=SHARD_MB,
        feature_batch_tokens=96,  # batched forwards: the store runs the same batches one by one
        medusa={"num_heads": 2, "batch_positions": 32, "loss": "kl"},
        eagle={"batch_tokens": 64},
        eagle3={"batch_tokens": 64, "ttt_steps": 2, "target_layers": (0, 1, 2)},
        block={"block_size": 4, "anchors": 4, "batch_tokens": 64, "num_layers": 1, "target_layer_ids": (0, 1)},
    )
    base.update(kw)
    return TrainConfig(**base)


def layers_of(cfg: TrainConfig):
    from selfspec.train.dflash import block_layers

    if cfg.head == "eagle3":
        return cfg.eagle3.target_layers
    if cfg.head in ("dflash", "dspark"):
        return tuple(i + 1 for i in block_layers(cfg, None))
    return None


def todays_store(cfg, target, tok, convs, layers):
    """The store as the whole-file reader gave it: every example's features from one batched pass, in memory."""
    parts = []
    for split in convs:
        ex = training_examples(cfg, target, tok, split)
        feats = features_reusing(target, ex, None, True, layers, cfg.feature_batch_tokens)
        parts.append(
            FeatureStore.from_examples(ex, feats, target.config.hidden_size * (len(layers) + 1 if layers else 1))
        )
    return parts


def recipe(cfg, run, train, held, sig):
    from selfspec.train.dflash import BlockRecipe
    from selfspec.train.eagle import EagleRecipe
    from selfspec.train.eagle3 import Eagle3Recipe
    from selfspec.train.medusa import MedusaRecipe

    if cfg.head == "medusa":
        return MedusaRecipe(cfg, run.target, train, held, sig)
    kind = {"eagle": EagleRecipe, "eagle3": Eagle3Recipe, "dflash": BlockRecipe, "dspark": BlockRecipe}[cfg.head]
    return kind(run, train, held, sig)


@pytest.mark.parametrize("head", ["medusa", "eagle", "eagle3", "dflash", "dspark"])
def test_streamed_store_gives_todays_batches_and_head(tmp_path, head):
    """Per family: the recipe on the store read from its shards builds every batch of an epoch and the held-out
    evaluation exactly as on the whole store in memory, and 3 training steps give the same head, bit for bit."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from selfspec.train.loop import train_loop

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(20)
    splits = (convs[:14], convs[14:])
    heads, seen = {}, {}
    for source in ("streamed", "memory"):
        cfg = config(tmp_path / source, head)
        run = RunInputs(cfg, Accelerator(cpu=True), target, tok, *splits)
        layers = layers_of(cfg)
        if source == "streamed":
            train, held, sig = target_features(run, layers)
            assert len(read_manifest(store_path(tmp_path / source)).shards) > 4  # many shards
            streamed = (train, held)
        else:
            train, held = todays_store(cfg, target, tok, splits, layers)
            for a, b in zip(streamed, (train, held), strict=True):  # the same sequences, features bit for bit
                assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
                assert torch.equal(a.features, b.features)
        r = recipe(cfg, run, train, held, sig)
        batches = r.batches(0)
        seen[source] = (batches, [r.collate(items) for items in batches], r.evaluate())
        if source == "memory":
            assert batches == seen["streamed"][0] and seen["memory"][2] == seen["streamed"][2]
            for got, want in zip(seen["memory"][1], seen["streamed"][1], strict=True):
                assert got.keys() == want.keys()
                assert all(torch.equal(got[k], want[k]) for k in got)
        heads_dir = train_loop(cfg, run.accelerator, r, run.heldout())
        heads[source] = load_file(str(heads_dir / "model.safetensors"))
    assert heads["streamed"].keys() == heads["memory"].keys()
    for name, value in heads["streamed"].items():
        assert torch.equal(value, heads["memory"][name]), name


def test_store_of_another_target_or_layers_is_recomputed_never_read(tmp_path, caplog):
    from accelerate import Accelerator

    tok, convs = tiny_tokenizer(), conversations(10)
    cfg = config(tmp_path)
    a, b = tiny_target("llama"), tiny_target("llama", seed=1)
    path = store_path(tmp_path)
    target_features(RunInputs(cfg, Accelerator(cpu=True), a, tok, convs[:8], convs[8:]), (0, 1))
    ident_a = store_identity(a, convs[:8], convs[8:], 32, (0, 1))
    assert load_features(path, ident_a) is not None
    # another target: not read, recomputed in place
    ident_b = store_identity(b, convs[:8], convs[8:], 32, (0, 1))
    caplog.clear()
    assert load_features(path, ident_b) is None
    assert any("written by another target" in r.getMessage() for r in caplog.records)
    train_b, _, _ = target_features(RunInputs(cfg, Accelerator(cpu=True), b, tok, convs[:8], convs[8:]), (0, 1))
    assert read_manifest(path).identity == ident_b and load_features(path, ident_a) is None
    # another layer choice
    caplog.clear()
    assert load_features(path, store_identity(b, convs[:8], convs[8:], 32, (0, 2))) is None
    assert any("another layer choice" in r.getMessage() for r in caplog.records)
    # another max_length, another dtype
    assert load_features(path, store_identity(b, convs[:8], convs[8:], 16, (0, 1))) is None
    import dataclasses

    assert load_features(path, dataclasses.replace(ident_b, dtype="bfloat16")) is None
    assert load_features(path, ident_b) is not None


def test_stopped_write_is_never_read_and_resumes(tmp_path, monkeypatch, caplog):
    """A write stopped after some shards leaves an incomplete manifest (never read), a temporary file and an unlisted
    shard (removed); a truncated listed shard is refused and recomputed; the resumed store computes only what the
    complete shards lack and equals an unbroken one."""
    from accelerate import Accelerator

    import selfspec.train.feature_store as fs

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(16)
    cfg = config(tmp_path / "stopped", feature_batch_tokens=0)  # one forward a sequence: bit-equal however resumed
    run = RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:12], convs[12:])
    ident = store_identity(target, convs[:12], convs[12:], 32, (0, 1, 2))
    real, calls = fs.hidden_features, []

    def failing(model, examples, *args, **kwargs):
        if len(calls) == 7:
            raise KeyboardInterrupt("stopped")
        calls.append(len(examples))
        return real(model, examples, *args, **kwargs)

    monkeypatch.setattr(fs, "hidden_features", failing)
    with pytest.raises(KeyboardInterrupt):
        target_features(run, (0, 1, 2))
    path = store_path(tmp_path / "stopped")
    manifest = read_manifest(path)
    assert not manifest.complete and 0 < len(manifest.shards) <= 7
    assert load_features(path, ident) is None  # incomplete: never read
    # what a kill can leave: a half-written temporary file, a shard renamed but not yet listed
    (path / ".train-00099.safetensors.tmp123").write_bytes(b"half a shard")
    (path / "train-00098.safetensors").write_bytes(b"unlisted")
    # a listed shard cut short (a disk that lost its tail)
    cut = path / manifest.shards[0].file
    cut.write_bytes(cut.read_bytes()[:100])
    monkeypatch.setattr(fs, "hidden_features", real)
    computed = []
    monkeypatch.setattr(fs, "hidden_features", lambda m, ex, *a, **k: computed.append(len(ex)) or real(m, ex, *a, **k))
    caplog.clear()
    with caplog.at_level("INFO"):
        train, held, _ = target_features(run, (0, 1, 2))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "is not the one its manifest lists" in said and "resuming after" in said
    kept = len(manifest.shards) - 1
    total = len(train) + len(held)
    assert sum(computed) == total - sum(s.sequences for s in manifest.shards[1:])
    assert sorted(p.name for p in path.iterdir() if not p.name.endswith(".safetensors")) == [MANIFEST]
    assert not (path / "train-00098.safetensors").exists() and kept > 0
    # the resumed store equals an unbroken one
    whole = RunInputs(config(tmp_path / "whole", feature_batch_tokens=0), Accelerator(cpu=True), target, tok,
                      convs[:12], convs[12:])  # fmt: skip
    ref_train, ref_held, _ = target_features(whole, (0, 1, 2))
    for got, want in ((train, ref_train), (held, ref_held)):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.features, want.features)


def test_store_round_trip_in_any_dtype_and_shard_size(tmp_path):
    g = torch.Generator().manual_seed(0)
    ex = [
        {"input_ids": torch.randint(0, 9, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.5}
        for n in (3, 7, 5, 2, 9)
    ]
    for dtype in (torch.float32, torch.bfloat16):
        feats = [torch.randn(e["input_ids"].numel(), 6, generator=g).to(dtype) for e in ex]
        store = FeatureStore.from_examples(ex, feats, 6)
        ident = StoreIdentity("sig", "fp", "final_norm", 16, 6, str(dtype).removeprefix("torch."))
        for shard_bytes in (1, 100, 1 << 20):
            out = tmp_path / f"{dtype}-{shard_bytes}"
            save_features(out, store, FeatureStore.cat([store, store]), ident, shard_bytes)
            train, held = load_features(out, ident)
            assert train.dtype == dtype and torch.equal(train.features, store.features)
            assert torch.equal(held.tokens, torch.cat([store.tokens, store.tokens]))
            # single positions (Medusa) across shards
            pos = torch.tensor([[0, 20], [3, 3]])
            assert torch.equal(train.feature_rows(pos), store.features[pos])
            # two processes' stores interleaved: the conversations' order, no feature read until asked
            both = FeatureStore.interleave([train, held])
            mem = FeatureStore.interleave([store, FeatureStore.cat([store, store])])
            assert torch.equal(both.tokens, mem.tokens) and torch.equal(both.features, mem.features)


@pytest.mark.slow
def test_killed_write_resumes_to_the_unbroken_store(tmp_path):
    """A process SIGKILLed while it writes the store (no cleanup of any kind) leaves a store that is not read; the
    same call resumes it to the store an unbroken run writes."""
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from accelerate import Accelerator
        import selfspec.train.feature_store as fs
        from selfspec.train.config import TrainConfig
        from selfspec.train.inputs import RunInputs
        from tests.helpers.archs import tiny_target
        from tests.helpers.conversations import conversations
        from tests.helpers.tokenizers import tiny_tokenizer
        torch.set_num_threads(1)
        real, n = fs.hidden_features, [0]
        def killing(*a, **k):
            n[0] += 1
            if n[0] == 9:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        fs.hidden_features = killing
        convs = conversations(16)
        cfg = TrainConfig(head="eagle3", target="tiny", self_distill=False, max_length=32, features="store",
                          feature_shard_mb={SHARD_MB}, feature_batch_tokens=0, output_dir={str(tmp_path / "killed")!r})
        run = RunInputs(cfg, Accelerator(cpu=True), tiny_target("llama"), tiny_tokenizer(), convs[:12], convs[12:])
        fs.target_features(run, (0, 1, 2))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=os.getcwd(), capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    from accelerate import Accelerator

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(16)
    path = store_path(tmp_path / "killed")
    manifest = read_manifest(path)
    assert not manifest.complete and manifest.shards
    ident = store_identity(target, convs[:12], convs[12:], 32, (0, 1, 2))
    assert load_features(path, ident) is None
    runs = {}
    for name in ("killed", "whole"):
        cfg = config(tmp_path / name, feature_batch_tokens=0, eagle3={})
        runs[name] = target_features(
            RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:12], convs[12:]), (0, 1, 2)
        )
    for got, want in zip(runs["killed"][:2], runs["whole"][:2], strict=True):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.features, want.features)


PEAK = """
import json, sys, torch
from pathlib import Path
from selfspec.train.feature_store import load_features
from selfspec.train.store_shards import read_manifest

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
torch.ones(1).sum()
base = status("VmHWM")
train, held = load_features(path, read_manifest(path).identity)
total = sum(float(train.sequence(i)[1].double().sum()) for i in range(len(train)))
print(json.dumps({"base": base, "peak": status("VmHWM"), "total": total}))
"""


@pytest.mark.slow
def test_peak_memory_stays_flat_with_a_store_four_times_larger(tmp_path):
    """Reading every sequence of a store of 48 MiB and of 192 MiB: the reading process's peak RSS grows by the same
    few MiB (one sequence and the ids in memory), while the store grows by 144 MiB."""
    T, W = 256, 512  # 512 KiB of float32 features a sequence
    peaks = {}
    for n in (96, 384):
        g = torch.Generator().manual_seed(n)
        ex = [{"input_ids": torch.randint(0, 90, (T,), generator=g), "loss_mask": torch.ones(T, dtype=torch.bool)}
              for _ in range(n)]  # fmt: skip
        store = FeatureStore.from_examples(ex, [torch.randn(T, W, generator=g) for _ in ex], W)
        ident = StoreIdentity(f"s{n}", "fp", "final_norm", T, W, "float32")
        out = tmp_path / f"store{n}"
        save_features(out, store, FeatureStore.empty(W), ident, 16 << 20)
        want = float(store.features.double().sum())
        del store, ex
        done = subprocess.run([sys.executable, "-c", PEAK, str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert abs(got["total"] - want) <= 1e-3 * abs(want) + 1
        peaks[n] = got["peak"] - got["base"]
    print(f"peak RSS growth reading every sequence: {peaks[96] / 2**20:.1f} MiB (48 MiB store), "
          f"{peaks[384] / 2**20:.1f} MiB (192 MiB store)")  # fmt: skip
    assert peaks[384] < peaks[96] + 16 * 2**20  # flat: far under the 144 MiB the store grew by
