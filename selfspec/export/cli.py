"""``selfspec export HEADS --format F --out DIR --target T`` and ``selfspec import SRC --format F --out DIR
--target T``.

Export formats: ``speculators`` (EAGLE-3, what ``vllm serve`` loads), ``sglang`` (EAGLE-3 / EAGLE-1).
Import formats: ``speculators``, ``sglang``. The target (a directory, Hub id or the
``smollm2-135m-instruct`` alias) is loaded to check the heads belong to it; it is written into the export's config.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selfspec.export.common import Head
from selfspec.export.importer import IMPORT_FORMATS, import_heads
from selfspec.export.sglang import export_sglang
from selfspec.export.speculators import export_speculators
from selfspec.heads import HeadFormatError, load_heads
from selfspec.target import load_target, resolve_target

__all__ = ["EXPORT_FORMATS", "export_heads", "export_main", "import_main"]

EXPORT_FORMATS = ("speculators", "sglang")


def export_heads(head: Head, fmt: str, out_dir: str | Path, *, target_name_or_path: str) -> Path:
    """Export ``head`` in format ``fmt`` (one of :data:`EXPORT_FORMATS`) to ``out_dir``. Returns ``out_dir``.

    Raises:
        HeadFormatError: an unknown format (the message lists the formats), or what the format's exporter raises.
    """
    if fmt == "speculators":
        return export_speculators(head, out_dir, target_name_or_path=target_name_or_path)
    if fmt == "sglang":
        return export_sglang(head, out_dir, target_name_or_path=target_name_or_path)
    raise HeadFormatError(f"unknown export format {fmt!r}; choose one of {list(EXPORT_FORMATS)}")


def _parser(prog: str, src: str, formats: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument(src)
    p.add_argument("--format", required=True, help=f"one of {', '.join(formats)}")
    p.add_argument("--out", required=True, help="directory to write (replaced as a whole)")
    p.add_argument("--target", required=True, help="the target model: directory, Hub id or smollm2-135m-instruct")
    return p


def export_main(argv: list[str]) -> int:
    """``selfspec export``: returns 0 on success, 2 on bad input (the reason printed)."""
    args = _parser("selfspec export", "heads", EXPORT_FORMATS).parse_args(argv)
    try:
        if args.format not in EXPORT_FORMATS:
            raise HeadFormatError(f"unknown export format {args.format!r}; choose one of {list(EXPORT_FORMATS)}")
        target, _ = load_target(args.target)
        head = load_heads(args.heads, target)
        out = export_heads(head, args.format, args.out, target_name_or_path=resolve_target(args.target))
    except HeadFormatError as err:
        print(f"selfspec export: {err}")
        return 2
    print(f"exported {args.heads} as {args.format} to {out}")
    return 0


def import_main(argv: list[str]) -> int:
    """``selfspec import``: returns 0 on success, 2 on bad input (the reason printed)."""
    args = _parser("selfspec import", "src", IMPORT_FORMATS).parse_args(argv)
    try:
        if args.format not in IMPORT_FORMATS:
            raise HeadFormatError(f"unknown import format {args.format!r}; choose one of {list(IMPORT_FORMATS)}")
        target, _ = load_target(args.target)
        out = import_heads(args.src, args.format, args.out, target)
    except HeadFormatError as err:
        print(f"selfspec import: {err}")
        return 2
    print(f"imported {args.src} ({args.format}) into {out}")
    return 0
