"""The packages import downward only, without cycles; no module reads another module's private names; no module
is longer than the line cap.

The import graph is read from the source with ``ast`` (nothing is imported). It holds every import of a
``selfspec`` module a file makes:

* ``import`` and ``from ... import``, at module level, inside functions (deferred imports) and under
  ``TYPE_CHECKING`` alike;
* dynamic imports that name their module with a literal: ``importlib.import_module("selfspec.x")``,
  ``__import__("selfspec.x")``;
* a package's lazy re-exports, declared as the table of ``lazy_exports(__name__, {name: module})``
  (:mod:`selfspec.base.lazy`): imports of the package ``__init__``, made on first access;
* and the eager imports of every package ``__init__`` above a module, which run whenever that module is imported
  (``import selfspec.base.files`` runs ``selfspec/__init__.py`` first): counted as imports of the module itself
  by the layer check.

Layers, bottom to top:

0. ``selfspec.base`` (``base/``): files and the strict reader, the CPU kernels, the target fingerprint and loader;
1. ``selfspec.heads`` (``heads/``): the head modules and their strict directory reader;
2. ``selfspec.decode`` (``decode/`` without ``tuning/``): the exact core, the drafters and the loop;
3. ``selfspec.decode.tuning``: what measures the machine and sizes trees;
4. ``selfspec.train`` (``train/``): training;
5. the API layer: everything else under ``selfspec/`` (api, prompts, bench, export, cli, hub, ...).
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "selfspec": "selfspec",
    "selfspec.base": "base",
    "selfspec.heads": "heads",
    "selfspec.decode": "decode",
    "selfspec.train": "train",
    "selfspec.configs": "configs",
}
LAYERS = (
    "selfspec.base",
    "selfspec.heads",
    "selfspec.decode",
    "selfspec.decode.tuning",
    "selfspec.train",
)  # bottom first
API_LAYER = len(LAYERS)
MAX_MODULE_LINES = 500

# Known violations, each with the reason it is still here. An entry is (importer, imported module, name or None).
ALLOWED: set[tuple[str, str, str | None]] = {
    # ``push_to_hub`` of every head family uploads through the API layer (the model card, bench reports): one
    # deferred import, made when a head is pushed, so the heads never load the API layer otherwise.
    ("selfspec.heads.hub", "selfspec.hub", "push_heads"),
}


class Import(NamedTuple):
    """One import of a selfspec module: ``module`` (a module, or the module a ``name`` is read from), the ``name``
    read from it (None for the module itself), the ``line`` that makes it, and ``via``: the package whose
    ``__init__`` makes it, for an import inherited from a package above (empty for the file's own imports)."""

    module: str
    name: str | None
    line: int
    via: str = ""


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


@functools.cache
def parse(path: Path) -> ast.Module:
    """The file's syntax tree (each file is parsed once per session)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def called(node: ast.Call) -> str:
    """The name a call is made by: ``f(...)`` and ``x.f(...)`` give ``"f"``."""
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def selfspec_literal(node: ast.expr | None) -> str | None:
    """The string of a literal that names a selfspec module, else None."""
    is_str = isinstance(node, ast.Constant) and isinstance(node.value, str)
    return node.value if is_str and node.value.split(".")[0] == "selfspec" else None


def imports(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every selfspec import the file makes itself: statements (deferred and ``TYPE_CHECKING`` ones included),
    literal dynamic imports and a ``lazy_exports`` table. ``from pkg import module`` and a table entry that names
    a submodule count as importing the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def named(source: str, item: str, line: int) -> Import:
        sub = f"{source}.{item}"
        return Import(sub, None, line) if sub in known else Import(source, item, line)

    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out += [Import(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "selfspec"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            if source.split(".")[0] == "selfspec":
                out += [named(source, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and called(node) in ("import_module", "__import__") and node.args:
            if (module := selfspec_literal(node.args[0])) is not None:
                out.append(Import(module, None, node.lineno))
        elif isinstance(node, ast.Call) and called(node) == "lazy_exports" and len(node.args) == 2:
            assert isinstance(node.args[1], ast.Dict), f"{path}:{node.lineno}: declare the lazy table as a literal"
            for key, value in zip(node.args[1].keys, node.args[1].values, strict=True):
                assert isinstance(key, ast.Constant) and selfspec_literal(value), f"{path}:{node.lineno}: {key}"
                out.append(named(value.value, key.value, node.lineno))
    return out


def lazy_lines(path: Path) -> set[int]:
    """The lines of the file's ``lazy_exports`` calls: its table's imports are not made when the file runs."""
    tree = parse(path)
    return {n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and called(n) == "lazy_exports"}


def packages_above(name: str, known: dict[str, Path]) -> list[str]:
    """The packages whose ``__init__`` runs before module ``name`` (outermost first), itself excluded."""
    parts = name.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known]


def graph() -> dict[str, list[Import]]:
    """Every module's imports: its own, and the eager ones of each package ``__init__`` above it."""
    known = modules()
    own = {name: imports(name, path, known) for name, path in known.items()}
    lazy = {name: lazy_lines(path) for name, path in known.items() if path.name == "__init__.py"}
    out = {}
    for name in known:
        inherited = [
            i._replace(via=parent)
            for parent in packages_above(name, known)
            for i in own[parent]
            if i.line not in lazy[parent]
        ]
        out[name] = own[name] + inherited
    return out


def where(name: str, found: Import) -> str:
    return f"{name}:{found.line}" if not found.via else f"{name} (through {found.via}/__init__.py:{found.line})"


def test_every_package_directory_is_read():
    found = modules()
    for package in ("selfspec.api", "selfspec.base.files", "selfspec.heads.io", "selfspec.decode.verify"):
        assert package in found
    assert "selfspec.decode.tuning.costs" in found and "selfspec.configs" in found
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
        ("selfspec.api", None, 6, ""),
        ("selfspec.base.files", "read_json", 7, ""),
        ("selfspec.decode.kv", None, 5, ""),
        ("selfspec.train.loop", "Recipe", 3, ""),
    ]
    assert layer("selfspec.base.files") == 0 and layer("selfspec.heads.mod") == 1 and layer("selfspec.decode.kv") == 2
    assert layer("selfspec.decode.tuning.costs") == 3 and layer("selfspec.train.loop") == 4
    assert layer("selfspec.api") == layer("selfspec") == layer("selfspec.bench.report") == API_LAYER


def test_the_reader_sees_dynamic_imports_and_lazy_tables(tmp_path):
    source = tmp_path / "__init__.py"
    source.write_text(
        "import importlib\n"
        "from selfspec.base.lazy import lazy_exports\n"
        'LOOP = importlib.import_module("selfspec.decode.loop")\n'
        'kv = __import__("selfspec.decode.kv")\n'
        'other = importlib.import_module("httpx")\n'
        "__getattr__, __dir__ = lazy_exports(\n"
        '    __name__, {"load": "selfspec.api", "costs": "selfspec.decode.tuning"}\n'
        ")\n"
    )
    known = {"selfspec.decode.tuning.costs": source}
    assert imports("selfspec.pkg", source, known) == [
        ("selfspec.base.lazy", "lazy_exports", 2, ""),
        ("selfspec.decode.loop", None, 3, ""),
        ("selfspec.decode.kv", None, 4, ""),
        ("selfspec.api", "load", 6, ""),
        ("selfspec.decode.tuning.costs", None, 6, ""),
    ]
    assert lazy_lines(source) == {6}


def test_a_package_init_s_eager_imports_count_for_every_module_below_it(tmp_path):
    """``import selfspec.heads.io`` runs ``selfspec/__init__.py`` and ``heads/__init__.py``: what they import
    eagerly is imported by ``selfspec.heads.io``; what they import lazily is not."""
    assert packages_above("selfspec.decode.drafters.eagle", modules()) == [
        "selfspec",
        "selfspec.decode",
        "selfspec.decode.drafters",
    ]
    found = graph()
    inherited = [i for i in found["selfspec.decode.drafters.eagle"] if i.via]
    assert all(i.via in ("selfspec", "selfspec.decode", "selfspec.decode.drafters") for i in inherited)
    lazy = {i.module for i in imports("selfspec", modules()["selfspec"], modules())} - {i.module for i in inherited}
    assert "selfspec.api" in lazy  # selfspec.load: in the package's own graph, not inherited by its modules


def test_layers_import_downward_only():
    upward = []
    for name, found in graph().items():
        for i in found:
            if layer(i.module) > layer(name) and (name, i.module, i.name) not in ALLOWED:
                upward.append(f"{where(name, i)} imports {i.module} (layer {layer(i.module)} above {layer(name)})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_a_private_name():
    private = []
    for name, found in graph().items():
        for i in found:
            if i.name and is_private(i.name) and (name, i.module, i.name) not in ALLOWED:
                private.append(f"{where(name, i)} imports {i.name} from {i.module}")
    assert not private, "\n".join(private)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names(path: Path, known: dict[str, Path], name: str) -> tuple[set[str], list[tuple[int, str, str]]]:
    """What the file defines and reads of private names: ``(defined, reads)``. ``defined`` holds the private
    functions, classes, variables and attributes it assigns (``self._x = ...``, ``_x: int`` fields); ``reads``
    holds ``(line, name, module)`` for each ``x._name`` read, ``module`` being the selfspec module ``x`` is when
    the file imported it as a module (else "")."""
    tree = parse(path)
    as_module = {}
    for i in imports(name, path, known):
        if i.name is None and i.module in known:
            as_module[i.module.rpartition(".")[2]] = i.module
    for node in ast.walk(tree):  # ``import selfspec.x.y as y``: the alias names the module
        if isinstance(node, ast.Import):
            as_module.update({a.asname: a.name for a in node.names if a.asname and a.name in known})
        elif isinstance(node, ast.ImportFrom):
            as_module.update({a.asname: f"{node.module}.{a.name}" for a in node.names if a.asname})
    defined, reads = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and is_private(node.name):
            defined.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and is_private(node.id):
            defined.add(node.id)
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            if isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
            else:
                owner = as_module.get(node.value.id, "") if isinstance(node.value, ast.Name) else ""
                reads.append((node.lineno, node.attr, owner if owner in known else ""))
    return defined, reads


def reach_ins(known: dict[str, Path]) -> list[str]:
    """Every read of another module's private attribute: ``module._name`` on an imported selfspec module, and
    ``x._name`` where ``_name`` is defined by another selfspec module and not by the reading one (a private
    attribute of an object of a class from elsewhere: ``head._target``)."""
    scanned = {name: private_names(path, known, name) for name, path in known.items()}
    defined_by: dict[str, list[str]] = {}
    for name, (defined, _) in scanned.items():
        for attr in defined:
            defined_by.setdefault(attr, []).append(name)
    out = []
    for name, (defined, reads) in scanned.items():
        for line, attr, module in reads:
            if (module and module != name) or (attr not in defined and attr in defined_by):
                owners = [module] if module else defined_by[attr]
                if (name, owners[0], attr) not in ALLOWED:
                    out.append(f"{name}:{line} reads {attr} of {' / '.join(owners)}")
    return out


def test_the_reach_in_scan_finds_module_and_object_reads(tmp_path):
    (tmp_path / "owner.py").write_text("_CACHE = {}\nclass Head:\n    def __init__(self):\n        self._target = 1\n")
    (tmp_path / "user.py").write_text(
        "from selfspec.base import owner\n"
        "import selfspec.base.owner as o\n"
        "class Twin:\n    def __init__(self):\n        self._own = 0\n"
        "def f(head, twin, m):\n"
        "    return owner._CACHE, o._CACHE, head._target, twin._own, m._parameters\n"
    )
    known = {"selfspec.base.owner": tmp_path / "owner.py", "selfspec.base.user": tmp_path / "user.py"}
    assert reach_ins(known) == [
        "selfspec.base.user:7 reads _CACHE of selfspec.base.owner",
        "selfspec.base.user:7 reads _CACHE of selfspec.base.owner",
        "selfspec.base.user:7 reads _target of selfspec.base.owner",
    ]


def test_no_module_reads_another_modules_private_attributes():
    found = reach_ins(modules())
    assert not found, "make the name public (part of the owner's contract) or move the code:\n" + "\n".join(found)


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
    """Over the imports each file makes itself: a package ``__init__`` runs to its end before any module below it,
    so what it imports is loaded by that module but closes no cycle with it."""
    found_by_module = graph()
    own = {name: [i for i in found if not i.via] for name, found in found_by_module.items()}
    edges = {
        name: {
            i.module for i in found if i.module != name and i.module in own and (name, i.module, i.name) not in ALLOWED
        }
        for name, found in own.items()
    }
    cycles = find_cycles(edges)
    assert not cycles, "\n".join(cycles)


def test_every_module_holds_the_line_cap():
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in modules().values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, f"split by concept, at most {MAX_MODULE_LINES} lines a module:\n" + "\n".join(long)


def loaded_by(module: str) -> list[str]:
    """The selfspec modules a fresh interpreter holds after ``import module`` (package ``__init__``s included)."""
    code = f"import sys, {module}; print(*sorted(m for m in sys.modules if m.startswith('selfspec')))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_the_built_in_family_table_names_head_modules():
    """``heads/families.py`` imports a built-in family's module by name on its first lookup (the module registers the
    family, so the table is not an edge of the graph above): each one is a module of the heads layer."""
    from selfspec.heads.families import BUILTIN_FAMILIES

    known = modules()
    assert BUILTIN_FAMILIES and all(
        m in known and layer(m) == layer("selfspec.heads") for m in BUILTIN_FAMILIES.values()
    )


def test_importing_a_module_loads_no_layer_above_it():
    """What the graph says, run for real: the package ``__init__``s re-export lazily, so importing the base layer's
    files, or the decode loop, loads nothing of a higher layer (nor ``selfspec.api``)."""
    assert [m for m in loaded_by("selfspec.heads.io") if m.startswith("selfspec.heads.")] == ["selfspec.heads.io"]
    for module in ("selfspec.base.files", "selfspec.decode.loop"):
        above = [m for m in loaded_by(module) if m != "selfspec" and layer(m) > layer(module)]
        assert not above, f"import {module} loads {above}: a package __init__ above it imports them eagerly"
