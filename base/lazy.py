"""A package's public names, imported from their modules on first access (PEP 562 module ``__getattr__``).

Why: importing any module runs every package ``__init__`` above it, so a package ``__init__`` that imported its
submodules eagerly made ``import selfspec.base.files`` load most of selfspec (and torch, transformers and the Hub
client with it). A package ``__init__`` declares its re-exports as one table instead::

    __getattr__, __dir__ = lazy_exports(__name__, {"load": "selfspec.api", "SpeculativeModel": "selfspec.api"})

``selfspec.load`` then imports :mod:`selfspec.api` the first time it is read, and ``import selfspec`` imports
nothing. The table is a literal on purpose: ``tests/test_layers.py`` reads it as the package's imports.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of package ``package`` that serve the names of ``table``.

    Args:
        package: the package's ``__name__``.
        table: public name -> dotted name of the module that defines it under the same name.

    Returns:
        ``(__getattr__, __dir__)``: assign both at the package's module level. ``__getattr__(name)`` imports
        ``table[name]``, reads ``name`` from it and keeps it in the package's namespace (so it runs once per name).

    Raises:
        AttributeError: (from ``__getattr__``) a name the table does not hold, as for any missing attribute.
    """

    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    return __getattr__, __dir__
