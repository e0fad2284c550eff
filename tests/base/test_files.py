"""base/files.py: a cache file that is missing, bad or unwritable means a new measurement, never an error."""

from __future__ import annotations

import logging

from selfspec.base.files import read_cached, read_json, write_cached


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
