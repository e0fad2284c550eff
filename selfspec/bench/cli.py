"""``selfspec bench ...``: arguments, prompts, target and methods, then the run and its outputs."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from selfspec.api import SpeculativeModel, make_verifier, plan_drafter
from selfspec.base.files import write_json
from selfspec.bench.batched import run_batch_bench, write_batch_report
from selfspec.bench.methods import BUILTIN_METHODS, DEFAULT_METHODS, BenchSettings, eagle_kwargs
from selfspec.bench.outputs import summary_text, write_report
from selfspec.console import parse_command
from selfspec.engines.registry import DEFAULT_ENGINE, EngineRun, engine, registered_engines
from selfspec.export.common import ExportError
from selfspec.prompts import SHAREGPT_HELDOUT, load_prompts
from selfspec.target import load_target

logger = logging.getLogger(__name__)

# The flags whose values are the BenchSettings fields of the same name (--target and --prompts are recorded as
# target_name and prompts_source).
SETTINGS_FLAGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "seed",
    "warmup",
    "max_prompt_tokens",
    "tree_nodes",
    "draft_model",
)


def parse_heads(items: Sequence[str]) -> dict[str, str]:
    """``DIR`` or ``NAME=DIR`` -> {name: dir}. A bare ``.../heads`` directory is named after its parent.

    Raises:
        ValueError: an empty name, or one already taken (by another head or a built-in method).
    """
    heads: dict[str, str] = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep:
            directory = item
            path = Path(item.rstrip("/"))
            name = path.parent.name if path.name == "heads" and path.parent.name else path.name
        if not name or name in heads or name in BUILTIN_METHODS:
            raise ValueError(f"head method name {name!r} (from {item!r}) is empty or taken; pass NAME=DIR")
        heads[name] = directory
    return heads


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="selfspec bench",
        description="Speedup, tau and exactness of selfspec methods against plain transformers generate, "
        "measured in one process, methods interleaved per prompt.",
    )
    p.add_argument(
        "--prompts",
        default=SHAREGPT_HELDOUT,
        help="MT-bench/Spec-Bench JSONL file, or 'sharegpt-heldout' (the split held out by the run "
        "that trained the first --heads, from its training_record.json)",
    )
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, directory or Hub id")
    p.add_argument(
        "--heads", nargs="*", default=[], metavar="DIR", help="head directories (or NAME=DIR), one method each"
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=BUILTIN_METHODS,
        help=f"built-in methods (default: {' '.join(DEFAULT_METHODS)}, plus draft_model with "
        "--draft-model); baseline always runs",
    )
    p.add_argument(
        "--draft-model", default=None, help="small causal LM with the target's tokenizer (draft_model method)"
    )
    p.add_argument(
        "--suffix-index",
        default=None,
        metavar="PATH",
        help="with --methods ... hybrid: also run hybrid_suffix, the hybrid with a suffix index of training "
        "answers as a second n-gram source (a JSONL of conversations, or an index saved as .safetensors)",
    )
    p.add_argument(
        "--eagle-depth",
        type=_int_or_auto,
        default=None,
        help="EAGLE-2 tree depth, or 'auto' (default): sized to this machine when the head has an "
        "acceptance profile (selfspec tune-tree), else selfspec's default",
    )
    p.add_argument("--eagle-top-k", type=int, default=None, help="EAGLE-2 expansions per node")
    p.add_argument(
        "--eagle-total-tokens",
        type=_int_or_auto,
        default=None,
        help="EAGLE-2 draft tokens kept per step, or 'auto' (default; see --eagle-depth)",
    )
    p.add_argument(
        "--tree-nodes",
        type=int,
        default=None,
        help="tree size for Medusa heads (default: sized to this machine from the heads' accuracies)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--num-prompts", type=int, default=None, help="first N questions (default: all)")
    p.add_argument("--max-turns", type=int, default=None, help="answer only the first N turns (1: first turns)")
    p.add_argument("--per-category", type=int, default=None, help="first N questions of each category")
    p.add_argument("--max-prompt-tokens", type=int, default=2048, help="skip longer prompt turns")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="prompts run untimed by every method first")
    p.add_argument(
        "--batch-size",
        type=int,
        nargs="+",
        default=None,
        metavar="B",
        help="measure total tokens/s of batched decoding at these batch sizes instead (e.g. 1 4 16): plain "
        "generate vs each head and prompt_lookup with the batch tree rule, heads also with their fixed tree; "
        "writes batch_report.json/.md",
    )
    names = registered_engines()
    p.add_argument(
        "--engine",
        choices=names,
        default=DEFAULT_ENGINE,
        help="; ".join(engine(name).help for name in names),
    )
    for name in names:
        for option in engine(name).options:
            p.add_argument(option.flag, **option.kwargs)
    swept = [engine(name).title for name in names if engine(name).sweep]
    p.add_argument(
        "--fresh-sweep",
        action="store_true",
        help=f"engines that sweep their settings once per machine ({', '.join(swept)}): sweep again, ignoring "
        "the cache",
    )
    p.add_argument(
        "--stream",
        action="store_true",
        help="serve the prompts in order as a stream with the first --heads: no drafts, the frozen head, the head "
        "adapting online and the hybrid with the served history, tau and speed per window (selfspec.bench.stream)",
    )
    p.add_argument("--window", type=int, default=10, help="--stream: requests per window")
    p.add_argument(
        "--stream-methods",
        nargs="*",
        default=["no_draft", "head", "online", "hybrid_history"],
        help="--stream: which of no_draft (always run), head, online, hybrid, hybrid_history",
    )
    p.add_argument(
        "--online-share",
        type=float,
        default=0.3,
        help="--stream: the online head's training share of the CPU seconds (OnlineOptions.cpu_share)",
    )
    p.add_argument("--out", default="runs/bench", help="directory for report.json, report.md and PNG plots")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``selfspec bench ...``: returns 0 on success, 2 on bad arguments."""
    parser = build_parser()
    args = parse_command(parser, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        heads = parse_heads(args.heads)
        settings = BenchSettings(
            **{name: vars(args)[name] for name in SETTINGS_FLAGS}, target_name=args.target, prompts_source=args.prompts
        )
    except ValueError as err:
        parser.error(str(err))
    methods = args.methods or list(DEFAULT_METHODS) + (["draft_model"] if args.draft_model else [])
    prompts = load_prompts(
        args.prompts, args.num_prompts, args.max_turns, args.per_category, head_dirs=list(heads.values())
    )
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    if args.stream:
        return _stream_main(parser, args, heads, prompts, target, tokenizer)
    if args.batch_size:
        return _batch_main(parser, args, heads, methods, prompts, settings, target, tokenizer)
    record = engine(args.engine)
    if args.methods and not record.takes_methods:
        parser.error(f"--methods names selfspec methods; with --engine {record.name} use --heads")
    why = record.missing()
    if why:
        parser.error(f"--engine {record.name}: {why}")
    run = EngineRun(target, tokenizer, prompts, settings, args.target, heads, args.threads, vars(args))
    try:
        output = record.bench(run)
    except (ValueError, ExportError) as err:
        parser.error(str(err))
    except RuntimeError as err:  # the engine failed to load or decode: its message and log
        print(f"selfspec bench: {err}", file=sys.stderr)
        return 1
    extra = [write_json(Path(args.out) / file, data) for file, data in output.records.items()]
    return _report_out(output.report, args.out, *extra)


def _report_out(report, out: str, *extra: Path) -> int:
    """Write the report's files into ``out``, print its summary and what was written (``extra``: files an engine
    wrote beside it); the exit status 0."""
    paths = [*write_report(report, out).values(), *extra]
    print(summary_text(report))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _stream_main(parser, args, heads, prompts, target, tokenizer) -> int:
    """``--stream``: :func:`selfspec.bench.stream.run_stream` with the first head, greedy, first turns."""
    from selfspec.bench.stream import build_stream_models, run_stream, stream_markdown, write_stream
    from selfspec.train.online import OnlineOptions

    if not heads or args.temperature or args.window < 1 or not 0.0 < args.online_share < 1.0:
        parser.error(
            "--stream needs --heads (the first is streamed), greedy decoding, --window >= 1, --online-share in (0, 1)"
        )
    methods = ["no_draft", *(m for m in args.stream_methods if m != "no_draft")]
    try:
        models = build_stream_models(
            target, tokenizer, next(iter(heads.values())), methods, OnlineOptions(cpu_share=args.online_share)
        )
    except ValueError as err:
        parser.error(str(err))
    report = run_stream(models, prompts, args.window, args.max_new_tokens)
    paths = write_stream(report, args.out)
    print(stream_markdown(report))
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _batch_main(parser, args, heads, methods, prompts, settings, target, tokenizer) -> int:
    """``--batch-size``: the batched bench (:func:`selfspec.bench.batched.run_batch_bench`)."""
    eagle_options = {"depth": args.eagle_depth, "top_k": args.eagle_top_k, "total_tokens": args.eagle_total_tokens}
    try:
        plans = {
            name: plan_drafter(target, heads=head, tree_nodes=args.tree_nodes, **eagle_kwargs(head, eagle_options))
            for name, head in heads.items()
        }
        if "prompt_lookup" in methods:
            plans["prompt_lookup"] = plan_drafter(target, prompt_lookup=True)
        verifier = make_verifier(target, next(iter(plans.values())).drafter)
        models = {
            name: SpeculativeModel(target, tokenizer, p.drafter, verifier, p.tree_budget) for name, p in plans.items()
        }
        report = run_batch_bench(target, tokenizer, models, prompts, settings, args.batch_size, fixed=list(heads))
    except ValueError as err:
        parser.error(str(err))
    paths = write_batch_report(report, args.out)
    print(paths[1].read_text())
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
