"""Online adaptation: an EAGLE-3 head that learns from the requests it serves. Outputs stay the target's while the
head changes between requests (single prompts and ragged batches, greedy and sampled); a fault in adaptation never
stops decoding; a swapped-in head that serves worse is rolled back; the buffers stay within their bound; the adapted
head is saved without text and a restarted process continues from it."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import selfspec
from selfspec.train.online import OnlineAdapter, OnlineOptions
from selfspec.train.recipes import online_adapter
from tests.helpers.archs import tiny_llama
from tests.helpers.heads import make_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")

N = 12  # new tokens per request
FAST = OnlineOptions(
    window=2,
    steps_per_request=3,
    batch_tokens=64,
    max_length=64,
    cpu_share=0.99,
    heldout_every=2,
    buffer_tokens=96,
    lr=3e-2,
)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=96, hidden_size=32, layers=3)


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g) for _ in range(n)]


def greedy(target, ids: torch.Tensor) -> list[int]:
    out = target.generate(ids[None], do_sample=False, max_new_tokens=N, min_new_tokens=N, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


def load(target, options=FAST):
    return selfspec.load(target, make_eagle3(target), adapt=options, tune="off", depth=3, top_k=2, total_tokens=6)


def test_outputs_stay_the_targets_while_the_head_changes(target):
    model = load(target)
    head = model.online.live
    start = {k: v.clone() for k, v in head.state_dict().items()}
    for ids in prompts(10):
        assert model.generate(ids, max_new_tokens=N, eos_token_id=[]).tokens == greedy(target, ids)
    batch = prompts(3, seed=1)  # ragged rows, each its own length
    outs = model.generate(batch, max_new_tokens=N, eos_token_id=[])
    assert [o.tokens for o in outs] == [greedy(target, ids) for ids in batch]
    stats = model.online.stats
    assert stats.requests == 13 and stats.steps > 0 and stats.swaps >= 1
    assert any(not torch.equal(start[k], v) for k, v in head.state_dict().items())  # it did change
    assert model.online.memory_bytes() <= (96 + 96 // 4 + 2 * 64) * (4 * 32 * 4 + 8)  # within the declared bound


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_sampled_outputs_keep_the_targets_distribution_while_adapting(target):
    """Seeded, 400 draws of the first two sampled tokens after one prompt, with the head adapting between draws;
    pooled chi-square against the target's exact law of those two tokens, and of the first, at p < 0.001."""
    from tests.helpers.stats import chi2_critical, pooled_chi2

    model = load(target)
    ids = prompts(1, seed=5)[0]
    n, counts = 400, {}
    for i in range(n):
        out = model.generate(ids, max_new_tokens=2, do_sample=True, seed=i, eos_token_id=[])
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert model.online.stats.steps > 0
    with torch.no_grad():  # the exact law of two sampled tokens: p(a) p(b | a), every a at once
        p1 = torch.softmax(target(ids[None]).logits[0, -1].double(), -1)
        rows = torch.cat([ids.repeat(96, 1), torch.arange(96)[:, None]], dim=1)
        p2 = torch.softmax(target(rows).logits[:, -1].double(), -1)
    law = {(a, b): float(p1[a] * p2[a, b]) for a in range(96) for b in range(96)}
    stat, dof = pooled_chi2(counts, law, n)
    assert stat < chi2_critical(dof), (stat, dof)  # the upper 0.001 point
    first: dict[int, int] = {}
    for (a, _), k in counts.items():
        first[a] = first.get(a, 0) + k
    stat, dof = pooled_chi2(first, {a: float(p1[a]) for a in range(96)}, n)  # the first token: more bins
    assert dof >= 2 and stat < chi2_critical(dof), (stat, dof)


def test_a_fault_in_adaptation_never_stops_decoding(target, monkeypatch):
    model = load(target)

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(model.online, "_step", broken)
    batch = prompts(3)
    with pytest.warns(RuntimeWarning, match="online adaptation stopped .*disk on fire.*serves on unchanged"):
        first = model.generate(batch[0], max_new_tokens=N, eos_token_id=[])
    assert not model.online.enabled
    assert first.tokens == greedy(target, batch[0])
    assert [model.generate(ids, max_new_tokens=N, eos_token_id=[]).tokens for ids in batch[1:]] == [
        greedy(target, ids) for ids in batch[1:]
    ]


def test_a_swapped_in_head_that_serves_worse_is_rolled_back(target):
    adapter = OnlineAdapter(make_eagle3(target), target, FAST)
    good = {k: v.clone() for k, v in adapter.live.state_dict().items()}
    adapter._window = [2.0, 2.0]
    adapter._end_window()  # the window of the first head: tau 2.0
    with torch.no_grad():
        adapter.live.fc.weight.add_(1.0)  # as a swap would
    adapter._trial = True
    adapter._window = [1.5, 1.5]  # served worse
    adapter._end_window()
    assert adapter.stats.rollbacks == 1 and adapter.stats.windows[-1]["action"] == "rolled back"
    assert all(torch.equal(good[k], v) for k, v in adapter.live.state_dict().items())


def test_saved_heads_carry_no_text_and_a_restart_continues(target, tmp_path):
    model = load(target)
    for ids in prompts(6):
        model.generate(ids, max_new_tokens=N, eos_token_id=[])
    out = model.save_heads(tmp_path / "adapted")
    record = json.loads((out / "adaptation.json").read_text())
    assert record["mode"] == "online" and record["requests"] == 6 and record["served_tokens"] == 6 * N
    restarted = selfspec.load(target, out, adapt=FAST, tune="off", depth=3, top_k=2, total_tokens=6)
    saved = model.online.live.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in restarted.online.live.state_dict().items())
    with pytest.raises(ValueError, match="load with adapt=True"):
        selfspec.load(target, out, tune="off").save_heads(tmp_path / "x")


def test_bad_options_and_families_are_refused(target):
    from tests.helpers.heads import make_eagle

    with pytest.raises(ValueError, match=r"OnlineOptions.cpu_share must be a number in \(0, 1\), got 1.5"):
        OnlineOptions(cpu_share=1.5)
    with pytest.raises(ValueError, match="trains eagle3 heads; these are eagle heads: adapt them offline"):
        online_adapter(make_eagle(target), target)
    with pytest.raises(ValueError, match="adapt them offline with selfspec adapt"):
        OnlineAdapter(make_eagle(target), target)
    with pytest.raises(ValueError, match="adapt= trains a drafter's head; this model drafts with prompt_lookup"):
        selfspec.load(target, prompt_lookup=True, tune="off", adapt=True)


def finite(module: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in module.state_dict().values() if v.is_floating_point())


def poisoned_loss(monkeypatch, bad_step):
    """Patch the online step's loss: ``bad_step(i)`` (i counts the calls) says which steps get a NaN loss ("loss")
    or a finite loss whose gradients are NaN ("grad"), as a bad batch or an overflow would."""
    from selfspec.train import online

    real, calls = online.eagle3_step_loss, []

    def loss_fn(*args, **kwargs):
        loss, per_step, scored = real(*args, **kwargs)
        kind = bad_step(len(calls))
        calls.append(kind)
        if kind == "loss":
            loss = loss * float("nan")
        elif kind == "grad":
            loss.register_hook(lambda g: g * float("nan"))
        return loss, per_step, scored

    monkeypatch.setattr(online, "eagle3_step_loss", loss_fn)
    return calls


@pytest.mark.parametrize("kind", ["loss", "grad"])
def test_non_finite_steps_are_skipped_and_never_reach_the_live_head(target, monkeypatch, kind):
    """Seeded: a third of the steps get a NaN loss (or NaN gradients); each is skipped and counted, the live head
    stays finite after every request, swaps still happen, and the outputs are the target's."""
    g = torch.Generator().manual_seed(3)
    draws = torch.rand(200, generator=g).tolist()
    calls = poisoned_loss(monkeypatch, lambda i: kind if draws[i] < 0.3 and (i % 3) != 2 else None)
    model = load(target)
    for ids in prompts(8, seed=2):
        assert model.generate(ids, max_new_tokens=N, eos_token_id=[]).tokens == greedy(target, ids)
        assert finite(model.online.live) and finite(model.online.shadow)
    stats = model.online.stats
    assert model.online.enabled and stats.failed is None
    assert stats.skipped_steps == sum(c is not None for c in calls) >= 3
    assert stats.steps == len(calls) - stats.skipped_steps and stats.swaps >= 1


def test_repeated_non_finite_steps_stop_adaptation_with_one_warning(target, monkeypatch):
    poisoned_loss(monkeypatch, lambda i: "loss")  # every step: a stream the head cannot learn from
    model = load(target)
    start = {k: v.clone() for k, v in model.online.live.state_dict().items()}
    batch = prompts(4, seed=4)
    with pytest.warns(RuntimeWarning, match=r"online adaptation stopped \(FloatingPointError: 3 optimiser steps in a "):
        outs = [model.generate(ids, max_new_tokens=N, eos_token_id=[]).tokens for ids in batch]
    assert outs == [greedy(target, ids) for ids in batch]
    assert not model.online.enabled and model.online.stats.skipped_steps == 3 and model.online.stats.steps == 0
    assert all(torch.equal(start[k], v) for k, v in model.online.live.state_dict().items())


def test_a_shadow_with_non_finite_weights_or_tau_is_never_swapped_in(target, monkeypatch):
    adapter = OnlineAdapter(make_eagle3(target), target, FAST)
    start = {k: v.clone() for k, v in adapter.live.state_dict().items()}
    taus = {"shadow": 2.0}
    monkeypatch.setattr(adapter, "heldout_tau", lambda head: taus["shadow"] if head is adapter.shadow else 1.0)
    adapter.stats.steps = 1
    with torch.no_grad():
        adapter.shadow.fc.weight[0, 0] = float("nan")  # one weight of the shadow, its held-out tau looking better
    adapter._window = [2.0, 2.0]
    adapter._end_window()
    assert adapter.stats.swaps == 0 and adapter.stats.windows[-1]["action"] == "refused: non-finite weights"
    assert all(torch.equal(start[k], v) for k, v in adapter.live.state_dict().items())
    assert finite(adapter.shadow)  # the broken shadow starts again from the live head
    taus["shadow"] = float("nan")
    adapter._window = [2.0, 2.0]
    adapter._end_window()
    assert adapter.stats.swaps == 0 and adapter.stats.windows[-1]["action"] == "kept"
    taus["shadow"] = 2.0
    adapter._window = [2.0, 2.0]
    adapter._end_window()
    assert adapter.stats.swaps == 1 and adapter.stats.windows[-1]["action"] == "swapped"


def test_background_trials_judge_the_head_that_served_them(target, monkeypatch):
    """Background mode under a fast thread switch interval (a busy machine): every window end swaps a shadow in
    (its held-out tau is made to look better), and each request's tau is made to say which head served it: 1.0
    for the head it started with, 0.5 for any swapped-in one. A trial window served by its own head has tau 0.5
    exactly and is rolled back; the head it started with serves again (tau 1.0) after every rollback."""
    import sys

    options = OnlineOptions(**{**FAST.__dict__, "background": True})
    model = load(target, options)
    online = model.online
    start = {k: v.clone() for k, v in online.live.state_dict().items()}
    monkeypatch.setattr(online, "heldout_tau", lambda head: 2.0 if head is online.shadow else 1.0)
    served: list[bool] = []
    real_before, real_observe = online.before_request, online.observe

    def before_request():
        version = real_before()
        served.append(all(torch.equal(start[k], v) for k, v in online.live.state_dict().items()))
        return version

    def observe(sequence, prompt_tokens, tau, served_s):
        real_observe(sequence, prompt_tokens, 1.0 if served[-1] else 0.5, served_s)

    monkeypatch.setattr(online, "before_request", before_request)
    monkeypatch.setattr(online, "observe", observe)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for ids in prompts(18, seed=6):
            assert model.generate(ids, max_new_tokens=N, eos_token_id=[]).tokens == greedy(target, ids)
        online.join()
    finally:
        sys.setswitchinterval(interval)
    windows = online.stats.windows
    assert online.enabled and online.stats.swaps >= 2 and online.stats.rollbacks >= 2
    trials = [w for w in windows if w["action"] == "rolled back"]
    assert len(trials) == online.stats.rollbacks and all(w["tau"] == 0.5 for w in trials)
    assert all(w["tau"] == 1.0 for w in windows if w["action"] == "swapped")
    assert online.stats.swaps - online.stats.rollbacks in (0, 1)


BAD_OPTIONS = {
    "buffer_tokens": (0, "an integer >= 1"),
    "window": (0, "an integer >= 1"),
    "steps_per_request": (-1, "an integer >= 0"),
    "batch_tokens": (0, "an integer >= 1"),
    "max_length": (2.5, "an integer >= 1"),
    "lr": (-1.0, "a number > 0"),
    "ttt_steps": (0, "an integer >= 1"),
    "cpu_share": (0.0, r"a number in \(0, 1\)"),
    "heldout_every": (1, "an integer >= 2"),
    "tolerance": (float("nan"), r"a number in \[0, 1\)"),
    "background": ("yes", "true or false"),
    "seed": (-3, "an integer >= 0"),
}


def test_every_online_option_is_checked_against_its_range():
    assert set(BAD_OPTIONS) == {f.name for f in dataclasses.fields(OnlineOptions)}
    for name, (value, valid) in BAD_OPTIONS.items():
        with pytest.raises(ValueError, match=f"OnlineOptions.{name} must be {valid}, got "):
            OnlineOptions(**{name: value})


def test_every_row_of_a_batch_is_judged_as_served_by_the_head_of_its_batch(target, monkeypatch):
    """A swap decided after the first row of a batch is a new version; the batch's other rows were served by the old
    one, so they are in no window (and never judge the new head)."""
    adapter = OnlineAdapter(make_eagle3(target), target, OnlineOptions(**{**FAST.__dict__, "window": 1}))
    monkeypatch.setattr(adapter, "heldout_tau", lambda head: 2.0 if head is adapter.shadow else 1.0)
    assert adapter.before_request() == 0
    for ids in prompts(3, seed=7):
        adapter.observe(torch.cat([ids, torch.tensor(greedy(target, ids))]), ids.numel(), 1.5, 0.1)
    assert adapter.stats.swaps == 1 and adapter.live_version == 1 and adapter.stats.stale_requests == 2
    assert [(w["version"], w["served"], w["action"]) for w in adapter.stats.windows] == [(0, [1], "swapped")]
    assert adapter.before_request() == 1
