"""train/eagle.py, eagle_data.py, unroll.py, clock.py + losses.eagle_loss: the token/feature/mask shift,
packing, the loss, the schedule, and a tiny run with resume."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.train import eagle as recipe
from selfspec.train.config import TrainConfig
from selfspec.train.eagle_data import PairStore, collate, pack_rows, shift_pairs
from selfspec.train.feature_store import feature_signature, save_features, store_identity, store_path
from selfspec.train.inputs import RunInputs
from selfspec.train.losses import eagle_loss
from selfspec.train.unroll import UnrolledEagle, chain_hits
from tests.helpers.archs import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def test_shift_on_hand_made_sequence():
    """8 tokens: a 3-token prompt, a 2-token answer, 1 template token, a 2-token answer.

    Pair t = (f_t, x_{t+1}) predicts f_{t+1}, which drafts x_{t+2}: scored iff x_{t+2} is an assistant token.
    """
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    feats = torch.arange(8, dtype=torch.float32).unsqueeze(1).repeat(1, 4)  # f_t = t
    tok, f_in, f_out, scored = shift_pairs(ids, feats, mask)
    assert tok.tolist() == [11, 12, 13, 14, 15, 16, 17]  # x_{t+1}
    assert f_in[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]  # f_t
    assert f_out[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7]  # f_{t+1}
    assert scored.tolist() == [False, True, True, False, True, True, False]
    # Spelled out: the scored pairs draft exactly the assistant tokens x_3, x_4, x_6, x_7 ...
    drafted = [int(ids[t + 2]) for t in range(7) if scored[t]]
    assert drafted == ids[mask].tolist()
    # ... and the known bug (mask shifted like the labels only once) would score other pairs.
    assert scored.tolist() != mask[1:].tolist()
    with pytest.raises(ValueError):
        shift_pairs(ids[:1], feats[:1], mask[:1])


def test_pack_rows():
    assert pack_rows([5, 3, 4, 9, 1], 8) == [[0, 1], [2], [3], [4]]
    assert pack_rows([2, 2, 2], 8) == [[0, 1, 2]]


def _store(lengths, D=32, V=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ex = [
        {"input_ids": torch.randint(0, V, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.3}
        for n in lengths
    ]
    feats = [torch.randn(n, D, generator=g) for n in lengths]
    return PairStore.from_examples(ex, feats, D)


def test_packed_batch_equals_separate_sequences():
    target = tiny_llama()
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=32, vocab_size=96), target.config, target=target).eval()
    store = _store([6, 9, 4])
    b = collate(store, [[0, 1], [2]])
    assert b["positions"][0].tolist() == list(range(5)) + list(range(8))
    assert b["valid"][1].tolist() == [True] * 3 + [False] * 10
    with torch.no_grad():
        packed = head(b["features"], b["tokens"], b["positions"], b["mask"])
        for row, seqs in enumerate([[0, 1], [2]]):
            o = 0
            for i in seqs:
                tok, f_in, _, _ = store.pairs(i)
                n = tok.numel()
                alone = head(f_in.unsqueeze(0), tok.unsqueeze(0), torch.arange(n).unsqueeze(0))
                torch.testing.assert_close(packed[row, o : o + n], alone[0], rtol=1e-5, atol=1e-5)
                o += n


def test_eagle_loss_hand_built():
    pred = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    tgt = torch.tensor([[0.5, 0.0], [1.0, 1.0]])
    # SmoothL1 (beta 1): |0.5| -> 0.125, |2| -> 1.5, zeros -> 0; mean over 4 elements
    logits_t = torch.tensor([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    logits_d = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    loss, feat, ce = eagle_loss(pred, tgt, logits_d, logits_t, ce_weight=0.1)
    assert feat.item() == pytest.approx((0.125 + 1.5) / 4)
    # the default token term is KL(p || q): EAGLE's soft-label cross entropy less the target's entropy
    p = torch.softmax(logits_t, -1)
    soft_ce = -(p * torch.log_softmax(logits_d, -1)).sum(-1).mean()
    entropy = -(p * p.log()).sum(-1).mean()
    assert ce.item() == pytest.approx((soft_ce - entropy).item(), abs=1e-6)
    assert loss.item() == pytest.approx(feat.item() + 0.1 * ce.item())
    # identical logits: KL 0 (its minimum)
    _, _, ce_same = eagle_loss(pred, tgt, logits_t, logits_t)
    assert ce_same.item() == pytest.approx(0.0, abs=1e-7)
    # the acceptance losses: row 0 p uniform, q = softmax(1, 0, 0); row 1 identical (TV 0)
    q0 = torch.softmax(logits_d[0], -1)
    tv0 = 0.5 * (q0 - 1 / 3).abs().sum().item()
    _, _, tv = eagle_loss(pred, tgt, logits_d, logits_t, token_loss="tv")
    assert tv.item() == pytest.approx(tv0 / 2, abs=1e-6)
    _, _, hard = eagle_loss(pred, tgt, logits_d, logits_t, token_loss="ce")  # against argmax p: ids 0 and 0
    assert hard.item() == pytest.approx(-(torch.log_softmax(logits_d, -1)[:, 0]).mean().item(), abs=1e-6)
    with pytest.raises(ValueError, match="eagle.loss"):
        eagle_loss(pred, tgt, logits_d, logits_t, token_loss="mse")
    # no scored position: zero, still differentiable
    z = torch.zeros(0, 2, requires_grad=True)
    loss0, _, _ = eagle_loss(z, z.detach(), torch.zeros(0, 3, requires_grad=True), torch.zeros(0, 3))
    loss0.backward()
    assert loss0.item() == 0.0
    with pytest.raises(ValueError):
        eagle_loss(pred, tgt[:1], logits_d, logits_t)


def _distilled_store(target, n: int, seed: int) -> PairStore:
    """The tiny target's own greedy answers to random prompts (a self-distilled set), with its features."""
    from selfspec.train.features import hidden_features

    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        prompt = torch.randint(3, 96, (6,), generator=g)
        out = target.generate(
            prompt.unsqueeze(0), do_sample=False, max_new_tokens=18, min_new_tokens=18, pad_token_id=0
        )
        ids = out[0]
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[6:] = True
        examples.append({"input_ids": ids, "loss_mask": mask})
    return PairStore.from_examples(examples, hidden_features(target, examples, disable_progress=True), 32)


def _untrained(target, held: PairStore) -> dict:
    """Held-out metrics of the head as training starts it (the recipe seeds its init with ``cfg.seed`` = 0),
    independent of what training drew from the global random state."""
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=32, vocab_size=96), target.config, target=target)
    return recipe.summarise_eval(recipe.evaluate(head, held, target.lm_head.weight, 3))


def _run(cfg: TrainConfig, target):
    from accelerate import Accelerator

    return recipe.train_eagle(RunInputs(cfg, Accelerator(cpu=True), target, None, [], []))


def test_tiny_training_run_learns_saves_and_resumes_exactly(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from selfspec.heads import load_heads

    target = tiny_llama()
    train, held = _distilled_store(target, 64, seed=0), _distilled_store(target, 6, seed=1)
    run_a = tmp_path / "a"
    (run_a / "features").mkdir(parents=True)
    base = dict(
        head="eagle",
        target="tiny",
        max_length=32,
        draft_vocab_size=80,
        lr=3e-3,
        warmup_steps=2,
        grad_clip=0.5,
        epochs=100,
        eval_every=1000,
        eval_topk=3,
        seed=0,
        eagle={"batch_tokens": 64},
    )  # 2 rows of 32 pairs per step
    # Cached features carry the signature of the data they came from (here: no conversations).
    save_features(store_path(run_a), train, held, store_identity(target, [], [], 32))

    # A quick run must learn: held-out top-1 well above the untrained head's.
    learn = tmp_path / "learn"
    shutil.copytree(run_a, learn)
    heads_dir = _run(TrainConfig(**base, max_steps=200, save_every=1000, output_dir=str(learn)), target)
    summary = json.loads((learn / "train_summary.json").read_text())
    assert summary["train_tokens_per_s"] > 0 and summary["step"] == 200 and summary["stopped_by"] == "steps"
    assert summary["trained_tokens"] == summary["train_tokens_total"]

    # A token budget ends the run once the head has trained on that many tokens, whatever the machine's speed.
    budget = tmp_path / "budget"
    shutil.copytree(run_a, budget)
    _run(TrainConfig(**base, max_train_tokens=1500, save_every=1000, output_dir=str(budget)), target)
    by_tokens = json.loads((budget / "train_summary.json").read_text())
    assert by_tokens["stopped_by"] == "tokens" and by_tokens["max_train_tokens"] == 1500
    per_step = summary["train_tokens_total"] / summary["step"]
    assert 1500 <= by_tokens["trained_tokens"] < 1500 + 2 * per_step and by_tokens["step"] < 200
    untrained = _untrained(target, held)
    assert summary["heldout"]["top1"] > max(0.1, 5 * untrained["top1"]), (summary["heldout"], untrained)
    assert summary["heldout"]["feature_loss"] < 0.8 * untrained["feature_loss"], (summary["heldout"], untrained)
    head = load_heads(heads_dir, target=target)
    assert head.config.heldout_top1 == summary["heldout"]["top1"] and head.config.n_draft == 80

    # Resume: a run checkpointed at step 3 and restarted ends with the same weights as an unbroken run.
    cfg_a = TrainConfig(**base, max_steps=6, save_every=3, output_dir=str(run_a))
    _run(cfg_a, target)
    run_b = tmp_path / "b"
    shutil.copytree(run_a, run_b)
    shutil.rmtree(run_b / "heads")
    assert json.loads((run_b / "checkpoint" / "trainer_state.json").read_text())["step"] == 3
    _run(TrainConfig(**base, max_steps=6, save_every=3, output_dir=str(run_b)), target)
    wa, wb = (
        load_file(str(run_a / "heads" / "model.safetensors")),
        load_file(str(run_b / "heads" / "model.safetensors")),
    )
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)
    fresh = EagleHead(head.config, target.config, draft_ids=head.draft_ids, target=target)
    assert not torch.allclose(fresh.fc.weight, wa["fc.weight"])  # it did train


def test_unrolled_steps_equal_chain_drafting():
    """Training-time test: step j at pair i must equal drafting depth j+1 from the chain that starts at pair
    i-j (target features up to there, then the head's own predicted features), with one KV cache, exactly as
    decoding does it. Two sequences packed in one row, three steps."""
    from transformers import DynamicCache

    target = tiny_llama()
    torch.manual_seed(0)
    head = EagleHead(EagleConfig(hidden_size=32, vocab_size=96), target.config, target=target).eval()
    store = _store([7, 6])
    b = collate(store, [[0, 1]])
    steps = 3
    with torch.no_grad():
        preds = UnrolledEagle(head)(b["features"], b["tokens"], b["positions"], b["segment"], steps)
        o = 0
        checked = 0
        for i in range(2):
            tok, f_in, _, _ = store.pairs(i)
            n = tok.numel()
            for t in range(n):
                cache = DynamicCache(config=head.arch_config)
                out = head(
                    f_in[: t + 1].unsqueeze(0), tok[: t + 1].unsqueeze(0), torch.arange(t + 1).unsqueeze(0), None, cache
                )
                torch.testing.assert_close(preds[0][0, o + t], out[0, -1], rtol=1e-5, atol=1e-5)
                feat = out[0, -1:]
                for j in range(1, steps):
                    if t + j >= n:
                        break
                    past = t + j
                    mask = torch.zeros(1, 1, 1, past + 1)
                    out = head(
                        feat.unsqueeze(0), tok[t + j : t + j + 1].unsqueeze(0), torch.tensor([[t + j]]), mask, cache
                    )
                    torch.testing.assert_close(preds[j][0, o + t + j], out[0, -1], rtol=1e-5, atol=1e-5)
                    feat = out[0, -1:]
                    checked += 1
            o += n
    assert checked == (5 + 4) + (4 + 3)  # 6 and 5 pairs: every (chain start, depth >= 2) inside its own sequence


def test_chain_hits_hand_made():
    c0 = torch.tensor([[True, True, False, True]])
    c1 = torch.tensor([[False, True, True, True]])
    u0 = torch.ones(1, 4, dtype=torch.bool)
    u1 = torch.tensor([[False, True, True, True]])  # step 1 needs one earlier pair
    hits, counts = chain_hits([c0, c1], [u0, u1])
    # depth 1: 3 of 4 starts correct; depth 2: starts 0..2 usable, (c0[0]&c1[1]) and (c0[1]&c1[2]) hold
    assert hits == [3, 2] and counts == [4, 3]


def test_feature_signature_tracks_the_data():
    target = tiny_llama()
    a = [{"id": "1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    b = [{"id": "1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo!"}]}]
    s = feature_signature(target, a, [], 32)
    assert s == feature_signature(target, a, [], 32)
    assert (
        len(
            {
                s,
                feature_signature(target, b, [], 32),
                feature_signature(target, [], a, 32),
                feature_signature(target, a, [], 64),
                feature_signature(target, a, [], 32, layers="15,final_norm"),
                feature_signature(tiny_llama(seed=1), a, [], 32),
            }
        )
        == 6
    )


def test_training_time_test_and_prompt_scoring_learn(tmp_path):
    target = tiny_llama()
    train, held = _distilled_store(target, 32, seed=0), _distilled_store(target, 6, seed=1)
    base = dict(
        head="eagle",
        target="tiny",
        max_length=32,
        draft_vocab_size=80,
        lr=3e-3,
        warmup_steps=2,
        grad_clip=0.5,
        epochs=100,
        eval_every=1000,
        eval_topk=3,
        seed=0,
        eagle={"batch_tokens": 64, "ttt_steps": 3, "score_prompt": True},
        max_steps=120,
        save_every=1000,
        output_dir=str(tmp_path),
    )
    save_features(store_path(tmp_path), train, held, store_identity(target, [], [], 32))
    _run(TrainConfig(**base), target)
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    untrained = _untrained(target, held)
    assert summary["options"]["ttt_steps"] == 3 and summary["options"]["score_prompt"] is True
    # every pair is scored with prompt scoring: 18 + 6 - 1 pairs per example
    assert summary["scored_positions_per_epoch"] == 32 * 23
    assert summary["heldout"]["chain_tau"] > untrained["chain_tau"] + 0.2, (summary["heldout"], untrained)
    assert summary["heldout"]["chain"][1] > max(0.03, 5 * untrained["chain"][1]), (summary["heldout"], untrained)


def test_lr_factor_anneals_by_time_or_steps():
    from selfspec.train.clock import lr_factor

    cfg = TrainConfig(warmup_steps=10, max_train_minutes=1.0)
    assert lr_factor(cfg, 4, 1010, 0.0) == pytest.approx(0.5)  # warmup: (4 + 1) / 10
    # the step count is the further along: 500 of 1000 decay steps -> cos at 0.5
    assert lr_factor(cfg, 510, 1010, 6.0) == pytest.approx(0.5)
    # the clock is the further along: 45 of 60 s -> 0.5 (1 + cos(0.75 pi))
    assert lr_factor(cfg, 20, 1010, 45.0) == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))
    assert lr_factor(cfg, 20, 1010, 90.0) == pytest.approx(0.0, abs=1e-12)
    no_limit = TrainConfig(warmup_steps=10)
    assert lr_factor(no_limit, 20, 1010, 1e9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 10 / 1000)))
    # a token budget: 3 of 4 million tokens trained -> 0.5 (1 + cos(0.75 pi)); the clock (1 of 60 s) is behind
    tokens = TrainConfig(warmup_steps=10, max_train_tokens=4_000_000, max_train_minutes=1.0)
    assert lr_factor(tokens, 20, 1010, 1.0, 3_000_000) == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))
    with pytest.raises(ValueError, match="max_train_tokens must be >= 1"):
        TrainConfig(max_train_tokens=0)


def test_one_scheduler_reads_the_step_and_the_clock():
    """The run's scheduler is built once; each step() sets the next rate from the step count and the clock:
    the time-annealed rate under a time budget, the step rate without one."""
    from selfspec.train.clock import TrainClock, lr_factor, make_scheduler

    class Clock(TrainClock):
        now = 0.0

        def elapsed(self) -> float:
            return self.now

    def optim(lr):
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
        return torch.optim.SGD(groups, lr=lr)

    timed = TrainConfig(lr=2e-3, warmup_steps=10, max_train_minutes=1.0)
    clock = Clock()
    opt = optim(timed.lr)
    sched = make_scheduler(timed, opt, 1010, clock)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * 0.1)  # warmup, step 0: (0 + 1) / 10
    for step in range(20):
        opt.step()
        clock.now = 45.0 if step == 19 else 1.0
        sched.step()
    want = 2e-3 * 0.5 * (1 + math.cos(0.75 * math.pi))  # step 20, 45 of 60 s: the clock is further along
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([want, want])
    assert sched.get_last_lr()[0] == pytest.approx(want)
    assert "lr_lambdas" in sched.state_dict() and sched.state_dict()["lr_lambdas"] == [None, None]  # no clock saved
    untimed = TrainConfig(lr=2e-3, warmup_steps=10)
    opt = optim(untimed.lr)
    sched = make_scheduler(untimed, opt, 1010, clock)
    for _ in range(20):
        opt.step()
        sched.step()
    clock.now = 1e9
    assert opt.param_groups[1]["lr"] == pytest.approx(2e-3 * lr_factor(untimed, 20, 1010, 0.0))
