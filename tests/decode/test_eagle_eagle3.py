"""EAGLE-3 heads through the EAGLE-2 drafter: greedy exactness for several budgets (two families; trained EAGLE-3
and EAGLE-3.1 heads), lossless sampling (seeded chi-square), the draft-vocabulary map applied exactly once, accepted
nodes' layer states."""

from __future__ import annotations

import functools

import pytest
import torch

from selfspec.decode.drafters import Drafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.kv import new_cache
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.verifier import Verifier
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.train.config import Eagle3Options
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss
from selfspec.train.eagle_data import collate, pack_rows
from tests.helpers.archs import tiny_target
from tests.helpers.drafters import NO_LIMIT
from tests.helpers.sampling import N_SAMPLES, SAMPLING, processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2
from tests.helpers.training import distilled_store

pytestmark = pytest.mark.usefixtures("one_thread")

D, V = 32, 96
SETTINGS = [(1, 1, 1), (4, 1, 4), (5, 4, 12), (3, 2, 6), (6, 8, 30)]  # (depth, top_k, total_tokens)


def make_head(
    target, draft_ids: torch.Tensor | None = None, seed: int = 1, eagle31: bool = False, **init
) -> Eagle3Head:
    torch.manual_seed(seed)
    S = V if draft_ids is None else draft_ids.numel()
    cfg = Eagle3Config(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=S,
        num_target_layers=target.config.num_hidden_layers,
        fc_norm=eagle31,
        norm_output=eagle31,
    )
    return Eagle3Head(cfg, target.config, draft_ids=draft_ids, target=target, **init).eval()


@functools.cache
def trained(arch: str = "llama", eagle31: bool = False) -> tuple:
    """A tiny target and an EAGLE-3 head (EAGLE-3.1 with ``eagle31``: ``fc_norm`` and ``norm_output``) fitted to
    its greedy answers (a few hundred steps, ~2 s): drafts that are sometimes right, so paths with accepted draft
    nodes occur."""
    target = tiny_target(arch)
    head = make_head(target, eagle31=eagle31, init_layer=-1, init_lm_head=True).train()
    store = distilled_store(target, head.target_layers, 64, seed=0)
    rows = pack_rows([int(x) - 1 for x in store.lengths], 64)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    unrolled, opts = UnrolledEagle3(head), Eagle3Options(ttt_steps=3)
    lm = target.get_output_embeddings().weight.float()
    for step in range(300):
        loss, _, _ = eagle3_step_loss(unrolled, collate(store, [rows[step % len(rows)]]), lm, opts, D)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, head.eval()


def prompts(n: int, length: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (length,), generator=g) for _ in range(n)]


def reference(target, ids: torch.Tensor, n: int) -> list[int]:
    out = target.generate(ids[None], do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


@pytest.mark.slow  # over 5 s: the whole suite runs it
@pytest.mark.parametrize("eagle31", [False, True], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("depth, top_k, total", SETTINGS)
def test_greedy_equals_generate_trained_head(depth, top_k, total, eagle31):
    target, head = trained(eagle31=eagle31)
    assert head.config.eagle31_flags == (("fc_norm", "norm_output") if eagle31 else ())
    accepted = []
    for ids in prompts(2):
        out = speculative_generate(target, EagleDrafter(head, target, depth, top_k, total), ids, max_new_tokens=24)
        assert out.tokens == reference(target, ids, 24)
        accepted.append(out.stats.mean_accepted_tokens)
    assert max(accepted) > 1.0  # some draft nodes were accepted: layer states at accepted nodes were used


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_greedy_equals_generate_other_families(arch):
    """Qwen2 (sliding layers, q/k/v biases) and Gemma-2 (soft-capped logits and attention, eager attention)."""
    target = tiny_target(arch)
    head = make_head(target, draft_ids=torch.arange(10, 90), init_layer=1, init_lm_head=True)
    for depth, top_k, total in [(4, 1, 4), (5, 4, 12)]:
        for ids in prompts(1, length=13):
            out = speculative_generate(target, EagleDrafter(head, target, depth, top_k, total), ids, max_new_tokens=20)
            assert out.tokens == reference(target, ids, 20)


class Recorder(Drafter):
    """Wraps a drafter; records each step's context and tree, and what ``accept`` was given."""

    def __init__(self, drafter):
        self.inner, self.steps, self.accepted = drafter, [], []

    def info(self):
        return self.inner.info()

    def begin(self, prompt_ids, hidden):
        self.inner.begin(prompt_ids, hidden)

    def propose(self, context, sampling, generator, limit):
        tree = self.inner.propose(context, sampling, generator, limit)
        self.steps.append((context.clone(), tree))
        return tree

    def accept(self, accepted):
        self.accepted.append((accepted.tokens.clone(), accepted.hidden.clone()))
        self.inner.accept(accepted)


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_accepted_nodes_get_their_layer_states_and_state_equals_fresh_start():
    """``accept`` receives, for the root and each accepted draft, the target's states entering the head's three
    layers at that position (equal to a prefill of the whole context), and after several steps the drafter's
    tree equals that of a drafter begun on the whole context."""
    target, head = trained()
    rec = Recorder(EagleDrafter(head, target, 4, 3, 10))
    ids = prompts(1, seed=3)[0]
    out = speculative_generate(target, rec, ids, max_new_tokens=16)
    verifier = Verifier(target)
    full = torch.cat([ids, torch.tensor(out.tokens)])
    _, states = verifier.prefill(full, new_cache(target), layers=head.target_layers)
    assert states.shape == (full.numel(), 3 * D)
    pos = ids.numel() - 1
    for (context, _), (tokens, hidden) in zip(rec.steps, rec.accepted, strict=True):
        assert context.numel() - 1 == pos + 1 and int(tokens[0]) == int(context[-1])
        torch.testing.assert_close(hidden, states[pos + 1 : pos + 1 + tokens.numel()], rtol=1e-4, atol=1e-4)
        pos += tokens.numel()
    assert max(t.numel() for t, _ in rec.accepted) > 1
    for context, tree in rec.steps[1::2]:
        fresh = EagleDrafter(head, target, 4, 3, 10)
        fresh.begin(context[:-1], verifier.prefill(context[:-1], new_cache(target), layers=head.target_layers)[1])
        again = fresh.propose(context, SamplingConfig(), None, NO_LIMIT)
        assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)


class FavouriteHead(Eagle3Head):
    """Rigged: draft id ``favourite`` always scores highest, then the others in draft-id order."""

    favourite = 0

    def draft_logits(self, output):
        S = self.config.draft_vocab_size
        base = -torch.arange(S, dtype=output.dtype, device=output.device)
        base[self.favourite] = 1.0
        return base.expand(*output.shape[:-1], S).clone()


@pytest.mark.parametrize("favourite, expected", [(0, 1), (3, 4), (5, 95)])
def test_d2t_applied_exactly_once_never_out_of_range(favourite, expected):
    """Hand-built map: draft ids 0..5 are target ids [1, 2, 3, 4, 5, 95] (d2t = [1, 1, 1, 1, 1, 90]). Drafted
    tokens and the tokens fed back into the head are those target ids: d2t applied twice would give 2 for
    draft id 0 (or index past the map for 95), not at all would give 0."""
    target = tiny_target("llama")
    ids = torch.tensor([1, 2, 3, 4, 5, 95])
    head = make_head(target, draft_ids=ids)
    assert head.d2t.tolist() == [1, 1, 1, 1, 1, 90] and head.t2d.nonzero().flatten().tolist() == ids.tolist()
    rigged = FavouriteHead(head.config, target.config, draft_ids=ids, target=target).eval()
    rigged.load_state_dict(head.state_dict())
    rigged.favourite = favourite
    fed = []
    embed = target.get_input_embeddings()
    hook = embed.register_forward_hook(lambda m, args, out: fed.append(args[0].flatten().tolist()))
    try:
        drafter = EagleDrafter(rigged, target, depth=3, top_k=2, total_tokens=6)
        prompt = prompts(1)[0]
        _, states = Verifier(target).prefill(prompt, new_cache(target), layers=rigged.target_layers)
        drafter.begin(prompt, states)
        tree = drafter.propose(torch.cat([prompt, torch.tensor([7])]), SamplingConfig(), None, NO_LIMIT)
    finally:
        hook.remove()
    drafted = tree.tokens[1:]
    assert int(drafted[0]) == expected
    assert bool(((drafted >= 0) & (drafted < V)).all()) and bool(head.t2d[drafted].all())
    assert set(drafted.tolist()) <= set(ids.tolist())
    # embedding calls: the target's prefill, the head's prompt pairs, then draft levels 2 and 3, which embed
    # drafted tokens: target ids of the draft vocabulary
    assert len(fed) == 4 and all(set(f) <= set(ids.tolist()) for f in fed[2:])
    assert expected in fed[2]
    out = speculative_generate(target, EagleDrafter(rigged, target, 3, 2, 6), prompt, max_new_tokens=12)
    assert out.tokens == reference(target, prompt, 12)


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_sampling_keeps_the_target_distribution():
    """Seeded Pearson chi-square of the first two sampled tokens (temperature 0.7, top-k 6) against the target's
    exact distribution, drafting with the trained EAGLE-3 head (N = 400, alpha = 0.001, as
    tests/decode/test_architectures.py); both acceptance and rejection of drafts occur."""
    target, head = trained()
    ids = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(7))
    p1 = processed_probs(target, ids)
    expected: dict[tuple[int, int], float] = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(target, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    gen = torch.Generator().manual_seed(1234)
    drafter, counts, accepted = EagleDrafter(head, target, 2, 3, 6), {}, 0
    for _ in range(N_SAMPLES):
        out = speculative_generate(target, drafter, ids, max_new_tokens=2, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accepted_per_step[0] > 1
    chi2, dof = pooled_chi2(counts, expected, N_SAMPLES)
    assert dof >= 2 and chi2 < chi2_critical(dof), (chi2, dof)
    assert 0 < accepted < N_SAMPLES


def test_make_drafter_loads_an_eagle3_head(tmp_path):
    from selfspec.api import make_drafter

    target, head = trained()
    head.save_pretrained(tmp_path)
    drafter = make_drafter(target, tmp_path, depth=3, top_k=2, total_tokens=5)
    assert isinstance(drafter.head, Eagle3Head) and drafter.info().target_layers == head.target_layers
    ids = prompts(1)[0]
    assert speculative_generate(target, drafter, ids, max_new_tokens=12).tokens == reference(target, ids, 12)


def test_an_eagle3_head_with_an_acceptance_profile_gets_a_machine_sized_budget(tmp_path, monkeypatch):
    """The "auto" budget path (the bench's and ``selfspec.load``'s default): calibration on the saved head,
    then drafting and verification costs measured and cached for an EAGLE-3 head (its own cost file), and
    the chosen budget decodes exactly."""
    from selfspec.decode.tuning import calibration

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    target, head = trained()
    head_dir = head.save_pretrained(tmp_path / "heads")
    profile = calibration.calibrate_acceptance(
        target, EagleDrafter(head, target, 3, 2, 6), prompts(2), max_new_tokens=6, total_tokens_max=6, depth_max=3
    )
    calibration.save_acceptance_profile(profile, head_dir)
    from selfspec.api import plan_drafter

    plan = plan_drafter(target, head_dir)
    drafter = plan.drafter
    assert plan.tree_budget.source == "auto" and isinstance(drafter.head, Eagle3Head)
    assert any(p.name.startswith("draft-eagle3-") for p in (tmp_path / "cache" / "profiles").iterdir())
    ids = prompts(1)[0]
    assert speculative_generate(target, drafter, ids, max_new_tokens=12).tokens == reference(target, ids, 12)


def test_an_eagle3_acceptance_profile_records_its_head_type_and_old_profiles_still_read(tmp_path):
    """The profile of an EAGLE-3 head says ``eagle3`` (in the file too); a profile written before the type was
    recorded (``"head_type": "eagle"`` for every EAGLE head) still reads, and is still used."""
    import json

    from selfspec.decode.tuning import calibration

    target, head = trained()
    head_dir = head.save_pretrained(tmp_path / "heads")
    profile = calibration.calibrate_acceptance(
        target, EagleDrafter(head, target, 2, 2, 4), prompts(1), max_new_tokens=4, total_tokens_max=4, depth_max=2
    )
    assert profile.head_type == "eagle3"
    path = calibration.save_acceptance_profile(profile, head_dir)
    assert json.loads(path.read_text())["head_type"] == "eagle3"
    assert calibration.load_acceptance_profile(head_dir, target=target).head_type == "eagle3"
    path.write_text(json.dumps({**json.loads(path.read_text()), "head_type": "eagle"}))
    old = calibration.load_acceptance_profile(head_dir, target=target)
    assert old is not None and old.head_type == "eagle" and old.tau == profile.tau
