"""The decode loop's own cost: one speculation cycle in plain decoding steps, its parts, and its host syncs.

Why: a speculation cycle (draft + verify forward + acceptance + cache compaction) pays only if it costs
little more than one plain decoding step. On a GPU the target's forward over a tree of N nodes costs about
what one token costs (:mod:`benchmarks.gpu_curves`: 1.15-1.31x at 128 nodes on an H200), so what the loop
does around that forward (host synchronisations, small kernels, Python) decides the cycle. The goal is a
cycle of at most 1.3 plain steps at the tree budget the chooser picks.

How: targets of real shapes with random weights (:mod:`benchmarks.random_targets`: ``135m``, ``1b``, ``8b``,
and ``tiny`` for the CPU dry run), built in place (no download).

For each target the plain greedy continuation of a random prompt is computed first (one-token forwards).
A rigged drafter (:class:`~benchmarks.rigged_drafter.RiggedDrafter`) then proposes a fixed tree (the
EAGLE-2-like shape of ``TREE_ACCURACY`` at N nodes) whose main path holds that continuation up to a depth k
set per step with P(k >= d) = a^d, and wrong tokens everywhere else, so a is the acceptance rate per depth.
Each configuration (N, a) runs the real loop, ``selfspec.decode.loop.speculative_generate``, unchanged:

* cycle ms: ``(total_s - prefill_s) / steps`` of a run of about ``--cycles`` steps (the loop reads the new
  tokens on the host every step, so its clock is synchronised), median over ``--rounds`` rounds. One
  plain step: ms per token of a greedy loop of ``--cycles`` one-token forwards (``Verifier.forward_tree``
  + ``lm_logits`` + argmax, the token fed back on the device, no host read until the end), run right
  before each configuration's run in every round; a cycle in plain steps is the median over rounds of
  the cycle over the plain step just before it. Configurations alternate their order round by round.
* the split: one more run with the loop's parts wrapped (:data:`LOOP_PARTS`: ``drafter.propose``,
  ``read_tree`` / ``cut_tree``, ``Verifier.forward_tree``, ``lm_logits`` + ``check_finite``,
  ``target_distributions``, ``argmax_with_check`` + ``verify_step``, ``kv.compact_cache``), the device
  synchronised around each; ``other`` is the rest of the cycle (the accepted tokens, the stopping rule, the
  context, the drafter's ``accept``).
* host syncs per step: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` with every warning counted
  and attributed to the Python line that caused it; on a CPU (or ``--sync-count patch``), counters
  patched into ``torch.Tensor.item / tolist / cpu / numpy / __bool__ / __int__ / __float__ / __index__ /
  nonzero`` (host reads of tensor values: syncs on a GPU when the tensor lives there) and, counted apart,
  ``Tensor.to(device)`` and ``torch.tensor(..., device=)`` (host-to-device copies when the data is on the
  host; a pageable copy waits for the stream).
* exactness: the loop's greedy output against the plain greedy continuation (and that against
  ``model.generate``), recorded per configuration; in bf16 a tree forward may round differently from a
  one-token forward, so it is reported there, not asserted.

Usage (docs/GPU.md has the GPU machine's set-up)::

    python -m benchmarks.gpu_cycle --device cuda --out runs/gpu_cycle.json   # bf16, 135m/1b/8b: ~4 min, H200
    python -m benchmarks.gpu_cycle --dry-run --out runs/cycle_dry.json      # CPU, tiny target, seconds

It measures the loop through the names it looks up (:data:`LOOP_PARTS`): a change of the loop's internals is a
change of that table.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch

from benchmarks.host_syncs import HOST_READS, MOVES, Probe, count_syncs, transparent
from benchmarks.random_targets import REAL_SIZES, SIZES, build_target, machine_record
from benchmarks.rigged_drafter import TREE_ACCURACY, RiggedDrafter, tree_parents
from selfspec.base.files import write_json
from selfspec.decode import kv, loop
from selfspec.decode.loop import speculative_generate
from selfspec.decode.tree import tree_depths
from selfspec.decode.verifier import Verifier

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# (owner, attribute, part): the named calls of one cycle, wrapped where the loop looks them up; ``"drafter"``
# and ``"verifier"`` stand for the run's objects. ``other`` is the rest of the cycle.
LOOP_PARTS = (
    ("drafter", "propose", "draft"),
    (loop, "read_tree", "tree_prep"),
    (loop, "cut_tree", "tree_prep"),
    ("verifier", "forward_tree", "forward"),
    ("verifier", "lm_logits", "logits"),
    (loop, "check_finite", "logits"),
    (loop, "target_distributions", "process"),
    (loop, "argmax_with_check", "accept"),
    (loop, "verify_step", "accept"),
    (kv, "compact_cache", "compact"),
)
GOAL_CYCLE_STEPS = 1.3
MIN_TRANSFORMERS = (5, 24)  # pyproject's bound: the release the decode loop is tested against
PARTS = ("draft", "tree_prep", "forward", "logits", "process", "accept", "compact", "other")


# --------------------------------------------------------------------------------------------------
# Measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def plain_decode(
    verifier: Verifier, prompt: torch.Tensor, steps: int, probe: Probe | None = None
) -> tuple[float, list[int]]:
    """Plain greedy decoding by one-token forwards: ``(ms per step, the steps + 1 new tokens)``.

    ``Verifier.forward_tree`` over the one new token (the model builds the causal mask), ``lm_logits``,
    argmax; the token stays on the device, the host reads the tokens once at the end. Timed from after
    the prefill's first token to the last step, device synchronised at both ends. ``probe`` is told when
    the steps begin.
    """
    device = prompt.device
    cache = verifier.new_cache()
    hidden = verifier.prefill(prompt, cache)
    token = verifier.lm_logits(hidden[-1:]).argmax(-1)  # [1]
    root = torch.tensor([-1], device=device)
    out, past = [token], prompt.numel()
    _sync(device)
    if probe is not None:
        probe.in_steps = True
    t0 = time.perf_counter()
    for _ in range(steps):
        token = verifier.lm_logits(verifier.forward_tree(token, root, cache, past)).argmax(-1)
        out.append(token)
        past += 1
    if probe is not None:
        probe.in_steps = False
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / steps
    return ms, torch.cat(out).tolist()


@torch.inference_mode()
def generate_ms_per_token(model: PreTrainedModel, prompt: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """``model.generate`` (greedy): ms per token past the first (``(t(steps + 1) - t(1)) / steps``), and its
    tokens."""
    device = prompt.device
    ids = prompt[None]
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    times, tokens = [], []
    for n in (1, steps + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        _sync(device)
        times.append(time.perf_counter() - t0)
        tokens = out[0, ids.shape[1] :].tolist()
    return (times[1] - times[0]) * 1e3 / steps, tokens


def run_loop(verifier: Verifier, drafter: RiggedDrafter, prompt: torch.Tensor, new_tokens: int):
    """One greedy ``speculative_generate`` run (no EOS): ``(ms per cycle, output)``."""
    _sync(prompt.device)
    out = speculative_generate(verifier, drafter, prompt, max_new_tokens=new_tokens)
    stats = out.stats
    return (stats.total_s - stats.prefill_s) * 1e3 / max(1, stats.steps), out


@contextlib.contextmanager
def timed_parts(verifier: Verifier, drafter: RiggedDrafter, probe: Probe, parts: dict[str, float]) -> Iterator[None]:
    """Accumulate wall seconds of the loop's parts during the steps into ``parts`` (device synchronised
    around each call): each call of :data:`LOOP_PARTS` is wrapped where the loop looks it up."""
    device = next(verifier.target.parameters()).device

    def timed(name: str, fn: Callable) -> Callable:
        @transparent
        def call(*args, **kwargs):
            if not probe.in_steps and name != "draft":
                return fn(*args, **kwargs)
            _sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(device)
                parts[name] += time.perf_counter() - t0

        return call

    objects = {"drafter": drafter, "verifier": verifier}
    with contextlib.ExitStack() as stack:
        for owner, attr, part in LOOP_PARTS:
            owner = objects[owner] if isinstance(owner, str) else owner
            stack.enter_context(mock.patch.object(owner, attr, timed(part, getattr(owner, attr))))
        yield


def _first_diff(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def measure_size(size: str, args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Every configuration of one target size (see the module docstring); the size's JSON record."""
    device = torch.device(args.device)
    t_size = time.perf_counter()
    model = build_target(size, dtype, args.device)
    verifier = Verifier(model)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1)).to(device)

    configs: list[dict[str, Any]] = []
    for shape in args.shapes:
        for n in args.nodes:
            for a in [None] if n == 1 else args.acceptance:
                if n == 1 and any(c["nodes"] == 1 for c in configs):
                    continue
                parents = tree_parents(n, shape)
                configs.append({"shape": "root" if n == 1 else shape, "nodes": n, "acceptance": a, "parents": parents})
    max_depth = max(int(tree_depths(c["parents"]).max()) for c in configs)
    longest = max(
        round(args.cycles * RiggedDrafter(prompt, c["parents"], c["acceptance"] or 0.0, vocab).expected_tau)
        for c in configs
    )
    _, reference = plain_decode(verifier, prompt, longest + max_depth + 1)
    ref_dev = torch.tensor(reference, device=device)
    gen_ms, gen_tokens = generate_ms_per_token(model, prompt, args.cycles)

    def plain_run(probe: Probe) -> int:
        plain_decode(verifier, prompt, args.cycles, probe)
        return args.cycles

    plain_counts = count_syncs(plain_run, args.sync_count)
    record: dict[str, Any] = {
        "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
        "config": SIZES[size],
        "reference_equals_generate": gen_tokens == reference[: len(gen_tokens)],
        "reference_generate_first_diff": _first_diff(gen_tokens, reference[: len(gen_tokens)]),
        "plain_step_syncs": plain_counts,
    }

    # Per configuration: a drafter, the run length, one counted run and one split run (both untimed).
    for c in configs:
        probe = Probe()
        drafter = RiggedDrafter(ref_dev, c["parents"], c["acceptance"] or 0.0, vocab, probe=probe)
        c["drafter"], c["probe"] = drafter, probe
        c["new_tokens"] = max(2, round(args.cycles * drafter.expected_tau))
        runs = []

        def counted_run(_probe: Probe, drafter=drafter, n: int = c["new_tokens"], runs: list = runs) -> int:
            runs.append(run_loop(verifier, drafter, prompt, n)[1])
            return runs[-1].stats.steps

        c.update(count_syncs(counted_run, args.sync_count, probe))
        out = runs[0]
        c["steps"] = out.stats.steps
        c["measured_tau"] = out.stats.mean_accepted_tokens
        c["first_diff"] = _first_diff(out.tokens, reference[: len(out.tokens)])
        c["exact"] = c["first_diff"] is None

        parts = dict.fromkeys(PARTS, 0.0)
        probe.in_steps = False
        with timed_parts(verifier, drafter, probe, parts):
            instrumented_ms, out = run_loop(verifier, drafter, prompt, c["new_tokens"])
        per_step = {k: v * 1e3 / out.stats.steps for k, v in parts.items()}
        per_step["other"] = max(0.0, instrumented_ms - sum(per_step.values()))
        c["parts_ms"] = per_step
        c["instrumented_cycle_ms"] = instrumented_ms

    # Timed rounds: each configuration right after a plain run (a load change on a busy machine shifts both
    # alike); the order of the configurations alternates round by round.
    plain_ms: list[float] = []
    for r in range(args.rounds):
        for c in configs if r % 2 == 0 else reversed(configs):
            plain_ms.append(plain_decode(verifier, prompt, args.cycles)[0])
            ms, _ = run_loop(verifier, c["drafter"], prompt, c["new_tokens"])
            c.setdefault("cycle_ms_rounds", []).append(ms)
            c.setdefault("cycle_rel_rounds", []).append(ms / plain_ms[-1])
    plain = statistics.median(plain_ms)
    rows = []
    for c in configs:
        cycle = statistics.median(c["cycle_ms_rounds"])
        rel = statistics.median(c["cycle_rel_rounds"])
        rows.append(
            {
                "shape": c["shape"],
                "nodes": c["nodes"],
                "depth": int(tree_depths(c["parents"]).max()),
                "acceptance": c["acceptance"],
                "expected_tau": c["drafter"].expected_tau,
                "measured_tau": c["measured_tau"],
                "steps": c["steps"],
                "exact": c["exact"],
                "first_diff": c["first_diff"],
                "cycle_ms": cycle,
                "cycle_ms_rounds": c["cycle_ms_rounds"],
                "cycle_rel": rel,
                "cycle_rel_rounds": c["cycle_rel_rounds"],
                "speedup": c["measured_tau"] / rel,
                "meets_goal": rel <= args.goal,
                "parts_ms": c["parts_ms"],
                "parts_rel": {k: v / plain for k, v in c["parts_ms"].items()},
                "instrumented_cycle_ms": c["instrumented_cycle_ms"],
                "syncs_per_step": c["syncs_per_step"],
                "sync_sites": c["sync_sites"],
                "host_reads_per_step": c["host_reads_per_step"],
                "device_moves_per_step": c["device_moves_per_step"],
                "host_read_sites": c["host_read_sites"],
            }
        )
    chosen = {}
    for a in args.acceptance:
        pool = [row for row in rows if row["acceptance"] in (a, None)]
        best = max(pool, key=lambda row: row["speedup"])
        chosen[str(a)] = {k: best[k] for k in ("nodes", "shape", "cycle_rel", "speedup", "meets_goal")}
    record.update(
        plain_step_ms=plain,
        plain_step_ms_rounds=plain_ms,
        generate_step_ms=gen_ms,
        configs=rows,
        chosen=chosen,
        measure_s=time.perf_counter() - t_size,
    )
    return record


# --------------------------------------------------------------------------------------------------
# Report


def print_size(size: str, rec: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one size's table, the best tree per acceptance and the sync sites of its widest tree."""
    print(
        f"\n== {size}: {rec['params_b']:.3f}B params, {args.dtype} on {args.device}; plain step "
        f"{rec['plain_step_ms']:.2f} ms (model.generate {rec['generate_step_ms']:.2f} ms/token); "
        f"syncs by {'sync debug mode' if args.sync_count == 'debug' else 'patched host-read counters'} =="
    )
    head = f"{'nodes':>5} {'depth':>5} {'acc':>4} {'tau exp/got':>11} {'cycle ms':>9} {'x plain':>7} {'speedup':>7}"
    head += f" {'<=' + str(args.goal):>6} {'syncs':>5} {'moves':>5} " + " ".join(f"{p[:7]:>7}" for p in PARTS)
    print(head + "  exact")
    for r in rec["configs"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1f}"
        print(
            f"{r['nodes']:>5} {r['depth']:>5} {acc:>4} {r['expected_tau']:>5.2f}/{r['measured_tau']:<5.2f} "
            f"{r['cycle_ms']:>9.2f} {r['cycle_rel']:>7.2f} {r['speedup']:>7.2f} "
            f"{'yes' if r['meets_goal'] else 'NO':>6} "
            f"{r['syncs_per_step']:>5.1f} {r['device_moves_per_step']:>5.1f} "
            + " ".join(f"{r['parts_ms'][p]:>7.2f}" for p in PARTS)
            + f"  {'yes' if r['exact'] else 'first diff at ' + str(r['first_diff'])}"
        )
    for a, best in rec["chosen"].items():
        print(
            f"best tree at acceptance {a}: {best['nodes']} nodes, cycle {best['cycle_rel']:.2f} plain steps, "
            f"speedup {best['speedup']:.2f}, goal {'met' if best['meets_goal'] else 'NOT met'}"
        )
    widest = max(rec["configs"], key=lambda r: r["nodes"])
    print(f"sync sites per step ({widest['nodes']} nodes, acceptance {widest['acceptance']}):")
    for site, n in widest["sync_sites"].items():
        print(f"  {n:5.2f}  {site}")
    print("moves to the device per step (host-to-device copies where the data is on the host):")
    for site, n in widest["host_read_sites"].items():
        if site.endswith(MOVES):
            print(f"  {n:5.2f}  {site}")
    plain = rec["plain_step_syncs"]
    print(
        f"plain step: {plain['syncs_per_step']:.1f} syncs, {plain['device_moves_per_step']:.1f} moves to the device; "
        f"plain greedy continuation equals model.generate: {rec['reference_equals_generate']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options, completed (``--dry-run``, device defaults) and checked (exits with the fix on bad input)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_cycle", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None, help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--sizes", nargs="+", default=list(REAL_SIZES), choices=list(SIZES))
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64], help="tree sizes, root included")
    p.add_argument("--acceptance", nargs="+", type=float, default=[0.0, 0.5, 0.8], help="per-depth acceptance")
    p.add_argument("--shapes", nargs="+", choices=("tree", "chain"), default=["tree"])
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (medians over them)")
    p.add_argument("--cycles", type=int, default=24, help="speculation cycles per run (about)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--sync-count", choices=("auto", "debug", "patch"), default="auto", help="auto: debug on CUDA")
    p.add_argument("--goal", type=float, default=GOAL_CYCLE_STEPS, help="cycle cost goal in plain steps")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--max-minutes", type=float, default=6.0, help="skip the sizes not started by then")
    p.add_argument("--dry-run", action="store_true", help="CPU, fp32, the tiny target, few rounds: seconds")
    p.add_argument("--strict", action="store_true", help="raise instead of recording a size's error")
    p.add_argument("--out", default="runs/gpu_cycle_cost.json")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.dtype, args.sizes, args.strict = "cpu", args.dtype or "float32", ["tiny"], True
        args.nodes, args.rounds, args.cycles, args.prompt_tokens = [1, 4, 8], 3, 8, 16
        args.threads = args.threads or 1
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.sync_count == "auto":
        args.sync_count = "debug" if args.device.startswith("cuda") else "patch"
    import transformers  # heavy import; its version decides whether the decode loop runs at all
    from packaging.version import Version

    if Version(transformers.__version__).release < MIN_TRANSFORMERS:
        p.error(
            f"transformers {transformers.__version__} is older than {'.'.join(map(str, MIN_TRANSFORMERS))}, which "
            "selfspec.decode needs; install that release, or carry its wheel (docs/GPU.md)"
        )
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available: pass --device cpu, or --dry-run for the tiny CPU run")
    if args.sync_count == "debug" and not args.device.startswith("cuda"):
        p.error("--sync-count debug needs CUDA (torch.cuda.set_sync_debug_mode); use patch on a CPU")
    if min(args.nodes) < 1 or args.rounds < 1 or args.cycles < 2 or args.prompt_tokens < 1:
        p.error("--nodes must be >= 1, --rounds >= 1, --cycles >= 2 and --prompt-tokens >= 1")
    if any(not 0.0 <= a <= 1.0 for a in args.acceptance):
        p.error("--acceptance values must lie in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu_cycle [options]``: measure, print, write ``--out``; returns 0."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers  # heavy import; for the report's versions

    t_start = time.perf_counter()
    report: dict[str, Any] = {
        **machine_record(args.device, args.dtype),
        "transformers": transformers.__version__,
        "sync_count": {
            "debug": "torch.cuda.set_sync_debug_mode('warn'), every warning counted",
            "patch": "patched torch.Tensor host reads (" + ", ".join(HOST_READS) + "); moves to a device apart",
        }[args.sync_count],
        "goal_cycle_rel": args.goal,
        "prompt_tokens": args.prompt_tokens,
        "cycles_per_run": args.cycles,
        "rounds": args.rounds,
        "tree_accuracy": TREE_ACCURACY,
        "sizes": {},
    }
    out = Path(args.out)
    for size in args.sizes:
        if (time.perf_counter() - t_start) / 60 > args.max_minutes:
            report["sizes"][size] = {"skipped": f"not started within --max-minutes {args.max_minutes}"}
            print(f"\n== {size}: skipped (past --max-minutes {args.max_minutes}) ==")
            continue
        try:
            report["sizes"][size] = measure_size(size, args, getattr(torch, args.dtype))
        except Exception as err:  # one size's failure must not cost the others' figures
            if args.strict:
                raise
            report["sizes"][size] = {"error": "".join(traceback.format_exception(err))}
            print(f"\n== {size}: failed ==\n{report['sizes'][size]['error']}")
        else:
            print_size(size, report["sizes"][size], args)
        gc.collect()  # the size's target is unreachable now
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        report["total_s"] = time.perf_counter() - t_start
        write_json(out, report)
    print(f"\nwrote {out} ({report['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
