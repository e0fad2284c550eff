"""Draft heads on every architecture family of :mod:`tests.archs` (sliding windows, mixed local/global layers,
per-layer-type rotary embeddings, q/k norms, soft-capped logits): the EAGLE head built from the target's
config is of the target's own layer class with full-context attention, its draft distribution is the
target's on the target's own features, EAGLE-2 trees of several shapes decode exactly like ``generate``
(with rejections, multi-token acceptances and contexts past the window), and a short EAGLE and Medusa
training run (features, loop, final evaluation, save, post-training calibration) saves heads that reload
and decode exactly; the training command exits 0."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from selfspec.decode.drafters import Drafter, DraftTree
from selfspec.decode.drafters.eagle import EagleDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.heads.eagle import FULL_ATTENTION, EagleConfig, EagleHead
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import ARCHS, WINDOW, tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 96
PROMPT = 12  # tokens: past the 8-token window before the first draft
NEW = 20
SHAPES = [(1, 1, 1), (4, 1, 4), (3, 2, 6), (5, 4, 12), (6, 8, 30)]  # (depth, top_k, total_tokens)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param, tiny_target(request.param)


def prompt(seed: int, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(3, V, (length,), generator=torch.Generator().manual_seed(seed))


def reference(target, ids: torch.Tensor, n: int = NEW) -> list[int]:
    out = target.generate(ids.unsqueeze(0), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, ids.numel() :].tolist()


def random_head(target, seed: int = 1) -> EagleHead:
    torch.manual_seed(seed)
    return EagleHead(EagleConfig(hidden_size=32, vocab_size=V), target.config, target=target).eval()


# ------------------------------------------------------------------------------------------------ the head
def test_head_is_the_family_layer_with_full_attention(arch, tmp_path):
    name, target = arch
    head = random_head(target)
    assert type(head.layers[0]) is type(target.model.layers[0])
    if getattr(target.config, "layer_types", None) is not None:
        assert head.arch_config.layer_types == [FULL_ATTENTION]
    assert getattr(head.arch_config, "sliding_window", None) is None
    # its own cache keeps every key: a context twice the window, nothing dropped
    from transformers import DynamicCache

    cache = DynamicCache(config=head.arch_config)
    T = 2 * WINDOW + 3
    feats = torch.randn(1, T, 32)
    with torch.no_grad():
        out = head(feats, prompt(0, T).unsqueeze(0), torch.arange(T).unsqueeze(0), None, cache)
        assert cache.layers[0].keys.shape[-2] == T
        # the last position attends to the whole context: changing the first pair changes it
        feats2 = feats.clone()
        feats2[0, 0] += 1.0
        out2 = head(feats2, prompt(0, T).unsqueeze(0), torch.arange(T).unsqueeze(0))
        plain = head(feats, prompt(0, T).unsqueeze(0), torch.arange(T).unsqueeze(0))
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[0, -1], out2[0, -1])
    # saved and reloaded (with and without the target), the same layer and the same outputs
    head.save_pretrained(tmp_path)
    alone = EagleHead.from_pretrained(tmp_path)
    assert type(alone.layers[0]) is type(head.layers[0])
    again = EagleHead.from_pretrained(tmp_path, target=target).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            again(feats, prompt(0, T).unsqueeze(0), torch.arange(T).unsqueeze(0)), plain, rtol=0, atol=0
        )


def test_draft_distribution_is_the_targets_on_its_features(arch):
    """With the full vocabulary, the head's draft logits of a target feature are the target's own logits
    (soft-capped where the family caps them, Gemma-2)."""
    name, target = arch
    head = random_head(target)
    ids = prompt(2)
    with torch.no_grad():
        logits = target(ids.unsqueeze(0)).logits[0]
        hidden = target.base_model(ids.unsqueeze(0)).last_hidden_state[0]
        torch.testing.assert_close(head.draft_logits(hidden), logits, rtol=1e-5, atol=1e-5)


def test_eagle_training_distribution_is_the_targets_soft_capped():
    """Gemma-2 caps its logits (``cap * tanh(z / cap)``): the EAGLE loss's target distribution p is the target's
    own, and the head's logits are capped the same way before the token term KL(p || q)."""
    from selfspec.train.config import EagleOptions
    from selfspec.train.eagle import eagle_step_loss

    target = tiny_target("gemma2")
    target.config.final_logit_softcapping = 2.0  # a cap that bites on this model's logits
    head = random_head(target)
    assert head.logit_softcap == 2.0
    ids = prompt(8)
    with torch.no_grad():
        logits = target(ids.unsqueeze(0)).logits[0, 1:]
        feats = target.base_model(ids.unsqueeze(0)).last_hidden_state
    T = ids.numel() - 1
    ones = torch.ones(1, T, dtype=torch.bool)
    batch = {
        "features": feats[:, :-1],
        "targets": feats[:, 1:],
        "tokens": ids[1:].unsqueeze(0),
        "positions": torch.arange(T).unsqueeze(0),
        "segment": torch.zeros(1, T, dtype=torch.long),
        "scored": ones,
        "valid": ones,
    }

    def half(features, tokens, positions, segment, steps):  # predicts half of every next feature
        return [batch["targets"] * 0.5] * steps

    lm = head.lm_weight(torch.float32)
    # p is the target's own (capped) distribution, q the head's logits capped the same way
    log_p = logits.log_softmax(-1)
    log_q = torch.log_softmax(torch.tanh(0.5 * feats[0, 1:] @ lm.T / 2.0) * 2.0, -1)
    want = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    capped = eagle_step_loss(half, batch, lm, EagleOptions(), logit_softcap=head.logit_softcap)
    torch.testing.assert_close(capped.ce_loss, want, rtol=1e-4, atol=1e-5)
    plain = eagle_step_loss(half, batch, lm, EagleOptions())
    assert abs(float(plain.ce_loss) - float(want)) > 1e-2  # the cap matters here


class Steered(Drafter):
    """An :class:`EagleDrafter` whose trees are steered after drafting: along the path of the target's
    greedy continuation, the last child of each node on it gets the next greedy token. Steps then accept
    several tokens through non-first branches (a non-contiguous compaction of the target's cache and a
    multi-token ``accept`` of the head), while every other node stays the head's own draft."""

    def __init__(self, drafter: EagleDrafter, prompt_len: int, continuation: list[int]) -> None:
        self.inner = drafter
        self.prompt_len, self.continuation = prompt_len, continuation

    def info(self):
        return self.inner.info()

    def begin(self, prompt_ids, hidden):
        self.inner.begin(prompt_ids, hidden)

    def accept(self, accepted):
        self.inner.accept(accepted)

    def propose(self, context, sampling, generator, limit):
        tree = self.inner.propose(context, sampling, generator, limit)
        assert self.inner._cache.get_seq_length() == context.numel() - 1  # stable pairs only
        tokens, parents = tree.tokens.clone(), tree.parents.tolist()
        decided = context.numel() - self.prompt_len
        last_child = {}
        for i in range(1, len(parents)):
            last_child[parents[i]] = i
        node, depth = 0, 0
        while node in last_child and decided + depth < len(self.continuation):
            node = last_child[node]
            tokens[node] = self.continuation[decided + depth]
            depth += 1
        return DraftTree(tokens=tokens, parents=tree.parents, q=None)


@pytest.mark.parametrize("depth, top_k, total", SHAPES)
def test_eagle_trees_decode_exactly(arch, depth, top_k, total):
    name, target = arch
    head = random_head(target)
    ids = prompt(3)
    ref = reference(target, ids)
    out = speculative_generate(target, EagleDrafter(head, target, depth, top_k, total), ids, max_new_tokens=NEW)
    assert out.tokens == ref, name  # a random head: nearly every draft rejected
    steered = Steered(EagleDrafter(head, target, depth, top_k, total), ids.numel(), ref)
    out = speculative_generate(target, steered, ids, max_new_tokens=NEW)
    assert out.tokens == ref, name
    if depth > 1 and total > 1:
        assert out.stats.mean_accepted_tokens > 1.5, name


# ---------------------------------------------------------------------------------------------- training


BUDGET = dict(
    self_distill=False,
    target="tiny",
    max_length=32,
    draft_vocab_size=64,
    lr=3e-3,
    warmup_steps=1,
    max_steps=3,
    eval_every=1000,
    save_every=1000,
    seed=0,
    calibrate_prompts=3,
    calibrate_max_new_tokens=4,
    max_train_minutes=None,
)


def train(tmp_path, target, head: str):
    from accelerate import Accelerator

    from selfspec.train.config import TrainConfig
    from selfspec.train.eagle import train_eagle
    from selfspec.train.medusa import train_medusa

    family = {
        "eagle": {"eagle": {"batch_tokens": 64, "ttt_steps": 2}},
        "medusa": {"medusa": {"num_heads": 2, "batch_positions": 32}},
    }
    cfg = TrainConfig(**BUDGET, **family[head], head=head, output_dir=str(tmp_path))
    convs = conversations(20)
    run = train_eagle if head == "eagle" else train_medusa
    heads_dir = run(RunInputs(cfg, Accelerator(cpu=True), target, tiny_tokenizer(), convs[:14], convs[14:]))
    return heads_dir, json.loads((tmp_path / "train_summary.json").read_text())


def test_eagle_trains_saves_reloads_and_decodes_exactly(arch, tmp_path):
    from selfspec.api import make_drafter

    name, target = arch
    heads_dir, summary = train(tmp_path, target, "eagle")
    assert summary["step"] == 3 and summary["heldout"]["positions"] > 0
    calibration = summary["acceptance_profile"]
    assert calibration["prompts"] == 3 and calibration["skipped"] == 1  # the long held-out prompt
    assert (heads_dir / "acceptance_profile.json").is_file()
    record = json.loads((heads_dir / "training_record.json").read_text())
    assert len(record["calibration_ids"]) == 3 and "c19" not in record["calibration_ids"]
    for depth, top_k, total in [(4, 2, 8), (3, 1, 3)]:
        drafter = make_drafter(target, heads_dir, tune="off", depth=depth, top_k=top_k, total_tokens=total)
        assert isinstance(drafter, EagleDrafter) and drafter.head.config.n_draft == 64
        for seed in (4, 5):
            ids = prompt(seed)
            assert speculative_generate(target, drafter, ids, max_new_tokens=NEW).tokens == reference(target, ids)


def test_medusa_trains_saves_reloads_and_decodes_exactly(arch, tmp_path):
    from selfspec.api import make_drafter
    from selfspec.heads import load_heads

    name, target = arch
    heads_dir, summary = train(tmp_path, target, "medusa")
    assert summary["step"] == 3 and len(summary["heldout_topk_accuracy"]) == 2
    heads = load_heads(heads_dir, target=target)
    assert heads.config.num_heads == 2 and heads.config.n_draft == 64
    for nodes in (3, 8):
        drafter = make_drafter(target, heads_dir, tune="off", tree_nodes=nodes)
        for seed in (6, 7):
            ids = prompt(seed)
            assert speculative_generate(target, drafter, ids, max_new_tokens=NEW).tokens == reference(target, ids)


def test_features_are_truncated_to_the_targets_context(tmp_path):
    from accelerate import Accelerator

    from selfspec.train.config import TrainConfig
    from selfspec.train.feature_store import target_features

    target = tiny_target("qwen2")
    target.config.max_position_embeddings = 16
    cfg = TrainConfig(**BUDGET, head="eagle", output_dir=str(tmp_path))
    convs = conversations(6)
    train_store, held, _ = target_features(
        RunInputs(cfg, Accelerator(cpu=True), target, tiny_tokenizer(), convs[:4], convs[4:])
    )
    assert int(train_store.lengths.max()) == 16 and int(held.lengths.max()) == 16


@pytest.mark.parametrize("family, head", [("gemma3", "eagle"), ("gemma2", "medusa")])
def test_training_command_exits_zero(tmp_path, family, head):
    """``python -m selfspec.train`` on a saved target directory (Gemma-3: sliding and global layers, two rotary
    bases; Gemma-2: soft-capped logits and attention, eager only): data file, features, training, evaluation,
    save and (EAGLE) calibration; exit status 0 and a summary."""
    from selfspec.train.__main__ import main

    target_dir = tmp_path / "target"
    tiny_target(family).save_pretrained(target_dir)
    tiny_tokenizer().save_pretrained(target_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(20)))
    overrides = {
        **BUDGET,
        "target": str(target_dir),
        "data": str(data),
        "eval_fraction": 0.3,
        "head": head,
        "output_dir": str(tmp_path / "run"),
        "max_train_minutes": "null",
        "self_distill": "false",
        "eagle.batch_tokens": 64,
        "medusa.num_heads": 2,
        "medusa.batch_positions": 32,
    }
    assert main([f"{k}={v}" for k, v in overrides.items()]) == 0
    summary = json.loads((tmp_path / "run" / "train_summary.json").read_text())
    assert summary["head"] == head and summary["step"] == 3
    if head == "eagle":
        assert summary["acceptance_profile"]["prompts"] > 0
    assert (tmp_path / "run" / "heads" / "training_record.json").is_file()


def test_bench_skips_prompts_past_the_targets_context(caplog):
    """A prompt turn that leaves no room for ``max_new_tokens`` in the target's ``max_position_embeddings`` is
    skipped with a log line, like one over ``max_prompt_tokens``."""
    import logging

    from selfspec.bench import BenchPrompt, BenchSettings, build_methods, run_bench
    from selfspec.bench.driver import prompt_limit

    target, tokenizer = tiny_target("gemma3"), tiny_tokenizer()
    target.config.max_position_embeddings = 40
    settings = BenchSettings(max_new_tokens=8, warmup=1, eos_token_ids=())
    assert prompt_limit(target, settings) == 32
    assert prompt_limit(target, dataclasses.replace(settings, max_prompt_tokens=20)) == 20
    methods = build_methods(target, tokenizer, settings, methods=["baseline"])
    long = " ".join(["tell me about the sea"] * 8)
    prompts = [BenchPrompt("long", "c", (long,)), BenchPrompt("short", "c", ("tell me about the moon",))]
    with caplog.at_level(logging.INFO, logger="selfspec.bench.driver"):
        report = run_bench(target, tokenizer, methods, prompts, settings).to_dict()
    assert [s["question_id"] for s in report["samples"]] == ["short"]
    assert [s["question_id"] for s in report["skipped"]] == ["long"]
    assert any("long turn 1 skipped" in r.getMessage() for r in caplog.records)
