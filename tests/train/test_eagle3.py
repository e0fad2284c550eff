"""train/eagle3.py: the label/mask shift on a hand-made sequence, training-time-test logits equal to decoding's
(EAGLE-3 and EAGLE-3.1 heads), the loss on hand-built logits, and a tiny run on the shared loop (learns, saves,
loads, config section; the EAGLE-3.1 options reach the saved head)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.kv import new_cache
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.verifier import Verifier
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.train.config import Eagle3Options, TrainConfig, load_config
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss, split_features, train_eagle3
from selfspec.train.eagle_data import PairStore, collate
from selfspec.train.feature_store import save_features, store_identity, store_path
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import tiny_llama
from tests.helpers.drafters import NO_LIMIT
from tests.helpers.training import distilled_store

pytestmark = pytest.mark.usefixtures("one_thread")

D, V = 32, 96


def test_shift_on_hand_made_sequence():
    """8 tokens: a 3-token prompt, a 2-token answer, 1 template token, a 2-token answer. Store features
    ``[g_t (3D), f_t (D)]`` with g_t = t and f_t = one-hot of x_{t+1} (a target that knows the next token).

    Pair t: input (g_t, x_{t+1}); target distribution from f_{t+1}, whose argmax is x_{t+2}; scored iff x_{t+2}
    is an assistant token. So the scored pairs' target tokens are exactly the assistant tokens."""
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17])
    mask = torch.tensor([0, 0, 0, 1, 1, 0, 1, 1], dtype=torch.bool)
    g = torch.arange(8, dtype=torch.float32).unsqueeze(1).repeat(1, 3 * D)
    f = torch.zeros(8, D)
    f[torch.arange(7), ids[1:] - 10] = 10.0  # f_t predicts x_{t+1}; f_7 predicts nothing
    store = PairStore.from_examples([{"input_ids": ids, "loss_mask": mask}], [torch.cat([g, f], -1)], 4 * D)
    b = collate(store, [[0]])
    layers, f_next = split_features(b, D)
    assert b["tokens"][0].tolist() == [11, 12, 13, 14, 15, 16, 17]  # x_{t+1}
    assert layers[0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]  # g_t
    lm = torch.eye(D)  # the "lm_head" reads token 10 + k from column k
    label = (f_next[0] @ lm.T).argmax(-1) + 10
    scored = b["scored"][0]
    assert scored.tolist() == [False, True, True, False, True, True, False]
    assert label[scored].tolist() == ids[mask].tolist() == [13, 14, 16, 17]
    assert label[:6].tolist() == ids[2:].tolist()  # pair t's target is x_{t+2}
    assert scored.tolist() != mask[1:].tolist()  # the mask shifted once (the EAGLE #317 bug class) differs


@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
def test_training_logits_equal_decoding_logits(eagle31):
    """For the same prefix, the training-time test's step-i logits at pair T-1+i equal the draft logits the EAGLE
    drafter computes at depth i+1 of a chain (fp32, atol 1e-5): the prompt's T pairs with the target's layer
    states, then the head's own outputs paired with the drafted tokens, through the decode cache and masks. For an
    EAGLE-3.1 head (``fc_norm``, ``norm_output``) both feed the post-norm output back and norm the fused layers."""
    target = tiny_llama(layers=3)
    torch.manual_seed(0)
    cfg = Eagle3Config(
        hidden_size=D, vocab_size=V, draft_vocab_size=V, num_target_layers=3, fc_norm=eagle31, norm_output=eagle31
    )
    head = Eagle3Head(cfg, target.config, target=target, init_layer=-1, init_lm_head=True).eval()
    if eagle31:
        with torch.no_grad():  # norms that are not the identity's scale
            for norm in head.fc_norm:
                norm.weight.uniform_(0.5, 1.5)
    steps, T = 4, 9
    prompt = torch.randint(3, V, (T,), generator=torch.Generator().manual_seed(2))
    root = torch.tensor([7])
    seen: list[torch.Tensor] = []

    class Spy(Eagle3Head):
        def draft_logits(self, output):
            out = super().draft_logits(output)
            seen.append(out.detach().clone())
            return out

    spy = Spy(cfg, target.config, target=target).eval()
    spy.load_state_dict(head.state_dict())
    drafter = EagleDrafter(spy, target, depth=steps, top_k=1, total_tokens=steps)
    _, states = Verifier(target).prefill(prompt, new_cache(target), layers=head.target_layers)
    drafter.begin(prompt, states)
    tree = drafter.propose(torch.cat([prompt, root]), SamplingConfig(), None, NO_LIMIT)
    decode_logits = [s.reshape(-1, V)[-1] for s in seen]  # one per depth
    assert len(decode_logits) == steps
    # The training sequence: prompt, root, the drafted chain; layer states of the target over all of it.
    seq = torch.cat([prompt, tree.tokens])  # tree.tokens[0] is the root
    feats = Verifier(target).prefill(seq, new_cache(target), layers=head.target_layers)
    store = PairStore.from_examples(
        [{"input_ids": seq, "loss_mask": torch.ones(seq.numel(), dtype=torch.bool)}],
        [torch.cat([feats[1], feats[0]], -1)],
        4 * D,
    )
    b = collate(store, [[0]])
    layers, _ = split_features(b, D)
    with torch.no_grad():
        train_logits = UnrolledEagle3(head)(layers, b["tokens"], b["positions"], b["segment"], steps, b["valid"])
    for i in range(steps):
        pair = T - 1 + i  # step i's rows are the pairs with positions >= i, so pair p is row p - i
        torch.testing.assert_close(train_logits[i][pair - i], decode_logits[i], rtol=0, atol=1e-5)


def test_loss_hand_built():
    """KL(p || q) at step 0 with hand-built logits, weights decay ** i, and the CE variant."""
    target = tiny_llama(layers=3)
    store = distilled_store(target, (0, 1, 2), 2, seed=3)
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=D, vocab_size=V, draft_vocab_size=V, num_target_layers=3)
    head = Eagle3Head(cfg, target.config, target=target)
    b = collate(store, [[0, 1]])
    lm = target.lm_head.weight.float()
    unrolled = UnrolledEagle3(head)
    loss, per_step, n = eagle3_step_loss(unrolled, b, lm, Eagle3Options(ttt_steps=2, ttt_decay=0.5), D)
    layers, f_next = split_features(b, D)
    q = [x.detach() for x in unrolled(layers, b["tokens"], b["positions"], b["segment"], 2, b["scored"])]
    p = torch.softmax(f_next[b["scored"]] @ lm.T, -1)
    kl = [
        (pl.clamp_min(1e-30) * (pl.clamp_min(1e-30).log() - torch.log_softmax(qi, -1))).sum(-1).mean()
        for pl, qi in ((p, q[0]), (p[b["positions"][b["scored"]] >= 1], q[1]))
    ]
    assert n == int(b["scored"].sum()) and per_step == pytest.approx([float(k) for k in kl], abs=1e-4)
    assert float(loss.detach()) == pytest.approx(float(kl[0] + 0.5 * kl[1]), abs=1e-4)
    _, ce_steps, _ = eagle3_step_loss(unrolled, b, lm, Eagle3Options(ttt_steps=1, loss="ce"), D)
    want = torch.nn.functional.cross_entropy(q[0], p.argmax(-1))
    assert ce_steps[0] == pytest.approx(float(want), abs=1e-4)
    # the acceptance losses at step 0, from alpha = sum min(p, q) written out here
    alpha = torch.minimum(p, torch.softmax(q[0], -1)).sum(-1)
    lam = torch.exp(-3 * alpha)
    wants = {
        "tv": 1 - alpha,
        "nla": -alpha.log(),
        "lk_hybrid": lam * (p * (p.log() - torch.log_softmax(q[0], -1))).sum(-1) + (1 - lam) * (1 - alpha),
    }
    for kind, want in wants.items():
        _, steps, _ = eagle3_step_loss(unrolled, b, lm, Eagle3Options(ttt_steps=1, loss=kind), D)
        assert steps[0] == pytest.approx(float(want.mean()), abs=1e-4), kind


def test_config_section():
    cfg = load_config(
        None, ["head=eagle3", "eagle3.ttt_steps=3", "eagle3.target_layers=[0, 1, 2]", "eagle3.init_layer=null"]
    )
    assert cfg.eagle3.ttt_steps == 3 and cfg.eagle3.target_layers == (0, 1, 2) and cfg.eagle3.init_layer is None
    assert (cfg.eagle3.fc_norm, cfg.eagle3.norm_output) == (False, False)
    cfg = load_config(None, ["head=eagle3", "eagle3.fc_norm=true", "eagle3.norm_output=true"])
    assert (cfg.eagle3.fc_norm, cfg.eagle3.norm_output) == (True, True)
    with pytest.raises(ValueError, match="eagle3.fc_norm"):
        load_config(None, ["eagle3.fc_norm=maybe"])
    assert TrainConfig().eagle3.ttt_steps == 7 and TrainConfig().eagle3.loss == "kl"
    with pytest.raises(ValueError, match="eagle3"):
        load_config(None, ["eagle3.steps=3"])
    with pytest.raises(ValueError):
        load_config(None, ["eagle3.loss=mse"])


def tiny_run(tmp_path, target, train, held, steps: int, **eagle3) -> Path:
    """The recipe on the shared loop over a saved feature store of ``train`` / ``held``; the heads directory."""
    from accelerate import Accelerator

    save_features(store_path(tmp_path), train, held, store_identity(target, [], [], 32, (0, 1, 2)))
    cfg = TrainConfig(
        head="eagle3",
        target="tiny",
        max_length=32,
        draft_vocab_size=80,
        lr=3e-3,
        warmup_steps=2,
        grad_clip=0.5,
        epochs=100,
        max_steps=steps,
        eval_every=1000,
        save_every=1000,
        seed=0,
        output_dir=str(tmp_path),
        calibrate_prompts=0,
        eagle3={"batch_tokens": 64, "ttt_steps": 3, **eagle3},
    )
    return train_eagle3(RunInputs(cfg, Accelerator(cpu=True), target, None, [], []))


def test_tiny_run_learns_saves_and_loads(tmp_path):
    from selfspec.heads import load_heads
    from selfspec.train.eagle3 import evaluate

    target = tiny_llama(layers=3)
    layers = (0, 1, 2)
    train, held = distilled_store(target, layers, 48, seed=0), distilled_store(target, layers, 6, seed=1)
    heads_dir = tiny_run(tmp_path, target, train, held, 120)
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["step"] == 120 and summary["draft_vocab_size"] == 80 and summary["target_layers"] == [0, 1, 2]
    head = load_heads(heads_dir, target=target)
    assert isinstance(head, Eagle3Head) and head.config.heldout_top1 == summary["heldout"]["top1"]
    assert head.config.eagle31_flags == ()
    # draft vocabulary: the 80 most frequent assistant tokens, ascending
    counts = torch.bincount(train.tokens[train.loss_mask], minlength=V)
    assert set(head.draft_ids.tolist()) >= set(torch.nonzero(counts > counts.sort().values[-80]).flatten().tolist())
    torch.manual_seed(0)
    untrained = Eagle3Head(
        head.config, target.config, draft_ids=head.draft_ids, target=target, init_layer=-1, init_lm_head=True
    )
    before = evaluate(untrained, held, target.lm_head.weight, 3, 32)
    assert summary["heldout"]["chain_tau"] > before["chain_tau"] + 0.05, (summary["heldout"], before)


def test_eagle31_options_reach_the_saved_head(tmp_path):
    """``eagle3: {fc_norm: true, norm_output: true}`` trains an EAGLE-3.1 head: recorded in the summary's options,
    saved with its fused-layer norms, reloaded with both flags, and it decodes exactly like ``generate``."""
    from selfspec.decode.loop import speculative_generate
    from selfspec.heads import load_heads

    target = tiny_llama(layers=3)
    layers = (0, 1, 2)
    train, held = distilled_store(target, layers, 16, seed=0), distilled_store(target, layers, 4, seed=1)
    heads_dir = tiny_run(tmp_path, target, train, held, 4, fc_norm=True, norm_output=True)
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["options"]["fc_norm"] is True and summary["options"]["norm_output"] is True
    head = load_heads(heads_dir, target=target).eval()
    assert head.config.eagle31_flags == ("fc_norm", "norm_output") and len(head.fc_norm) == 3
    ids = torch.randint(3, V, (10,), generator=torch.Generator().manual_seed(4))
    ref = target.generate(ids[None], do_sample=False, max_new_tokens=16, min_new_tokens=16, pad_token_id=0)
    out = speculative_generate(target, EagleDrafter(head, target, 4, 2, 8), ids, max_new_tokens=16)
    assert out.tokens == ref[0, ids.numel() :].tolist()
