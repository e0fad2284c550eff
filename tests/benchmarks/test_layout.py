"""The harnesses stay outside the product: ``benchmarks/`` is not installed, the package imports nothing of it, and the
harnesses import no private name of the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("selfspec", "base", "heads", "decode", "train")


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every import statement of the file (deferred ones included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = [(a.name, []) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    out += [(n.module or "", [a.name for a in n.names]) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    return out


def test_benchmarks_are_not_a_setuptools_package():
    text = (ROOT / "pyproject.toml").read_text()
    packages = next(line for line in text.splitlines() if line.startswith("packages = "))
    assert "benchmarks" not in packages and '"selfspec"' in packages


def test_the_package_imports_no_harness():
    found = [
        f"{path.relative_to(ROOT)}: {module}"
        for d in PACKAGE_DIRS
        for path in sorted((ROOT / d).rglob("*.py"))
        for module, _ in _imports(path)
        if module == "benchmarks" or module.startswith("benchmarks.")
    ]
    assert not found, found


def test_the_harnesses_read_only_public_names_of_the_package():
    private = [
        f"{path.name}: {module}.{name}"
        for path in sorted((ROOT / "benchmarks").glob("*.py"))
        for module, names in _imports(path)
        if module.startswith("selfspec")
        for name in names
        if name.startswith("_")
    ]
    assert not private, private
    assert {p.stem for p in (ROOT / "benchmarks").glob("*.py")} >= {"trainers", "gpu_curves", "gpu_cycle", "sets"}
