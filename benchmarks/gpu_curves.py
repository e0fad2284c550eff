"""Verification cost vs tree size, Medusa draft cost, and bf16 greedy exactness on random Llama targets.

Why: a tree of N nodes is worth verifying only while one target forward over N nodes costs little more
than over 1 node (memory-bound decoding). This measures that curve on real target shapes, built in place
with random weights (no download; :mod:`benchmarks.random_targets`: ``135m`` SmolLM2-135M, ``1b``
Llama-3.2-1B's shape, ``8b`` Llama-3.1-8B's shape), through selfspec's own ``Verifier.forward_tree`` after a
cached prefix.

For each size: median ms of ``forward_tree`` + lm_head logits over N nodes, for a Medusa-style static tree
and a chain, N in 1..128, relative to N = 1; the CPU time of building the tree mask (part of the tree
time); and the per-step cost of Medusa drafting (4 heads, random weights, full vocabulary and a reduced
8,192-token draft vocabulary). Then greedy exactness on the random 135M target, bf16 and fp32:
``speculative_generate`` with prompt lookup and with random Medusa heads vs ``model.generate``;
reported, not asserted (bf16 tree forwards may round differently from one-token forwards).

Usage (docs/GPU.md has the GPU machine's set-up)::

    python -m benchmarks.gpu_curves --out runs/gpu_cost_curves.json  # CUDA, bf16, all sizes, < 5 min on an H200
    python -m benchmarks.gpu_curves --device cpu --sizes 135m --quick  # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from benchmarks.random_targets import REAL_SIZES, SIZES, build_target, machine_record
from selfspec.base.files import write_json
from selfspec.decode import kv
from selfspec.decode.drafters import DraftLimit, MedusaDrafter, PromptLookupDrafter
from selfspec.decode.loop import speculative_generate
from selfspec.decode.sampling import SamplingConfig
from selfspec.decode.tree import (
    greedy_tree_from_accuracy,
    static_tree,
    tree_attention_bias,
    tree_depths,
    tree_position_ids,
)
from selfspec.decode.verifier import Verifier
from selfspec.heads.medusa import MedusaConfig, MedusaHeads

# Medusa-like cumulative top-k accuracies of 4 heads: only the *shape* of the trees built from them matters.
TREE_ACCURACY = [[0.60, 0.72, 0.78, 0.81, 0.83, 0.85, 0.86, 0.87, 0.88, 0.89]] + [
    [a * 0.75**k for a in (0.45, 0.57, 0.63, 0.67, 0.70, 0.72, 0.74, 0.75, 0.76, 0.77)] for k in range(3)
]
MEDUSA_DRAFT_NODES = 10  # the drafter's own tree (selfspec's CPU default size)
EOS = 2  # the random targets' EOS and pad id (the exactness runs stop at it)


def random_medusa(model, draft_vocab_size: int | None, num_heads: int = 4) -> MedusaHeads:
    """Medusa heads with random (not identity) residual blocks, on the target's device and dtype."""
    cfg = MedusaConfig(
        hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size,
        num_heads=num_heads,
        draft_vocab_size=draft_vocab_size,
    )
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    draft_ids = None
    if draft_vocab_size is not None:
        draft_ids = (
            torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:draft_vocab_size].sort().values
        )
    with torch.device(device):
        heads = MedusaHeads(cfg, target_lm_head=model.get_output_embeddings().weight, draft_ids=draft_ids)
    with torch.no_grad():
        for block in heads.blocks.parameters():
            block.normal_(0.0, 0.02)
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def median_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in ms (CUDA synchronised around each call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def tree_parents(num_nodes: int) -> torch.Tensor:
    """Parents ``[N]`` of a Medusa-style static tree of ``num_nodes`` nodes (root included)."""
    if num_nodes == 1:
        return torch.tensor([-1])
    return static_tree(greedy_tree_from_accuracy(TREE_ACCURACY, num_nodes)).parents


@torch.inference_mode()
def cost_curve(model, nodes: list[int], prefix_tokens: int, repeats: int, warmup: int) -> list[dict]:
    """Verification cost of trees and chains of each size after ``prefix_tokens`` cached tokens."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    verifier = Verifier(model)
    cache = verifier.new_cache()
    verifier.prefill(torch.randint(3, vocab, (prefix_tokens,), generator=gen).to(device), cache)
    rows = []
    for n in nodes:
        tokens = torch.randint(3, vocab, (n,), generator=gen).to(device)
        row = {"nodes": n}
        for shape, parents in (("tree", tree_parents(n)), ("chain", torch.arange(-1, n - 1))):
            parents = parents.to(device)

            def step(tokens: torch.Tensor = tokens, parents: torch.Tensor = parents) -> None:
                h = verifier.forward_tree(tokens, parents, cache, prefix_tokens)
                verifier.lm_logits(h)
                kv.crop_cache(cache, prefix_tokens)

            row[f"{shape}_ms"] = median_ms(step, device, repeats, warmup)
        cpu_parents = tree_parents(n)
        dtype = next(model.parameters()).dtype
        row["mask_ms"] = median_ms(
            lambda cpu_parents=cpu_parents, dtype=dtype: (
                tree_attention_bias(cpu_parents, prefix_tokens, dtype),
                tree_position_ids(cpu_parents, prefix_tokens),
            ),
            torch.device("cpu"),
            repeats,
            1,
        )
        row["tree_depth"] = int(tree_depths(cpu_parents).max())
        rows.append(row)
    base_tree, base_chain = rows[0]["tree_ms"], rows[0]["chain_ms"]
    for row in rows:
        row["tree_rel"] = row["tree_ms"] / base_tree
        row["chain_rel"] = row["chain_ms"] / base_chain
    return rows


@torch.inference_mode()
def medusa_draft_cost(model, repeats: int, warmup: int) -> list[dict]:
    """Per-step cost of ``MedusaDrafter.propose`` (4 heads), full and reduced draft vocabulary (8,192 tokens, or
    half the vocabulary of a target with fewer than 16,384)."""
    device = next(model.parameters()).device
    hidden = torch.randn(4, model.config.hidden_size, device=device, dtype=next(model.parameters()).dtype)
    context = torch.randint(3, model.config.vocab_size, (64,), device=device)
    paths = greedy_tree_from_accuracy(TREE_ACCURACY, MEDUSA_DRAFT_NODES)
    limit = DraftLimit(useful_depth=64)
    rows = []
    reduced = min(8192, model.config.vocab_size // 2)
    for label, dv in (("full_vocab", None), (f"draft_vocab_{reduced}", reduced)):
        heads = random_medusa(model, dv)
        drafter = MedusaDrafter(heads, static_tree(paths))
        drafter.begin(context, hidden)
        ms = median_ms(lambda d=drafter: d.propose(context, SamplingConfig(), None, limit), device, repeats, warmup)
        params = sum(p.numel() for p in heads.parameters())
        rows.append({"variant": label, "draft_ms": ms, "head_params_m": params / 1e6})
        del heads, drafter
    return rows


@torch.inference_mode()
def greedy_exactness(
    size: str, dtype: torch.dtype, device: str, prompts: int, prompt_tokens: int, new_tokens: int
) -> dict:
    """Greedy ``speculative_generate`` vs ``model.generate`` on a random target: match rate per drafter."""
    model = build_target(size, dtype, device, eos_token_id=EOS)
    eos = model.generation_config.eos_token_id
    gen = torch.Generator().manual_seed(1)
    medusa = MedusaDrafter(
        random_medusa(model, None), static_tree(greedy_tree_from_accuracy(TREE_ACCURACY, MEDUSA_DRAFT_NODES))
    )
    built = {d.info().name: d for d in (PromptLookupDrafter(num_tokens=8), medusa)}
    result = {name: {"matches": 0, "prompts": 0, "first_diffs": [], "tau": []} for name in built}
    for _ in range(prompts):
        # half random tokens, half a repeated random snippet, so prompt lookup has something to find
        snippet = torch.randint(3, model.config.vocab_size, (prompt_tokens // 4,), generator=gen)
        ids = torch.cat(
            [torch.randint(3, model.config.vocab_size, (prompt_tokens // 2,), generator=gen), snippet, snippet]
        )
        ids = ids.to(device)
        ref = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids[None]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, ids.numel() :].tolist()
        for name, drafter in built.items():
            out = speculative_generate(model, drafter, ids, max_new_tokens=new_tokens, eos_token_id=eos)
            diff = next((i for i, (a, b) in enumerate(zip(ref, out.tokens, strict=False)) if a != b), None)
            if diff is None and len(ref) != len(out.tokens):
                diff = min(len(ref), len(out.tokens))
            r = result[name]
            r["prompts"] += 1
            r["matches"] += diff is None
            r["first_diffs"].append(diff)
            r["tau"].append(out.stats.mean_accepted_tokens)
    for r in result.values():
        r["match_rate"] = r["matches"] / max(1, r["prompts"])
        r["tau"] = statistics.mean(r["tau"]) if r["tau"] else None
    del model, built
    return result


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu_curves [options]``: measure, print, write ``--out``; returns 0."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_curves", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--sizes", nargs="+", default=list(REAL_SIZES), choices=list(SIZES))
    p.add_argument("--nodes", nargs="+", type=int, default=None, help="tree sizes (default 1 2 4 ... 128)")
    p.add_argument("--prefix-tokens", type=int, default=None, help="cached prefix (default 256; 64 with --quick)")
    p.add_argument("--quick", action="store_true", help="few sizes, repeats and tokens: a smoke test")
    p.add_argument("--skip-exactness", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is steadiest on a busy machine)")
    p.add_argument("--out", default="runs/gpu_cost_curves.json")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available: pass --device cpu (with --quick for a smoke test)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    nodes = args.nodes or ([1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128])
    prefix = args.prefix_tokens or (64 if args.quick else 256)
    repeats, warmup = (2, 1) if args.quick else (20, 5)
    t_start = time.perf_counter()
    report: dict = {
        **machine_record(args.device, args.dtype),
        "prefix_tokens": prefix,
        "repeats": repeats,
        "sizes": {},
    }
    for size in args.sizes:
        t0 = time.perf_counter()
        model = build_target(size, dtype, args.device, eos_token_id=EOS)
        params = sum(p.numel() for p in model.parameters()) / 1e9
        curve = cost_curve(model, nodes, prefix, repeats, warmup)
        draft = medusa_draft_cost(model, repeats, warmup)
        one_node = curve[0]["tree_ms"]
        for row in draft:
            row["draft_rel"] = row["draft_ms"] / one_node
        report["sizes"][size] = {
            "params_b": params,
            "curve": curve,
            "medusa_draft": draft,
            "build_and_measure_s": time.perf_counter() - t0,
        }
        print(f"\n== {size}: {params:.2f}B params, {args.dtype}, {args.device}, prefix {prefix} tokens ==")
        print(f"{'nodes':>5} {'depth':>5} {'tree ms':>9} {'x1':>6} {'chain ms':>9} {'x1':>6} {'mask ms':>8}")
        for r in curve:
            print(
                f"{r['nodes']:>5} {r['tree_depth']:>5} {r['tree_ms']:>9.2f} {r['tree_rel']:>6.2f} "
                f"{r['chain_ms']:>9.2f} {r['chain_rel']:>6.2f} {r['mask_ms']:>8.2f}"
            )
        for r in draft:
            print(
                f"medusa draft ({r['variant']}, {r['head_params_m']:.0f}M params): {r['draft_ms']:.2f} ms "
                f"= {r['draft_rel']:.2f} x a 1-node target forward"
            )
        del model
        _free(args.device)

    if not args.skip_exactness:
        n_prompts, p_tokens, n_new = (1, 32, 12) if args.quick else (8, 128, 64)
        report["exactness"] = {}
        for dt in ("bfloat16", "float32"):
            res = greedy_exactness("135m", getattr(torch, dt), args.device, n_prompts, p_tokens, n_new)
            report["exactness"][dt] = res
            for name, r in res.items():
                print(
                    f"greedy exactness 135m {dt} {name}: {r['matches']}/{r['prompts']} match plain generate "
                    f"(first diffs {r['first_diffs']}), tau {r['tau']:.2f}"
                )
            _free(args.device)
    report["total_s"] = time.perf_counter() - t_start
    out = write_json(Path(args.out), report)
    print(f"\nwrote {out} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
