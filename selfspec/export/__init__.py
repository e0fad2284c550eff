"""Heads that leave selfspec: export to the formats serving engines load, and import from them.

Formats: ``speculators`` (vLLM serves it directly; :mod:`selfspec.export.speculators`), ``sglang`` (SGLang /
SpecForge EAGLE layouts, :mod:`selfspec.export.sglang`, and vLLM's ``MedusaModel`` for Medusa heads,
:mod:`selfspec.export.medusa_vllm`), ``gguf`` (llama.cpp's ``eagle3`` draft, :mod:`selfspec.export.gguf`). Import:
:mod:`selfspec.export.importer`. Command line: ``selfspec export`` / ``selfspec import`` (:mod:`selfspec.export.cli`).
The file trees and contracts: ``docs/EXPORT.md``.
"""

from __future__ import annotations

from selfspec.export.common import ExportError
from selfspec.export.medusa_vllm import export_vllm_medusa
from selfspec.export.sglang import export_sglang

__all__ = ["ExportError", "export_sglang", "export_vllm_medusa"]
