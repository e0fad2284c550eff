"""Measurement files on disk: the selfspec cache root, atomic JSON writes, strict dataclass loading.

Every profile (:mod:`selfspec.decode.tuning.costs`, :mod:`selfspec.decode.tuning.calibration`) is a frozen dataclass
written as a JSON object with a ``format`` / ``version`` header; :func:`from_record` reads one back,
refusing missing, unknown or mistyped keys (types come from the dataclass annotations).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def cache_root() -> Path:
    """Root directory of selfspec's caches (converted targets, cost profiles): ``$SELFSPEC_CACHE``, else
    ``$XDG_CACHE_HOME/selfspec``, else ``~/.cache/selfspec``."""
    root = os.environ.get("SELFSPEC_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "selfspec"


def profiles_dir() -> Path:
    """Cache directory of cost profiles: ``<cache root>/profiles``."""
    return cache_root() / "profiles"


def now_utc() -> str:
    """The current time, ISO 8601 in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> Path:
    """Write ``data`` atomically (temporary file + rename), so a killed process never leaves half a file.

    Raises:
        OSError: the directory cannot be created or written.
        ValueError: ``data`` holds a NaN or an infinity.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, allow_nan=False))
    os.replace(tmp, path)
    return path


def read_json(path: str | Path) -> Any:
    """Parse a JSON file.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON (or not UTF-8).
    """
    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"not JSON: {err}") from err


def _check(value: Any, hint: Any, name: str) -> Any:
    """``value`` converted to ``hint`` (lists become tuples); ValueError naming ``name`` otherwise."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, name)
            except ValueError:
                continue
        raise ValueError(f"{name} must be {hint}, got {value!r}")
    if hint is type(None):
        if value is not None:
            raise ValueError(f"{name} must be null")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{name} must be a list")
        item = typing.get_args(hint)[0]
        return tuple(_check(v, item, f"{name}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping, typing.Mapping):
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be an object")
        key_hint, item = typing.get_args(hint)
        return {_check(k, key_hint, f"{name} key"): _check(v, item, f"{name}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"from_record cannot check {name}: {hint}")


def from_record(cls: type[T], data: Any, header: Mapping[str, Any], derived: Collection[str] = ()) -> T:
    """Build the dataclass ``cls`` from a JSON object, strictly.

    Args:
        cls: a dataclass whose annotations use ``int``, ``float``, ``str``, ``tuple[X, ...]``,
            ``Mapping[K, X]``, ``X | None`` and ``Any``.
        data: the parsed JSON.
        header: keys that must hold exactly these values (e.g. ``format``, ``version``); not fields.
        derived: keys written for readers but recomputed from the fields (ignored here, but required).
            Every field is required too.

    Returns:
        ``cls(**fields)``; its ``__post_init__`` checks what the types cannot.

    Raises:
        ValueError: not an object, missing or unknown keys, a header value that differs, or a mistyped
            field (the message names the key).
    """
    if not isinstance(data, dict):
        raise ValueError(f"a {cls.__name__} file holds a JSON object")
    wrong = [key for key, want in header.items() if data.get(key) != want]
    if wrong:
        what = " ".join(f"{k}={v!r}" for k, v in header.items())
        if {"format", "version"} <= set(header):
            what = f"version-{header['version']} {header['format']}"
        raise ValueError(f"not a {what} file ({', '.join(f'{k}={data.get(k)!r}' for k in wrong)})")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    expected = set(fields) | set(header) | set(derived)
    missing = sorted(expected - set(data))
    unknown = sorted(set(data) - expected)
    if missing or unknown:
        raise ValueError(f"missing keys {missing}, unknown keys {unknown}")
    return cls(**{name: _check(data[name], hints[name], name) for name in fields})
