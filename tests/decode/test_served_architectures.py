"""The architectures served in 2026 (tests/helpers/archs.py ``SERVED_ARCHS``: Qwen3-MoE, Mixtral, gpt-oss,
DeepSeek-V3, SmolLM3, Gemma-4) are targets: they pass the load check, a tree verified in one forward gives every
node the logits of its branch run alone (routed experts see the same tokens), greedy decoding with prompt lookup
and a random head of every family equals the target's own ``generate`` token for token at batch 1 (a prompt past
the 8-token window, forced rejections and deep accepted paths of an oracle), and every row of a ragged batch equals
the target's ``generate`` of its prompt. Sampling: tests/decode/test_architectures.py
(``test_sampling_keeps_the_target_distribution``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

import selfspec
from selfspec.decode.drafters import MedusaDrafter, PromptLookupDrafter
from selfspec.decode.drafters.block import BlockDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import speculative_generate, speculative_generate_batch
from selfspec.decode.tree import static_tree
from selfspec.decode.verifier import Verifier
from tests.helpers.archs import SERVED_ARCHS, tiny_target
from tests.helpers.drafters import OracleDrafter
from tests.helpers.heads import block_head, make_eagle, make_eagle3, random_heads

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
PROMPT = 13  # past the 8-token window
NEW = 12
LENGTHS = (5, 13, 9)  # a ragged batch


@functools.cache
def target(arch: str):
    return tiny_target(arch)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    """``length`` token ids that repeat themselves (so prompt lookup finds matches)."""
    half = torch.randint(3, V, ((length + 1) // 2,), generator=torch.Generator().manual_seed(seed))
    return torch.cat([half, half])[:length]


@functools.cache
def reference(arch: str, length: int, seed: int = 0) -> list[int]:
    ids = prompt(length, seed)
    out = target(arch).generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0, top_k=None)
    return out[0, length:].tolist()


# name -> (target, prompt ids, greedy reference) -> Drafter: prompt lookup and a random head of every family
DRAFTERS: dict[str, Callable] = {
    "prompt_lookup": lambda t, ids, ref: PromptLookupDrafter(num_tokens=5),
    "medusa": lambda t, ids, ref: MedusaDrafter(random_heads(t), static_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])),
    "eagle": lambda t, ids, ref: EagleDrafter(make_eagle(t), t, depth=4, top_k=2, total_tokens=8),
    "eagle3": lambda t, ids, ref: EagleDrafter(make_eagle3(t), t, depth=4, top_k=2, total_tokens=8),
    "dflash": lambda t, ids, ref: BlockDrafter(block_head(t, "dflash", 4), t, top_k=2),
    "oracle": lambda t, ids, ref: OracleDrafter(ids.numel(), ref, seed=1, nodes=12),
}


@pytest.mark.parametrize("arch", SERVED_ARCHS)
def test_passes_the_load_check(arch):
    model = selfspec.load(target(arch), prompt_lookup=True, tune="off")
    ids = prompt(PROMPT)
    assert model.generate(ids, max_new_tokens=NEW, eos_token_id=[]).tokens == reference(arch, PROMPT)


def branch(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("arch", SERVED_ARCHS)
def test_forward_tree_equals_each_branch_alone(arch):
    """A mixed tree and a branch deeper than the window, after 12 cached tokens: every node's logits equal the model's
    own for the node's branch run alone (fp32, tolerance 5e-5)."""
    t = target(arch)
    v = Verifier(t)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, V, (12,), generator=g)
    for parents in ([-1, 0, 0, 1, 1, 2, 5, 3], [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 3]):
        tokens = torch.randint(3, V, (len(parents),), generator=g)
        with torch.inference_mode():
            cache = v.new_cache()
            v.prefill(ids, cache)
            logits = v.lm_logits(v.forward_tree(tokens, torch.tensor(parents), cache, ids.numel()))
            for node in range(len(parents)):
                alone = t(input_ids=torch.cat([ids, tokens[branch(parents, node)]])[None]).logits[0, -1].float()
                torch.testing.assert_close(logits[node], alone, rtol=5e-5, atol=5e-5, msg=f"{arch} node {node}")


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("arch", SERVED_ARCHS)
def test_greedy_equals_generate(arch, drafter):
    t, ids, ref = target(arch), prompt(PROMPT), reference(arch, PROMPT)
    out = speculative_generate(t, DRAFTERS[drafter](t, ids, ref), ids, max_new_tokens=NEW)
    assert out.tokens == ref, (arch, drafter)
    if drafter == "oracle":
        assert out.stats.mean_accepted_tokens > 2.0  # long paths through non-first branches were accepted


@pytest.mark.parametrize(
    "arch, drafter",
    [("qwen3_moe", "eagle3"), ("deepseek_v3", "eagle3"), ("gemma4", "eagle3"), ("mixtral", "dflash")]
    + [("gpt_oss", "prompt_lookup"), ("smollm3", "medusa")],
)
def test_ragged_batch_rows_equal_generate(arch, drafter):
    t = target(arch)
    prompts = [prompt(n, seed) for seed, n in enumerate(LENGTHS)]
    rows = speculative_generate_batch(t, DRAFTERS[drafter](t, None, None), prompts, max_new_tokens=NEW)
    assert [r.tokens for r in rows] == [reference(arch, n, seed) for seed, n in enumerate(LENGTHS)]
