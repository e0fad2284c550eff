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

Everything is checked before any work (an empty prompt file, a file of unknown layout, prompts longer than the
target's context, heads of another target, a budget of 0). The input heads are only read; the run lives in DIR
(``DIR/heads`` the adapted heads, ``DIR/distill`` the answers, ``DIR/checkpoint``), so a killed run resumes with the
same command. ``DIR/heads/adaptation.json`` records the adaptation (prompt and token counts, budget, hashes of the
prompts and of the heads it started from): no text and no paths, and the training record names the prompts by
their hash, so the heads can be pushed or exported as they are.
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

from selfspec.base.files import write_json
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


def _check_budget(tokens: int | None, minutes: float | None) -> None:
    if tokens is None and minutes is None:
        raise ValueError("give a budget: --tokens N (trained tokens) and / or --minutes M (training wall time)")
    if (tokens is not None and tokens <= 0) or (minutes is not None and minutes <= 0):
        raise ValueError(f"a budget must be positive (got tokens={tokens}, minutes={minutes}): nothing would train")


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
        ValueError: no budget or a budget of 0, an empty prompt file or one of unknown layout, prompts longer than
            the target's context, a family that cannot train.
        HeadFormatError: heads that are missing, corrupt, or of another target.
        FileNotFoundError: no such prompt file.
    """
    from selfspec.train.__main__ import run

    _check_budget(tokens, minutes)
    conversations = load_prompt_file(prompts)
    head_dir = resolve_head_dir(heads)
    saved = load_heads(head_dir)
    family = str(saved.config.head_type)
    target_name = target or saved.config.target
    if not target_name:
        raise ValueError(f"{head_dir} names no target: pass --target")
    model, tokenizer = load_target(target_name)
    try:
        load_heads(head_dir, model)  # the fingerprint, before any work
    except HeadFormatError as err:
        raise HeadFormatError(f"{err} (pass --target for the target these heads were trained on)") from err
    context = context_length(model)
    longest = _check_lengths(conversations, tokenizer, context, str(prompts))
    del model
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / "prompts.jsonl"
    # the OpenAI layout, each prompt followed by the empty answer that self-distillation writes (never trained on as
    # it is: every conversation is regenerated)
    slots = [{**c, "messages": [*c["messages"], {"role": "assistant", "content": ""}]} for c in conversations]
    data.write_text("".join(json.dumps(c) + "\n" for c in slots))
    max_length = max(512, longest + max_new_tokens + 8)
    if context is not None:
        max_length = min(max_length, context)
    settings = [
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
        f"distill_dir={out_dir / 'distill'}",
        f"output_dir={out_dir}",
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
    cfg: TrainConfig = load_config(family_config(family), settings)
    t0 = time.perf_counter()
    adapted = run(cfg)
    summary = json.loads((out_dir / "train_summary.json").read_text())
    record = adaptation_record(cfg, saved.config, head_dir, conversations, out_dir, summary, tokens, minutes)
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(adapted / ADAPTATION_FILE, record)
    anonymise_training_record(adapted, record["prompts_sha256"])
    return AdaptResult(adapted, record)


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
    """``selfspec adapt``: prints :func:`report`; bad input exits 2 with the reason before any work."""
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        options = vars(args)  # every flag is the keyword of adapt() of the same name
        where = [options.pop(name) for name in ("heads", "prompts", "out")]
        result = adapt(*where, **{**options, "overrides": tuple(options["overrides"])})
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
