"""train/features.py: self-distillation's settings from the config: every assistant turn regenerated on the
regenerated history, the answer and prompt caps, sampling settings and a system prompt; bad settings refused before
anything is generated."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.train.config import TrainConfig, load_config
from selfspec.train.distill_states import CapturedStates
from selfspec.train.features import self_distill
from selfspec.train.regenerate import distill_variant
from tests.helpers.archs import tiny_target
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

END = 6  # "<|end|>": the tiny targets' EOS here


def word_tokenizer():
    """Word-level over all 96 ids (specials 0-6, then one word per id): a generated word re-tokenizes to itself."""
    return tiny_tokenizer([f"w{i}" for i in range(89)])


def words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(j)}" for j in torch.randint(0, 89, (n,), generator=g))


def multi_turn(n: int, turns: int = 3, seed: int = 0) -> list[dict]:
    """``n`` conversations of 1 .. ``turns`` user / assistant exchanges, prompts of 2 to 6 words."""
    g = torch.Generator().manual_seed(seed)
    convs = []
    for i in range(n):
        msgs = []
        for _ in range(1 + i % turns):
            msgs += [{"role": "user", "content": words(g, 2 + i % 5)}, {"role": "assistant", "content": "w1 w2"}]
        convs.append({"id": f"c{i}", "messages": msgs})
    return convs


def greedy_answer(target, tok, messages, n):
    """The target's greedy answer to ``messages`` alone (no batch), as self-distillation decodes it."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = target.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.fixture
def target():
    model = tiny_target("llama")
    model.generation_config.eos_token_id = END
    model.generation_config.suppress_tokens = [0, 1, 2, 3, 4, 5]
    return model


def test_default_settings_are_the_first_turn_greedy(target, tmp_path):
    """The defaults (what the config passes by default) write the answers the explicit first-turn greedy call does,
    the conversation cut after its first answer."""
    tok, convs = word_tokenizer(), multi_turn(7)
    plain = self_distill(target, tok, convs, tmp_path / "a.jsonl", 6, 3, disable_progress=True)
    explicit = self_distill(
        target, tok, convs, tmp_path / "b.jsonl", 6, 3, disable_progress=True, turns="first", temperature=0.0
    )
    assert plain == explicit
    for rec, conv in zip(plain, convs, strict=True):
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
        assert rec["messages"][-1]["content"] == greedy_answer(target, tok, conv["messages"][:1], 6)
    cfg = TrainConfig()
    assert (cfg.distill_max_new_tokens, cfg.distill_prompt_cap(), cfg.distill_turns) == (160, 352, "first")
    assert (cfg.distill_temperature, cfg.distill_top_p, cfg.distill_system_prompt) == (0.0, 1.0, None)
    assert distill_variant(cfg) == ""  # today's cache file names


@pytest.mark.parametrize("capture", [False, True])
def test_all_turns_regenerated_on_the_regenerated_history(target, tmp_path, capture):
    tok, convs = word_tokenizer(), multi_turn(7)
    store = CapturedStates(None, 1 << 30) if capture else None
    out = self_distill(
        target, tok, convs, tmp_path / "all.jsonl", 5, 2, disable_progress=True, turns="all", capture=store
    )
    assert [r["id"] for r in out] == [c["id"] for c in convs]
    for rec, conv in zip(out, convs, strict=True):
        got = rec["messages"]
        assert [m["role"] for m in got] == [m["role"] for m in conv["messages"]]
        for i, m in enumerate(got):
            if m["role"] == "user":
                assert m == conv["messages"][i]  # the user turns as written
            else:  # each answer: the target's greedy answer to the regenerated history before it
                assert m["content"] == greedy_answer(target, tok, got[:i], 5)
    assert any(len(r["messages"]) == 6 for r in out)
    if capture:  # the last round's capture holds the whole regenerated conversation
        assert len(store) == 7
    # a second call reads every conversation back from the cache
    again = self_distill(target, tok, convs, tmp_path / "all.jsonl", 5, 2, disable_progress=True, turns="all")
    assert again == out


def test_all_turns_resume_after_a_kill_and_prompt_cap(target, tmp_path):
    tok, convs = word_tokenizer(), multi_turn(6)
    full = self_distill(target, tok, convs, tmp_path / "full.jsonl", 5, 2, disable_progress=True, turns="all")
    cut = tmp_path / "cut.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    cut.write_text(lines[0] + "\n" + lines[1][:10])  # one record, then a line cut by a kill
    assert self_distill(target, tok, convs, cut, 5, 2, disable_progress=True, turns="all") == full
    # a cap of 8 tokens: c4's first prompt (6 words) is longer (skipped); a conversation ends at the first turn
    # whose regenerated history is longer, with the same answers before it
    capped = self_distill(target, tok, convs, tmp_path / "cap.jsonl", 5, 2, 8, disable_progress=True, turns="all")
    assert [r["id"] for r in capped] == ["c0", "c1", "c2", "c3", "c5"]

    def prompt_tokens(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    ended = 0
    for rec, whole in zip(capped, [r for r in full if r["id"] != "c4"], strict=True):
        n = len(rec["messages"])
        assert rec["messages"] == whole["messages"][:n]
        assert prompt_tokens(rec["messages"][:-1]) <= 8
        if n < len(whole["messages"]):
            ended += 1
            assert prompt_tokens(whole["messages"][: n + 1]) > 8
    assert ended >= 1


def test_system_prompt_and_sampling(target, tmp_path):
    tok, convs = word_tokenizer(), multi_turn(4, turns=1)
    convs[1]["messages"].insert(0, {"role": "system", "content": "w7"})
    out = self_distill(target, tok, convs, tmp_path / "s.jsonl", 5, 2, disable_progress=True, system_prompt="w3 w4")
    assert out[0]["messages"][0] == {"role": "system", "content": "w3 w4"}
    assert out[1]["messages"][0] == {"role": "system", "content": "w7"}  # its own system message is kept
    assert out[0]["messages"][-1]["content"] == greedy_answer(target, tok, out[0]["messages"][:2], 5)
    sampled = []
    for name in ("x", "y"):
        torch.manual_seed(3)
        sampled.append(
            self_distill(target, tok, convs, tmp_path / f"{name}.jsonl", 5, 2, disable_progress=True, temperature=1.5)
        )
    assert sampled[0] == sampled[1]  # seeded
    greedy = self_distill(target, tok, convs, tmp_path / "g.jsonl", 5, 2, disable_progress=True)
    assert sampled[0] != greedy
    cfg = TrainConfig(distill_temperature=0.7)
    assert distill_variant(cfg).startswith("-") and distill_variant(cfg) != distill_variant(
        TrainConfig(distill_turns="all")
    )


def test_bad_settings_are_refused_before_any_answer(target, tmp_path):
    tok = word_tokenizer()
    prompts = [{"id": "p", "messages": [{"role": "user", "content": "w1"}]}]
    cache = tmp_path / "never.jsonl"
    with pytest.raises(ValueError, match="none of the 1 conversations has one"):
        self_distill(target, tok, prompts, cache, 5, 2, turns="all")
    with pytest.raises(ValueError, match="turns must be one of"):
        self_distill(target, tok, prompts, cache, 5, 2, turns="every")
    with pytest.raises(ValueError, match="top_p in"):
        self_distill(target, tok, prompts, cache, 5, 2, temperature=1.0, top_p=0.0)
    assert not cache.exists()
    for bad, match in (
        ("distill_turns=every", "distill_turns must be"),
        ("distill_temperature=-1", "distill_temperature must be"),
        ("distill_max_prompt_tokens=0", "distill_max_prompt_tokens must be"),
    ):
        with pytest.raises(ValueError, match=match):
            load_config(None, [bad])
    cfg = load_config(None, ["distill_turns=all", "distill_max_prompt_tokens=1000", "distill_system_prompt=be brief"])
    assert (cfg.distill_turns, cfg.distill_prompt_cap(), cfg.distill_system_prompt) == ("all", 1000, "be brief")
    json.dumps(cfg.distill_system_prompt)
