"""The real SmolLM2-135M-Instruct target (fp32): speculative greedy output equals plain generate."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.decode.verifier import Verifier
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence, then list three famous landmarks there.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain why the sky is blue to a ten-year-old.",
]


def fresh_heads(model, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    cfg = MedusaConfig(
        hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, num_heads=3, draft_vocab_size=4096
    )
    heads = MedusaHeads(cfg, target_lm_head=model.lm_head.weight, draft_ids=torch.arange(4096))
    for p in heads.blocks.parameters():
        torch.nn.init.normal_(p, std=0.01)
    return heads


@pytest.mark.parametrize("method", ["medusa", "prompt_lookup"])
def test_greedy_matches_plain_generate(smollm2, method):
    model, tok = smollm2
    kwargs = {"heads": fresh_heads(model)} if method == "medusa" else {"prompt_lookup": True}
    spec = selfspec.load(model, tokenizer=tok, **kwargs)
    for text in PROMPTS:
        messages = [{"role": "user", "content": text}]
        ids = spec.encode(messages)
        # An explicit attention mask: the prompt contains <|im_end|> (id 2), which is also SmolLM2's pad id,
        # and generate would otherwise mask those positions out as padding.
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=64,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )
        ref = ref[0, ids.numel() :].tolist()
        out = spec.generate(messages, max_new_tokens=64, eos_token_id=[])
        assert len(out.tokens) == 64
        assert out.tokens == ref
        assert out.stats.steps <= 64


def test_eos_and_text(smollm2):
    model, tok = smollm2
    spec = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    out = spec.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=40)
    assert out.stats.finish_reason == "stop" and out.tokens[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in out.text


def memorising_eagle_head(model, sequences, steps: int = 120):
    """An EAGLE head fitted for a few seconds to the target's own features on ``sequences`` (LongTensors),
    so that decoding those prompts accepts long paths and exercises deep tree verification."""
    from selfspec.heads.config import draft_vocab_from_counts
    from selfspec.heads.eagle import EagleConfig, EagleHead
    from selfspec.train.config import EagleOptions
    from selfspec.train.eagle import eagle_step_loss
    from selfspec.train.eagle_data import PairStore, collate, pack_rows
    from selfspec.train.features import hidden_features
    from selfspec.train.unroll import UnrolledEagle

    V, D = model.config.vocab_size, model.config.hidden_size
    examples = [{"input_ids": s, "loss_mask": torch.ones(s.numel(), dtype=torch.bool)} for s in sequences]
    store = PairStore.from_examples(examples, hidden_features(model, examples, disable_progress=True), D)
    draft_ids = draft_vocab_from_counts(torch.bincount(store.tokens, minlength=V).float() + 1e-3, 4096)
    torch.manual_seed(0)
    head = EagleHead(
        EagleConfig(hidden_size=D, vocab_size=V, draft_vocab_size=4096), model.config, draft_ids=draft_ids, target=model
    )
    unrolled = UnrolledEagle(head)
    optim = torch.optim.AdamW(head.parameters(), lr=1e-3)
    b = collate(store, pack_rows([int(n) - 1 for n in store.lengths], 4096))
    lm = head.lm_weight(torch.float32)
    # two unrolled steps weighted equally, every pair scored (prompts included), no input noise
    options = EagleOptions(ttt_steps=2, ttt_decay=1.0, ce_weight=1.0, score_prompt=True, noise=0.0)
    for _ in range(steps):
        loss = eagle_step_loss(unrolled, b, lm, options).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
    return head.eval()


def test_eagle_greedy_matches_plain_generate(smollm2):
    """EAGLE-2 dynamic trees on the real target: several (depth, top_k, total_tokens), output identical to
    plain greedy generate, with a head that accepts deep paths (tau well above 1)."""
    model, tok = smollm2
    spec0 = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    refs, seqs = [], []
    for text in PROMPTS:
        ids = spec0.encode([{"role": "user", "content": text}])
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=48,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )[0]
        refs.append((ids, ref[ids.numel() :].tolist()))
        seqs.append(ref)
    head = memorising_eagle_head(model, seqs)
    taus = []
    # The settings verify with each linear kernel at every tree size (W @ x^T; oneDNN on packed weights).
    packed = "packed" if Verifier(model).packed_available() else "weight_first"
    settings = (
        (1, 1, 1, "weight_first"),
        (3, 2, 4, "linear"),
        (5, 4, 12, packed),
        (6, 3, 24, "packed"),
        (4, 4, 8, "weight_first"),
    )
    for depth, top_k, total, kernel in settings:
        if kernel == "packed" and not Verifier(model).packed_available():
            continue
        spec = selfspec.load(model, head, tokenizer=tok, depth=depth, top_k=top_k, total_tokens=total)
        spec.verifier = Verifier(model, {n: kernel for n in range(1, 65)})
        for ids, ref in refs:
            out = spec.generate(ids, max_new_tokens=48, eos_token_id=[])
            assert out.tokens == ref, (depth, top_k, total, kernel)
            taus.append((depth, out.stats.mean_accepted_tokens))
    assert min(t for d, t in taus if d >= 3) > 2.0, taus  # deep paths were accepted and verified
