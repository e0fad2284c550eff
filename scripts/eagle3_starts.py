"""EAGLE-3 small-budget starts: held-out per-position acceptance of trained heads, and the step cost by depth.

    python scripts/eagle3_starts.py eval FEATURES.safetensors NAME=HEAD_DIR [NAME=HEAD_DIR ...] [--out OUT.json]
        [--depth 3] [--threads 2]
    python scripts/eagle3_starts.py time FEATURES.safetensors [--recipes eagle2,eagle3-ttt2,...,medusa] [--rounds 3]
        [--threads 2] [--out OUT.json]

``FEATURES.safetensors`` is a finished EAGLE-3 run's feature cache (``<output_dir>/features/rank0-of1.safetensors``
of ``configs/eagle3-smollm2.yaml``, SmolLM2-135M-Instruct, layers ``2,15,27,final_norm``).

``eval`` reads the held-out split of that cache (its ``eval_*`` tensors only) and, for each head directory, runs
the recipe's own evaluation (:func:`selfspec.train.eagle3.evaluate`): ``chain[d-1]`` is the share of held-out
scored positions whose first d drafts, each the head's top-1 fed its own previous output as in decoding, all equal
the target's greedy tokens (per-position acceptance at depth d, conditioned as a chain); ``chain_tau`` is
``1 + sum(chain)``. It prints a Markdown table and writes the figures to ``--out``.

``time`` measures the wall time of one optimiser step (the recipe's own ``loss``, backward, AdamW; run from the
repository root) of each recipe in ``--recipes``: ``eagle2`` (``configs/eagle-smollm2.yaml``), ``eagle3-ttt<k>``
(``configs/eagle3-smollm2.yaml`` with ``eagle3.ttt_steps=k``) and ``medusa`` (``configs/medusa-smollm2.yaml``), on
their own first-epoch batches of the cache, interleaved round by round so that every recipe sees the same machine
load. The ratios to the first recipe convert a step rate measured for it (EAGLE-2: 1,127 steps in 12 minutes on a
quiet machine) into the others' step counts at equal wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import safe_open

from selfspec.heads import load_heads
from selfspec.target import load_target
from selfspec.train.config import load_config
from selfspec.train.eagle import EagleRecipe
from selfspec.train.eagle3 import Eagle3Recipe, evaluate
from selfspec.train.eagle_data import PairStore
from selfspec.train.feature_store import FeatureStore
from selfspec.train.loop import Recipe
from selfspec.train.medusa import MedusaRecipe

TARGET = "smollm2-135m-instruct"
ROW_LEN = 512


def read_store(features: str, prefix: str) -> PairStore:
    """One split of a feature cache (``prefix`` ``""`` train, ``"eval_"`` held out), reading only its tensors."""
    with safe_open(features, "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys() if k.startswith(prefix) and (prefix or not k.startswith("eval_"))}
    return PairStore.from_tensors(t, prefix)


def run_eval(features: str, heads: list[tuple[str, str]], depth: int, out: Path | None) -> dict:
    model, _ = load_target(TARGET)
    held = read_store(features, "eval_")
    lm = model.get_output_embeddings().weight.detach()
    results = {}
    for name, directory in heads:
        head = load_heads(directory, target=model).float()
        t0 = time.perf_counter()
        m = evaluate(head, held, lm, depth=depth, row_len=ROW_LEN)
        m["seconds"] = round(time.perf_counter() - t0, 1)
        m["head"] = directory
        results[name] = m
        print(f"{name}: {json.dumps(m)}", flush=True)
    cols = " | ".join(f"depth {d + 1}" for d in range(depth))
    print(f"\n| start | positions | {cols} | chain tau |\n|---|---|{'---|' * depth}---|")
    for name, m in results.items():
        accs = " | ".join(f"{a:.3f}" for a in m["chain"])
        print(f"| {name} | {m['positions']} | {accs} | {m['chain_tau']:.3f} |")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")
    return results


def recipe_for(name: str, model, train: FeatureStore, held: FeatureStore) -> Recipe:
    """The recipe of ``name`` (``eagle2``, ``eagle3-ttt<k>``, ``medusa``) from its SmolLM2 config, on the stores
    (EAGLE-2 and Medusa read the last ``D`` columns, the final-norm state, of the EAGLE-3 store)."""
    D = model.config.hidden_size
    last = [FeatureStore(s.tokens, s.features[:, 3 * D :], s.loss_mask, s.lengths) for s in (train, held)]
    acc = Accelerator(cpu=True)
    if name == "eagle2":
        return EagleRecipe(load_config("configs/eagle-smollm2.yaml"), acc, model, None, *last, "", [])
    if name == "medusa":
        return MedusaRecipe(load_config("configs/medusa-smollm2.yaml"), model, *last, "")
    if name.startswith("eagle3-ttt"):
        cfg = load_config("configs/eagle3-smollm2.yaml", [f"eagle3.ttt_steps={int(name[len('eagle3-ttt') :])}"])
        return Eagle3Recipe(cfg, acc, model, None, train, held, "", [])
    raise SystemExit(f"unknown recipe {name!r}: eagle2, medusa or eagle3-ttt<k>")


def run_time(features: str, names: list[str], rounds: int, out: Path | None) -> dict:
    model, _ = load_target(TARGET)
    train, held = read_store(features, ""), read_store(features, "eval_")
    recipes = {n: recipe_for(n, model, train, held) for n in names}
    steps = {}
    for n, r in recipes.items():
        module = r.module()
        params = [p for p in module.parameters() if p.requires_grad]
        steps[n] = (module, torch.optim.AdamW(params, lr=1e-4), r.batches(0))
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds + 1):  # round 0 warms up and is not counted
        for n, r in recipes.items():
            module, opt, batches = steps[n]
            t0 = time.perf_counter()
            out_i = r.loss(module, r.collate(batches[i % len(batches)]), i)
            opt.zero_grad()
            out_i.loss.backward()
            opt.step()
            if i > 0:
                seconds[n].append(time.perf_counter() - t0)
    ref = statistics.median(seconds[names[0]])
    result = {
        n: {
            "median_s": round(statistics.median(v), 3),
            "runs_s": [round(x, 3) for x in v],
            f"ratio_to_{names[0]}": round(statistics.median(v) / ref, 3),
        }
        for n, v in seconds.items()
    }
    print(json.dumps(result, indent=2))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("features")
    e.add_argument("heads", nargs="+", help="NAME=HEAD_DIR")
    e.add_argument("--depth", type=int, default=3)
    e.add_argument("--out", type=Path)
    e.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("time")
    t.add_argument("features")
    t.add_argument("--recipes", default="eagle2,eagle3-ttt2,eagle3-ttt3,eagle3-ttt7,medusa")
    t.add_argument("--out", type=Path)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.cmd == "eval":
        pairs = [h.split("=", 1) for h in a.heads]
        if any(len(x) != 2 for x in pairs):
            raise SystemExit("each head is NAME=HEAD_DIR, e.g. random=runs/e3s-random/heads")
        run_eval(a.features, [(n, d) for n, d in pairs], a.depth, a.out)
    else:
        run_time(a.features, a.recipes.split(","), a.rounds, a.out)


if __name__ == "__main__":
    main()
