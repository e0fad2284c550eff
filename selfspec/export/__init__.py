"""Heads that leave selfspec: export to the formats serving engines load, and import from them.

Formats: ``speculators`` (vLLM serves it directly; :mod:`selfspec.export.speculators`), ``sglang`` (SGLang /
SpecForge EAGLE layouts, :mod:`selfspec.export.sglang`, and vLLM's ``MedusaModel`` for Medusa heads,
:mod:`selfspec.export.medusa_vllm`), ``gguf`` (llama.cpp's ``eagle3`` draft, :mod:`selfspec.export.gguf`). Import:
:mod:`selfspec.export.importer`. Command line: ``selfspec export`` / ``selfspec import`` (:mod:`selfspec.export.cli`).
Which layout a head gets in each format is its family's record (:attr:`selfspec.families.Family.exports`); this
package holds the layouts only and imports no family record. The file trees and contracts: ``docs/EXPORT.md``.
"""

from __future__ import annotations

from selfspec.base.lazy import lazy_exports

__all__ = ["ExportError", "export_sglang_eagle", "export_sglang_eagle3", "export_vllm_medusa"]

# Imported on first use: one exporter loads without the others.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ExportError": "selfspec.export.common",
        "export_sglang_eagle": "selfspec.export.sglang",
        "export_sglang_eagle3": "selfspec.export.sglang",
        "export_vllm_medusa": "selfspec.export.medusa_vllm",
    },
)
