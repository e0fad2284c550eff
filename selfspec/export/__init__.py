"""Heads that leave selfspec: export to the formats serving engines load, and import from them.

Formats: ``speculators`` (vLLM serves it directly; :mod:`selfspec.export.speculators`), ``sglang`` (SGLang /
SpecForge EAGLE layouts, :mod:`selfspec.export.sglang`, and vLLM's ``MedusaModel`` for Medusa heads,
:mod:`selfspec.export.medusa_vllm`), ``gguf`` (llama.cpp's ``eagle3`` draft, :mod:`selfspec.export.gguf`). Import:
:mod:`selfspec.export.importer`. Command line: ``selfspec export`` / ``selfspec import`` (:mod:`selfspec.export.cli`).
The file trees and contracts: ``docs/EXPORT.md``.
"""

from __future__ import annotations

from selfspec.base.lazy import lazy_exports

__all__ = ["ExportError", "export_sglang", "export_vllm_medusa"]

# Imported on first use: one exporter loads without the others.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ExportError": "selfspec.export.common",
        "export_sglang": "selfspec.export.sglang",
        "export_vllm_medusa": "selfspec.export.medusa_vllm",
    },
)
