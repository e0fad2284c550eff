"""train/distill_states.py: features captured during self-distillation equal the feature pass's, the answers do
not change, and a conversation whose tokens differ falls back to the feature pass; on several families, sliding
window layers included."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec.train.chat_tokens import build_training_examples
from selfspec.train.config import MedusaOptions, TrainConfig
from selfspec.train.distill_states import CapturedStates, TailForcer, template_tail
from selfspec.train.features import features_reusing, hidden_features, self_distill
from tests.helpers.archs import WINDOW, tiny_target
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

END = 6  # "<|end|>": the end of an assistant turn, and the targets' EOS here


def word_tokenizer():
    """A word-level tokenizer over all 96 ids of the tiny targets: specials 0-6, then one word per id, so a
    generated word decodes and re-tokenizes to itself and only a special token (skipped on decoding) changes an
    answer's tokens."""
    return tiny_tokenizer([f"w{i}" for i in range(89)])


def conversations(n: int, seed: int = 0) -> list[dict]:
    """``n`` conversations with prompts of 2 to 11 words (different lengths: left padding in a batch)."""
    g = torch.Generator().manual_seed(seed)
    convs = []
    for i in range(n):
        words = " ".join(f"w{int(j)}" for j in torch.randint(0, 89, (2 + i % 10,), generator=g))
        convs.append(
            {"id": f"c{i}", "messages": [{"role": "user", "content": words}, {"role": "assistant", "content": "w1"}]}
        )
    return convs


def distill(target, tmp_path, name, capture=None, n=12, specials=False):
    """Self-distil ``n`` conversations (14 new tokens, batches of 5). Without ``specials`` the target never generates
    the special ids 0-5 (``generate``'s own ``suppress_tokens``, in both paths), so every answer re-tokenizes to
    the tokens generated."""
    tok = word_tokenizer()
    target.generation_config.eos_token_id = END
    target.generation_config.suppress_tokens = None if specials else [0, 1, 2, 3, 4, 5]
    out = self_distill(
        target, tok, conversations(n), tmp_path / f"{name}.jsonl", 14, 5, disable_progress=True, capture=capture
    )
    return tok, out


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral"])
@pytest.mark.parametrize("layers", [None, (0, 2), (2, 2, 0)])  # a layer taken twice, in any order
def test_captured_features_equal_the_feature_pass(tmp_path, arch, layers):
    target = tiny_target(arch)
    _, plain = distill(target, tmp_path, "plain")
    capture = CapturedStates(layers, 1 << 30)
    tok, captured = distill(target, tmp_path, "captured", capture)
    assert captured == plain  # the same answers, word for word
    assert len(capture) == 12
    examples = build_training_examples(tok, captured, 64)
    assert max(e["input_ids"].numel() for e in examples) > 2 * WINDOW  # sliding windows are crossed
    ref = hidden_features(target, examples, True, layers)
    for e, r in zip(examples, ref, strict=True):
        got = capture.take(e, layers)
        assert got is not None and got.shape == r.shape
        torch.testing.assert_close(got, r, rtol=1e-5, atol=1e-5)
    assert len(capture) == 12 - len(examples)  # take() removes what it returns; dropped examples stay
    capture.clear()
    assert capture.nbytes == 0


def test_fallback_for_changed_tokens_and_other_layers():
    capture = CapturedStates((0, 2), 1 << 30)
    ids = torch.tensor([4, 9, 10, 6, 5, 11, 12, 6])
    feats = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    capture.add("a", ids, feats)
    capture.add("b", ids, feats)
    capture.add("c", ids, feats)
    assert capture.nbytes == 3 * feats.nbytes
    # a truncated training example keeps the captured prefix
    assert torch.equal(capture.take({"id": "a", "input_ids": ids[:5]}, (0, 2)), feats[:5])
    # tokens that differ (an answer re-tokenized otherwise): not used, and dropped
    other = ids.clone()
    other[6] = 13
    assert capture.take({"id": "b", "input_ids": other}, (0, 2)) is None
    # longer than what was captured
    assert capture.take({"id": "c", "input_ids": torch.cat([ids, ids[:1]])}, (0, 2)) is None
    capture.add("d", ids, feats)
    assert capture.take({"id": "d", "input_ids": ids}, None) is None  # other layers: never mixed
    assert capture.take({"id": "never", "input_ids": ids}, (0, 2)) is None
    with pytest.raises(ValueError, match="8 tokens but 7 feature rows"):
        capture.add("e", ids, feats[:7])
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        CapturedStates(None, -1)


def test_features_reusing_mixes_captured_and_computed_in_order(tmp_path):
    """Answers with special tokens (dropped on decoding, so the training tokens differ) and a conversation never
    captured are computed; the rest are taken; all equal the feature pass, in the examples' order."""
    target = tiny_target("gemma3")
    capture = CapturedStates(None, 1 << 30)
    tok, convs = distill(target, tmp_path, "c", capture, specials=True)
    examples = build_training_examples(tok, convs, 64)
    ref = hidden_features(target, examples, True)
    del capture._entries["c3"]
    same = []
    for e in examples:
        entry = capture._entries.get(e["id"])
        n = e["input_ids"].numel()
        same.append(
            entry is not None and entry.input_ids.numel() >= n and torch.equal(entry.input_ids[:n], e["input_ids"])
        )
    assert 0 < sum(same) < len(examples) - 1  # both kinds, besides c3
    mixed = features_reusing(target, examples, capture, True, None, batch_tokens=100)
    for a, b in zip(mixed, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    kept = {c["id"] for c in convs} - {e["id"] for e in examples} - {"c3"}
    assert set(capture._entries) == kept  # every example's capture was looked up and dropped


def test_budget_stops_capture_and_answers_stay_the_same(tmp_path):
    target = tiny_target("llama")
    _, plain = distill(target, tmp_path, "plain")
    capture = CapturedStates(None, 1)  # full after the first batch
    _, out = distill(target, tmp_path, "small", capture)
    assert out == plain
    assert len(capture) == 5  # one batch of 5


def test_answers_that_end_at_eos_and_at_the_cap(tmp_path):
    """Rows ending at different steps of one batch: at EOS (the forced tail starts where generate would stop) and at
    max_new_tokens; every answer equals plain generate's and every capture covers prompt + answer + tail."""
    target = tiny_target("qwen2")
    with torch.no_grad():  # make END likely: some answers stop early
        target.lm_head.weight[END] = target.lm_head.weight[END] * 2.0
    _, plain = distill(target, tmp_path, "plain")
    capture = CapturedStates(None, 1 << 30)
    tok, out = distill(target, tmp_path, "captured", capture)
    assert out == plain
    lengths = {len(r["messages"][-1]["content"].split()) for r in out}
    assert min(lengths) < 14 and 14 in lengths, lengths  # both kinds of ending happened
    rendered = build_training_examples(tok, out, 64)
    for e in rendered:
        entry = capture._entries[e["id"]]
        assert int(entry.input_ids[-1]) == END
        assert entry.features.shape == (entry.input_ids.numel(), 32)


def test_answers_stay_the_same_when_eos_is_an_ordinary_token(tmp_path):
    """An EOS id that decoding keeps (not a special token): plain generate's answer ends with its text, so the
    captured path's answer must too (the forced tail replaces it only as the next input)."""
    target = tiny_target("llama")
    eos = 40  # "w33"
    with torch.no_grad():
        target.lm_head.weight[eos] = target.lm_head.weight[eos] * 2.0
    results = []
    for capture in (None, CapturedStates(None, 1 << 30)):
        tok = word_tokenizer()
        target.generation_config.eos_token_id = eos
        target.generation_config.suppress_tokens = [0, 1, 2, 3, 4, 5]
        results.append(
            self_distill(
                target,
                tok,
                conversations(12),
                tmp_path / f"{capture is None}.jsonl",
                14,
                5,
                disable_progress=True,
                capture=capture,
            )
        )
    assert results[0] == results[1]
    assert any(r["messages"][-1]["content"].endswith("w33") for r in results[0])  # some answers stopped at EOS


def test_template_tail_and_forcer():
    tok = word_tokenizer()
    msgs = [{"role": "user", "content": "w1 w2"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert template_tail(tok, msgs, text) == [END]
    assert template_tail(tok, msgs, "something else") == []  # the prompt is not a prefix: not captured
    forcer = TailForcer(prompt_width=3, eos_ids=[2], tails=[[6, 7], [6, 7]], max_answer_tokens=2)
    scores = torch.zeros(2, 10)
    scores[0, 2] = 1.0  # row 0's greedy token is EOS at the first step
    scores[1, 4] = 1.0
    out = forcer(torch.zeros(2, 3, dtype=torch.long), scores.clone())
    assert out[0].argmax() == 6 and torch.isinf(out[0, 2]) and out[1].argmax() == 4
    assert forcer.answer_tokens == [0, None]
    out = forcer(torch.zeros(2, 4, dtype=torch.long), scores.clone())
    assert out[0].argmax() == 7 and out[1].argmax() == 4
    out = forcer(torch.zeros(2, 5, dtype=torch.long), scores.clone())  # row 1 at the cap: its tail starts
    assert out[1].argmax() == 6 and forcer.answer_tokens == [0, 2] and forcer.stopped_by == [2, None]
    assert forcer.done(2, torch.device("cpu")).tolist() == [False, False]
    assert forcer.done(3, torch.device("cpu")).tolist() == [True, False]
    assert forcer.done(5, torch.device("cpu")).tolist() == [True, True]


def test_config_and_run_wiring():
    from selfspec.train.__main__ import capture_for

    target = tiny_target("llama")
    with pytest.raises(ValueError, match="distill_capture_gb must be >= 0"):
        TrainConfig(distill_capture_gb=-1)
    assert capture_for(TrainConfig(head="eagle", distill_capture_gb=0), target) is None
    assert capture_for(TrainConfig(head="eagle", self_distill=False), target) is None
    assert capture_for(TrainConfig(head="medusa", medusa=MedusaOptions(joint=True)), target) is None
    assert capture_for(TrainConfig(head="eagle3", features="online"), target) is None
    eagle3 = capture_for(TrainConfig(head="eagle3", distill_capture_gb=0.5), target)
    assert eagle3.layers is not None and len(eagle3.layers) == 3 and eagle3.max_bytes == 2**29
    assert capture_for(TrainConfig(head="medusa"), target).layers is None
    assert json.loads(json.dumps(dataclasses.asdict(TrainConfig())))["distill_capture_gb"] == 4.0


def test_a_training_run_stores_the_captured_features(tmp_path, caplog):
    """``selfspec train`` end to end (self-distillation, then the EAGLE-3 store): the store built from captured
    features equals the store of a run without capture (``distill_capture_gb=0``) within float rounding, and the
    log says how many sequences were captured."""
    import logging

    from selfspec.train.__main__ import run
    from selfspec.train.feature_store import load_features, store_path
    from selfspec.train.store_shards import read_manifest

    target = tiny_target("gemma3")
    target.generation_config.eos_token_id = END
    target.generation_config.suppress_tokens = [0, 1, 2, 3, 4, 5]
    target.save_pretrained(tmp_path / "target")
    word_tokenizer().save_pretrained(tmp_path / "target")
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(30)))
    common = dict(
        head="eagle3",
        target=str(tmp_path / "target"),
        data=str(data),
        distill_conversations=16,
        distill_max_new_tokens=12,
        distill_batch_size=6,
        max_length=64,
        eval_fraction=0.2,
        draft_vocab_size=64,
        max_steps=2,
        calibrate_prompts=0,
        features="store",
    )
    stores = {}
    for gb in (4.0, 0.0):
        out = tmp_path / f"run-{gb}"
        with caplog.at_level(logging.INFO, logger="selfspec.train.feature_store"):
            caplog.clear()
            run(TrainConfig(**common, distill_capture_gb=gb, output_dir=str(out)))
        train, held = load_features(store_path(out), read_manifest(store_path(out)).identity)
        stores[gb] = {**train.tensors(), **held.tensors("eval_")}
        said = [r.getMessage() for r in caplog.records if "captured during self-distillation" in r.getMessage()]
        if gb:
            assert said and all(" 0 of " not in s for s in said), said
        else:
            assert not said
    assert stores[4.0].keys() == stores[0.0].keys()
    for k, v in stores[0.0].items():
        if v.is_floating_point():
            torch.testing.assert_close(stores[4.0][k], v, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(stores[4.0][k], v), k
