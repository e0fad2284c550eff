"""``selfspec adapt HEADS --prompts FILE --out DIR``: heads that learn the user's work, from a prompt file.

A user serves one model on one kind of work; data like the work moves acceptance where more of other data does
not (self-distilled in-domain data took an EAGLE-3 head's GSM8K tau from 1.72 to 2.85 in SpecForge's SpecBundle,
and a warm start keeps what the head knew: the speculators regression tests, DESIGN notes in docs/ARCHITECTURE.md).
So adaptation is training with three changes, all of them the training layer's own pieces:

1. the data is the user's prompts only (:func:`selfspec.train.data.load_prompt_file`: MT-bench / Spec-Bench turns,
   ShareGPT or OpenAI conversations, or plain text), and the target writes the answers (self-distillation, greedy:
   the answers the target serves);
2. training starts from the given heads (``init_heads``, :mod:`selfspec.train.warm_start`) with the family's shipped
   recipe (``configs/<family>-smollm2.yaml``) at a fine-tuning learning rate, budgeted by trained tokens and / or
   minutes;
3. a hash-chosen share of the prompts is held out, the head is evaluated on it before the first step and every few
   steps, and the head saved is the one of the highest held-out chain tau estimate, the start included: on its
   held-out prompts an adapted head never ranks below the head it started from.

Everything is checked before any work, before the target loads and before DIR is created (every option against
its range, an empty prompt file, a file of unknown layout, prompts longer than the target's context, heads of
another target, a budget of 0, and a DIR whose ``heads`` or ``run`` would be, hold or lie inside the input heads).
The input heads are only read; the run's work lives in ``DIR/run`` (the answers, the features, the checkpoints), so a
killed run resumes with the same command; the adapted heads are written there and moved to ``DIR/heads`` (replacing
an older one as a whole) only when complete, their record included. ``DIR/heads/adaptation.json`` records the
adaptation (prompt and token counts, budget, hashes of the prompts and of the heads it started from): no text and
no paths, and the training record names the prompts by their hash, so the heads can be pushed or exported as they
are.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from selfspec.base.errors import UserError
from selfspec.base.files import check_fields, in_range, replace_dir, write_json
from selfspec.base.target import load_target
from selfspec.decode.drafters.base import context_length
from selfspec.heads import load_heads
from selfspec.heads.hub import resolve_head_dir
from selfspec.heads.io import ADAPTATION_NAME as ADAPTATION_FILE
from selfspec.heads.io import HeadFormatError
from selfspec.train.config import TrainConfig, load_config
from selfspec.train.data import load_prompt_file

logger = logging.getLogger(__name__)

ADAPTATION_FORMAT = "selfspec-adaptation"


@dataclasses.dataclass(frozen=True)
class AdaptResult:
    """What an adaptation did.

    Attributes:
        heads_dir: the adapted heads (``<out>/heads``).
        record: the adaptation record written beside them (:data:`ADAPTATION_FILE`; layout in :func:`adapt`).
    """

    heads_dir: Path
    record: dict[str, Any]

    @property
    def before(self) -> dict[str, Any]:
        """Held-out ``{"acceptance": [a_1, ..], "chain_tau": float}`` of the heads it started from."""
        return self.record["heldout"]["before"]

    @property
    def after(self) -> dict[str, Any]:
        """The same for the adapted heads."""
        return self.record["heldout"]["after"]


def family_config(family: str) -> Path | None:
    """The shipped config of a head family (``selfspec.configs/<family>-smollm2.yaml``), whose recipe options an
    adaptation uses; None when the package ships none for it."""
    path = Path(str(resources.files("selfspec.configs") / f"{family}-smollm2.yaml"))
    return path if path.is_file() else None


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


RUN_DIR = "run"  # <out>/run: the run's answers, features and checkpoints (a killed run resumes from it)


@dataclasses.dataclass(frozen=True)
class AdaptOptions:
    """The options of :func:`adapt` (``selfspec adapt``'s flags), each checked against its range on construction,
    before any work.

    Raises:
        UserError: an option of another type or out of its range, named as its flag, with its range; no budget.
    """

    tokens: int | None = in_range(None, ge=1, unset="no token budget")
    minutes: float | None = in_range(None, gt=0, unset="no time budget")
    lr: float = in_range(5e-4, gt=0, le=1)
    max_new_tokens: int = in_range(256, ge=1)
    heldout_fraction: float = in_range(0.2, gt=0, lt=1)
    threads: int | None = in_range(None, ge=1, unset="torch's default")
    seed: int = in_range(0, ge=0)
    overrides: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        try:
            check_fields(self, lambda name: "overrides" if name == "overrides" else f"--{name.replace('_', '-')}")
        except ValueError as err:
            raise UserError(str(err)) from err
        bad = [item for item in self.overrides if "=" not in item or item.startswith("=")]
        if bad:
            raise UserError(f"training overrides are key=value items (eagle3.ttt_steps=2), got {bad[0]!r}")
        if self.tokens is None and self.minutes is None:
            raise UserError("give a budget: --tokens N (trained tokens) and / or --minutes M (training wall time)")


def check_out(head_dir: Path, out: Path) -> None:
    """Refuse an ``out`` that would write over the input heads: ``out/heads`` (where the adapted heads go) and
    ``out/run`` (where the run works) must neither be the input heads' directory, nor hold it, nor lie inside it
    (paths resolved, so links and ``..`` do not hide it).

    Raises:
        UserError: the message names both paths and the fix.
    """
    source = head_dir.resolve()
    for name in ("heads", RUN_DIR):
        written = (out / name).resolve()
        if written == source:
            how = "is"
        elif source.is_relative_to(written):
            how = "holds"
        elif written.is_relative_to(source):
            how = "lies inside"
        else:
            continue
        raise UserError(
            f"--out {out} would write {written}, which {how} the input heads {source}: pass another --out "
            "(the input heads are only read, never written over)"
        )


def _check_lengths(prompts: list[dict], tokenizer: Any, context: int | None, path: str) -> int:
    """The longest rendered prompt in tokens; prompts that leave no room in the target's context are an error."""
    texts = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False) for p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if context is not None:
        over = [i for i, n in enumerate(lengths, start=1) if n >= context]
        if over:
            raise ValueError(
                f"{len(over)} prompt(s) of {path} are longer than the target's context of {context} tokens (the first "
                f"is prompt {over[0]}, {lengths[over[0] - 1]} tokens): shorten or drop them"
            )
    return max(lengths)


def adapt(
    heads: str | Path,
    prompts: str | Path,
    out: str | Path,
    *,
    tokens: int | None = None,
    minutes: float | None = None,
    target: str | None = None,
    lr: float = 5e-4,
    max_new_tokens: int = 256,
    heldout_fraction: float = 0.2,
    threads: int | None = None,
    seed: int = 0,
    overrides: tuple[str, ...] = (),
) -> AdaptResult:
    """Adapt ``heads`` to the work of a prompt file (see the module docstring for the method).

    Args:
        heads: a head directory or Hub id of any family that trains (EAGLE-3, EAGLE, Medusa, DFlash, DSpark).
        prompts: the user's prompts (:data:`selfspec.train.data.PROMPT_LAYOUTS`).
        out: the run directory; the adapted heads go to ``<out>/heads``.
        tokens / minutes: the budget: trained tokens and / or wall minutes of training (at least one, > 0).
        target: the target (default: the one the heads name); its fingerprint must be the heads'.
        lr: the peak learning rate (a fine-tuning rate, below the from-scratch recipes').
        max_new_tokens: the longest answer the target writes per prompt.
        heldout_fraction: the share of prompts held out for selection (chosen by a hash of each prompt).
        threads: torch threads (None: torch's default).
        overrides: further ``key=value`` training overrides (:func:`selfspec.train.config.load_config`).

    Returns:
        :class:`AdaptResult`; the record (``<out>/heads/adaptation.json``) holds ``format``, ``version``, ``family``,
        ``from_heads`` (the hash of the heads' weights and their target fingerprint), ``prompts`` /
        ``train_prompts`` / ``heldout_prompts`` (counts), ``answer_tokens`` (self-distilled), ``trained_tokens``,
        ``train_s``, ``budget`` (``tokens``, ``minutes``), ``prompts_sha256`` and ``heldout`` (``before`` /
        ``after``: held-out acceptance by position and chain tau estimate).

    Raises:
        ValueError: an option out of its range (:class:`AdaptOptions`) or no budget, an ``out`` that would write
            over the input heads (:func:`check_out`), an empty prompt file or one of unknown layout, prompts longer
            than the target's context, a family that cannot train, a bad training override.
        HeadFormatError: heads that are missing, corrupt, or of another target.
        FileNotFoundError: no such prompt file.
    """
    from selfspec.train.__main__ import run

    AdaptOptions(tokens, minutes, lr, max_new_tokens, heldout_fraction, threads, seed, tuple(overrides))
    conversations = load_prompt_file(prompts)
    head_dir = resolve_head_dir(heads)
    out_dir = Path(out).expanduser()
    check_out(head_dir, out_dir)
    saved = load_heads(head_dir)
    family = str(saved.config.head_type)
    target_name = target or saved.config.target
    if not target_name:
        raise ValueError(f"{head_dir} names no target: pass --target")
    run_dir = out_dir / RUN_DIR
    data = run_dir / "prompts.jsonl"

    def settings(max_length: int) -> list[str]:
        return [
            f"head={family}",
            f"target={target_name}",
            f"init_heads={head_dir}",
            f"data={data}",
            f"max_conversations={len(conversations)}",
            f"eval_fraction={heldout_fraction}",
            f"max_length={max_length}",
            "self_distill=true",
            f"distill_conversations={len(conversations)}",
            f"distill_eval_conversations={len(conversations)}",  # every held-out prompt is answered and evaluated
            "original_conversations=0",
            f"distill_max_new_tokens={max_new_tokens}",
            f"distill_dir={run_dir / 'distill'}",
            f"output_dir={run_dir}",
            f"max_train_tokens={'null' if tokens is None else tokens}",
            f"max_train_minutes={'null' if minutes is None else minutes}",
            "epochs=1000",
            f"lr={lr}",
            "warmup_steps=5",
            "eval_every=10",
            "save_every=10",
            f"seed={seed}",
            f"threads={'null' if threads is None else threads}",
            *overrides,
        ]

    load_config(family_config(family), settings(512))  # the overrides and the recipe, before the target loads
    model, tokenizer = load_target(target_name)
    try:
        load_heads(head_dir, model)  # the fingerprint, before any work
    except HeadFormatError as err:
        raise HeadFormatError(f"{err} (pass --target for the target these heads were trained on)") from err
    context = context_length(model)
    longest = _check_lengths(conversations, tokenizer, context, str(prompts))
    del model
    run_dir.mkdir(parents=True, exist_ok=True)
    # the OpenAI layout, each prompt followed by the empty answer that self-distillation writes (never trained on as
    # it is: every conversation is regenerated)
    slots = [{**c, "messages": [*c["messages"], {"role": "assistant", "content": ""}]} for c in conversations]
    data.write_text("".join(json.dumps(c) + "\n" for c in slots))
    max_length = max(512, longest + max_new_tokens + 8)
    if context is not None:
        max_length = min(max_length, context)
    cfg: TrainConfig = load_config(family_config(family), settings(max_length))
    t0 = time.perf_counter()
    staged = run(cfg)  # <out>/run/heads
    summary = json.loads((run_dir / "train_summary.json").read_text())
    record = adaptation_record(cfg, saved.config, head_dir, conversations, run_dir, summary, tokens, minutes)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(staged / ADAPTATION_FILE, record)
    anonymise_training_record(staged, record["prompts_sha256"])
    return AdaptResult(replace_dir(staged, out_dir / "heads"), record)  # in place only when complete


def adaptation_record(
    cfg: TrainConfig,
    head_config: Any,
    head_dir: Path,
    conversations: list[dict],
    out_dir: Path,
    summary: dict[str, Any],
    tokens: int | None,
    minutes: float | None,
) -> dict[str, Any]:
    """The adaptation record (layout: :func:`adapt`): counts, budget and hashes, no text and no paths."""
    from selfspec.train.data import split_conversations

    train, held = split_conversations(conversations, eval_fraction=cfg.eval_fraction, seed=cfg.seed)
    answers = [
        json.loads(line)
        for f in sorted(Path(cfg.distill_dir or out_dir / "distill").glob("*.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    answer_chars = sum(len(m["content"]) for a in answers for m in a["messages"] if m["role"] == "assistant")

    def estimate(info: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if info is None else {"acceptance": info["acceptance"], "chain_tau": info["chain_tau"]}

    weights = b"".join(p.read_bytes() for p in sorted(head_dir.glob("*.safetensors")))
    return {
        "format": ADAPTATION_FORMAT,
        "version": 1,
        "mode": "prompts",
        "family": str(head_config.head_type),
        "from_heads": {"weights_sha256": _digest(weights), "target_fingerprint": head_config.target_fingerprint},
        "prompts": len(conversations),
        "train_prompts": len(train),
        "heldout_prompts": len(held),
        "answers": len(answers),
        "answer_chars": answer_chars,
        "trained_tokens": summary["trained_tokens"],
        "train_s": summary["train_s"],
        "stopped_by": summary["stopped_by"],
        "budget": {"tokens": tokens, "minutes": minutes},
        "prompts_sha256": _digest(json.dumps([c["messages"] for c in conversations], sort_keys=True).encode()),
        "heldout": {"before": estimate(summary.get("initial")), "after": estimate(summary.get("selected"))},
    }


def anonymise_training_record(heads_dir: Path, prompts_hash: str) -> None:
    """The training record of adapted heads names its data by the prompts' hash, not by a path."""
    from selfspec.train.record import RECORD_FILE

    path = heads_dir / RECORD_FILE
    record = json.loads(path.read_text())
    record["data"] = f"prompts {prompts_hash}"
    write_json(path, record)


def _line(values: list[float] | None) -> str:
    return "-" if not values else " ".join(f"{v:.3f}" for v in values)


def report(result: AdaptResult) -> str:
    """The lines ``selfspec adapt`` prints: counts, budget, held-out acceptance and chain tau before and after."""
    r, before, after = result.record, result.before or {}, result.after or {}
    return "\n".join(
        [
            f"adapted {r['family']} heads on {r['prompts']} prompts ({r['train_prompts']} trained on, "
            f"{r['heldout_prompts']} held out): {r['trained_tokens']:,} tokens trained in {r['train_s']:.0f} s "
            f"(stopped by {r['stopped_by']}), {r['wall_s']:.0f} s in all",
            f"held-out acceptance by position  before {_line(before.get('acceptance'))}  after "
            f"{_line(after.get('acceptance'))}",
            f"held-out chain tau estimate      before {before.get('chain_tau', 0):.3f}  after "
            f"{after.get('chain_tau', 0):.3f}",
            f"heads: {result.heads_dir}",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``selfspec adapt`` argument parser."""
    p = argparse.ArgumentParser(
        prog="selfspec adapt",
        description="Adapt draft heads to the work of a prompt file: the target answers the prompts, the heads train "
        "from where they are on those answers, and the head of the best held-out acceptance is kept.",
    )
    p.add_argument("heads", help="head directory or Hub id (EAGLE-3, EAGLE, Medusa, DFlash or DSpark)")
    p.add_argument("--prompts", required=True, help="prompt file: MT-bench JSONL, ShareGPT / OpenAI JSON(L), or text")
    p.add_argument("--out", required=True, help="run directory; the adapted heads go to OUT/heads")
    p.add_argument("--tokens", type=int, default=None, help="budget in trained tokens")
    p.add_argument("--minutes", type=float, default=None, help="budget in minutes of training")
    p.add_argument("--target", default=None, help="target (default: the one the heads name)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (default 5e-4)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest answer the target writes per prompt")
    p.add_argument("--heldout-fraction", type=float, default=0.2, help="share of prompts held out for selection")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="key=value training overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    """``selfspec adapt``: prints :func:`report`.

    Raises:
        UserError: bad input, before any work (the ``selfspec`` command prints it as one line on stderr and exits
            with 2); the options and ``--out`` are checked before anything is logged or written.
    """
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    options = vars(args)  # every flag is the keyword of adapt() of the same name
    where = [options.pop(name) for name in ("heads", "prompts", "out")]
    options["overrides"] = tuple(options["overrides"])
    target = options.pop("target")
    AdaptOptions(**options)
    heads = Path(where[0]).expanduser()
    if heads.is_dir():  # a Hub id is checked once resolved, in adapt()
        check_out(heads, Path(where[2]).expanduser())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        result = adapt(*where, target=target, **options)
    except UserError:
        raise
    except (ValueError, FileNotFoundError) as err:  # the heads, the prompts, the target: all the user's input
        raise UserError(str(err)) from err
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
