"""``selfspec tune-tree``: size a head's draft tree to this machine.

EAGLE-1/2 and EAGLE-3 heads (both drafted as EAGLE-2 dynamic trees by
:class:`~selfspec.decode.drafters.eagle.EagleDrafter`):

1. Calibrate: decode a few prompts greedily with the largest budget (``--depth-max``,
   ``--total-tokens-max``) and derive the mean tokens per step of every smaller budget
   (:func:`selfspec.decode.tuning.calibration.calibrate_acceptance`); written to ``<heads>/acceptance_profile.json``.
2. Measure (or read from the cache) the target's verification cost by tree size and the head's
   drafting cost by depth on this device / dtype / thread count.
3. Print the budget with the highest expected tokens per second, and the tables it was chosen from.

Medusa heads have no acceptance profile: their static tree is sized from the verification cost profile and the
heads' held-out top-k accuracies (``head_topk_accuracy`` in their ``config.json``, written by training;
:func:`selfspec.decode.tuning.budget.medusa_trees`). For them the command measures (or reads) the
cost profile and prints the node count that ``selfspec.load`` will then choose, with its table; no prompt is
decoded and nothing is written beside the heads.

Afterwards ``selfspec.load(target, heads)`` and ``selfspec bench --heads DIR`` use the chosen budget on
their own (``depth`` / ``total_tokens`` / ``tree_nodes`` default to ``"auto"`` / None); explicit values still win.

Usage::

    selfspec tune-tree --target smollm2-135m-instruct --heads runs/eagle3-smollm2/heads --threads 2
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from selfspec.base.errors import run_command
from selfspec.console import parse_command
from selfspec.decode.drafters.eagle import DEFAULT_TOP_K, EagleDrafter
from selfspec.decode.tuning import budget as tree_budget
from selfspec.decode.tuning import calibration, costs, draft_costs
from selfspec.families import family, registered_families
from selfspec.heads import load_heads
from selfspec.heads.config import HeadFormatError, read_json
from selfspec.prompts import SHAREGPT_HELDOUT, encode_messages, load_prompts, resolve_eos
from selfspec.target import load_target

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec tune-tree`` argument parser."""
    p = argparse.ArgumentParser(
        prog="selfspec tune-tree",
        description="Measure an EAGLE or EAGLE-3 head's acceptance for every tree budget and this machine's "
        "verification cost, write <heads>/acceptance_profile.json and print the fastest budget; for Medusa heads, "
        "print the tree size chosen from the verification cost and the heads' held-out accuracies.",
    )
    p.add_argument("--target", default="smollm2-135m-instruct", help="target name, directory or Hub id")
    p.add_argument("--heads", required=True, metavar="DIR", help="head directory (save_pretrained output)")
    p.add_argument(
        "--prompts",
        default=SHAREGPT_HELDOUT,
        help="MT-bench/Spec-Bench JSONL file (first turns are used), or 'sharegpt-heldout' (the split "
        "held out by the run that trained the head, from its training_record.json)",
    )
    p.add_argument("--n-prompts", type=int, default=8, help="prompts to decode")
    p.add_argument(
        "--skip-prompts", type=int, default=0, help="skip the first N prompts (e.g. those a later bench measures)"
    )
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument(
        "--depth-max", type=int, default=calibration.CALIBRATION_DEPTH_MAX, help="largest draft depth in the table"
    )
    p.add_argument(
        "--total-tokens-max",
        type=int,
        default=calibration.CALIBRATION_TOTAL_TOKENS_MAX,
        help="largest total_tokens in the table",
    )
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="EAGLE-2 expansions per node (profiled as given)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (use what decoding will use)")
    p.add_argument("--refresh-cost", action="store_true", help="measure the costs again even if cached")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``selfspec tune-tree ...``: returns 0 on success, 2 on bad arguments."""
    parser = build_parser()
    args = parse_command(parser, argv)
    if min(args.n_prompts, args.max_new_tokens, args.depth_max, args.total_tokens_max, args.top_k) < 1:
        parser.error("--n-prompts, --max-new-tokens, --depth-max, --total-tokens-max and --top-k must be >= 1")
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be >= 2 (the first token comes from prefill, not from a draft)")
    heads_dir = Path(args.heads)
    try:
        head_type = read_json(heads_dir / "config.json").get("head_type")
    except HeadFormatError as err:
        parser.error(str(err))
    tunable = [name for name in registered_families() if family(name).tree_tuning is not None]
    try:
        record = family(head_type)
    except (HeadFormatError, ValueError):
        parser.error(f"{heads_dir} holds {head_type!r} heads; tune-tree sizes the trees of {tunable} heads")
    if record.tree_tuning is None:
        parser.error(
            f"{heads_dir} holds {record.title} heads, whose tree selfspec.load sizes by itself (block heads: from the "
            "held-out chain acceptance saved with them, heldout_chain, and this machine's verification costs); "
            f"there is no tree to tune. tune-tree sizes the trees of {tunable} heads"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    if record.tree_tuning == "head_accuracy":
        return _medusa(parser, args, heads_dir)
    prompts = load_prompts(args.prompts, head_dirs=[heads_dir])[args.skip_prompts : args.skip_prompts + args.n_prompts]
    if not prompts:
        parser.error(f"no prompts left in {args.prompts} after skipping {args.skip_prompts}")
    target, tokenizer = load_target(args.target, dtype=args.dtype, device=args.device)
    device = next(target.parameters()).device
    head = load_heads(heads_dir, target=target).to(device=device, dtype=next(target.parameters()).dtype).eval()
    try:
        drafter = EagleDrafter(head, target, args.depth_max, args.top_k, args.total_tokens_max)
    except ValueError as err:
        parser.error(str(err))
    ids = [encode_messages(tokenizer, p.first_turn_messages()).to(device) for p in prompts]
    eos = resolve_eos(target, tokenizer)  # the stop ids decoding uses (SpeculativeModel.default_eos)
    logger.info(
        "calibrating on %d prompts, %d new tokens each, budget up to depth %d / total_tokens %d ...",
        len(ids),
        args.max_new_tokens,
        args.depth_max,
        args.total_tokens_max,
    )
    profile = calibration.calibrate_acceptance(
        target,
        drafter,
        ids,
        max_new_tokens=args.max_new_tokens,
        total_tokens_max=args.total_tokens_max,
        depth_max=args.depth_max,
        eos_token_id=eos,
    )
    path = calibration.save_acceptance_profile(profile, heads_dir)
    cost = costs.get_cost_profile(target, refresh=args.refresh_cost)
    draft = draft_costs.get_draft_cost(drafter, target, range(1, args.depth_max + 1), refresh=args.refresh_cost)
    budget = tree_budget.choose_tree(cost, tree_budget.eagle_trees(profile, draft))
    shape = budget.shape
    print(f"acceptance profile: {path} ({profile.steps} steps over {profile.prompts} prompts, top_k {profile.top_k})")
    inexact = sum(map(sum, profile.inexact_steps))
    if inexact:
        print(f"  {inexact} (budget, step) cells are lower bounds: their trees keep candidates the big tree dropped")
    chosen = (
        f"chosen: depth {shape.depth}, total_tokens {shape.tokens}, top_k {shape.top_k}: expected tau "
        f"{budget.expected_tau:.2f}, {budget.expected_cycle_ms:.1f} ms a step vs {budget.plain_step_ms:.1f} ms a "
        f"plain step, expected speedup {budget.expected_speedup:.2f}x"
    )
    draft_line = "draft cost by depth (ms): " + ", ".join(f"{d}: {v:.1f}" for d, v in sorted(draft.items()))
    _print_choice(cost, target, draft_line, tree_budget.tree_table_text(budget), chosen, budget.expected_speedup)
    return 0


def _medusa(parser: argparse.ArgumentParser, args: argparse.Namespace, heads_dir: Path) -> int:
    """The Medusa tree size ``selfspec.load`` chooses here (:func:`~.tuning.budget.medusa_trees` by the one chooser,
    over the cached or measured verification cost), printed with its table. Exits 2 for heads without accuracies."""
    target, _ = load_target(args.target, dtype=args.dtype, device=args.device)
    heads = load_heads(heads_dir, target=target)
    accuracy = heads.config.head_topk_accuracy
    if not accuracy:
        parser.error(
            f"{heads_dir}: Medusa trees are sized from the heads' held-out top-k accuracies (head_topk_accuracy in "
            "config.json, measured by `selfspec train` on its held-out split) and this machine's verification cost; "
            "these heads have none (made or imported elsewhere?), so decoding uses the default tree. Pass "
            "tree_nodes=N or tree=[...] to selfspec.load, or train the heads with `selfspec train`"
        )
    cost = costs.get_cost_profile(target, refresh=args.refresh_cost)
    size = tree_budget.choose_tree(cost, tree_budget.medusa_trees(accuracy))
    chosen = (
        f"chosen: Medusa tree of {size.shape.nodes} nodes: expected tau {size.expected_tau:.2f}, "
        f"{size.expected_cycle_ms:.1f} ms a step vs {cost.plain_step_ms:.1f} ms a plain step, expected speedup "
        f"{size.expected_speedup:.2f}x (selfspec.load and selfspec bench size the tree this way by themselves)"
    )
    _print_choice(cost, target, None, tree_budget.tree_table_text(size), chosen, size.expected_speedup)
    return 0


def _print_choice(
    cost: costs.CostProfile, target, draft_line: str | None, table: str, chosen: str, speedup: float
) -> None:
    """The verification cost table (ms by tree nodes) and where it is cached, the drafting cost (EAGLE), the
    expected tau / speedup table, the chosen tree and a note when even it is slower than plain decoding."""
    print(
        f"verification cost ({cost.device}, {cost.dtype}, {cost.threads} threads; cached in "
        f"{costs.cost_profile_path(target)}):"
    )
    print("  nodes " + " ".join(f"{n:>7}" for n in cost.node_counts))
    print("  ms    " + " ".join(f"{v:>7.1f}" for v in cost.verify_ms))
    if draft_line is not None:
        print(draft_line)
    print()
    print(table)
    print(chosen)
    if speedup < 1.0:
        print("note: no tree is expected to beat plain decoding on this machine with these heads")


if __name__ == "__main__":
    sys.exit(run_command("selfspec tune-tree", main, sys.argv[1:]))
