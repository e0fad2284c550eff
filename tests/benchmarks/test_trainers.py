"""benchmarks/trainers.py and its parts, without the trainers' venvs: the feature files other trainers read hold
the tokens, masks and target states selfspec trained on, in the meaning their readers give them (a tiny random
target's own logits come back out of them); the step plans count tokens as selfspec does over the trainers' own data
orders; the written-down patches apply exactly or fail loudly; the table renders."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from benchmarks.trainer_data import (
    StepPlan,
    answer_counts,
    pair_counts,
    plan_from_batches,
    prenorm_states,
    specforge_plan,
    split_states,
    write_specforge,
    write_speculators,
)
from benchmarks.trainer_patches import PATCHES, Patch, apply_patches
from benchmarks.trainers import eagle31, kept_trainers, markdown
from selfspec.engine_envs import ENGINE_ENVS
from selfspec.train.eagle_data import PairStore
from selfspec.train.features import hidden_features
from tests.helpers.archs import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

D, V, LAYERS = 32, 96, (1, 2, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(layers=4)


@pytest.fixture(scope="module")
def stores(target):
    """A training and a held-out store of random sequences with ``[3 layers, last]`` features, as selfspec keeps."""

    def store(n, seed):
        g = torch.Generator().manual_seed(seed)
        examples = []
        for i in range(n):
            T = 9 + 3 * i
            ids = torch.randint(3, V, (T,), generator=g)
            mask = torch.zeros(T, dtype=torch.bool)
            mask[4:] = True
            examples.append({"input_ids": ids, "loss_mask": mask})
        return PairStore.from_examples(examples, hidden_features(target, examples, True, layers=LAYERS), 4 * D)

    return store(5, 0), store(2, 1)


def test_prenorm_states_normalise_back(target):
    """The state written for speculators' trainer, normalised by the target's own final norm, is selfspec's state."""
    norm = LlamaRMSNorm(D, eps=target.config.rms_norm_eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D) + 0.5)
    h = torch.randn(7, D) * 3
    f = norm(h)
    assert torch.allclose(norm(prenorm_states(f, norm.weight)), f, atol=1e-5, rtol=1e-5)


def test_specforge_files_give_the_targets_own_logits(target, stores, tmp_path):
    """SpecForge's reader takes ``input_ids``, ``loss_mask``, ``aux_hidden_state``, ``hidden_state`` and turns the
    last into logits with the lm_head alone (its TargetHead): those are the target's own logits, in file order."""
    train, _ = stores
    out = write_specforge(train, tmp_path / "sf", D, torch.bfloat16)
    files = sorted(out.glob("*.ckpt"))
    assert len(files) == len(train)
    for i, path in enumerate(files):
        raw = torch.load(path, weights_only=False)
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        tokens, feats, mask = train.sequence(i)
        g, f = split_states(feats, D)
        assert torch.equal(raw["input_ids"], tokens) and torch.equal(raw["loss_mask"], mask.long())
        assert raw["aux_hidden_state"].dtype == torch.bfloat16 and raw["aux_hidden_state"].shape == g.shape
        assert torch.equal(raw["aux_hidden_state"], g.to(torch.bfloat16))
        logits = target.lm_head(raw["hidden_state"].float())
        expected = target(tokens[None]).logits[0]
        assert torch.allclose(logits, expected, atol=0.05, rtol=0.02)  # bf16 states


def test_speculators_data_gives_the_targets_own_states(target, stores, tmp_path):
    """speculators' reader: an Arrow set in torch format (training rows first, then the held-out rows its ratio puts
    in validation), ``hs_{i}`` files of ``[T, 4, D]``: the three layers as selfspec fuses them, then a last state whose
    RMSNorm under the target's own final norm gives the target's logits; ``token_freq.pt`` counts answer tokens."""
    from datasets import load_from_disk

    train, held = stores
    out = tmp_path / "spec"
    ratio = write_speculators(train, held, out, D, target.model.norm.weight, torch.float32)
    data = load_from_disk(str(out / "arrow"))
    assert len(data) == len(train) + len(held) and int(len(data) * ratio) == len(train)
    for i in range(len(train) + len(held)):
        tokens, feats, mask = train.sequence(i) if i < len(train) else held.sequence(i - len(train))
        row = data[i]
        assert torch.equal(row["input_ids"], tokens) and torch.equal(row["loss_mask"], mask.long())
        assert int(row["seq_len"]) == tokens.numel()
        from safetensors.torch import load_file

        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], tokens) and hs["hidden_states"].shape == (tokens.numel(), 4, D)
        out_states = target(tokens[None], output_hidden_states=True).hidden_states
        for k, layer in enumerate(LAYERS):
            assert torch.allclose(hs["hidden_states"][:, k], out_states[layer][0], atol=1e-5)
        logits = target.lm_head(target.model.norm(hs["hidden_states"][:, 3]))
        assert torch.allclose(logits, target(tokens[None]).logits[0], atol=1e-4, rtol=1e-4)
    assert torch.load(out / "token_freq.pt") == dict(answer_counts(train))


def test_specforge_plan_follows_its_sampler_order():
    """SpecForge's offline order is DistributedSampler's (seed + epoch, one sequence per step): the plan stops at the
    first step whose tokens reach the budget, counting T - 1 pairs per sequence."""
    pairs = [10, 20, 30, 40, 50]
    plan = specforge_plan(pairs, 200, seed=42)
    done, steps = 0, 0
    for epoch in range(5):
        sampler = torch.utils.data.DistributedSampler(range(5), num_replicas=1, rank=0, shuffle=True, seed=42)
        sampler.set_epoch(epoch)
        for i in sampler:
            done, steps = done + pairs[i], steps + 1
            if done >= 200:
                break
        if done >= 200:
            break
    assert (plan.steps, plan.trained_tokens, plan.epochs) == (steps, done, 2)


def test_plan_from_batches_and_pair_counts(stores):
    assert plan_from_batches([[5, 7], [6, 6]], 13) == StepPlan(3, 2, 18, 6.0)
    assert plan_from_batches([[5]], 12).steps == 3  # the last epoch repeats
    train, _ = stores
    assert pair_counts(train) == [int(n) - 1 for n in train.lengths]
    assert pair_counts(train, 10) == [min(int(n), 10) - 1 for n in train.lengths]
    with pytest.raises(ValueError):
        specforge_plan([], 10, 0)


def test_patches_apply_exactly_or_fail(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "m.py").write_text('x = "cuda"\ny = "cuda"\ndef kernel():\n    pass\n')
    done = apply_patches(
        pkg,
        (
            Patch("sub/m.py", '"cuda"', '"cpu"', "device name", count=2),
            Patch("sub/m.py", "def kernel():", "def kernel():\n    return 0\n", "a GPU kernel", to_end=True),
        ),
    )
    assert (pkg / "sub" / "m.py").read_text() == 'x = "cpu"\ny = "cpu"\ndef kernel():\n    return 0\n'
    assert [d["reason"] for d in done] == ["device name", "a GPU kernel"]
    with pytest.raises(RuntimeError, match="device name"):
        apply_patches(pkg, (Patch("sub/m.py", '"cuda"', '"cpu"', "device name"),))


def test_every_patch_says_why_and_every_trainer_has_a_venv():
    for trainer, (package, patches) in PATCHES.items():
        assert trainer in ENGINE_ENVS and package
        assert patches and all(p.reason and p.old for p in patches)


def test_markdown_table():
    held = {"positions": 10, "chain": [0.4, 0.2, 0.1], "chain_tau": 1.6, "chain_tau_3": 1.7}
    report = {
        "run": "runs/e3",
        "budget": 1000,
        "bench_engines": ["selfspec", "llamacpp"],
        "bench": {
            "selfspec": {"selfspec": 1.5, "specforge": None},
            "llamacpp": {"selfspec": 1.25, "specforge": "EAGLE-3.1 head: this engine's export refuses it"},
        },
        "trainers": {
            "selfspec": {"trained_tokens": 1001, "steps": 3, "heldout": held, "cpu_minutes": 1.25, "wall_s": 40},
            "specforge": {
                "trained_tokens": 1003,
                "steps": 4,
                "heldout": held,
                "cpu_minutes": None,
                "wall_s": None,
                "patches": [{"path": "core/loss.py", "reason": "a GPU kernel"}],
            },
        },
    }
    text = markdown(report)
    assert "| selfspec | 1,001 | 3 | 0.4000 | 0.2000 | 0.1000 | 1.6000 | 1.7000 | 1.2 | 40 | 1.500 | 1.250 |" in text
    assert "| specforge | 1,003 | 4 |" in text and text.count("| - |") == 1 and "core/loss.py" in text
    assert "bench (llamacpp), specforge: EAGLE-3.1 head" in text
    json.dumps(report)


def test_eagle31_heads_are_recognised(tmp_path):
    for flags, want in (({"fc_norm": False, "norm_output": True}, True), ({"fc_norm": False}, False)):
        (tmp_path / "config.json").write_text(json.dumps({"selfspec": {"head_type": "eagle3", **flags}}))
        assert eagle31(str(tmp_path)) is want


def test_a_comparison_goes_on_trainer_by_trainer_with_the_same_settings(tmp_path):
    heads = tmp_path / "speculators" / "heads"
    heads.mkdir(parents=True)
    (heads / "config.json").write_text("{}")
    record = {"head_dir": str(heads), "trained_tokens": 1003}
    gone = {"head_dir": str(tmp_path / "specforge" / "heads"), "trained_tokens": 1001}  # its head was deleted
    earlier = {
        "run": "runs/e3",
        "budget": 1000,
        "ttt_steps": None,
        "trainers": {"speculators": record, "specforge": gone},
    }
    (tmp_path / "trainers.json").write_text(json.dumps(earlier))
    assert kept_trainers(tmp_path, "runs/e3", 1000, None) == {"speculators": record}
    assert kept_trainers(tmp_path, "runs/e3", 2000, None) == {}  # another budget: nothing kept
    assert kept_trainers(tmp_path, "runs/e3", 1000, 2) == {}  # another TTT length
    assert kept_trainers(tmp_path / "empty", "runs/e3", 1000, None) == {}
