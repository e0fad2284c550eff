"""One process of ``tests/train/test_target_parallel.py``: run under ``accelerate launch`` (2 CPU processes, gloo).

For each architecture, a whole copy and a sharded copy (``shard_target``) of the same tiny random target: features of
this process's share of examples (shares of different sizes per process), greedy answers of different lengths, an
EAGLE-3 head started from the last layer, the fingerprint, and the bytes of the decoder layers held here. Process 0
writes every process's figures to the JSON file named by the first argument.
"""

from __future__ import annotations

import json
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from selfspec.base.fingerprint import target_fingerprint
from selfspec.base.target_shards import decoder_layers, held_bytes, shard_target, sync_forwards
from selfspec.heads.eagle3 import Eagle3Config, Eagle3Head
from selfspec.train.features import hidden_features
from tests.helpers.archs import tiny_target


def eagle3_head(target) -> dict[str, torch.Tensor]:
    cfg = target.config
    hcfg = Eagle3Config(
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=cfg.vocab_size,
        num_target_layers=cfg.num_hidden_layers,
        target_layers=(0, 0, cfg.num_hidden_layers - 1),
        target_fingerprint=target_fingerprint(target),
    )
    torch.manual_seed(1)
    head = Eagle3Head(hcfg, cfg, target=target, init_layer=-1, init_lm_head=True)
    return head.state_dict()


def figures(arch: str, rank: int) -> dict:
    whole = tiny_target(arch)
    layer_bytes = sum(held_bytes(layer) for layer in decoder_layers(whole))
    sharded = tiny_target(arch)
    shard_target(sharded, "cpu")
    out: dict = {"arch": arch, "rank": rank}
    out["layer_bytes"] = [layer_bytes, sum(held_bytes(layer) for layer in sharded.base_model.layers)]
    out["bytes"] = [held_bytes(whole), held_bytes(sharded)]
    out["fingerprint"] = [str(target_fingerprint(whole)), str(target_fingerprint(sharded))]
    vocab = whole.config.vocab_size
    g = torch.Generator().manual_seed(100 + rank)
    examples = [{"input_ids": torch.randint(0, vocab, (5 + 3 * i + rank,), generator=g)} for i in range(2 + 2 * rank)]
    ref = hidden_features(whole, examples, True, layers=[1], batch_tokens=64)
    got = hidden_features(sharded, examples, True, layers=[1], batch_tokens=64)
    sync_forwards(sharded)
    out["examples"] = len(examples)
    out["feature_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got, strict=True))
    prompt = torch.randint(0, vocab, (1, 4 + rank), generator=g)
    n = 3 + 5 * rank
    a = whole.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, synced_gpus=False)
    b = sharded.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, synced_gpus=False)
    sync_forwards(sharded)
    out["answer_tokens"] = int(b.shape[1] - prompt.shape[1])
    out["answers_equal"] = bool(torch.equal(a, b))
    heads = eagle3_head(whole), eagle3_head(sharded)
    out["head_equal"] = sorted(heads[0]) == sorted(heads[1]) and all(
        torch.equal(heads[0][k], heads[1][k]) for k in heads[0]
    )
    return out


def main() -> None:
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    archs = sys.argv[2].split(",")
    mine = [figures(arch, accelerator.process_index) for arch in archs]
    every = gather_object(mine)
    if accelerator.is_main_process:
        with open(sys.argv[1], "w") as fh:
            json.dump(every, fh, indent=1)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
