"""How a selfspec command starts: its arguments parsed and its log lines on the console."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` (None: ``sys.argv[1:]``) with ``parser`` and send INFO log lines to the console, bare.

    Raises:
        SystemExit: bad arguments (``argparse`` prints the usage and exits with 2).
    """
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return args
