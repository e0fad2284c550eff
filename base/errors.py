"""A user's mistake, and how a command reports one: one line on stderr, exit status 2, no traceback.

:class:`UserError` is raised where input a person gave (a file, a flag, a config value, a target name) cannot be
used; its message names the problem and what to do instead. It is a ``ValueError``, so code that catches
``ValueError`` keeps working. Every ``selfspec`` command runs through :func:`run_command`, which catches it once:
the sites that find a mistake raise, none of them prints or exits. Any other exception is a fault of the program and
keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

__all__ = ["MissingFileError", "UserError", "one_line", "run_command"]


class UserError(ValueError):
    """A mistake in what the user gave; the message says what it is and what to do (``selfspec`` prints it as one
    line on stderr and exits with 2)."""


class MissingFileError(UserError, FileNotFoundError):
    """A file the user named does not exist (a ``UserError`` that is also the ``FileNotFoundError`` callers catch)."""


def one_line(message: str) -> str:
    """``message`` on one line: its lines stripped and joined with ``"; "`` (a line ending with ``:`` is joined to
    the next by a space), so ``"2 problems:\\n  a\\n  b"`` becomes ``"2 problems: a; b"``."""
    out = ""
    for line in (part.strip() for part in message.splitlines()):
        if not line:
            continue
        out += ("" if not out else " " if out.endswith(":") else "; ") + line
    return out


def run_command(prog: str, main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """``main(argv)``, with a :class:`UserError` printed as ``"{prog}: error: {message}"`` (one line, stderr).

    Returns:
        ``main``'s exit status, or 2 after a user error.
    """
    try:
        return main(list(argv))
    except UserError as err:
        print(f"{prog}: error: {one_line(str(err))}", file=sys.stderr)
        return 2
