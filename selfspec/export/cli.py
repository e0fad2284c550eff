"""``selfspec export HEADS --format F --out DIR --target T`` and ``selfspec import SRC --format F --out DIR
--target T``.

Export formats (:data:`EXPORT_FORMATS`): ``speculators`` (EAGLE-3, what ``vllm serve`` loads), ``sglang`` (EAGLE-3 /
EAGLE-1 for SGLang; Medusa in vLLM's ``MedusaModel`` layout), ``gguf`` (EAGLE-3 for llama.cpp, through its own
converter; the target must be a local Hugging Face directory or an alias), ``openvino`` (EAGLE-3 and its target as
OpenVINO IR for OpenVINO GenAI, through optimum-intel's exporter in the ``openvino`` venv). Import formats:
``speculators``, ``sglang``. The target (a directory, Hub id or the ``smollm2-135m-instruct`` alias) is loaded,
without its tokenizer, to check the heads belong to it; it is written into the export's config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from selfspec.export.common import ExportError, Head, family_name
from selfspec.export.importer import IMPORT_FORMATS, import_heads
from selfspec.families import EXPORT_FORMATS, family, registered_families
from selfspec.heads import HeadFormatError, load_heads
from selfspec.heads.config import read_json
from selfspec.target import TargetNotFoundError, resolve_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["EXPORT_FORMATS", "export_heads", "export_main", "import_main", "load_frozen_target"]


def export_heads(head: Head, fmt: str, out_dir: str | Path, *, target_name_or_path: str, **options: Any) -> Path:
    """Export ``head`` in format ``fmt`` (one of :data:`EXPORT_FORMATS`) to ``out_dir``, with the exporter its
    family's record has for that format (:attr:`selfspec.families.Family.exports`): the one dispatch of every export.

    ``gguf`` runs llama.cpp's converter with the target's Hugging Face directory (or an alias; it reads the tokenizer)
    and writes one ``.gguf`` file into ``out_dir``; its ``options`` are ``name``, ``outtype`` and ``llamacpp``
    (:func:`selfspec.export.gguf.export_gguf`). ``openvino`` converts the target's IR and the head's in the
    ``openvino`` venv (cached; :func:`selfspec.export.openvino.export_openvino`).

    Returns:
        ``out_dir`` (``speculators``, ``sglang``, ``openvino``), or the written ``.gguf`` file (``gguf``).

    Raises:
        HeadFormatError: an unknown format (the message lists the formats), a module that is not a head of a
            registered family, or what the format's exporter raises.
        ExportError: the format has no layout for the head's family (the message names the families it holds and
            what to do with this head: :attr:`selfspec.families.Family.export_hint`).
        RuntimeError: ``gguf``: llama.cpp's converter failed or cannot be built; ``openvino``: its venv is missing
            or optimum-intel's exporter failed.
    """
    if fmt not in EXPORT_FORMATS:
        raise HeadFormatError(f"unknown export format {fmt!r}; choose one of {list(EXPORT_FORMATS)}")
    record = family(family_name(head))  # a wrapped head is refused with the attribute that holds it
    exporter = record.exports.get(fmt)
    if exporter is None:
        titles = [family(name).title for name in registered_families() if fmt in family(name).exports]
        held = ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else "".join(titles) or "no"
        raise ExportError(f"the {fmt} format holds {held} heads, not {record.name}; {record.export_hint(head)}")
    return exporter(head, out_dir, target_name_or_path=target_name_or_path, **options)


def load_frozen_target(name: str) -> tuple[PreTrainedModel, str]:
    """Load the target's weights only (fp32, eval, no gradients; no tokenizer: exporting and importing heads never
    tokenizes). Returns ``(model, where)``, ``where`` as :func:`selfspec.target.resolve_target` resolves ``name``.

    Raises:
        HeadFormatError: the name resolves to nothing loadable (the message says what to pass).
    """
    from transformers import AutoModelForCausalLM  # heavy: only when a command runs

    try:
        where = resolve_target(name)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32)
    except (TargetNotFoundError, OSError, ValueError) as err:
        raise HeadFormatError(f"cannot load the target {name!r}: {err}") from err
    model.eval().requires_grad_(False)
    return model, where


def _run(
    argv: list[str],
    command: str,
    src: str,
    formats: tuple[str, ...],
    act: Callable[[argparse.Namespace, PreTrainedModel, str], str],
    tool_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Parse ``selfspec COMMAND SRC --format F --out DIR --target T``, check the format, load the target, then
    ``act(args, target, where)``, whose line is printed. Returns 0; 1 when one of ``tool_errors`` (an outside tool's
    failure) was raised, its message on stderr.

    Raises:
        HeadFormatError: bad input (a ``UserError``: the ``selfspec`` command prints it on stderr and exits with 2).
    """
    p = argparse.ArgumentParser(prog=f"selfspec {command}")
    p.add_argument(src)
    p.add_argument("--format", required=True, help=f"one of {', '.join(formats)}")
    p.add_argument("--out", required=True, help="directory to write (a previous export is replaced as a whole)")
    p.add_argument("--target", required=True, help="the target model: directory, Hub id or smollm2-135m-instruct")
    args = p.parse_args(argv)
    if args.format not in formats:
        raise HeadFormatError(f"unknown {command} format {args.format!r}; choose one of {list(formats)}")
    try:
        target, where = load_frozen_target(args.target)
        done = act(args, target, where)
    except tool_errors as err:
        print(f"selfspec {command}: {err}", file=sys.stderr)
        return 1
    print(done)
    return 0


def export_main(argv: list[str]) -> int:
    """``selfspec export``: returns 0 on success, 1 when llama.cpp failed; bad input raises a ``HeadFormatError``."""

    def act(args: argparse.Namespace, target: PreTrainedModel, where: str) -> str:
        out = export_heads(load_heads(args.heads, target), args.format, args.out, target_name_or_path=where)
        return f"exported {args.heads} as {args.format} to {out}"

    return _run(argv, "export", "heads", EXPORT_FORMATS, act, tool_errors=(RuntimeError,))  # gguf: llama.cpp


def import_main(argv: list[str]) -> int:
    """``selfspec import``: returns 0 on success; bad input raises a ``HeadFormatError``."""

    def act(args: argparse.Namespace, target: PreTrainedModel, where: str) -> str:
        out = import_heads(args.src, args.format, args.out, target)
        done = f"imported {args.src} ({args.format}) into {out}"
        if family(read_json(out / "config.json")["head_type"]).tree_tuning == "acceptance_profile":
            # another trainer's head comes without one: until then it decodes with the default tree, which on a
            # 2-core CPU ran slower than no drafts (0.64-0.75x, docs/journal/round-22.md)
            done += (
                f"\nit has no acceptance profile yet: size its draft tree to this machine with `selfspec tune-tree "
                f"--heads {out} --target {args.target} --prompts <prompts like your traffic>` (until then it "
                "decodes with the default tree)"
            )
        return done

    return _run(argv, "import", "src", IMPORT_FORMATS, act)
