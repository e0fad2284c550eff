"""Prompts and heads for the tests on the real SmolLM2-135M-Instruct target (slow tier)."""

from __future__ import annotations

import torch

from selfspec.base.fingerprint import target_fingerprint
from selfspec.heads.config import draft_vocab_from_counts
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.heads.medusa import MedusaConfig, MedusaHeads
from selfspec.train.config import Eagle3Options
from selfspec.train.eagle3 import UnrolledEagle3, eagle3_step_loss
from selfspec.train.eagle_data import PairStore, collate, pack_rows
from selfspec.train.features import hidden_features

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


def memorising_block_head(model, sequences: list[torch.Tensor], head_type: str = "dflash", steps: int = 150):
    """A DFlash or DSpark head (block of 4, one layer started from the target's last, a 4096-token draft
    vocabulary) fitted for a few seconds to the target's own states on ``sequences`` (LongTensors), anchored at every
    position, so that decoding those prompts accepts several tokens a step."""
    from selfspec.heads.block_layers import draft_layer_config
    from selfspec.heads.dflash import BlockConfig, BlockHead, default_target_layer_ids
    from selfspec.train.config import BlockOptions
    from selfspec.train.dflash import block_step_loss, collate_sequences, init_from_target_layer
    from selfspec.train.feature_store import FeatureStore

    V, D, L = model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers
    examples = [{"input_ids": s, "loss_mask": torch.ones(s.numel(), dtype=torch.bool)} for s in sequences]
    counts = torch.bincount(torch.cat(sequences), minlength=V).float() + 1e-3
    draft_ids = draft_vocab_from_counts(counts, 4096)
    dspark = head_type == "dspark"
    cfg = BlockConfig(
        head_type=head_type,
        hidden_size=D,
        vocab_size=V,
        num_target_layers=L,
        block_size=4,
        num_layers=1,
        mask_token_id=V - 1,
        target_layer_ids=default_target_layer_ids(L),
        draft_vocab_size=4096,
        markov_rank=16 if dspark else 0,
        confidence=dspark,
        target_fingerprint=target_fingerprint(model),
    )
    torch.manual_seed(0)
    head = BlockHead(cfg, draft_layer_config(model.config, 1, 4), draft_ids, model)
    init_from_target_layer(head, model, -1)
    feats = hidden_features(model, examples, True, layers=cfg.target_layers)
    store = FeatureStore.from_examples(examples, feats, (len(cfg.target_layers) + 1) * D)
    batch = collate_sequences(store, list(range(len(store))), 512, cfg.max_drafts, torch.Generator().manual_seed(0))
    lm_rows = model.get_output_embeddings().weight.detach()[draft_ids].float()
    optim = torch.optim.AdamW(head.parameters(), lr=5e-3)
    options = BlockOptions(block_size=4, loss="ce", decay=100.0)
    head.train()
    for _ in range(steps):
        loss, _, _ = block_step_loss(lambda *a: block_logits_of(head, *a), head, batch, lm_rows, options)
        optim.zero_grad()
        loss.backward()
        optim.step()
    return head.eval()


def block_logits_of(head, states, tokens, valid, anchors):
    from selfspec.train.dflash import block_logits

    return block_logits(head, states, tokens, valid, anchors)
