"""Block drafting (DFlash, DSpark) through the one decode loop: greedy output equal to ``generate``'s on every
architecture of the matrix, for several block sizes, chain and top-k trees, a DSpark block cut by its confidence
head, a batch; sampling keeps the target's law (seeded chi-square); the drafter's block logits equal the training
forward's for the same prefix (fp32, 1e-5); the block tree sized from held-out acceptance."""

from __future__ import annotations

import pytest
import torch

from selfspec.decode.drafters import BlockDrafter
from selfspec.decode.drafters.base import DraftLimit
from selfspec.decode.loop import speculative_generate, speculative_generate_batch
from selfspec.decode.sampling import SamplingConfig
from tests.helpers.archs import ARCHS, tiny_target
from tests.helpers.heads import block_head
from tests.helpers.sampling import SAMPLING, processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

pytestmark = pytest.mark.usefixtures("one_thread")

V, NEW = 96, 20


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(3, V, (length,), generator=torch.Generator().manual_seed(seed))


def reference(target, ids: torch.Tensor, n: int = NEW) -> list[int]:
    out = target.generate(ids.unsqueeze(0), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_greedy_output_is_the_targets_on_every_architecture(arch, head_type):
    target = tiny_target(arch)
    for block_size, top_k, draft in [(3, 1, None), (6, 1, 48), (6, 3, None)]:
        head = block_head(target, head_type, block_size, draft)
        drafter = BlockDrafter(head, target, top_k=top_k)
        for seed in (0, 1):
            ids = prompt(seed)
            out = speculative_generate(target, drafter, ids, max_new_tokens=NEW)
            assert out.tokens == reference(target, ids), (arch, head_type, block_size, top_k)
            assert sum(out.stats.drafted_by_depth) > 0


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_a_fitted_head_gets_drafts_accepted_and_stays_exact():
    """A head whose block reproduces the target's greedy continuation (its lm_head rows made the target's and its
    layers tuned for a few steps on the target's own continuation) gets many drafts accepted per step; the output is
    still exactly the target's, with chains, trees and a DSpark block cut by its confidence head."""
    from selfspec.train.config import BlockOptions
    from selfspec.train.dflash import block_logits, block_step_loss, collate_sequences
    from selfspec.train.feature_store import FeatureStore
    from selfspec.train.features import hidden_features

    target = tiny_target("llama")
    ids = prompt(5)
    full = torch.cat([ids, torch.tensor(reference(target, ids, 40))])
    for head_type in ("dflash", "dspark"):
        head = block_head(target, head_type, 4, seed=1)
        for p in head.parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.05)
        ex = [{"input_ids": full, "loss_mask": torch.ones(full.numel(), dtype=torch.bool)}]
        store = FeatureStore.from_examples(ex, hidden_features(target, ex, True, layers=head.target_layers), 4 * 32)
        batch = collate_sequences(store, [0], 64, head.config.max_drafts, torch.Generator().manual_seed(0))
        rows = target.get_output_embeddings().weight.detach().float()
        optim = torch.optim.AdamW(head.parameters(), lr=1e-2)
        head.train()
        for _ in range(150):
            loss, _, _ = block_step_loss(
                lambda *a, h=head: block_logits(h, *a), head, batch, rows, BlockOptions(block_size=4, loss="kl")
            )
            optim.zero_grad()
            loss.backward()
            optim.step()
        head.eval()
        for kwargs in ({}, {"top_k": 2}, {"confidence_min": 0.3} if head_type == "dspark" else {"length": 2}):
            out = speculative_generate(target, BlockDrafter(head, target, **kwargs), ids, max_new_tokens=40)
            assert out.tokens == full[ids.numel() :].tolist()
            assert out.stats.new_tokens / out.stats.steps > 1.5, (head_type, kwargs, out.stats)


def test_a_batch_and_its_rows_decode_exactly():
    target = tiny_target("qwen3")
    head = block_head(target, "dspark", 5)
    prompts = [prompt(s, 6 + s) for s in range(3)]
    outs = speculative_generate_batch(target, BlockDrafter(head, target), prompts, max_new_tokens=NEW)
    assert [o.tokens for o in outs] == [reference(target, p) for p in prompts]


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_training_forward_and_decoding_give_the_same_block_logits(head_type):
    """For anchors at several positions of one sequence, the block the training forward scores (all blocks of the
    row in one forward, :func:`~selfspec.train.dflash.block_mask`) equals the block the drafter scores with the
    context fed up to the anchor (fp32, 1e-5): mask, anchor placement, positions and feature injection agree; the
    chain it drafts is the greedy chain of those logits, DSpark's with its Markov bias chained through the block
    (which changes the chain at some anchor, so a drafter without it fails)."""
    from selfspec.train.dflash import block_logits

    target = tiny_target("gemma3")
    head = block_head(target, head_type, 5, draft=48)
    ids = prompt(9, 24)
    with torch.no_grad():
        hs = target(ids.unsqueeze(0), output_hidden_states=True).hidden_states
    states = torch.cat([hs[i][0] for i in head.target_layers], dim=-1)  # [T, k D]
    anchors = torch.tensor([[3, 7, 15, 22]])
    with torch.no_grad():
        z = block_logits(head, states.unsqueeze(0), ids.unsqueeze(0), torch.ones(1, 24, dtype=torch.bool), anchors)
    biased = 0  # anchors where DSpark's Markov bias changes the chain: the check below can tell it from none
    for n, a in enumerate(anchors[0].tolist()):
        drafter = BlockDrafter(head, target, length=2)  # fewer drafts than the block: the block still runs whole
        drafter.begin(ids[:a], states[:a])
        cfg = head.config
        slots = cfg.block_size
        tokens = torch.full((1, slots), cfg.mask_token_id)
        tokens[0, 0] = ids[a]
        with torch.no_grad():
            decode_z = head(tokens, torch.arange(a, a + slots).unsqueeze(0), drafter._context.layers)
        torch.testing.assert_close(decode_z[0, cfg.first_slot :], z[0, n], rtol=1e-5, atol=1e-5)
        tree = drafter.propose(ids[: a + 1], SamplingConfig(), None, DraftLimit(useful_depth=10))
        want = markov_chain(head, head.draft_logits(z[0, n, :2]), ids[a])
        assert tree.tokens[1:].tolist() == want, (head_type, a)
        biased += want != head.draft_ids[head.draft_logits(z[0, n, :2]).argmax(-1)].tolist()
    assert biased > 0 if head_type == "dspark" else biased == 0


def markov_chain(head, logits: torch.Tensor, anchor: torch.Tensor) -> list[int]:
    """The greedy chain of target ids a block's draft ``logits`` ``[P, S]`` give: DSpark adds to slot j's logits its
    low-rank Markov bias ``markov_w2 @ markov_w1[prev_j]``, ``prev_j`` the anchor for the first slot and the previous
    slot's draft after it (heads/dflash.py); DFlash's are its logits alone."""
    chain, prev = [], anchor
    for scores in logits.float():
        if head.markov_head is not None:
            w1, w2 = head.markov_head.markov_w1.weight, head.markov_head.markov_w2.weight
            scores = scores + (w2 @ w1[prev]).float()
        prev = head.draft_ids[scores.argmax()]
        chain.append(int(prev))
    return chain


def choose_block(cost, chain, draft_ms=0.0, siblings=None, length=None, top_k=None):
    """The one tree chooser over a block drafter's trees (:func:`~selfspec.decode.tuning.budget.block_trees`)."""
    from selfspec.decode.tuning.budget import block_trees, choose_tree

    return choose_tree(cost, block_trees(chain, draft_ms, siblings=siblings, length=length, top_k=top_k))


def shape_of(size) -> tuple[int, int, int, int]:
    """``(L, top_k, branch_depth, nodes)`` of a block tree size."""
    return size.shape.depth, size.shape.top_k, size.shape.branch_depth, size.shape.nodes


def test_block_length_sized_from_acceptance_and_costs():
    from selfspec.decode.tuning.costs import CostProfile

    cost = CostProfile(
        target_fingerprint="f" * 16, device="cpu", dtype="torch.float32", threads=1, torch="2.13.0",
        context_length=64, node_counts=(1, 2, 4, 8), verify_ms=(10.0, 11.0, 12.0, 20.0),
    )  # fmt: skip
    # chain shares 0.6, 0.4, 0.3, 0.1, 0.05: at 8 nodes the cost jumps, so 3 drafts (4 nodes) win
    size = choose_block(cost, [0.6, 0.4, 0.3, 0.1, 0.05, 0.02, 0.01])
    assert shape_of(size) == (3, 1, 0, 4)
    assert size.expected_tau == pytest.approx(2.3)
    assert size.expected_speedup == pytest.approx(2.3 * 10.0 / 12.0)
    # the block forward costs the same for every tree: it lowers every option alike (the ratio moves, not the tree)
    drafted = choose_block(cost, [0.6, 0.4, 0.3, 0.1, 0.05, 0.02, 0.01], draft_ms=5.0)
    assert drafted.shape.depth == 3 and drafted.expected_speedup == pytest.approx(2.3 * 10.0 / 17.0)
    with pytest.raises(ValueError, match="held-out chain"):
        choose_block(cost, [])


def test_block_tree_width_sized_from_sibling_acceptance():
    from selfspec.decode.tuning.costs import CostProfile

    cost = CostProfile(
        target_fingerprint="f" * 16, device="cpu", dtype="torch.float32", threads=1, torch="2.13.0",
        context_length=64, node_counts=(1, 2, 3, 4, 8), verify_ms=(10.0, 10.5, 11.0, 11.5, 20.0),
    )  # fmt: skip
    chain, siblings = [0.5, 0.2], [[0.3, 0.1], [0.35, 0.12]]
    # by tau / verify_ms(nodes): chain L=1 1.5/10.5, L=2 1.7/11; one sibling (k=2) at depth 1: L=1 1.8/11,
    # L=2 2.0/11.5 (4 nodes, the best); at both depths 2.1/13.625 (5 nodes: 11.5 + (20 - 11.5) / 4); k=3 at depth 1
    # 2.05/13.625
    size = choose_block(cost, chain, siblings=siblings)
    assert shape_of(size) == (2, 2, 1, 4)
    assert size.expected_tau == pytest.approx(2.0) and size.expected_speedup == pytest.approx(2.0 * 10.0 / 11.5)
    assert len(size.table) == (1 + 1 + 1) + (1 + 2 + 2)  # per L: the chain, then k = 2, 3 at b = 1 .. L
    widest = [o for o in size.table if (o.shape.depth, o.shape.top_k, o.shape.branch_depth) == (2, 3, 2)]
    assert [(o.tau, o.speedup) for o in widest] == [
        (pytest.approx(2.17), pytest.approx(2.17 * 10.0 / (11.5 + 8.5 * 3 / 4)))
    ]
    fixed = choose_block(cost, chain, siblings=siblings, length=1, top_k=3)
    assert shape_of(fixed)[:3] == (1, 3, 1) and fixed.expected_tau == pytest.approx(1.85)
    # free of siblings, the chain alone is sized
    assert choose_block(cost, chain).shape.top_k == 1
    with pytest.raises(ValueError, match="sibling"):
        choose_block(cost, chain, siblings=siblings[:1], top_k=3)
    with pytest.raises(ValueError, match="depths"):
        choose_block(cost, chain, siblings=[[0.1]])
    with pytest.raises(ValueError, match="outside"):
        choose_block(cost, chain, length=3)


def test_make_drafter_sizes_the_block_tree_from_the_heads_profile(monkeypatch):
    """``tune="auto"``: chain length, width and branched depths come from the head's held-out chain and sibling
    acceptance and this machine's verification costs (here a fixed profile); a fixed field is kept and the rest
    sized around it; a width the head has no profile for keeps all depths branched."""
    import dataclasses

    from selfspec import head_drafters
    from selfspec.api import make_drafter
    from selfspec.decode.tuning.costs import CostProfile

    cost = CostProfile(
        target_fingerprint="f" * 16, device="cpu", dtype="torch.float32", threads=1, torch="2.13.0",
        context_length=64, node_counts=(1, 2, 3, 4, 8), verify_ms=(10.0, 10.5, 11.0, 11.5, 20.0),
    )  # fmt: skip
    monkeypatch.setattr(head_drafters.costs, "get_cost_profile", lambda target: cost)
    drafted = []  # the block forward's cost: asked once per sizing, at the whole block (2 drafts for B = 3)
    block_cost = lambda d, t, depths: drafted.append(depths) or {2: 2.0}  # noqa: E731
    monkeypatch.setattr(head_drafters.draft_costs, "get_draft_cost", block_cost)
    target = tiny_target("llama")
    head = block_head(target, "dflash", 3)
    profile = {"heldout_chain": (0.5, 0.2), "heldout_siblings": ((0.3, 0.1), (0.35, 0.12))}
    head.config = dataclasses.replace(head.config, **profile)
    got = make_drafter(target, head, tune="auto")
    assert (got.length, got.top_k, got.branch_depth) == (2, 2, 1) and drafted == [[2]]
    got = make_drafter(target, head, tune="auto", block_top_k=1)
    assert (got.length, got.top_k) == (2, 1)
    got = make_drafter(target, head, tune="auto", block_length=1)
    assert (got.length, got.top_k, got.branch_depth) == (1, 2, 1)
    got = make_drafter(target, head, tune="auto", block_top_k=5)  # no profile for 5 candidates
    assert (got.length, got.top_k, got.branch_depth) == (2, 5, 2)
    assert make_drafter(target, head, tune="off").top_k == 1
    with pytest.raises(ValueError, match="block_top_k"):
        make_drafter(target, head, tune="auto", block_top_k="wide")


@pytest.mark.parametrize("head_type", ["dflash", "dspark"])
def test_sampling_keeps_the_target_distribution(head_type):
    """Seeded Pearson chi-square (as tests/decode/test_architectures.py) of the first two sampled tokens
    (temperature 0.7, top-k 6) against the target's exact law, drafted by a random block head as a tree (chain of
    3, 2 candidates per slot) whose draft vocabulary is the tokens the target can sample at the first two positions
    (so drafts are both accepted and refused): N = 300, pairs with expected count >= 5 (the rest pooled),
    alpha = 0.001."""
    t = tiny_target("llama")
    ids = prompt(7, 12)
    p1 = processed_probs(t, ids)
    expected, support = {}, set(p1.nonzero().flatten().tolist())
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
        support |= set(p2.nonzero().flatten().tolist())
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    head = block_head(t, head_type, 4, draft_ids=torch.tensor(sorted(support)))
    gen, counts, accepted, n = torch.Generator().manual_seed(4321), {}, 0, 300
    for _ in range(n):
        drafter = BlockDrafter(head, t, length=3, top_k=2)
        out = speculative_generate(t, drafter, ids, max_new_tokens=3, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected  # never a pair the target cannot produce
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(out.stats.accepted_by_depth) > 0
    chi2, dof = pooled_chi2(counts, expected, n)
    assert dof >= 2 and chi2 < chi2_critical(dof), (chi2, dof)
    assert 0 < accepted < n
