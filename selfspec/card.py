"""The model card (``README.md``) that goes with heads pushed to the Hub.

Made with ``huggingface_hub``'s :class:`~huggingface_hub.ModelCard` / :class:`~huggingface_hub.ModelCardData`
(the Hub's model-card metadata: https://huggingface.co/docs/hub/model-cards). The metadata block holds
``base_model`` (the target, a Hub id), ``library_name: selfspec`` and the tags ``speculative-decoding`` and
the head family (``medusa``, ``eagle``, ``eagle3``). The text says what the heads are and how to serve them:
in selfspec straight from the repo, and in vLLM, SGLang and llama.cpp after ``selfspec export`` to the
engine's own layout (``--format speculators`` for vLLM's EAGLE-3 ``vllm serve DIR``, ``--format sglang`` for
SGLang's ``LlamaForCausalLMEagle`` (with ``--speculative-token-map`` for a reduced vocabulary) /
``LlamaForCausalLMEagle3`` and vLLM's ``MedusaModel``, ``--format gguf`` for llama.cpp's ``--spec-type
draft-eagle3``); only commands the exporters run for the heads are printed (``tests/export/test_card_commands.py``
runs them), and families or heads an engine cannot run are said to be so. With a bench report
(:class:`BenchFigures`) it adds the measured tau and speedup, the command and the hardware they were measured with.

Pure text: nothing here reads files or reaches the network.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from selfspec.card_text import CardContext
from selfspec.families import family
from selfspec.heads.io import HeadFormatError

__all__ = ["BenchFigures", "head_card"]


@dataclass(frozen=True)
class BenchFigures:
    """What one ``selfspec bench`` report measured for these heads (read by :func:`selfspec.hub.bench_figures`).

    Attributes:
        engine: which engine decoded (``"selfspec"``, ``"llama.cpp"``, ``"vLLM"``, ``"OpenVINO GenAI"``); ``speedup`` is
            against that engine's own plain decoding.
        method: the heads' method name in the report.
        tau: mean accepted tokens per target forward, pooled over every step (None: not recorded).
        speedup: median over prompt turns of the per-turn speedup against ``reference`` (a ratio).
        engine_speedup: the same against the engine's own decoding with no drafts (the gain of speculation
            alone); None when the report has no such baseline. In llama.cpp both references are plain llama.cpp.
        tokens_per_s: median tokens per second of the heads; reference_tokens_per_s: of the reference.
        reference: what the speedup is against (the reference method's description).
        engine_reference: what ``engine_speedup`` is against (its description), or None.
        verdict: the llama.cpp engine's sentence on the heads against plain llama.cpp, or None.
        num_samples: prompt turns measured; prompts: where they came from.
        decoding: e.g. ``"greedy, 128 new tokens, float32 on cpu, 2 threads"``.
        mismatches: greedy runs: prompt turns whose output differed from the reference (None: sampling).
        command: the command that made the report.
        command_recorded: False when ``command`` was rebuilt from the report's settings (the report does not
            store the prompt-selection flags, so the card says so).
        hardware: the machine (CPU count, accelerator, platform, torch version).
    """

    engine: str
    method: str
    tau: float | None
    speedup: float | None
    engine_speedup: float | None
    tokens_per_s: float | None
    reference_tokens_per_s: float | None
    reference: str
    engine_reference: str | None
    verdict: str | None
    num_samples: int
    prompts: str
    decoding: str
    mismatches: int | None
    command: str
    command_recorded: bool
    hardware: str


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _bench(figures: Sequence[BenchFigures]) -> str:
    header = ["engine", "method", "tau (tokens per target forward)", "speedup vs reference", "speculation gain"]
    header += ["tokens/s", "reference tokens/s", "prompt turns"]
    rows = [
        [
            f.engine,
            f.method,
            _fmt(f.tau, ".2f"),
            _fmt(f.speedup, ".2f") + "x",
            "-" if f.engine_speedup is None else _fmt(f.engine_speedup, ".2f") + "x",
            _fmt(f.tokens_per_s, ".1f"),
            _fmt(f.reference_tokens_per_s, ".1f"),
            str(f.num_samples),
        ]
        for f in figures
    ]
    table = "\n".join("| " + " | ".join(cells) + " |" for cells in (header, ["---"] * len(header), *rows))
    parts = [f"## Measured\n\n{table}\n"]
    for f in figures:
        how = "" if f.command_recorded else " (rebuilt from the report's settings, which omit how prompts were chosen)"
        mismatch = "" if f.mismatches is None else f"; outputs differing from the reference: {f.mismatches}"
        gain = f" The speculation gain is against {f.engine_reference}." if f.engine_reference else ""
        verdict = f"\n\n{f.verdict}" if f.verdict else ""
        parts.append(
            f"""### {f.engine}

Against {f.reference}, in the same process, methods interleaved per prompt ({f.decoding}{mismatch}).{gain}
Prompts: {f.prompts}. Hardware: {f.hardware}.{verdict}

Command{how}:

```bash
{f.command}
```
"""
        )
    return "\n".join(parts)


def adapted_line(adaptation: Mapping[str, Any] | None) -> str:
    """The card's line on an adaptation (counts only), with its line break; empty without one."""
    if not adaptation:
        return ""
    if adaptation.get("mode") == "online":
        return (
            f"- Adapted online on {adaptation['requests']:,} served requests / {adaptation['served_tokens']:,} served "
            f"tokens ({adaptation['swaps']} updates kept, {adaptation['rollbacks']} rolled back).\n"
        )
    return (
        f"- Adapted on {adaptation['prompts']:,} prompts / {adaptation['trained_tokens']:,} trained tokens of the "
        f"target's answers to them (`selfspec adapt`; held-out chain tau "
        f"{adaptation['heldout']['before']['chain_tau']:.2f} -> {adaptation['heldout']['after']['chain_tau']:.2f}).\n"
    )


def head_card(
    config: Mapping[str, Any],
    *,
    repo_id: str,
    base_model: str,
    bench: Sequence[BenchFigures] = (),
    target_note: str | None = None,
    adaptation: Mapping[str, Any] | None = None,
) -> ModelCard:
    """The model card of a head directory.

    Args:
        config: the head's ``config.json`` (as ``save_pretrained`` wrote it; ``head_type`` names the family).
        repo_id: the Hub repo the heads go to (used in the load commands).
        base_model: the target's Hub id (``base_model`` in the metadata).
        bench: measured figures to report (see :class:`BenchFigures`), one per bench report (selfspec's, llama.cpp's,
            vLLM's, OpenVINO GenAI's); none: no "Measured" section.
        target_note: a sentence on where the target the heads were trained on comes from (e.g. an alias's
            package), or None.
        adaptation: the heads' ``adaptation.json`` (``selfspec adapt`` or online adaptation), or None: the card then
            says what they were adapted on, in counts (never text).

    Returns:
        A :class:`~huggingface_hub.ModelCard`; ``str(card)`` is the ``README.md`` text and ``card.data``
        its metadata.

    Raises:
        ValueError: ``config`` names no registered head family, or one without model-card text.
    """
    try:
        record = family(config.get("head_type"))
    except (HeadFormatError, ValueError) as err:
        raise ValueError(str(err)) from err
    if record.card is None:
        raise ValueError(f"head family {record.name!r} has no model-card text (Family.card in selfspec.families)")
    ours = config.get("selfspec", config)  # EAGLE configs nest selfspec's fields under "selfspec"
    trained_on = ours.get("target") or base_model
    fingerprint = ours.get("target_fingerprint") or "none recorded"
    data = ModelCardData(base_model=base_model, library_name="selfspec", tags=["speculative-decoding", record.name])
    # The name the heads were trained with (an alias or a Hub id) loads the very weights they were trained on;
    # a local path means nothing to a reader of the card: the base model then.
    load_target = trained_on if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", trained_on) else base_model
    note = f"\n  {target_note}" if target_note else ""
    layer_type = str(config.get("model_type") or "llama")  # the decoder layer's kind, for the EAGLE layouts
    adapted = adapted_line(adaptation)
    engines = record.card.engines(CardContext(record.name, repo_id, base_model, load_target, ours, layer_type))
    body = f"""
# {record.card_title} draft heads for {base_model}

Draft heads for speculative decoding of [{base_model}](https://huggingface.co/{base_model}), trained with
selfspec on the frozen target's own hidden states. The target verifies
every drafted token: greedy output is the target's own, token for token, and sampling keeps its distribution.

- Family: {record.card_title} ({record.card.paper}).
- {record.card.describe(ours)}
{adapted}- Trained on the target `{trained_on}` (target fingerprint `{fingerprint}`). selfspec checks the fingerprint
  when it loads the heads and refuses other target weights (another checkpoint or quantisation of the model).{note}

## Use

### selfspec

```python
import selfspec

model = selfspec.load("{load_target}", "{repo_id}")
out = model.generate([{{"role": "user", "content": "Hi!"}}], max_new_tokens=128)
print(out.text, out.stats.mean_accepted_tokens, out.stats.tokens_per_s)
```

{engines}"""
    if bench:
        body += "\n" + _bench(bench)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
