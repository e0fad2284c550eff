"""What a model card says of each head family: its paper, a sentence on what the heads are, and how to serve them in
vLLM, SGLang and llama.cpp (export first, then the engine's own command).

Pure text. Each family's :class:`CardText` sits in its record in :mod:`selfspec.families`;
:func:`selfspec.card.head_card` asks the record and never switches on the family's name. Only commands the
exporters run for the heads are given (``tests/export/test_card_commands.py`` runs them), and what an engine cannot
run is said to be so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CardContext",
    "CardText",
    "block_description",
    "block_engines",
    "eagle3_description",
    "eagle3_engines",
    "eagle_description",
    "eagle_engines",
    "medusa_description",
    "medusa_engines",
    "non_llama_engines",
]


@dataclass(frozen=True)
class CardContext:
    """What the engine sections of a card are written from.

    Attributes:
        head_type: the family's name.
        repo_id: the Hub repo the heads go to; base_model: the target's Hub id; target: the name the heads were
            trained with (what ``selfspec export --target`` is given).
        ours: the head's ``selfspec`` config fields (``config.json``'s ``selfspec`` object, or the config itself).
        layer_type: the model type of the head's decoder layer (the engine layouts hold Llama layers).
    """

    head_type: str
    repo_id: str
    base_model: str
    target: str
    ours: Mapping[str, Any]
    layer_type: str = "llama"

    @property
    def name(self) -> str:
        """The repo's name without its namespace (the export directories are named after it)."""
        return self.repo_id.split("/")[-1]

    @property
    def reduced(self) -> bool:
        """The head drafts over a reduced vocabulary."""
        return (self.ours.get("draft_vocab_size") or self.ours.get("vocab_size")) != self.ours.get("vocab_size")

    @property
    def num_heads(self) -> int:
        """Medusa heads (0 for other families)."""
        return int(self.ours.get("num_heads") or 0)

    @property
    def fc_bias(self) -> bool:
        """SGLang's EAGLE-1 ``fc`` has a bias: does this head's?"""
        return bool(self.ours.get("fc_bias", True))

    @property
    def eagle31(self) -> bool:
        """An EAGLE-3.1 head (``fc_norm`` / ``norm_output``), which the SGLang and llama.cpp exports refuse."""
        return bool(self.ours.get("fc_norm") or self.ours.get("norm_output"))

    @property
    def block_size(self) -> int:
        """A block head's block (SGLang's DSPARK verifies ``block_size + 1`` tokens); 0 for other families."""
        return int(self.ours.get("block_size") or 0)


@dataclass(frozen=True)
class CardText:
    """A family's text on a model card.

    Attributes:
        paper: the citation (authors, year, title, link).
        describe: ``describe(ours) -> str``: one sentence on the heads from their ``selfspec`` config fields.
        engines: ``engines(ctx) -> str``: the vLLM, SGLang and llama.cpp sections (Markdown, ``###`` headings).
        title: the family's name on the card when it says more than the family's title (None: the title).
    """

    paper: str
    describe: Callable[[Mapping[str, Any]], str]
    engines: Callable[[CardContext], str]
    title: str | None = None


def _vocab(ours: Mapping[str, Any]) -> tuple[Any, Any]:
    vocab = ours.get("vocab_size")
    return ours.get("draft_vocab_size") or vocab, vocab


def medusa_description(ours: Mapping[str, Any]) -> str:
    """The Medusa heads in one sentence."""
    draft, vocab = _vocab(ours)
    lm = "an own lm_head each" if ours.get("own_lm_head", True) else "the target's lm_head, shared"
    return (
        f"{ours.get('num_heads')} Medusa heads of {ours.get('num_layers')} residual block(s) each, with {lm}, "
        f"over a draft vocabulary of {draft} of the target's {vocab} tokens; head k predicts token t+2+k."
    )


def eagle_description(ours: Mapping[str, Any]) -> str:
    """An EAGLE-1 head in one sentence."""
    draft, vocab = _vocab(ours)
    return (
        "One decoder layer of the target's kind over `fc(concat(embed(x), feature))`, predicting the next "
        f"feature; the target's own lm_head scores it, over {draft} of the target's {vocab} tokens."
    )


def block_description(ours: Mapping[str, Any], markov: bool = False) -> str:
    """A DFlash head (``markov`` False) or a DSpark head (with its Markov head and confidence head) in one
    sentence."""
    draft, vocab = _vocab(ours)
    fused = ", ".join(str(i) for i in ours.get("target_layer_ids") or [])
    extra = (
        f" plus a rank-{ours.get('markov_rank')} Markov logit bias"
        + (" and a confidence head" if ours.get("confidence") else "")
        if markov
        else ""
    )
    return (
        f"{ours.get('num_layers')} Qwen3-style layers drafting a block of {ours.get('block_size')} slots in one "
        f"forward over the fused outputs of target layers ({fused}){extra}; the target's embedding and lm_head are "
        f"shared, over {draft} of the target's {vocab} tokens."
    )


def eagle3_description(ours: Mapping[str, Any]) -> str:
    """An EAGLE-3 (or EAGLE-3.1) head in one sentence."""
    draft, vocab = _vocab(ours)
    layers = ", ".join(str(i) for i in ours.get("target_layers") or [])
    eagle31 = [k for k in ("fc_norm", "norm_output") if ours.get(k)]
    return (
        f"One decoder layer over the fused hidden states of target layers ({layers}), with its own lm_head over "
        f"a draft vocabulary of {draft} of the target's {vocab} tokens (`d2t` / `t2d` maps included)."
        + (f" EAGLE-3.1 (arXiv:2605.09992): {' and '.join(f'`{k}`' for k in eagle31)}." if eagle31 else "")
    )


def medusa_engines(ctx: CardContext) -> str:
    """Medusa heads: vLLM's ``MedusaModel``; SGLang and llama.cpp have no Medusa drafter."""
    repo_id, base_model, target, name = ctx.repo_id, ctx.base_model, ctx.target, ctx.name
    return f"""### vLLM

Export to vLLM's `MedusaModel` layout, then pass it as the speculative model:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-medusa
vllm serve {base_model} \\
    --speculative-config '{{"method": "medusa", "model": "{name}-medusa", "num_speculative_tokens": {ctx.num_heads}}}'
```

### SGLang

SGLang has no Medusa drafter: serve these heads with vLLM or selfspec.

### llama.cpp

llama.cpp has no Medusa drafter (`--spec-type` offers `draft-eagle3`, n-gram and other drafters): train an
EAGLE-3 head with selfspec for llama.cpp.
"""


def block_engines(ctx: CardContext, sglang_class: str, verifies_block_plus_one: bool = False) -> str:
    """DFlash / DSpark heads: speculators for vLLM, SGLang's ``sglang_class`` layout (full vocabulary only; with
    ``verifies_block_plus_one`` SGLang is told to verify ``block_size + 1`` tokens), llama.cpp's GGUF."""
    repo_id, base_model, target, name = ctx.repo_id, ctx.base_model, ctx.target, ctx.name
    algorithm = ctx.head_type.upper()
    draft_tokens = f" --speculative-num-draft-tokens {ctx.block_size + 1}" if verifies_block_plus_one else ""
    sglang_block = (
        f"""Export to SGLang's `{sglang_class}` layout, then:

```bash
selfspec export {repo_id} --format sglang --target {target} --out {name}-sglang
python -m sglang.launch_server --model-path {base_model} --speculative-algorithm {algorithm} \\
    --speculative-draft-model-path {name}-sglang{draft_tokens}
```"""
        if not ctx.reduced
        else "SGLang's DFLASH / DSPARK drafters use the target's full lm_head and this head drafts over a reduced "
        "vocabulary: serve it with vLLM, llama.cpp or selfspec, or train one with `draft_vocab_size: null`."
    )
    return f"""### vLLM

Export to the `speculators` format (`speculators_model_type: {ctx.head_type}`), which vLLM serves directly:

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
llama-server -m TARGET.gguf -md {name}-gguf/<the .gguf file it wrote> --spec-type draft-{ctx.head_type}
```

Both exports refuse a target whose token embedding is scaled (Gemma), and the speculators export one whose logits
are soft-capped: those engines would draft with another function.
"""


def non_llama_engines(ctx: CardContext) -> str:
    """An EAGLE head whose decoder layer is not Llama's: no engine layout holds it."""
    return f"""### vLLM, SGLang and llama.cpp

The engines' EAGLE layouts hold a Llama decoder layer; this head's layer is `{ctx.layer_type}` (its target's kind),
so `selfspec export` refuses it: serve it with selfspec.
"""


def eagle_engines(ctx: CardContext) -> str:
    """EAGLE-1 heads: SGLang's ``LlamaForCausalLMEagle`` (with ``fc.bias``); no vLLM or llama.cpp layout."""
    if ctx.layer_type != "llama":
        return non_llama_engines(ctx)
    repo_id, base_model, target, name = ctx.repo_id, ctx.base_model, ctx.target, ctx.name
    token_map = f" \\\n    --speculative-token-map {name}-sglang/speculative_token_map.pt" if ctx.reduced else ""
    vocab = (
        "\nThe export carries `speculative_token_map.pt`, the head's draft vocabulary (SGLang's FR-Spec token "
        "map): pass it as shown, or SGLang drafts over the target's full lm_head.\n"
        if ctx.reduced
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
        if ctx.fc_bias
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


def eagle3_engines(ctx: CardContext) -> str:
    """EAGLE-3 heads: speculators for vLLM, SGLang's ``LlamaForCausalLMEagle3`` and llama.cpp's GGUF (EAGLE-3.1 heads:
    vLLM only)."""
    if ctx.layer_type != "llama":
        return non_llama_engines(ctx)
    repo_id, base_model, target, name = ctx.repo_id, ctx.base_model, ctx.target, ctx.name
    vllm = f"""### vLLM

Export to the `speculators` format, which vLLM serves directly (the target is named in its config):

```bash
selfspec export {repo_id} --format speculators --target {target} --out {name}-speculators
vllm serve {name}-speculators
```
"""
    if ctx.eagle31:
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
