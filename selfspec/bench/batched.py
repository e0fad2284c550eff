"""``selfspec bench --batch-size 1 4 16``: total tokens/s of batched decoding, with and without speculation.

For each batch size B the first turns are taken B at a time (consecutive groups, a ragged batch each) and
every method decodes every group, methods interleaved group by group (the order rotated) so that load
changes on a busy machine shift every method alike:

* ``plain``: ``transformers`` ``generate`` on the left-padded batch (its attention mask), greedy;
* each selfspec method with the batch tree rule (``batch_tree="auto"``: the tree sized to the batch from
  this machine's measured costs, speculation off where it does not pay);
* each head method also with its own tree at every batch size (``batch_tree="fixed"``), to show what
  the rule changes.

Tokens count up to and including each row's EOS. Total tokens/s = all rows' new tokens / wall seconds of
all groups. The report (``batch_report.json``, ``batch_report.md``) also lists the rule's choice at every
batch size (:meth:`~selfspec.api.SpeculativeModel.batch_tree_rule`).
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.prompts import encode_messages

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from selfspec.api import SpeculativeModel
    from selfspec.bench.methods import BenchSettings
    from selfspec.prompts import BenchPrompt

logger = logging.getLogger(__name__)


def _trim(tokens: Sequence[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first EOS."""
    out = []
    for t in tokens:
        out.append(int(t))
        if t in eos:
            break
    return out


def plain_batch(
    target: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int, eos: Sequence[int], pad: int
) -> list[list[int]]:
    """``target.generate`` on the left-padded batch (greedy); each row's new tokens through its first EOS."""
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel() :] = p
        mask[i, width - p.numel() :] = 1
    device = next(target.parameters()).device
    out = target.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=list(eos),
        pad_token_id=pad,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    return [_trim(row[width:].tolist(), set(eos)) for row in out]


def run_batch_bench(
    target: PreTrainedModel,
    tokenizer: Any,
    models: Mapping[str, SpeculativeModel],
    prompts: Sequence[BenchPrompt],
    settings: BenchSettings,
    batch_sizes: Sequence[int],
    fixed: Sequence[str] = (),
) -> dict[str, Any]:
    """Measure total tokens/s by batch size (see module docstring).

    Args:
        models: method name -> :class:`~selfspec.api.SpeculativeModel` (all sharing ``target``).
        prompts: the questions (first turns are used).
        settings: ``max_new_tokens`` and the EOS ids (greedy only).
        batch_sizes: B values, each >= 1.
        fixed: method names to run also with ``batch_tree="fixed"`` (as ``<name>_fixed``).

    Returns:
        The report: ``{"batch_sizes", "num_prompts", "max_new_tokens", "rows": [{"batch", "method",
        "tokens", "seconds", "tokens_per_s", "speedup", "mean_tau"}], "rule": {method: rule table}}``.

    Raises:
        ValueError: a batch size < 1, sampling settings, or fewer prompts than the largest batch.
    """
    if settings.do_sample:
        raise ValueError("the batch bench measures greedy decoding; pass --temperature 0")
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("batch sizes must be >= 1")
    device = next(target.parameters()).device
    encoded = [encode_messages(tokenizer, p.first_turn_messages()).to(device) for p in prompts]
    if len(encoded) < max(batch_sizes):
        raise ValueError(f"{len(encoded)} prompts cannot fill a batch of {max(batch_sizes)}: add --num-prompts")
    eos = settings.stop_ids(target, tokenizer)
    pad = getattr(target.generation_config, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    n = settings.max_new_tokens
    runs: dict[str, Any] = {"plain": lambda group: (plain_batch(target, group, n, eos, pad), None)}
    for name, model in models.items():
        for mode, label in [("auto", name)] + ([("fixed", f"{name}_fixed")] if name in fixed else []):

            def run(group, model=model, mode=mode):
                rows = model.generate(list(group), max_new_tokens=n, eos_token_id=eos, batch_tree=mode)
                return [r.tokens for r in rows], [r.stats.mean_accepted_tokens for r in rows]

            runs[label] = run
    names = list(runs)
    # warm-up: one small batch through every method (caches, kernels, the batch cost profile)
    for name in names:
        runs[name](encoded[: min(2, len(encoded))])
    rows = []
    for b in sorted(set(batch_sizes)):
        groups = [encoded[i : i + b] for i in range(0, len(encoded) - b + 1, b)]
        totals = {name: [0, 0.0, []] for name in names}
        for g, group in enumerate(groups):
            order = names[g % len(names) :] + names[: g % len(names)]
            for name in order:
                t0 = time.perf_counter()
                tokens, taus = runs[name](group)
                totals[name][1] += time.perf_counter() - t0
                totals[name][0] += sum(len(_trim(t, set(eos))) for t in tokens)
                totals[name][2].extend(taus or [])
        base = totals["plain"][0] / totals["plain"][1]
        for name in names:
            tok, sec, taus = totals[name]
            rows.append(
                {
                    "batch": b,
                    "method": name,
                    "prompts": len(groups) * b,
                    "tokens": tok,
                    "seconds": round(sec, 3),
                    "tokens_per_s": round(tok / sec, 2),
                    "speedup": round(tok / sec / base, 3),
                    "mean_tau": round(statistics.mean(taus), 3) if taus else None,
                }
            )
            logger.info("batch %d %s: %.1f tokens/s (%.2fx)", b, name, tok / sec, tok / sec / base)
    rule = {name: model.batch_tree_rule().table(sorted(set(batch_sizes))) for name, model in models.items()}
    return {
        "batch_sizes": sorted(set(batch_sizes)),
        "num_prompts": len(encoded),
        "max_new_tokens": n,
        "threads": torch.get_num_threads(),
        "rows": rows,
        "rule": rule,
    }


def batch_markdown(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table (batch x method) and the rule's choices."""
    lines = [
        f"# Batched decoding: total tokens/s ({report['num_prompts']} prompts, greedy, "
        f"{report['max_new_tokens']} new tokens, {report['threads']} threads)",
        "",
        "| batch | method | tokens | seconds | tokens/s | vs plain | mean tau |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        tau = "" if r["mean_tau"] is None else f"{r['mean_tau']:.2f}"
        lines.append(
            f"| {r['batch']} | {r['method']} | {r['tokens']} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{r['speedup']:.2f}x | {tau} |"
        )
    lines += ["", "## The batch tree rule (depth 0 = no speculation)", ""]
    for name, table in report["rule"].items():
        cells = ", ".join(
            f"B={t['batch']}: "
            + ("online (re-decided every step from this call's acceptance)" if t["depth"] is None else "")
            + ("" if t["depth"] is None else f"depth {t['depth']}")
            + (f" / {t['total_tokens']} tokens" if t["total_tokens"] else "")
            + (f" ({t['expected_speedup']:.2f}x expected)" if t["expected_speedup"] else "")
            for t in table
        )
        lines.append(f"- {name}: {cells}")
    return "\n".join(lines) + "\n"


def write_batch_report(report: Mapping[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``batch_report.json`` and ``batch_report.md`` into ``out_dir`` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "batch_report.json", out / "batch_report.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(batch_markdown(report))
    return paths
