"""``python -m benchmarks.gpu_cycle``: its CPU dry run writes real, positive figures of the right shape and
decodes exactly; its rigged drafter has the acceptance it claims; its sync counters attribute what they count and
leave torch as they found it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch

from benchmarks import gpu_cycle, host_syncs
from benchmarks.rigged_drafter import RiggedDrafter, tree_parents
from selfspec.decode.drafters.base import DraftLimit
from selfspec.decode.tree import tree_depths
from selfspec.decode.verify import verify_greedy

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    """The dry run as a user runs it, in a fresh interpreter (the counters patch torch there, not here)."""
    out = tmp_path_factory.mktemp("cycle") / "cycle.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_cycle", "--dry-run", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "best tree at acceptance 0.8" in proc.stdout
    return json.loads(out.read_text())


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


@pytest.mark.slow  # the dry run in its own process (~40 s on 2 cores)
def test_dry_run_figures(dry_run):
    assert dry_run["device"] == "cpu" and dry_run["dtype"] == "float32" and dry_run["goal_cycle_rel"] == 1.3
    assert "patched torch.Tensor" in dry_run["sync_count"]
    assert list(dry_run["sizes"]) == ["tiny"]
    rec = dry_run["sizes"]["tiny"]
    assert _positive(rec["plain_step_ms"]) and _positive(rec["generate_step_ms"])
    assert len(rec["plain_step_ms_rounds"]) == 3 * 7 and dry_run["rounds"] == 3  # one before each run
    assert all(_positive(x) for x in rec["plain_step_ms_rounds"])
    assert rec["reference_equals_generate"] is True
    # the plain loop keeps its tokens on the device: no host read between its first and last step
    assert rec["plain_step_syncs"]["syncs_per_step"] == 0.0

    rows = rec["configs"]
    assert [(r["nodes"], r["acceptance"]) for r in rows] == [(1, None)] + [
        (n, a) for n in (4, 8) for a in (0.0, 0.5, 0.8)
    ]
    for r in rows:
        assert r["exact"] is True and r["first_diff"] is None, r
        assert _positive(r["cycle_ms"]) and len(r["cycle_ms_rounds"]) == 3
        assert all(_positive(x) for x in r["cycle_ms_rounds"])
        assert r["cycle_ms"] == pytest.approx(sorted(r["cycle_ms_rounds"])[1])
        assert len(r["cycle_rel_rounds"]) == 3 and all(_positive(x) for x in r["cycle_rel_rounds"])
        assert r["cycle_rel"] == pytest.approx(sorted(r["cycle_rel_rounds"])[1])
        assert r["speedup"] == pytest.approx(r["measured_tau"] / r["cycle_rel"])
        assert r["meets_goal"] is (r["cycle_rel"] <= 1.3)
        assert set(r["parts_ms"]) == set(gpu_cycle.PARTS)
        assert all(v >= 0 and math.isfinite(v) for v in r["parts_ms"].values())
        assert r["parts_ms"]["forward"] > 0 and r["parts_ms"]["accept"] > 0
        assert sum(r["parts_ms"].values()) == pytest.approx(r["instrumented_cycle_ms"], rel=1e-6)
        # every step reads at least its accepted tokens on the host
        assert r["syncs_per_step"] >= 1 and r["steps"] >= 2
        assert sum(r["sync_sites"].values()) == pytest.approx(r["syncs_per_step"])
        assert any(site.startswith("decode/") for site in r["sync_sites"])
    assert [r["depth"] for r in rows] == [0, 2, 2, 2, 3, 3, 3]
    for n in (4, 8):
        taus = [r for r in rows if r["nodes"] == n]
        assert taus[0]["measured_tau"] == 1.0  # acceptance 0: the bonus token only
        assert 1.0 < taus[1]["measured_tau"] < taus[2]["measured_tau"]
        for r in taus:
            assert r["measured_tau"] == pytest.approx(r["expected_tau"], abs=0.25)
    assert set(rec["chosen"]) == {"0.0", "0.5", "0.8"}
    assert rec["chosen"]["0.8"]["nodes"] in (1, 4, 8)


def test_rigged_drafter_acceptance():
    """The main path holds the reference up to the step's k and nothing else is right: greedy verification
    of the proposal against the reference's one-hot logits accepts exactly k drafts."""
    vocab, prompt = 50, torch.tensor([7, 8, 9])
    reference = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0))
    parents = tree_parents(16, "tree")
    for a in (0.0, 0.5, 0.8, 1.0):
        drafter = RiggedDrafter(reference, parents, a, vocab)
        drafter.begin(prompt, torch.zeros(3, 4))
        ks = []
        for step in range(12):
            m = 1 + step  # decided tokens after the prompt, the root included
            context = torch.cat([prompt, reference[:m]])
            tree = drafter.propose(context, None, None, DraftLimit(useful_depth=40))
            k = drafter.accepted_depth(step)
            assert tree.tokens[0] == context[-1] and torch.equal(tree.parents, parents)
            depth = tree_depths(parents)
            logits = torch.full((16, vocab), -1.0)
            logits[torch.arange(16), reference[m + depth]] = 1.0  # argmax at node i: the token after it
            result = verify_greedy(logits, tree.tokens, tree.parents)
            assert result.num_accepted == k and result.next_token == int(reference[m - 1 + k + 1])
            ks.append(k)
        if a == 0.0:
            assert set(ks) == {0}
        if a == 1.0:
            assert set(ks) == {drafter.main_depth}
    long = RiggedDrafter(reference, parents, 0.5, vocab)
    mean_k = sum(long.accepted_depth(i) for i in range(2000)) / 2000
    assert 1.0 + mean_k == pytest.approx(long.expected_tau, abs=0.01)
    with pytest.raises(ValueError, match="acceptance"):
        RiggedDrafter(reference, parents, 1.5, vocab)


def _sync_here() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_cuda_sync_counter_attributes_warnings():
    """CUDA's sync debug warnings are counted by the line that raised them, during the steps only."""
    probe, sites = host_syncs.Probe(), Counter()
    with mock.patch.object(torch.cuda, "set_sync_debug_mode") as mode:
        with host_syncs.count_cuda_syncs(probe, sites):
            _sync_here()  # before the steps: ignored
            probe.in_steps = True
            _sync_here()
            _sync_here()
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert [c.args for c in mode.call_args_list] == [("warn",), ("default",)]
    assert len(sites) == 1 and sum(sites.values()) == 2
    assert next(iter(sites)).split(":")[0].endswith("tests/benchmarks/test_gpu_cycle.py")


def test_host_read_counter_restores_torch():
    before = {name: torch.Tensor.__dict__.get(name) for name in (*host_syncs.HOST_READS, "to")}
    tensor_fn = torch.tensor
    probe, sites = host_syncs.Probe(), Counter()
    probe.in_steps = True
    with host_syncs.count_host_reads(probe, sites):
        x = torch.tensor([1, 2], device="cpu")
        x.tolist()
        int(x[0])
        x.to("cpu")
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before and torch.tensor is tensor_fn
    kinds = sorted(site.rsplit(" ", 1)[1] for site in sites)
    assert kinds == ["__int__", "tensor(device=)", "to(device)", "tolist"]
    assert all(site.split(":")[0].endswith("tests/benchmarks/test_gpu_cycle.py") for site in sites)
