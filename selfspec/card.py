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

__all__ = ["FAMILIES", "BenchFigures", "Family", "head_card"]


@dataclass(frozen=True)
class Family:
    """How a head family is named and cited on a card."""

    tag: str
    title: str
    paper: str


FAMILIES = {
    "medusa": Family("medusa", "Medusa-1", "Cai et al. 2024, Medusa, https://arxiv.org/abs/2401.10774"),
    "eagle": Family(
        "eagle",
        "EAGLE-1 (decoded with the EAGLE-2 dynamic tree)",
        "Li et al. 2024, EAGLE https://arxiv.org/abs/2401.15077 and EAGLE-2 https://arxiv.org/abs/2406.16858",
    ),
    "eagle3": Family("eagle3", "EAGLE-3", "Li et al. 2025, EAGLE-3, https://arxiv.org/abs/2503.01840"),
    "dflash": Family("dflash", "DFlash", "Chen et al. 2026, DFlash, https://arxiv.org/abs/2602.06036"),
    "dspark": Family("dspark", "DSpark", "DeepSeek 2026, DSpark, https://arxiv.org/abs/2607.05147"),
}


@dataclass(frozen=True)
class BenchFigures:
    """What one ``selfspec bench`` report measured for these heads (read by :func:`selfspec.hub.bench_figures`).

    Attributes:
        engine: ``"selfspec"`` or ``"llama.cpp"``: which engine decoded.
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


def _describe(head_type: str, config: Mapping[str, Any]) -> str:
    ours = config.get("selfspec", config)  # EAGLE configs nest selfspec's fields under "selfspec"
    vocab = ours.get("vocab_size")
    draft = ours.get("draft_vocab_size") or vocab
    if head_type == "medusa":
        lm = "an own lm_head each" if ours.get("own_lm_head", True) else "the target's lm_head, shared"
        return (
            f"{ours.get('num_heads')} Medusa heads of {ours.get('num_layers')} residual block(s) each, with {lm}, "
            f"over a draft vocabulary of {draft} of the target's {vocab} tokens; head k predicts token t+2+k."
        )
    if head_type == "eagle":
        return (
            "One decoder layer of the target's kind over `fc(concat(embed(x), feature))`, predicting the next "
            f"feature; the target's own lm_head scores it, over {draft} of the target's {vocab} tokens."
        )
    if head_type in ("dflash", "dspark"):
        fused = ", ".join(str(i) for i in ours.get("target_layer_ids") or [])
        extra = (
            f" plus a rank-{ours.get('markov_rank')} Markov logit bias"
            + (" and a confidence head" if ours.get("confidence") else "")
            if head_type == "dspark"
            else ""
        )
        return (
            f"{ours.get('num_layers')} Qwen3-style layers drafting a block of {ours.get('block_size')} slots in one "
            f"forward over the fused outputs of target layers ({fused}){extra}; the target's embedding and lm_head are "
            f"shared, over {draft} of the target's {vocab} tokens."
        )
    layers = ", ".join(str(i) for i in ours.get("target_layers") or [])
    eagle31 = [k for k in ("fc_norm", "norm_output") if ours.get(k)]
    return (
        f"One decoder layer over the fused hidden states of target layers ({layers}), with its own lm_head over "
        f"a draft vocabulary of {draft} of the target's {vocab} tokens (`d2t` / `t2d` maps included)."
        + (f" EAGLE-3.1 (arXiv:2605.09992): {' and '.join(f'`{k}`' for k in eagle31)}." if eagle31 else "")
    )


def _engines(
    head_type: str,
    repo_id: str,
    base_model: str,
    target: str,
    num_heads: int,
    reduced: bool,
    layer_type: str = "llama",
    fc_bias: bool = True,
    eagle31: bool = False,
    block_size: int = 0,
) -> str:
    """The vLLM, SGLang and llama.cpp sections: export first (``selfspec export`` loads the heads onto
    ``target``, their own target), then the engine's own command. Only commands the exporters run for these
    heads are given (:mod:`selfspec.export`): ``reduced``: the head drafts over a reduced vocabulary (an EAGLE-1
    export then carries SGLang's ``--speculative-token-map`` file); ``layer_type``: the EAGLE layer's model type
    (the engine layouts hold Llama layers); ``fc_bias``: SGLang's EAGLE-1 ``fc`` has a bias; ``eagle31``: an EAGLE-3.1
    head (``fc_norm`` / ``norm_output``), which the SGLang and llama.cpp exports refuse; ``block_size``: a DSpark
    head's block (SGLang's DSPARK verifies ``block_size + 1`` tokens)."""
    name = repo_id.split("/")[-1]
    if head_type == "medusa":
        return f"""### vLLM

Export to vLLM's `MedusaModel` layout, then pass it as the speculative model:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-medusa
vllm serve {base_model} \\
    --speculative-config '{{"method": "medusa", "model": "{name}-medusa", "num_speculative_tokens": {num_heads}}}'
```

### SGLang

SGLang has no Medusa drafter: serve these heads with vLLM or selfspec.

### llama.cpp

llama.cpp has no Medusa drafter (`--spec-type` offers `draft-eagle3`, n-gram and other drafters): train an
EAGLE-3 head with selfspec for llama.cpp.
"""
    if head_type in ("dflash", "dspark"):
        algorithm = head_type.upper()
        draft_tokens = f" --speculative-num-draft-tokens {block_size + 1}" if head_type == "dspark" else ""
        sglang_block = (
            f"""Export to SGLang's `{"DFlashDraftModel" if head_type == "dflash" else "Qwen3DSparkModel"}` layout, then:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-sglang
python -m sglang.launch_server --model-path {base_model} --speculative-algorithm {algorithm} \\
    --speculative-draft-model-path {name}-sglang{draft_tokens}
```"""
            if not reduced
            else "SGLang's DFLASH / DSPARK drafters use the target's full lm_head and this head drafts over a reduced "
            "vocabulary: serve it with vLLM, llama.cpp or selfspec, or train one with `draft_vocab_size: null`."
        )
        return f"""### vLLM

Export to the `speculators` format (`speculators_model_type: {head_type}`), which vLLM serves directly:

```bash
selfspec export {repo_id} --format speculators --target {target} --out {name}-speculators
vllm serve {name}-speculators
```

### SGLang

{sglang_block}

### llama.cpp

Export to GGUF (selfspec runs llama.cpp's own `convert_hf_to_gguf.py ... --target-model-dir TARGET`), then give the
draft to the target's GGUF:

```bash
selfspec export {repo_id} --format gguf --target {target} --out {name}-gguf
llama-server -m TARGET.gguf -md {name}-gguf/<the .gguf file it wrote> --spec-type draft-{head_type}
```

Both exports refuse a target whose token embedding is scaled (Gemma), and the speculators export one whose logits
are soft-capped: those engines would draft with another function.
"""
    if layer_type != "llama":
        return f"""### vLLM, SGLang and llama.cpp

The engines' EAGLE layouts hold a Llama decoder layer; this head's layer is `{layer_type}` (its target's kind),
so `selfspec export` refuses it: serve it with selfspec.
"""
    if head_type == "eagle":
        token_map = f" \\\n    --speculative-token-map {name}-sglang/speculative_token_map.pt" if reduced else ""
        vocab = (
            "\nThe export carries `speculative_token_map.pt`, the head's draft vocabulary (SGLang's FR-Spec token "
            "map): pass it as shown, or SGLang drafts over the target's full lm_head.\n"
            if reduced
            else ""
        )
        sglang = (
            f"""### SGLang

Export to SGLang's `LlamaForCausalLMEagle` layout, then:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-sglang
python -m sglang.launch_server --model-path {base_model} --speculative-algorithm EAGLE \\
    --speculative-draft-model-path {name}-sglang --speculative-num-steps 5 --speculative-eagle-topk 8 \\
    --speculative-num-draft-tokens 32{token_map}
```
{vocab}"""
            if fc_bias
            else """### SGLang

SGLang's EAGLE-1 (`LlamaForCausalLMEagle`) has a bias in `fc` and this head was trained without one: train an
EAGLE-1 head with `fc_bias: true` (or an EAGLE-3 head) for SGLang, or serve this one with selfspec.
"""
        )
        return f"""### vLLM

`selfspec export` writes no vLLM layout for EAGLE-1 heads (`speculators` 0.9.0, the format vLLM serves, has no
EAGLE-1 class): serve this head with SGLang or selfspec, or train an EAGLE-3 head for vLLM.

{sglang}
### llama.cpp

llama.cpp runs EAGLE-3 drafts only (`--spec-type draft-eagle3`), not EAGLE-1: train an EAGLE-3 head with
selfspec for llama.cpp.
"""
    vllm = f"""### vLLM

Export to the `speculators` format, which vLLM serves directly (the target is named in its config):

```bash
selfspec export {repo_id} --format speculators --target {target} --out {name}-speculators
vllm serve {name}-speculators
```
"""
    if eagle31:
        return f"""{vllm}
This is an EAGLE-3.1 head (`fc_norm` / `norm_output` in the speculators config): serve it with a vLLM that reads
both fields.

### SGLang and llama.cpp

Their EAGLE-3 drafts compute neither EAGLE-3.1 option (no per-layer norm before `fc`, the pre-norm state fed to the
next step), so `selfspec export` refuses this head for them: serve it with vLLM or selfspec, or train an EAGLE-3
head (`eagle3.fc_norm` and `eagle3.norm_output` false) for them.
"""
    return f"""{vllm}
### SGLang

Export to SGLang's `LlamaForCausalLMEagle3` layout, then:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-sglang
python -m sglang.launch_server --model-path {base_model} --speculative-algorithm EAGLE3 \\
    --speculative-draft-model-path {name}-sglang --speculative-num-steps 5 --speculative-eagle-topk 8 \\
    --speculative-num-draft-tokens 32
```

### llama.cpp

Export to GGUF (selfspec runs llama.cpp's own `convert_hf_to_gguf.py ... --target-model-dir TARGET`), then
give the draft to the target's GGUF:

```bash
selfspec export {repo_id} --format gguf --target {target} --out {name}-gguf
llama-server -m TARGET.gguf -md {name}-gguf/<the .gguf file it wrote> --spec-type draft-eagle3
```
"""


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


def head_card(
    config: Mapping[str, Any],
    *,
    repo_id: str,
    base_model: str,
    bench: Sequence[BenchFigures] = (),
    target_note: str | None = None,
) -> ModelCard:
    """The model card of a head directory.

    Args:
        config: the head's ``config.json`` (as ``save_pretrained`` wrote it; ``head_type`` names the family).
        repo_id: the Hub repo the heads go to (used in the load commands).
        base_model: the target's Hub id (``base_model`` in the metadata).
        bench: measured figures to report (see :class:`BenchFigures`), one per bench report (selfspec's and
            llama.cpp's); none: no "Measured" section.
        target_note: a sentence on where the target the heads were trained on comes from (e.g. an alias's
            package), or None.

    Returns:
        A :class:`~huggingface_hub.ModelCard`; ``str(card)`` is the ``README.md`` text and ``card.data``
        its metadata.

    Raises:
        ValueError: ``config`` names no known head family.
    """
    head_type = config.get("head_type")
    if head_type not in FAMILIES:
        raise ValueError(f"head_type {head_type!r} is not one of {sorted(FAMILIES)}")
    family = FAMILIES[head_type]
    ours = config.get("selfspec", config)
    trained_on = ours.get("target") or base_model
    fingerprint = ours.get("target_fingerprint") or "none recorded"
    data = ModelCardData(base_model=base_model, library_name="selfspec", tags=["speculative-decoding", family.tag])
    # The name the heads were trained with (an alias or a Hub id) loads the very weights they were trained on;
    # a local path means nothing to a reader of the card: the base model then.
    load_target = trained_on if re.fullmatch(r"[\w.-]+(/[\w.-]+)?", trained_on) else base_model
    note = f"\n  {target_note}" if target_note else ""
    reduced = (ours.get("draft_vocab_size") or ours.get("vocab_size")) != ours.get("vocab_size")
    layer_type = str(config.get("model_type") or "llama") if head_type != "medusa" else "llama"
    engines = _engines(
        head_type,
        repo_id,
        base_model,
        load_target,
        int(ours.get("num_heads") or 0),
        reduced,
        layer_type=layer_type,
        fc_bias=bool(ours.get("fc_bias", True)),
        eagle31=bool(ours.get("fc_norm") or ours.get("norm_output")),
        block_size=int(ours.get("block_size") or 0),
    )
    body = f"""
# {family.title} draft heads for {base_model}

Draft heads for speculative decoding of [{base_model}](https://huggingface.co/{base_model}), trained with
selfspec on the frozen target's own hidden states. The target verifies
every drafted token: greedy output is the target's own, token for token, and sampling keeps its distribution.

- Family: {family.title} ({family.paper}).
- {_describe(head_type, config)}
- Trained on the target `{trained_on}` (target fingerprint `{fingerprint}`). selfspec checks the fingerprint
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
