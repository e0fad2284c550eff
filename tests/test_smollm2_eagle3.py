"""The real SmolLM2-135M-Instruct target (fp32) with an EAGLE-3 head: speculative greedy output equals plain
greedy ``generate`` for several EAGLE-2 tree budgets, with the head read back from disk."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.heads import load_heads
from selfspec.heads.config import draft_vocab_from_counts
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.fingerprint import target_fingerprint
from selfspec.train.config import Eagle3Options
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss
from selfspec.train.eagle_data import PairStore, collate, pack_rows
from selfspec.train.features import hidden_features
from tests.test_smollm2 import PROMPTS

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
SETTINGS = [(1, 1, 1), (3, 2, 4), (5, 4, 12), (6, 3, 24), (4, 8, 16)]  # (depth, top_k, total_tokens)


def memorising_eagle3_head(model, sequences: list[torch.Tensor], steps: int = 80) -> Eagle3Head:
    """An EAGLE-3 head (decoder layer and lm_head started from the target's) fitted for a few seconds to the
    target's own three layers on ``sequences`` (LongTensors), with a 3-step training-time test, so that decoding
    those prompts accepts paths of several tokens and exercises deep tree verification."""
    V, D, L = model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers
    examples = [{"input_ids": s, "loss_mask": torch.ones(s.numel(), dtype=torch.bool)} for s in sequences]
    counts = torch.bincount(torch.cat(sequences), minlength=V).float() + 1e-3
    draft_ids = draft_vocab_from_counts(counts, 4096)
    cfg = Eagle3Config(
        hidden_size=D,
        vocab_size=V,
        draft_vocab_size=4096,
        num_target_layers=L,
        target_fingerprint=target_fingerprint(model),
    )
    torch.manual_seed(0)
    head = Eagle3Head(cfg, model.config, draft_ids=draft_ids, target=model, init_layer=-1, init_lm_head=True)
    feats = hidden_features(model, examples, True, layers=head.target_layers)
    store = PairStore.from_examples(examples, feats, 4 * D)
    batch = collate(store, pack_rows([int(n) - 1 for n in store.lengths], 4096))
    lm_rows = model.get_output_embeddings().weight.detach()[draft_ids].float()
    unrolled = UnrolledEagle3(head.train())
    optim = torch.optim.AdamW(head.parameters(), lr=1e-3)
    options = Eagle3Options(ttt_steps=3, ttt_decay=1.0, score_prompt=True)
    for _ in range(steps):
        loss, _, _ = eagle3_step_loss(unrolled, batch, lm_rows, options, D, head.logit_softcap)
        optim.zero_grad()
        loss.backward()
        optim.step()
    return head.eval()


def test_eagle3_greedy_matches_plain_generate(smollm2, tmp_path):
    """Several (depth, top_k, total_tokens) trees, each output identical to plain greedy generate over 48 new
    tokens of three chat prompts; the head drafts from the target's layers 2, 15, 27 and maps its 4,096-token
    draft vocabulary into target ids (d2t), and accepts deep paths (tau above 1.5 at depth >= 3)."""
    model, tok = smollm2
    spec0 = selfspec.load(model, tokenizer=tok, prompt_lookup=True)
    refs, seqs = [], []
    for text in PROMPTS:
        ids = spec0.encode([{"role": "user", "content": text}])
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            top_k=None,
        )[0]
        refs.append((ids, ref[ids.numel() :].tolist()))
        seqs.append(ref)
    memorising_eagle3_head(model, seqs).save_pretrained(tmp_path / "heads")
    head = load_heads(tmp_path / "heads", target=model)
    assert isinstance(head, Eagle3Head) and head.target_layers == (2, 15, 27)
    taus = []
    for depth, top_k, total in SETTINGS:
        spec = selfspec.load(model, head, tokenizer=tok, depth=depth, top_k=top_k, total_tokens=total)
        for ids, ref in refs:
            out = spec.generate(ids, max_new_tokens=NEW_TOKENS, eos_token_id=[])
            assert out.tokens == ref, (depth, top_k, total)
            taus.append((depth, out.stats.mean_accepted_tokens))
    assert min(t for d, t in taus if d >= 3) > 1.5, taus
