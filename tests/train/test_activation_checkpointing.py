"""``activation_checkpointing: true`` (train/dflash.py): DFlash and DSpark draft layers recomputed in the backward
pass give the same gradients and the same head while keeping fewer activations; the recipes that cannot honour it
refuse it."""

from __future__ import annotations

import pytest
import torch

from selfspec.train.config import TrainConfig
from selfspec.train.inputs import RunInputs
from tests.helpers.archs import tiny_target
from tests.helpers.conversations import conversations
from tests.helpers.tokenizers import tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def config(out, head: str = "dflash", **kw) -> TrainConfig:
    base = dict(
        head=head, target="tiny", self_distill=False, max_length=64, draft_vocab_size=64, lr=3e-3, warmup_steps=1,
        max_steps=3, max_train_minutes=None, eval_every=2, save_every=1000, seed=0, calibrate_prompts=0,
        output_dir=str(out), features="store",
        block={"block_size": 4, "anchors": 8, "batch_tokens": 128, "num_layers": 2, "target_layer_ids": (0, 1)},
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s output and the bytes autograd keeps for its backward."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


@pytest.mark.parametrize("head", ["dflash", "dspark"])
def test_recomputed_layers_give_the_same_gradients_and_head_with_fewer_activations(tmp_path, head):
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from selfspec.train.dflash import BlockRecipe
    from selfspec.train.feature_store import target_features
    from selfspec.train.loop import train_loop

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(16)
    heads, grads, kept = {}, {}, {}
    for on in (False, True):
        cfg = config(tmp_path / str(on), head, activation_checkpointing=on)
        run = RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:12], convs[12:])
        recipe = BlockRecipe(run, *target_features(run, (1, 2)))
        trainer = recipe.module()
        batch = recipe.collate(recipe.batches(0)[0])  # states: the 2 fused layers (64), then the last state
        args = (batch["states"][..., :64].float(), batch["tokens"], batch["valid"], batch["anchors"])
        z, kept[on] = saved_bytes(lambda: trainer(*args))  # noqa: B023
        z.square().mean().backward()
        grads[on] = {n: p.grad.clone() for n, p in trainer.named_parameters() if p.grad is not None}
        trainer.zero_grad(set_to_none=True)
        heads_dir = train_loop(cfg, run.accelerator, recipe, run.heldout())
        heads[on] = load_file(str(heads_dir / "model.safetensors"))
    print(f"bytes kept for the backward: {kept[False]:,} without, {kept[True]:,} with activation checkpointing")
    assert kept[True] < 0.6 * kept[False], kept  # the layers' activations are not kept
    assert grads[True].keys() == grads[False].keys() and grads[True]
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=1e-6)
    for name, value in heads[False].items():
        torch.testing.assert_close(heads[True][name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("head", ["eagle3", "eagle", "medusa"])
def test_recipes_that_cannot_recompute_refuse_it(tmp_path, head):
    from accelerate import Accelerator

    from selfspec.train.recipes import recipe_for

    target, tok, convs = tiny_target("llama"), tiny_tokenizer(), conversations(6)
    cfg = config(tmp_path, head, activation_checkpointing=True)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        recipe_for(cfg).train(RunInputs(cfg, Accelerator(cpu=True), target, tok, convs[:4], convs[4:]))
