"""base/files.py: a cache file that is missing, bad or unwritable means a new measurement, never an error; the cache
root and the build cache, and the test session's split of them (tests/conftest.py)."""

from __future__ import annotations

import logging
from pathlib import Path

from selfspec.base.files import build_cache_root, cache_root, read_cached, read_json, write_cached


def _parse(data):
    if not isinstance(data, dict) or "ms" not in data:
        raise ValueError("not a profile")
    return data["ms"]


def test_read_cached_returns_the_record_or_none_with_a_warning(tmp_path, caplog):
    path = tmp_path / "profiles" / "p.json"
    assert read_cached(path, _parse, "test profile") is None  # no file: nothing to say
    write_cached(path, {"ms": 1.5}, "test profile")
    assert read_json(path) == {"ms": 1.5} and read_cached(path, _parse, "test profile") == 1.5
    for broken in ("{not json", '{"other": 1}'):
        path.write_text(broken)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert read_cached(path, _parse, "test profile") is None
        assert f"test profile {path} is unreadable" in caplog.text and "measuring it again" in caplog.text


def test_write_cached_warns_when_the_cache_cannot_be_written(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should be
    with caplog.at_level(logging.WARNING):
        write_cached(blocker / "p.json", {"ms": 1.0}, "test profile")
    assert "cannot cache the test profile in" in caplog.text and "using it uncached" in caplog.text


def test_cache_roots_env_overrides(monkeypatch, tmp_path):
    """``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``; the build cache is the cache root unless
    ``$SELFSPEC_BUILD_CACHE`` sets it apart."""
    monkeypatch.delenv("SELFSPEC_BUILD_CACHE", raising=False)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "c"))
    assert cache_root() == build_cache_root() == tmp_path / "c"
    monkeypatch.delenv("SELFSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == build_cache_root() == tmp_path / "xdg" / "selfspec"
    monkeypatch.setenv("SELFSPEC_BUILD_CACHE", str(tmp_path / "builds"))
    assert (cache_root(), build_cache_root()) == (tmp_path / "xdg" / "selfspec", tmp_path / "builds")


def listing(root: Path) -> set[Path]:
    """Every path under ``root`` (empty when it does not exist)."""
    return set(root.rglob("*")) if root.is_dir() else set()


def test_a_tuned_decode_in_the_test_session_caches_nothing_in_the_real_cache(session_cache):
    """tests/conftest.py parts the roots: a decode with ``tune="auto"`` measures a cost profile for a target never
    measured before and caches it in the session's temporary directory; the machine's cache gains nothing."""
    import selfspec
    from selfspec.decode.tuning.costs import cost_profile_path
    from tests.helpers.archs import tiny_llama
    from tests.helpers.heads import random_heads

    real = build_cache_root()
    assert cache_root() == session_cache and session_cache not in (real, *real.parents)
    before = listing(real)
    target = tiny_llama(seed=29)  # a fingerprint of its own: its profile is measured here
    model = selfspec.load(target, random_heads(target), tune="auto")
    assert len(model.generate([5, 17, 23, 42], max_new_tokens=4).tokens) == 4
    assert cost_profile_path(target).is_file() and cost_profile_path(target).is_relative_to(session_cache)
    assert listing(real) == before
