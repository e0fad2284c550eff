"""Batched decoding: ragged prompts decode together, each row exactly as it decodes alone.

Greedy fp32: every row of a ragged batch equals its own batch-1 output, on every tiny family (sliding
windows, mixed layers, soft caps), for prompt lookup, Medusa, a draft model, EAGLE and EAGLE-3 heads and
oracle trees whose accepted paths leave holes in the cache. Sampling: each row keeps the target's
distribution (seeded chi-square), and the batched forward gives every row the logits its own forward gives.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

import selfspec
from selfspec.decode import loop as batch_mod
from selfspec.decode.batch_cache import SlotTable
from selfspec.decode.drafters import DraftModelDrafter, MedusaDrafter, PromptLookupDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import TreeCap, speculative_generate, speculative_generate_batch
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import static_tree
from selfspec.decode.verifier import Verifier
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from tests.helpers.archs import ARCHS, tiny_target
from tests.helpers.drafters import OracleDrafter, TargetTopKDrafter
from tests.helpers.heads import random_heads
from tests.helpers.host_reads import counted_reads
from tests.helpers.sampling import processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

V = 96
LENGTHS = (5, 13, 9, 20, 3)  # ragged: shorter and longer than the sliding window (tests.archs.WINDOW = 8)
NEW_TOKENS = 20


@functools.cache
def target(arch: str):
    return tiny_target(arch)


def prompt(length: int, seed: int) -> torch.Tensor:
    """Token ids that repeat themselves (so prompt lookup finds matches)."""
    half = torch.randint(3, V, ((length + 1) // 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half])[:length]


PROMPTS = [prompt(n, s) for s, n in enumerate(LENGTHS)]


def eagle(t):
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    return EagleDrafter(head, t, depth=4, top_k=3, total_tokens=8)


def eagle3(t):
    torch.manual_seed(2)
    cfg = Eagle3Config(
        hidden_size=t.config.hidden_size, vocab_size=V, draft_vocab_size=V, num_target_layers=3, target_layers=(0, 1, 2)
    )
    head = Eagle3Head(cfg, t.config, target=t, init_layer=-1, init_lm_head=True).eval()
    return EagleDrafter(head, t, depth=3, top_k=2, total_tokens=6)


DRAFTERS = {
    "prompt_lookup": lambda t, arch: PromptLookupDrafter(num_tokens=5),
    "medusa": lambda t, arch: MedusaDrafter(random_heads(t), static_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])),
    "draft_model": lambda t, arch: DraftModelDrafter(tiny_target(arch, seed=3), num_tokens=3),
    "eagle": lambda t, arch: eagle(t),
    "eagle3": lambda t, arch: eagle3(t),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_equals_its_batch1_output(arch, drafter):
    t = target(arch)
    alone = [speculative_generate(t, DRAFTERS[drafter](t, arch), p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS]
    rows = speculative_generate_batch(t, DRAFTERS[drafter](t, arch), PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in rows] == alone
    assert all(r.stats.steps >= 1 and len(r.tokens) == NEW_TOKENS for r in rows)


def oracles(t, prompts, seed: int = 0):
    refs = [speculative_generate(t, PromptLookupDrafter(), p, max_new_tokens=NEW_TOKENS).tokens for p in prompts]
    return refs, lambda: [
        OracleDrafter(p.numel(), r, seed=seed + i, nodes=12) for i, (p, r) in enumerate(zip(prompts, refs, strict=True))
    ]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_oracle_trees_leave_holes_and_rows_stay_exact(arch, monkeypatch):
    """Long accepted paths through non-first branches, a different length per row each step: the cache
    gets empty slots and rows move entries; packing the cache after every step changes nothing."""
    t = target(arch)
    refs, make = oracles(t, PROMPTS)
    rows = speculative_generate_batch(t, make(), PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in rows] == refs
    assert max(r.stats.mean_accepted_tokens for r in rows) > 2.0  # long, uneven paths were accepted
    monkeypatch.setattr(batch_mod, "PACK_EMPTY_SLOTS", 1)
    assert [r.tokens for r in speculative_generate_batch(t, make(), PROMPTS, max_new_tokens=NEW_TOKENS)] == refs


def test_rows_finish_independently_and_come_back_in_order():
    t = target("llama")
    alone = [speculative_generate(t, PromptLookupDrafter(), p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS]
    eos = alone[1][2]  # row 1 stops at its third token; other rows stop wherever they produce it
    rows = speculative_generate_batch(t, PromptLookupDrafter(), PROMPTS, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    for r, a in zip(rows, alone, strict=True):
        want = a[: a.index(eos) + 1] if eos in a else a
        assert r.tokens == want
        assert r.stats.finish_reason == ("stop" if eos in a else "length")
    assert len(rows[1].tokens) == 3


def test_forward_block_gives_each_row_its_own_logits():
    """A batch of rows with holes in their caches and different trees: each row's tree logits equal a
    batch-1 verification of that tree over that row's tokens alone (fp32, atol 1e-5)."""
    t = target("gemma3")  # sliding and global layers, soft-capped logits
    v = Verifier(t)
    g = torch.Generator().manual_seed(0)
    lengths = [11, 4, 7]
    rows = [torch.randint(3, V, (n,), generator=g) for n in lengths]
    cache, table = v.new_cache(), SlotTable(3)
    chains = [torch.arange(-1, n - 1) for n in lengths]
    pos = torch.stack([torch.cat([torch.arange(n), torch.full((11 - n,), n)]) for n in lengths])
    tokens = torch.stack([torch.cat([r, torch.zeros(11 - r.numel(), dtype=torch.long)]) for r in rows])
    v.forward_block(tokens, pos, table.positions, chains, cache)
    # keep a ragged subset of each prompt as if drafts were rejected: holes at different slots per row
    kept = [torch.arange(11), torch.arange(4), torch.arange(7)]
    table.keep(cache, kept, pos)
    trees = [torch.tensor([-1, 0, 0, 1]), torch.tensor([-1]), torch.tensor([-1, 0, 1, 2, 0])]
    toks = [torch.randint(3, V, (p.numel(),), generator=g) for p in trees]
    q = max(p.numel() for p in trees)
    depth = [torch.tensor([0, 1, 1, 2]), torch.tensor([0]), torch.tensor([0, 1, 2, 3, 1])]
    bpos = torch.stack(
        [torch.cat([d + n, torch.full((q - d.numel(),), n)]) for d, n in zip(depth, lengths, strict=True)]
    )
    btok = torch.stack([torch.cat([x, torch.zeros(q - x.numel(), dtype=torch.long)]) for x in toks])
    h = v.forward_block(btok, bpos, table.positions, trees, cache)
    for b in range(3):
        alone = v.new_cache()
        v.prefill(rows[b], alone)
        ref = v.lm_logits(v.forward_tree(toks[b], trees[b], alone, lengths[b]))
        got = v.lm_logits(h[b, : trees[b].numel()])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("caps", [{1: 0, 2: 3, 3: 0, 4: 2, 5: 1}, {n: 0 for n in range(1, 6)}])
def test_rows_stay_exact_when_the_rule_turns_drafting_off_and_on(caps):
    """Steps without drafting leave an EAGLE row's pairs pending (fed at its next draft): exact either way."""
    t = target("qwen2")
    alone = [speculative_generate(t, eagle(t), p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS]

    class Rule:
        def __call__(self, batch):
            return TreeCap(depth=caps[batch], total_tokens=6)

        def observe(self, *args):
            pass

    rows = speculative_generate_batch(t, eagle(t), PROMPTS, max_new_tokens=NEW_TOKENS, tree_rule=Rule())
    assert [r.tokens for r in rows] == alone


def test_public_generate_takes_a_list_of_prompts_and_a_batch_tensor():
    t = target("llama")
    model = selfspec.load(t, prompt_lookup=True, tune="off")
    rows = model.generate([p.tolist() for p in PROMPTS[:3]], max_new_tokens=8)
    assert [r.tokens for r in rows] == [model.generate(p, max_new_tokens=8).tokens for p in PROMPTS[:3]]
    with pytest.raises(ValueError, match="one streamer per prompt"):
        model.generate([PROMPTS[0], PROMPTS[1]], streamer=lambda ids: None)


# ------------------------------------------------------------------ sampling
N_SAMPLES = 300
SAMPLING = SamplingConfig(do_sample=True, temperature=0.7, top_k=6)


@pytest.mark.slow  # over 5 s: the whole suite runs it
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_sampling_keeps_each_rows_distribution(arch):
    """Seeded Pearson chi-square of each row's first two sampled tokens against the target's exact
    distribution for that row's prompt (temperature 0.7, top-k 6): two rows of different lengths (12 and 5
    tokens, one past the window) decoded together N = 300 times, pairs with expected count >= 5 (the rest
    pooled), alpha = 0.001 per row. Three tokens are asked for, so the second can be an accepted draft
    (with two, nothing is left to draft after the first); drafts are both accepted and rejected."""
    t = target(arch)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, V, (12,), generator=g), torch.randint(3, V, (5,), generator=g)]
    expected = []
    for ids in prompts:
        p1 = processed_probs(t, ids)
        exp = {}
        for x1 in p1.nonzero().flatten().tolist():
            p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
            for x2 in p2.nonzero().flatten().tolist():
                exp[(x1, x2)] = float(p1[x1] * p2[x2])
        expected.append(exp)
    gen = torch.Generator().manual_seed(1234)
    counts = [{}, {}]
    accepted = 0
    for _ in range(N_SAMPLES):
        rows = speculative_generate_batch(
            t, TargetTopKDrafter(t), prompts, max_new_tokens=3, sampling=SAMPLING, generator=gen
        )
        for b, r in enumerate(rows):
            key = (r.tokens[0], r.tokens[1])
            assert key in expected[b]  # never a pair the target cannot produce
            counts[b][key] = counts[b].get(key, 0) + 1
            accepted += r.stats.accepted_per_step[0] > 1
    for b in range(2):
        exp_b = expected[b]
        chi2, dof = pooled_chi2(counts[b], exp_b, N_SAMPLES)
        assert dof >= 2 and chi2 < chi2_critical(dof), (b, chi2, dof)
    assert 0 < accepted < 2 * N_SAMPLES


@pytest.mark.parametrize("kernel", ["weight_first", "packed"])
def test_rows_stay_exact_with_the_verifiers_kernel_plan(kernel):
    """The block forward runs the planned kernel of its B * Q rows (a twin of the backbone): rows still equal
    their batch-1 output, and that equals plain generate."""
    t = target("llama")
    v = Verifier(t)
    if kernel == "packed" and not v.packed_available():
        pytest.skip("no oneDNN in this torch")
    v.set_plan({n: kernel for n in range(1, 65)})
    assert v.kernel_for(12) == kernel
    alone = [speculative_generate(v, eagle(t), p, max_new_tokens=NEW_TOKENS).tokens for p in PROMPTS]
    plain = [
        t.generate(p[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, top_k=None)[0, p.numel() :]
        for p in PROMPTS
    ]
    assert alone == [x.tolist() for x in plain]
    rows = speculative_generate_batch(v, eagle(t), PROMPTS, max_new_tokens=NEW_TOKENS)
    assert [r.tokens for r in rows] == alone


def test_a_batch_step_reads_the_host_at_most_twice_per_row_as_batch1_does():
    """Greedy: per step, each row's tree is read once and every row's argmaxes in one copy, so a row-step costs
    1 + 1/B reads against 2 alone (the slot table and the masks built from it are host tensors, not counted)."""
    t = target("llama")
    heads = random_heads(t)
    paths = [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    alone = [speculative_generate(t, MedusaDrafter(heads, static_tree(paths)), p, max_new_tokens=12) for p in PROMPTS]
    drafter = MedusaDrafter(heads, static_tree(paths))  # built outside the count (it reads its tree)
    sites: Counter = Counter()
    with counted_reads(sites, skip_files=("batch_cache.py", "masks.py")):
        rows = speculative_generate_batch(t, drafter, PROMPTS, max_new_tokens=12)
    assert [r.tokens for r in rows] == [a.tokens for a in alone]
    row_steps = sum(r.stats.steps for r in rows)
    batch_steps = max(r.stats.steps for r in rows)
    # the prefill's first tokens in one read; each step: one tree read per row, one argmax read for all rows
    assert sum(sites.values()) == 1 + row_steps + batch_steps, sites
    assert sum(sites.values()) <= 1 + 2 * row_steps


def test_batches_stream_each_row_and_call_back_each_row_step():
    """One streamer per prompt gets exactly its row's tokens; the step callback sees every row-step with its row."""
    t = target("qwen2")
    seen: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    streamed = [[] for _ in PROMPTS]
    streamers = [lambda ids, i=i: streamed[i].extend(ids) for i in range(len(PROMPTS))]
    rows = speculative_generate_batch(
        t,
        eagle(t),
        PROMPTS,
        max_new_tokens=NEW_TOKENS,
        streamers=streamers,
        step_callback=lambda row, tree, result: seen[row].append(len(result.path)),
    )
    assert streamed == [r.tokens for r in rows]
    assert {i: len(v) for i, v in seen.items()} == {i: r.stats.steps for i, r in enumerate(rows)}
    assert all(v == r.stats.accepted_per_step for v, r in zip(seen.values(), rows, strict=True))
    model = selfspec.load(t, prompt_lookup=True, tune="off")
    texts = [[] for _ in PROMPTS[:2]]
    outs = model.generate(PROMPTS[:2], max_new_tokens=8, streamer=[texts[0].extend, texts[1].extend])
    assert texts == [o.tokens for o in outs]
    with pytest.raises(ValueError, match="one streamer per prompt"):
        model.generate(PROMPTS[:2], max_new_tokens=8, streamer=texts[0].extend)
    with pytest.raises(ValueError, match="got 1 streamers for 2 prompts"):
        model.generate(PROMPTS[:2], max_new_tokens=8, streamer=[None])
