"""Hybrid targets whose layers keep a recurrent or convolution state (tests/helpers/archs.py ``STATE_ARCHS``:
Qwen3-Next and Qwen3.5 gated delta nets, LFM2 short convolutions, Granite-4 Mamba-2 layers) decode exactly: their
multi-token (chunked) forward equals token-by-token decoding within float tolerance, drafts are verified as chains
and the state rolled back to the accepted prefix after a rejection (``transformers``' past recording, no extra pass),
greedy output equals the target's own ``generate`` token for token with prompt lookup, Medusa, EAGLE-3 and an oracle
whose chains are often cut short, and every row of a ragged batch equals ``generate`` of its prompt (the rows decode
one at a time). A layer type whose state cannot be handled (Falcon-H1's attention-and-Mamba ``"hybrid"`` layers) is
refused at load, naming it."""

from __future__ import annotations

import functools

import pytest
import torch

import selfspec
from selfspec.decode.drafters import MedusaDrafter, PromptLookupDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.host import read_tree
from selfspec.decode.kv import compact_cache, new_cache
from selfspec.decode.loop import speculative_generate, speculative_generate_batch
from selfspec.decode.masks import attention_layout
from selfspec.decode.state import MAX_CHAIN, first_chain, is_state_layer
from selfspec.decode.target_check import UnsupportedTargetError
from selfspec.decode.tree import DraftTree, static_tree
from selfspec.decode.verifier import Verifier
from tests.helpers.archs import STATE_ARCHS, tiny_target
from tests.helpers.drafters import OracleDrafter
from tests.helpers.heads import make_eagle3, random_heads

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
PROMPT = 13
NEW = 12


@functools.cache
def target(arch: str):
    return tiny_target(arch)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    half = torch.randint(3, V, ((length + 1) // 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half])[:length]


@functools.cache
def reference(arch: str, length: int, seed: int = 0) -> list[int]:
    ids = prompt(length, seed)
    out = target(arch).generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0, top_k=None)
    return out[0, length:].tolist()


DRAFTERS = {
    "prompt_lookup": lambda t, ids, ref: PromptLookupDrafter(num_tokens=5),
    "medusa": lambda t, ids, ref: MedusaDrafter(random_heads(t), static_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])),
    "eagle3": lambda t, ids, ref: EagleDrafter(make_eagle3(t), t, depth=4, top_k=2, total_tokens=8),
    "oracle": lambda t, ids, ref: OracleDrafter(ids.numel(), ref, seed=1, nodes=12),
}


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_declared_chains_only_and_its_cache_rolls_back(arch):
    t = target(arch)
    assert attention_layout(t.config).chains_only
    cache = new_cache(t)
    assert any(is_state_layer(layer) for layer in cache.layers)
    selfspec.load(t, prompt_lookup=True, tune="off")  # passes the load check (a rolled-back chain probe)


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_chunked_forward_equals_token_by_token(arch):
    """Twelve tokens after a prefix in one forward (the chunked path: the last 16 by the recurrent step) and one
    token at a time give the same logits as the whole sequence from scratch, within 1e-4 relative (fp32)."""
    t = target(arch)
    ids = torch.randint(3, V, (20,), generator=torch.Generator().manual_seed(2))
    v = Verifier(t)
    with torch.inference_mode():
        want = t(input_ids=ids[None]).logits[0, 8:].float()
        scale = 1.0 + float(want.abs().max())
        chunked, single = v.new_cache(), v.new_cache()
        v.prefill(ids[:8], chunked)
        v.prefill(ids[:8], single)
        got = v.lm_logits(v.forward_tree(ids[8:], torch.arange(-1, 11), chunked, 8))
        steps = [v.lm_logits(v.forward_tree(ids[i : i + 1], torch.tensor([-1]), single, i)) for i in range(8, 20)]
    assert float((got - want).abs().max()) / scale < 1e-4
    assert float((torch.cat(steps) - want).abs().max()) / scale < 1e-4


def test_a_rolled_back_cache_keeps_only_a_chain_prefix():
    t = target("qwen3_next")
    v = Verifier(t)
    cache = v.new_cache()
    with torch.inference_mode():
        v.prefill(torch.arange(3, 11), cache)
        v.forward_tree(torch.arange(20, 23), torch.tensor([-1, 0, 0]), cache, 8)
    with pytest.raises(TypeError, match="chain's prefix only"):
        compact_cache(cache, 8, torch.tensor([0, 2]), [0, 2])


def test_first_chain_keeps_the_first_branch():
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2])
    tree = DraftTree(torch.arange(10, 17), parents)
    chain, host = first_chain(tree, read_tree(tree.tokens, tree.parents))
    assert host.parents == [-1, 0, 1, 2] and host.tokens == [10, 11, 13, 15] and chain.tokens.tolist() == host.tokens
    long = DraftTree(torch.arange(40), torch.arange(-1, 39))
    assert first_chain(long, read_tree(long.tokens, long.parents))[1].num_nodes == MAX_CHAIN


# Granite-4 has no RoPE for an EAGLE layer: its head is refused at build (test_eagle_head_refused_without_rope)
@pytest.mark.parametrize(
    "arch, drafter", [(a, d) for a in STATE_ARCHS for d in DRAFTERS if (a, d) != ("granite4", "eagle3")]
)
def test_greedy_equals_generate(arch, drafter):
    t, ids, ref = target(arch), prompt(PROMPT), reference(arch, PROMPT)
    out = speculative_generate(t, DRAFTERS[drafter](t, ids, ref), ids, max_new_tokens=NEW)
    assert out.tokens == ref, (arch, drafter)
    if drafter == "oracle":
        assert out.stats.mean_accepted_tokens > 2.0  # chains cut short by rejections and rolled back


def test_eagle_head_refused_without_rope():
    from selfspec.heads.io import HeadFormatError

    with pytest.raises(HeadFormatError, match="rotary"):
        make_eagle3(target("granite4"))


@pytest.mark.parametrize("arch", ["qwen3_next", "lfm2"])
def test_ragged_batch_rows_equal_generate(arch):
    t = target(arch)
    lengths = (5, 13, 9)
    prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
    rows = speculative_generate_batch(t, PromptLookupDrafter(num_tokens=5), prompts, max_new_tokens=NEW)
    assert [r.tokens for r in rows] == [reference(arch, n, seed) for seed, n in enumerate(lengths)]


def test_a_layer_with_attention_and_a_state_is_refused():
    from transformers import AutoModelForCausalLM, FalconH1Config

    config = FalconH1Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedTargetError, match=r"FalconH1ForCausalLM cannot be .*layer types \['hybrid'\]"):
        selfspec.load(model, prompt_lookup=True, tune="off")


def test_a_state_targets_verification_cost_is_measured_on_chains(monkeypatch):
    """The cost profile times what the loop verifies for a state target: a chain of every size, never a tree."""
    from selfspec.decode.tuning import costs, timing

    seen = []
    forward_tree = Verifier.forward_tree

    def recording(self, tokens, parents, *args, **kwargs):
        seen.append(parents.tolist())
        return forward_tree(self, tokens, parents, *args, **kwargs)

    monkeypatch.setattr(Verifier, "forward_tree", recording)
    rule = timing.TimingRule(max_spread=1.0, max_rounds=1)
    profile = costs.measure_cost_profile(
        target("lfm2"), node_counts=(1, 3, 6), context_length=16, repeats=1, kernels=("linear",), rule=rule
    )
    assert profile.node_counts == (1, 3, 6) and len(profile.verify_ms) == 3
    assert {len(p) for p in seen} == {1, 3, 6}
    assert all(p == list(range(-1, len(p) - 1)) for p in seen)  # node i's parent is i - 1


def test_tree_budgets_of_a_state_target_price_chains(monkeypatch):
    """EAGLE's budgets for a state target are chains (N = depth, depth + 1 <= MAX_CHAIN nodes, tau of the depth best
    drafts); Medusa's are the top-1 chains with tau 1 + the sum of the products of the heads' top-1 accuracies; the
    chooser picks a chain for the state target and a tree for the same profiles on a dense one."""
    from selfspec.decode.tuning import budget
    from selfspec.decode.tuning.calibration import AcceptanceProfile
    from selfspec.decode.tuning.costs import CostProfile

    depth_max, n_max = 8, 24
    tau = tuple(tuple(1.0 + 0.9 * (1 - 0.6**d) * (1 + 0.02 * n) for n in range(1, n_max + 1)) for d in range(1, 9))
    zeros = tuple(tuple(0 for _ in row) for row in tau)
    profile = AcceptanceProfile(top_k=2, tau=tau, inexact_steps=zeros, steps=100, prompts=4, max_new_tokens=64)
    draft = dict.fromkeys(range(1, depth_max + 1), 0.1)
    chains = budget.eagle_trees(profile, draft, chains=True)
    assert [shape.nodes for shape, _, _ in chains] == [d + 1 for d in range(1, depth_max + 1)]
    assert all(s.tokens == s.depth and t == profile.tau_at(s.depth, s.depth) for s, t, _ in chains)
    with pytest.raises(ValueError, match="chains only: total_tokens must equal the depth"):
        budget.eagle_trees(profile, draft, depth=3, total_tokens=5, chains=True)
    acc = [[0.8, 0.9], [0.5, 0.7], [0.4, 0.6]]
    medusa = budget.medusa_trees(acc, chains=True)
    assert [shape.nodes for shape, _, _ in medusa] == [2, 3, 4]
    assert [t for _, t, _ in medusa] == pytest.approx([1.8, 1.8 + 0.4, 1.8 + 0.4 + 0.16])
    flat = tuple(0.01 * n for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))  # verification nearly free: the biggest wins
    cost = CostProfile(
        target_fingerprint="f" * 16, device="cpu test", dtype="float32", threads=1, torch=torch.__version__,
        context_length=128, node_counts=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), verify_ms=tuple(10 + x for x in flat),
    )  # fmt: skip
    monkeypatch.setattr(budget, "get_draft_cost", lambda drafter, target, depths, refresh=False: draft)
    for arch, is_chain in (("lfm2", True), ("llama", False)):
        t = target(arch)
        size = budget.tune_tree_budget(t, EagleDrafter(make_eagle3(t), t, top_k=2), profile, cost=cost)
        assert (size.shape.nodes == size.shape.depth + 1) is is_chain, arch
