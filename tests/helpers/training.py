"""Training inputs for the tests: distilled stores of a tiny target's own greedy answers, training records, a
fresh ``Accelerator``."""

from __future__ import annotations

import json

import torch

from selfspec.train.eagle_data import PairStore
from selfspec.train.features import hidden_features

D, V = 32, 96  # hidden size and vocabulary of the tiny targets


def distilled_store(target, layers, n: int, seed: int) -> PairStore:
    """The target's own greedy answers to random prompts, with ``[layers, last]`` features."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        prompt = torch.randint(3, V, (6,), generator=g)
        ids = target.generate(prompt[None], do_sample=False, max_new_tokens=18, min_new_tokens=18, pad_token_id=0)[0]
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[6:] = True
        examples.append({"input_ids": ids, "loss_mask": mask})
    return PairStore.from_examples(examples, hidden_features(target, examples, True, layers=layers), 4 * D)


def write_record(head_dir, heldout_ids, **over):
    head_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "format": "selfspec-training-record",
        "version": 1,
        "head": "eagle",
        "target": "tiny",
        "target_fingerprint": "f" * 16,
        "data": "my-chats.jsonl",
        "max_conversations": 150,
        "eval_fraction": 0.1,
        "seed": 3,
        "max_length": 256,
        "heldout_ids": heldout_ids,
        "calibration_ids": heldout_ids[-1:],
    }
    record.update(over)
    (head_dir / "training_record.json").write_text(json.dumps(record))
    return head_dir


def fresh_accelerator(**kwargs):
    """A new ``Accelerator`` with its own mixed precision / accumulation (accelerate's state is a singleton)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, **kwargs)


def tiny_run_config(target, data, head: str, out, /, **over):
    """A ``TrainConfig`` of a seconds-long training run on a tiny saved target (``target``: its directory, ``data``:
    a conversations file): no self-distillation, 32-token rows, a 64-token draft vocabulary, evaluation every 2
    steps; ``over`` replaces any field (a family section included)."""
    from selfspec.train.config import TrainConfig

    options = dict(
        head=head,
        target=str(target),
        data=str(data),
        self_distill=False,
        max_length=32,
        draft_vocab_size=64,
        lr=1e-2,
        warmup_steps=1,
        epochs=3,
        eval_every=2,
        save_every=2,
        eval_fraction=0.2,
        calibrate_prompts=0,
        output_dir=str(out),
    )
    options.update(over)
    return TrainConfig(**options)
