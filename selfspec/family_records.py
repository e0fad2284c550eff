"""The built-in head families' records of the API layer (:class:`selfspec.families.Family`): Medusa, EAGLE-1, EAGLE-3,
DFlash and DSpark, each with its drafter factory, the drafter options it takes, its export layout in each format, what
to do where a format has none, its model-card text and its tree tuning.

:mod:`selfspec.families` imports this module by name the first time a family is asked for (its
:data:`~selfspec.families.BUILTIN_RECORDS`), so the registry itself imports no exporter and the export package
(whose command asks the registry) and the family records do not import each other.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from selfspec.card_text import (
    CardText,
    block_description,
    block_engines,
    eagle3_description,
    eagle3_engines,
    eagle_description,
    eagle_engines,
    medusa_description,
    medusa_engines,
)
from selfspec.export.gguf import export_gguf
from selfspec.export.gguf_block import export_gguf_block
from selfspec.export.medusa_vllm import export_vllm_medusa
from selfspec.export.openvino import export_openvino
from selfspec.export.sglang import export_sglang_eagle, export_sglang_eagle3
from selfspec.export.sglang_block import export_sglang_block
from selfspec.export.speculators import export_speculators
from selfspec.export.speculators_block import export_speculators_block
from selfspec.families import Family, register_family
from selfspec.head_drafters import block_drafter, eagle_drafter, medusa_drafter

__all__ = ["BLOCK_OPTIONS", "EAGLE_OPTIONS", "eagle_export_hint", "gguf_block_export", "gguf_export"]


def gguf_export(head: Any, out_dir: str | Path, *, target_name_or_path: str, **options: Any) -> Path:
    """The EAGLE-3 family's ``gguf`` exporter: :func:`selfspec.export.gguf.export_gguf` with the target's Hugging Face
    directory (or alias) as ``target_dir`` (llama.cpp's converter reads its tokenizer); ``options`` (``name``,
    ``outtype``, ``llamacpp``) pass on. Returns the written ``.gguf`` file."""
    return export_gguf(head, out_dir, target_dir=target_name_or_path, **options)


def gguf_block_export(head: Any, out_dir: str | Path, *, target_name_or_path: str, **options: Any) -> Path:
    """The DFlash and DSpark families' ``gguf`` exporter: :func:`selfspec.export.gguf_block.export_gguf_block`, called
    as :func:`gguf_export` calls its own."""
    return export_gguf_block(head, out_dir, target_dir=target_name_or_path, **options)


def eagle_export_hint(head: Any) -> str:
    """Where an EAGLE-1 head goes: SGLang's ``LlamaForCausalLMEagle``, which needs ``fc.bias`` (no engine layout holds
    a head without one)."""
    if head.config.fc_bias:
        return "export with --format sglang (LlamaForCausalLMEagle)"
    return "export with selfspec's own format (SGLang's LlamaForCausalLMEagle needs fc.bias: retrain with fc_bias=True)"


EAGLE_OPTIONS = ("depth", "top_k", "total_tokens")
BLOCK_OPTIONS = ("block_length", "block_top_k", "confidence_min")
_BLOCK_EXPORTS = {"speculators": export_speculators_block, "sglang": export_sglang_block, "gguf": gguf_block_export}

for _record in (
    Family(
        "medusa",
        medusa_drafter,
        exports={"sglang": export_vllm_medusa},
        export_hint=lambda head: "export with --format sglang (vLLM's MedusaModel)",
        card=CardText("Cai et al. 2024, Medusa, https://arxiv.org/abs/2401.10774", medusa_description, medusa_engines),
        tree_tuning="head_accuracy",
    ),
    Family(
        "eagle",
        eagle_drafter,
        EAGLE_OPTIONS,
        exports={"sglang": export_sglang_eagle},
        export_hint=eagle_export_hint,
        card=CardText(
            "Li et al. 2024, EAGLE https://arxiv.org/abs/2401.15077 and EAGLE-2 https://arxiv.org/abs/2406.16858",
            eagle_description,
            eagle_engines,
            title="EAGLE-1 (decoded with the EAGLE-2 dynamic tree)",
        ),
        tree_tuning="acceptance_profile",
    ),
    Family(
        "eagle3",
        eagle_drafter,
        EAGLE_OPTIONS,
        exports={
            "speculators": export_speculators,
            "sglang": export_sglang_eagle3,
            "gguf": gguf_export,
            "openvino": export_openvino,
        },
        card=CardText("Li et al. 2025, EAGLE-3, https://arxiv.org/abs/2503.01840", eagle3_description, eagle3_engines),
        tree_tuning="acceptance_profile",
        llamacpp_spec_type="draft-eagle3",
    ),
    Family(
        "dflash",
        block_drafter,
        BLOCK_OPTIONS,
        exports=_BLOCK_EXPORTS,
        card=CardText(
            "Chen et al. 2026, DFlash, https://arxiv.org/abs/2602.06036",
            block_description,
            partial(block_engines, sglang_class="DFlashDraftModel"),
        ),
        llamacpp_spec_type="draft-dflash",
    ),
    Family(
        "dspark",
        block_drafter,
        BLOCK_OPTIONS,
        exports=_BLOCK_EXPORTS,
        card=CardText(
            "DeepSeek 2026, DSpark, https://arxiv.org/abs/2607.05147",
            partial(block_description, markov=True),
            partial(block_engines, sglang_class="Qwen3DSparkModel", verifies_block_plus_one=True),
        ),
        llamacpp_spec_type="draft-dspark",
    ),
):
    register_family(_record)
