"""Lazy package exports: a name is imported from its module on first access, kept, listed by ``dir``, and a name
outside the table is an ordinary missing attribute."""

from __future__ import annotations

import sys
import types

import pytest

from selfspec.base.lazy import lazy_exports


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``fakepkg`` whose ``VALUE`` comes lazily from a module ``fake_source`` (not imported yet)."""
    (tmp_path / "fake_source.py").write_text("VALUE = object()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_source", raising=False)
    module = types.ModuleType("fakepkg")
    monkeypatch.setitem(sys.modules, "fakepkg", module)
    module.__getattr__, module.__dir__ = lazy_exports("fakepkg", {"VALUE": "fake_source"})
    yield module
    sys.modules.pop("fake_source", None)


def test_a_name_is_imported_on_first_access_and_kept(package):
    assert "fake_source" not in sys.modules
    assert "VALUE" in dir(package) and "VALUE" not in vars(package)
    value = package.VALUE
    assert value is sys.modules["fake_source"].VALUE
    assert vars(package)["VALUE"] is value  # the next access is a plain attribute read


def test_a_name_outside_the_table_is_a_missing_attribute(package):
    with pytest.raises(AttributeError, match="module 'fakepkg' has no attribute 'Nothing'"):
        _ = package.Nothing
    assert not hasattr(package, "Nothing")
    assert "fake_source" not in sys.modules


def test_the_public_packages_serve_their_names():
    import selfspec
    import selfspec.bench
    import selfspec.decode.drafters
    import selfspec.export

    for pkg in (selfspec, selfspec.bench, selfspec.decode.drafters, selfspec.export):
        for name in pkg.__all__:
            assert getattr(pkg, name) is not None, f"{pkg.__name__}.{name}"
