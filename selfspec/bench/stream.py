"""``selfspec bench --stream``: a prompt file served in order, as a stream, window by window.

Adaptation pays over time, so it is measured over time: the prompts are served one after another by every method
(interleaved per request, the order rotated each request so no method always runs first), and every ``window``
requests each method's tau (accepted tokens per step) and speed against selfspec's own decoding with no drafts (the
gain of speculation alone, the baseline in the same process) are taken over that window. Methods:

* ``no_draft``: selfspec's loop with no drafts (the reference; its tokens are every request's expected output);
* ``head``: the frozen head, its tree sized to this machine;
* ``online``: the same head adapting to the stream (:mod:`selfspec.train.online`); its speed counts decoding only,
  and the adaptation's CPU seconds per window are reported beside it;
* ``hybrid``: the frozen head merged with prompt lookup (what the served history adds to);
* ``hybrid_history``: the frozen head merged with prompt lookup and the outputs served so far
  (:mod:`selfspec.decode.drafters.served_history`).

Every request of every method is checked against ``no_draft``'s tokens (greedy): a mismatch is reported, never
hidden. Writes ``stream.json``, ``stream.md`` and ``stream.png`` (tau and speed by window).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from selfspec.api import SpeculativeModel, load, make_verifier
from selfspec.base.files import write_json
from selfspec.decode.drafters import NoDraftDrafter
from selfspec.prompts import BenchPrompt
from selfspec.train.online import OnlineOptions

logger = logging.getLogger(__name__)

STREAM_METHODS = ("no_draft", "head", "online", "hybrid", "hybrid_history")


@dataclasses.dataclass
class Served:
    """One request of one method: tokens, verification steps and the tokens they produced (tau's terms), decode
    seconds, the adaptation seconds it triggered, and the steps its tree rule switched drafting off."""

    tokens: list[int]
    steps: int
    accepted: int
    decode_s: float
    adapt_s: float = 0.0
    off_steps: int = 0


def build_stream_models(
    target: Any, tokenizer: Any, heads: str, methods: list[str], online: OnlineOptions
) -> dict[str, SpeculativeModel]:
    """One model per stream method (:data:`STREAM_METHODS`), each with its own drafter state.

    Raises:
        ValueError: an unknown method (the message lists them).
    """
    unknown = sorted(set(methods) - set(STREAM_METHODS))
    if unknown:
        raise ValueError(f"unknown stream methods {unknown}; choose from {list(STREAM_METHODS)}")
    head = load(target, heads, tokenizer=tokenizer)
    models: dict[str, SpeculativeModel] = {}
    for name in methods:
        if name == "no_draft":
            verifier = make_verifier(target, head.drafter)
            models[name] = SpeculativeModel(target, tokenizer, NoDraftDrafter(), verifier)
        elif name == "head":
            models[name] = head
        elif name == "online":
            models[name] = load(target, heads, tokenizer=tokenizer, adapt=online)
        elif name == "hybrid":
            models[name] = load(target, heads, tokenizer=tokenizer, hybrid=True)
        else:
            models[name] = load(target, heads, tokenizer=tokenizer, hybrid=True, history=True)
    return models


def serve(model: SpeculativeModel, prompt: BenchPrompt, max_new_tokens: int) -> Served:
    """Serve one request greedily; an adapting model's adaptation seconds are taken out of its decode time."""
    before = model.online.stats.train_s if model.online is not None else 0.0
    t0 = time.perf_counter()
    out = model.generate(prompt.first_turn_messages(), max_new_tokens)
    total = time.perf_counter() - t0
    adapt_s = (model.online.stats.train_s - before) if model.online is not None else 0.0
    per_step = out.stats.accepted_per_step
    return Served(out.tokens, len(per_step), sum(per_step), total - adapt_s, adapt_s, out.stats.drafting_off_steps)


def run_stream(
    models: dict[str, SpeculativeModel], prompts: list[BenchPrompt], window: int, max_new_tokens: int
) -> dict[str, Any]:
    """Serve ``prompts`` in order with every model (interleaved, rotated); returns the report (see
    :func:`window_rows`)."""
    names = list(models)
    served: dict[str, list[Served]] = {n: [] for n in names}
    for i, prompt in enumerate(prompts):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            served[name].append(serve(models[name], prompt, max_new_tokens))
        logger.info("stream: %d / %d requests", i + 1, len(prompts))
    return {"requests": len(prompts), "window": window, "rows": window_rows(served, window), "methods": names}


def window_rows(served: dict[str, list[Served]], window: int) -> list[dict[str, Any]]:
    """Per window of ``window`` requests and per method: tau (tokens per verification step), tokens/s, speed over
    ``no_draft`` (its tokens/s over no_draft's in the window), the share of steps drafting was switched off
    (``drafting_off``, by the live tree rule), adaptation seconds, and the requests whose tokens differ from
    ``no_draft``'s (mismatches)."""
    ref = served["no_draft"]
    rows = []
    for start in range(0, len(ref), window):
        part = slice(start, start + window)
        ref_rate = sum(len(s.tokens) for s in ref[part]) / max(1e-9, sum(s.decode_s for s in ref[part]))
        row: dict[str, Any] = {"first": start + 1, "last": min(len(ref), start + window), "methods": {}}
        for name, runs in served.items():
            got = runs[part]
            tokens = sum(len(s.tokens) for s in got)
            rate = tokens / max(1e-9, sum(s.decode_s for s in got))
            mismatches = [start + j + 1 for j, s in enumerate(got) if s.tokens != ref[start + j].tokens]
            row["methods"][name] = {
                "tau": round(sum(s.accepted for s in got) / max(1, sum(s.steps for s in got)), 3),
                "tokens_per_s": round(rate, 2),
                "vs_no_draft": round(rate / ref_rate, 3),
                "drafting_off": round(sum(s.off_steps for s in got) / max(1, sum(s.steps for s in got)), 3),
                "adapt_s": round(sum(s.adapt_s for s in got), 2),
                "mismatches": mismatches,
            }
        rows.append(row)
    return rows


def stream_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table: one row per window, tau, speed over no drafts and the share of steps with
    drafting switched off per method."""
    names = [n for n in report["methods"] if n != "no_draft"]
    cols = " | ".join(f"{n} tau | {n} vs no_draft | {n} off" for n in names)
    head = "| requests | " + cols + " | adapt s | mismatches |"
    lines = [head, "|---|" + "---:|---:|---:|" * len(names) + "---:|---:|"]
    for row in report["rows"]:
        m = row["methods"]
        cells = " | ".join(
            f"{m[n]['tau']:.2f} | {m[n]['vs_no_draft']:.2f}x | {m[n].get('drafting_off', 0.0):.0%}" for n in names
        )
        adapt = sum(v["adapt_s"] for v in m.values())
        bad = sum(len(v["mismatches"]) for v in m.values())
        lines.append(f"| {row['first']}-{row['last']} | {cells} | {adapt:.1f} | {bad} |")
    return "\n".join(lines)


def write_stream(report: dict[str, Any], out: str | Path) -> list[Path]:
    """Write ``stream.json``, ``stream.md`` and ``stream.png`` into ``out``; returns their paths."""
    from matplotlib.figure import Figure

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [write_json(out_dir / "stream.json", report), out_dir / "stream.md"]
    paths[1].write_text(stream_markdown(report) + "\n")
    fig = Figure(figsize=(8.0, 6.0))
    names = [n for n in report["methods"] if n != "no_draft"]
    x = [row["last"] for row in report["rows"]]
    panels = (("tau", "tau"), ("vs_no_draft", "speed over no drafts"))
    for ax, (field, label) in zip(fig.subplots(2, 1, sharex=True), panels, strict=True):
        for name in names:
            ax.plot(x, [row["methods"][name][field] for row in report["rows"]], marker="o", label=name)
        ax.set_ylabel(label)
    fig.axes[1].axhline(1.0, color="black", linewidth=0.8)
    fig.axes[1].set_xlabel("requests served")
    fig.axes[0].legend(fontsize="small")
    fig.axes[0].set_title(f"Stream of {report['requests']} requests, windows of {report['window']}")
    fig.tight_layout()
    fig.savefig(out_dir / "stream.png")
    paths.append(out_dir / "stream.png")
    return paths
