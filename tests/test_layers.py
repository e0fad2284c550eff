"""The packages import downward only, without cycles, and no module imports another module's private name.

The import graph is read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ...
import`` of a ``selfspec`` module, at module level, inside functions (deferred imports) and under
``TYPE_CHECKING`` alike. Layers, bottom to top:

0. ``selfspec.base`` (``base/``): files and the strict reader, the CPU kernels, the target fingerprint and loader;
1. ``selfspec.heads`` (``heads/``): the head modules and their strict directory reader;
2. ``selfspec.decode`` (``decode/`` without ``tuning/``): the exact core, the drafters and the loop;
3. ``selfspec.decode.tuning``: what measures the machine and sizes trees;
4. ``selfspec.train`` (``train/``): training;
5. the API layer: everything else under ``selfspec/`` (api, prompts, bench, export, cli, hub, ...).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "selfspec": "selfspec",
    "selfspec.base": "base",
    "selfspec.heads": "heads",
    "selfspec.decode": "decode",
    "selfspec.train": "train",
}
LAYERS = (
    "selfspec.base",
    "selfspec.heads",
    "selfspec.decode",
    "selfspec.decode.tuning",
    "selfspec.train",
)  # bottom first
API_LAYER = len(LAYERS)

# Known violations, each with the reason it is still here. An entry is (importer, imported module, name or None).
ALLOWED: set[tuple[str, str, str | None]] = set()


def layer(module: str) -> int:
    """The layer of a module: the deepest layer package it sits in, else the API layer."""
    found = [i for i, pkg in enumerate(LAYERS) if module == pkg or module.startswith(pkg + ".")]
    return max(found) if found else API_LAYER


def modules() -> dict[str, Path]:
    """Every module of the package directories, by dotted name."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every selfspec import in the file, deferred and
    ``TYPE_CHECKING`` ones included; ``from pkg import module`` counts as importing the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "selfspec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] != "selfspec":
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in known else (source, alias.name, node.lineno))
    return out


def graph() -> dict[str, list[tuple[str, str | None, int]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_package_directory_is_read():
    found = modules()
    for package in (
        "selfspec.api",
        "selfspec.base.files",
        "selfspec.heads.io",
        "selfspec.decode.verify",
        "selfspec.decode.tuning.costs",
    ):
        assert package in found
    assert "selfspec.train.loop" in found and "selfspec.bench.report" in found


def test_the_reader_sees_deferred_relative_and_type_checking_imports(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from selfspec.train.loop import Recipe\n"
        "def f():\n    from selfspec.decode import kv\n    import selfspec.api\n"
        "from .files import read_json\n"
    )
    known = {"selfspec.decode.kv": source, "selfspec.base.files": source}
    assert sorted(imports("selfspec.base.mod", source, known)) == [
        ("selfspec.api", None, 6),
        ("selfspec.base.files", "read_json", 7),
        ("selfspec.decode.kv", None, 5),
        ("selfspec.train.loop", "Recipe", 3),
    ]
    assert layer("selfspec.base.files") == 0 and layer("selfspec.heads.mod") == 1 and layer("selfspec.decode.kv") == 2
    assert layer("selfspec.decode.tuning.costs") == 3 and layer("selfspec.train.loop") == 4
    assert layer("selfspec.api") == layer("selfspec") == layer("selfspec.bench.report") == API_LAYER


def test_layers_import_downward_only():
    upward = []
    for name, found in graph().items():
        for module, item, line in found:
            if layer(module) > layer(name) and (name, module, item) not in ALLOWED:
                upward.append(f"{name}:{line} imports {module} (layer {layer(module)} above {layer(name)})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_a_private_name():
    private = []
    for name, found in graph().items():
        for module, item, line in found:
            if item and item.startswith("_") and not item.startswith("__") and (name, module, item) not in ALLOWED:
                private.append(f"{name}:{line} imports {item} from {module}")
    assert not private, "\n".join(private)


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    """Every cycle a depth-first walk of ``edges`` closes, as ``a -> b -> a``."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    return cycles


def test_the_cycle_finder_finds_a_deferred_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycles():
    found_by_module = graph()
    edges = {
        name: {m for m, item, _ in found if m != name and m in found_by_module and (name, m, item) not in ALLOWED}
        for name, found in found_by_module.items()
    }
    cycles = find_cycles(edges)
    assert not cycles, "\n".join(cycles)
