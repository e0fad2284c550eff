"""Heads that leave selfspec: export to the formats serving engines load, and import from them.

Formats: ``speculators`` (vLLM serves it directly; :mod:`selfspec.export.speculators`), ``sglang`` (SGLang /
SpecForge EAGLE layouts; :mod:`selfspec.export.sglang`). Import: :mod:`selfspec.export.importer`. Command line:
``selfspec export`` / ``selfspec import`` (:mod:`selfspec.export.cli`).
"""

from __future__ import annotations

from selfspec.export.common import ExportError
from selfspec.export.sglang import export_sglang

__all__ = ["ExportError", "export_sglang"]
