"""A 262,144-token vocabulary (Gemma-3's size) on a tiny Gemma-3 target: tied, scaled embeddings, mixed
sliding/global layers with an 8-token window. Greedy output of every drafter equals ``generate``, with
reduced draft vocabularies whose ids lie across the whole range (so a draft id mapped wrong, or an index
truncated to a smaller dtype, shows up as a wrong token)."""

from __future__ import annotations

import functools

import pytest
import torch

import selfspec
from selfspec.decode.drafters import MedusaDrafter, PromptLookupDrafter
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.tree import static_tree
from selfspec.heads.eagle import EagleConfig, EagleHead
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from tests.helpers.archs import WINDOW
from tests.helpers.drafters import OracleDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

V = 262_144
S = 4096  # reduced draft vocabulary
NEW = 16
PROMPT = WINDOW + 5  # past the window before the first draft


@functools.cache
def target():
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.2,
        sliding_window=WINDOW,
        sliding_window_pattern=2,
        query_pre_attn_scalar=8,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.requires_grad_(False)
    return model


def prompt() -> torch.Tensor:
    """Token ids from the whole vocabulary, the first half repeated (prompt lookup finds matches)."""
    half = torch.randint(3, V, ((PROMPT + 1) // 2,), generator=torch.Generator().manual_seed(0))
    return torch.cat([half, half])[:PROMPT]


@functools.cache
def reference() -> tuple[int, ...]:
    ids = prompt()
    out = target().generate(ids[None], max_new_tokens=NEW, do_sample=False, pad_token_id=0, top_k=None)
    return tuple(out[0, PROMPT:].tolist())


def draft_ids(seed: int) -> torch.Tensor:
    """S sorted target ids spread over the whole vocabulary, always holding the reference tokens (so the
    heads can propose them) and ids above 2**16 and 2**17."""
    g = torch.Generator().manual_seed(seed)
    ids = set(reference()) | {V - 1, 70_000, 140_000}
    for i in torch.randperm(V, generator=g).tolist():
        if len(ids) == S:
            break
        ids.add(i)
    return torch.tensor(sorted(ids))


def medusa_drafter(t) -> MedusaDrafter:
    torch.manual_seed(0)
    cfg = MedusaConfig(hidden_size=32, vocab_size=V, num_heads=3, draft_vocab_size=S)
    heads = MedusaHeads(cfg, target_lm_head=t.get_output_embeddings().weight, draft_ids=draft_ids(1)).eval()
    for p in heads.blocks.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return MedusaDrafter(heads, static_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]))


def eagle_drafter(t) -> EagleDrafter:
    torch.manual_seed(0)
    head = EagleHead(
        EagleConfig(hidden_size=32, vocab_size=V, draft_vocab_size=S), t.config, draft_ids=draft_ids(2), target=t
    ).eval()
    return EagleDrafter(head, t, depth=3, top_k=4, total_tokens=8)


DRAFTERS = {
    "prompt_lookup": lambda t: PromptLookupDrafter(num_tokens=5),
    "medusa": medusa_drafter,
    "eagle": eagle_drafter,
    "oracle": lambda t: OracleDrafter(PROMPT, list(reference()), seed=0, nodes=10),
}


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_equals_generate_with_a_262k_vocabulary(drafter):
    t = target()
    out = speculative_generate(t, DRAFTERS[drafter](t), prompt(), max_new_tokens=NEW)
    assert tuple(out.tokens) == reference()
    assert all(0 <= tok < V for tok in out.tokens)
    if drafter == "oracle":
        assert out.stats.mean_accepted_tokens > 2.0  # long accepted paths, compacted in the cache


def test_the_load_check_passes_and_the_api_is_exact():
    model = selfspec.load(target(), prompt_lookup=True, tune="off")
    out = model.generate(prompt().tolist(), max_new_tokens=NEW, eos_token_id=[])
    assert tuple(out.tokens) == reference()
