"""The test tree's own layering: a test module never imports another test module (nor a ``conftest.py``);
shared builders come from ``tests/helpers`` and fixtures from the conftest files."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_names(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(line, dotted name)`` for every import in ``source`` (a module of ``package``, e.g. ``("tests",
    "decode")``), deferred ones inside functions included: ``import a.b`` gives ``a.b``, ``from a import b``
    gives ``a.b`` (b may be a module), and a relative import is resolved against ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ((base,) if base else ()))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def forbidden(name: str) -> bool:
    """Whether ``name`` lies in the test tree outside the helper package (a test module, a conftest file)."""
    parts = name.split(".")
    return parts[0] == "tests" and (len(parts) == 1 or parts[1] != "helpers")


def test_no_test_module_imports_another_test_module():
    offences = []
    for path in sorted(TESTS.rglob("*.py")):
        package = path.relative_to(TESTS.parent).parts[:-1]
        for line, name in imported_names(path.read_text(), package):
            if forbidden(name):
                offences.append(f"{path.relative_to(TESTS.parent)}:{line} imports {name}")
    assert not offences, "move the shared builder into tests/helpers and import it from there:\n" + "\n".join(offences)


def test_the_scan_finds_every_kind_of_import():
    """Not vacuous: top-level, deferred, ``import tests.x``, ``from tests import x`` and relative imports are all
    found; the helper package and other libraries are allowed."""
    source = (
        "import torch\n"
        "from tests.decode.test_verify import t64\n"
        "from tests.helpers.archs import tiny_target\n"
        "from tests.helpers import stats\n"
        "import tests.conftest\n"
        "from tests import test_bench\n"
        "from . import test_kv\n"
        "def f():\n"
        "    from .test_loop import plain\n"
        "    from ..helpers.drafters import OracleDrafter\n"
    )
    got = [(line, name) for line, name in imported_names(source, ("tests", "decode")) if forbidden(name)]
    assert got == [
        (2, "tests.decode.test_verify.t64"),
        (5, "tests.conftest"),
        (6, "tests.test_bench"),
        (7, "tests.decode.test_kv"),
        (9, "tests.decode.test_loop.plain"),
    ]
