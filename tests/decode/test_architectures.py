"""Every architecture family of tests/archs.py is a target: greedy decoding with every drafter equals the
target's own ``generate`` token for token (prompts shorter and longer than the 8-token sliding window,
generations running past it, trees chain / wide / deep / random with forced rejections), a tree forward
equals each branch run alone, the sampling verifier keeps the target's distribution (seeded chi-square
test), soft-capped logits are the model's own, and a target that cannot be verified exactly is refused
at load with its class name and the reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import selfspec
from selfspec.decode.drafters import (
    Drafter,
    DrafterInfo,
    DraftModelDrafter,
    DraftTree,
    MedusaDrafter,
    PromptLookupDrafter,
)
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.kv import call_with_cache, compact_cache, crop_cache, new_cache
from selfspec.decode.loop import speculative_generate
from selfspec.decode.masks import (
    FULL,
    SLIDING,
    AttentionLayout,
    UnsupportedLayoutError,
    attention_layout,
    tree_allowed,
    tree_attention_masks,
)
from selfspec.decode.target_check import UnsupportedTargetError, check_target
from selfspec.decode.tree import static_tree, tree_position_ids
from selfspec.decode.verifier import Verifier
from tests.helpers.archs import ARCHS, CONFIGS, SERVED_ARCHS, STATE_ARCHS, WINDOW, tiny_target
from tests.helpers.drafters import OracleDrafter, TargetTopKDrafter
from tests.helpers.heads import make_eagle3, random_heads
from tests.helpers.sampling import N_SAMPLES, SAMPLING, processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96  # the vocabulary of every tests/archs.py family
PROMPT_LENGTHS = (5, 13)  # shorter and longer than WINDOW
NEW_TOKENS = 20  # every generation runs past the window


@functools.cache
def target(arch: str):
    return tiny_target(arch)


@functools.cache
def draft_model(arch: str):
    return tiny_target(arch, seed=3)  # same family and vocabulary, other weights


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    """``length`` token ids that repeat themselves (so prompt lookup finds matches)."""
    half = torch.randint(3, V, ((length + 1) // 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half])[:length]


@functools.cache
def reference(arch: str, length: int) -> list[int]:
    model, ids = target(arch), prompt(length)
    out = model.generate(ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, top_k=None)
    return out[0, length:].tolist()


class TwoBranchOracle(Drafter):
    """A deep two-branch tree: branch one starts with a wrong token (rejected at depth 1), branch two, after
    it, holds the next ``depth`` tokens of the true greedy continuation. The accepted path is not the
    first nodes (entries move in the cache) and runs deeper than the sliding window."""

    def __init__(self, prompt_len: int, ref: list[int], depth: int) -> None:
        self.prompt_len, self.ref, self.depth = prompt_len, ref, depth

    def info(self):
        return DrafterInfo(name="two_branch_oracle", max_depth=self.depth)

    def propose(self, context, sampling, generator, limit):
        pos = context.numel() - self.prompt_len
        right = self.ref[pos : pos + self.depth]
        if not right:
            return DraftTree(context[-1:], torch.tensor([-1]))
        wrong = [(right[0] + 1) % V] + right[1:]
        n = len(right)
        parents = [-1] + list(range(n)) + [0] + list(range(n + 1, 2 * n))
        tokens = [int(context[-1])] + wrong + right
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))


MEDUSA_TREES = {
    "chain": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)],
    "wide": [(0,), (1,), (2,), (3,), (4,), (5,)],
    "mixed": [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
}


def medusa(paths) -> Callable:
    """A drafter factory: random Medusa heads built for the target, on the static tree ``paths``."""
    return lambda t, arch, ids, ref: MedusaDrafter(random_heads(t), static_tree(paths))


def eagle3(**flags: bool) -> Callable:
    """A drafter factory: a random EAGLE-3 head of the family (``flags``: EAGLE-3.1's ``fc_norm`` / ``norm_output``)
    growing EAGLE-2 trees of depth 4."""
    return lambda t, arch, ids, ref: EagleDrafter(make_eagle3(t, **flags), t, depth=4, top_k=2, total_tokens=8)


# Every drafter run on every family: name -> (target, family, prompt ids, greedy reference) -> Drafter.
# Other drafters (e.g. EAGLE heads built for the family) join the matrix by adding an entry here.
DRAFTERS: dict[str, Callable] = {
    "prompt_lookup": lambda t, arch, ids, ref: PromptLookupDrafter(num_tokens=5),
    "draft_model": lambda t, arch, ids, ref: DraftModelDrafter(draft_model(arch), num_tokens=3),
    "draft_model_self": lambda t, arch, ids, ref: DraftModelDrafter(t, num_tokens=WINDOW + 2),  # deep chains
    **{f"medusa_{shape}": medusa(paths) for shape, paths in MEDUSA_TREES.items()},
    "eagle3": eagle3(),
    "eagle3.1": eagle3(fc_norm=True, norm_output=True),
    "oracle_random": lambda t, arch, ids, ref: OracleDrafter(ids.numel(), ref, seed=ids.numel(), nodes=12),
    "oracle_deep": lambda t, arch, ids, ref: TwoBranchOracle(ids.numel(), ref, depth=WINDOW + 3),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_generate(arch, drafter):
    t = target(arch)
    for length in PROMPT_LENGTHS:
        ids, ref = prompt(length), reference(arch, length)
        out = speculative_generate(t, DRAFTERS[drafter](t, arch, ids, ref), ids, max_new_tokens=NEW_TOKENS)
        assert out.tokens == ref, (arch, drafter, length)
        if drafter.startswith("oracle") or drafter == "draft_model_self":
            assert out.stats.mean_accepted_tokens > 2.0  # long paths were accepted (and compacted)


def branch(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


TREES = {
    "chain": [-1, 0, 1, 2, 3],  # the fast path: the model builds its own masks
    "wide": [-1, 0, 0, 0, 0, 0, 0],
    "mixed": [-1, 0, 0, 1, 1, 2, 5, 3],
    "deep": [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 3],  # a branch of depth 12 > WINDOW, and a side leaf
}


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_tree_equals_each_branch_alone(arch):
    """Logits at every node of a tree verified in one forward equal the model's own for the node's branch
    run alone (fresh cache, its own masks), after prefixes shorter and longer than the window. fp32,
    tolerance 5e-5 (another summation order, masked keys included)."""
    t = target(arch)
    v = Verifier(t)
    for past in (3, 12):
        for shape, parents in TREES.items():
            g = torch.Generator().manual_seed(past)
            ids = torch.randint(3, V, (past,), generator=g)
            tokens = torch.randint(3, V, (len(parents),), generator=g)
            with torch.inference_mode():
                cache = v.new_cache()
                v.prefill(ids, cache)
                logits = v.lm_logits(v.forward_tree(tokens, torch.tensor(parents), cache, past))
                assert cache.get_seq_length() == past + len(parents)
                for node in range(len(parents)):
                    seq = torch.cat([ids, tokens[branch(parents, node)]])
                    alone = t(input_ids=seq[None]).logits[0, -1].float()
                    torch.testing.assert_close(logits[node], alone, rtol=5e-5, atol=5e-5, msg=f"{arch} {shape} {past}")


def test_window_mask_is_needed():
    """The sliding-window masks matter: a deep tree verified with full-attention masks on every layer of a
    sliding-window family gives other logits than the branch alone."""
    t = target("mistral")
    parents = torch.tensor(TREES["deep"])
    ids = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(3, V, (parents.numel(),), generator=torch.Generator().manual_seed(1))
    full = AttentionLayout((FULL,) * t.config.num_hidden_layers)
    with torch.inference_mode():
        cache = new_cache(t)
        Verifier(t).prefill(ids, cache)
        mask = tree_attention_masks(parents, 12, torch.float32, full)
        kwargs = dict(input_ids=tokens[None], attention_mask=mask, position_ids=tree_position_ids(parents, 12))
        wrong = t.lm_head(call_with_cache(t.model, cache, **kwargs).last_hidden_state)[0, 12]
        alone = t(input_ids=torch.cat([ids, tokens[branch(TREES["deep"], 12)]])[None]).logits[0, -1]
    assert (wrong - alone).abs().max() > 1e-2


def test_tree_allowed_sliding_rule():
    """Key position k is visible from query position q iff q - W < k <= q, on the branch (plus the prefix)."""
    parents = torch.tensor([-1, 0, 1, 2, 0, 4])
    past, w = 5, 3
    got = tree_allowed(parents, past, w)
    depth = [0, 1, 2, 3, 1, 2]
    pos = list(range(past)) + [past + d for d in depth]
    for i in range(6):
        on_branch = set(range(past)) | {past + j for j in branch(parents.tolist(), i)}
        for k in range(past + 6):
            want = k in on_branch and pos[past + i] - w < pos[k] <= pos[past + i]
            assert bool(got[i, k]) == want, (i, k)
    assert bool(tree_allowed(parents, past)[:, :past].all())  # full attention sees the whole prefix


def test_masks_by_layout():
    parents = torch.tensor([-1, 0, 0])
    mixed = attention_layout(target("gemma3").config)
    assert set(mixed.layer_types) == {FULL, SLIDING} and mixed.sliding_window == WINDOW
    masks = tree_attention_masks(parents, 10, torch.float32, mixed)
    assert set(masks) == {FULL, SLIDING} and masks[FULL].shape == (1, 1, 3, 13)
    assert bool((masks[FULL] == 0).sum() > (masks[SLIDING] == 0).sum())
    sliding = attention_layout(target("mistral").config)
    assert sliding.layer_types == (SLIDING,) * 3
    single = tree_attention_masks(parents, 10, torch.bfloat16, sliding)
    assert isinstance(single, torch.Tensor) and single.dtype == torch.bfloat16
    assert attention_layout(target("llama").config).sliding_window is None


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_cache_layers_keep_every_key_and_edit_consistently(arch):
    t = target(arch)
    cache = new_cache(t)
    assert [type(layer).__name__ for layer in cache.layers] == ["DynamicLayer"] * t.config.num_hidden_layers
    with torch.inference_mode():
        Verifier(t).prefill(torch.arange(3, 3 + 2 * WINDOW), cache)
        assert [layer.get_seq_length() for layer in cache.layers] == [2 * WINDOW] * len(cache.layers)
        compact_cache(cache, 10, torch.tensor([0, 2, 5]))
        crop_cache(cache, 12)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [12] * len(cache.layers)
    assert cache.get_seq_length() == 12


def test_crop_refuses_a_windowed_layer_that_dropped_keys():
    from transformers import DynamicCache

    t = target("mistral")
    cache = DynamicCache(config=t.config)  # sliding layers keep only the last window
    with torch.inference_mode():
        t(input_ids=torch.arange(3, 3 + 2 * WINDOW)[None], cache=cache, use_cache=True)
    with pytest.raises(TypeError, match="dropped keys"):
        crop_cache(cache, 5)
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer"):
        compact_cache(cache, 10, torch.tensor([0]))


def test_soft_capped_logits_are_the_models_own():
    config = CONFIGS["gemma2"]()
    config.final_logit_softcapping = 2.0  # a cap that bites on this model's logits
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    t = AutoModelForCausalLM.from_config(config).eval()
    ids = prompt(12)
    v = Verifier(t)
    with torch.inference_mode():
        own = t(input_ids=ids[None]).logits[0].float()
        hidden = v.prefill(ids, v.new_cache())
        got = v.lm_logits(hidden)
        uncapped = t.lm_head(hidden).float()
    torch.testing.assert_close(got, own, rtol=1e-6, atol=1e-6)
    assert got.abs().max() < 2.0 < uncapped.abs().max()


# ------------------------------------------------------------------ sampling


@pytest.mark.parametrize(
    "arch",
    ["llama", "gemma3"] + [pytest.param(a, marks=pytest.mark.slow) for a in SERVED_ARCHS + STATE_ARCHS],
)
def test_sampling_keeps_the_target_distribution(arch):
    """Seeded Pearson chi-square goodness of fit of the first two sampled tokens (temperature 0.7, top-k 6)
    against the target's exact distribution, after a 12-token prompt (past the window, so Gemma-3's
    sliding layers mask keys; the served architectures: experts routed per token, latent attention, sinks; the
    hybrid ones: chains through recurrent states rolled back after each rejection):
    N = 400 samples, pairs with expected count >= 5 (the rest pooled), alpha = 0.001. Both acceptance and
    rejection of drafts occur. The served architectures run in the slow tier (400 decodes of a tiny target with
    experts take ~10-30 s)."""
    t = target(arch)
    ids = torch.randint(3, V, (12,), generator=torch.Generator().manual_seed(7))
    p1 = processed_probs(t, ids)
    expected: dict[tuple[int, int], float] = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    gen = torch.Generator().manual_seed(1234)
    drafter, counts, accepted = TargetTopKDrafter(t), {}, 0
    for _ in range(N_SAMPLES):
        out = speculative_generate(t, drafter, ids, max_new_tokens=2, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected  # never a pair the target cannot produce
        counts[key] = counts.get(key, 0) + 1
        accepted += out.stats.accepted_per_step[0] > 1
    chi2, dof = pooled_chi2(counts, expected, N_SAMPLES)
    assert dof >= 2
    assert chi2 < chi2_critical(dof), (chi2, dof)
    assert 0 < accepted < N_SAMPLES


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_passes_the_load_check(arch):
    check_target(target(arch))


def mask_dropping_llama():
    """A Llama whose backbone forward drops the attention mask (builds its own causal one instead)."""
    from transformers import LlamaForCausalLM, LlamaModel

    class MaskDroppingModel(LlamaModel):
        def forward(self, input_ids=None, attention_mask=None, cache=None, **kwargs):
            return super().forward(input_ids=input_ids, cache=cache, **kwargs)

    class MaskDroppingLlama(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            self.model = MaskDroppingModel(config)

    torch.manual_seed(0)
    return MaskDroppingLlama(CONFIGS["llama"]()).eval()


def test_a_forward_that_ignores_the_mask_is_refused_at_load():
    with pytest.raises(UnsupportedTargetError, match=r"MaskDroppingLlama cannot be .*4-D attention mask"):
        selfspec.load(mask_dropping_llama(), prompt_lookup=True, tune="off")


def tiny_falcon_h1():
    """A tiny Falcon-H1: each layer runs attention and a Mamba-2 mixer side by side, a cache layer of keys and a
    state in one (``"hybrid"``), which is not verified."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    config = FalconH1Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_an_unsupported_cache_layer_type_is_refused():
    model = tiny_falcon_h1()
    with pytest.raises(UnsupportedTargetError, match=r"FalconH1ForCausalLM cannot be .*layer types \['hybrid'\]"):
        selfspec.load(model, prompt_lookup=True, tune="off")
    with pytest.raises(UnsupportedLayoutError, match="hybrid"):
        DraftModelDrafter(model)
    with pytest.raises(UnsupportedLayoutError, match="hybrid"):
        new_cache(model)
