"""Files on disk, for every format selfspec writes: the cache roots, atomic writes, one strict reader.

* :func:`cache_root` holds what selfspec measures and caches (cost profiles, the llama.cpp settings sweep);
  :func:`build_cache_root` the expensive builds made once per machine (converted targets, the llama.cpp build, the
  speculators venv). They are one directory unless ``$SELFSPEC_BUILD_CACHE`` parts them: a test session caches
  its measurements in a temporary directory and still reads the machine's builds.

* :func:`write_json` writes a JSON file and :func:`replace_dir` puts a fully written directory in place, both
  atomically: a killed process never leaves half a file or half a directory, and an existing directory is
  swapped only once the new one is complete.
* :func:`read_dataclass` builds a dataclass from parsed JSON (or YAML) strictly, from its type hints: a missing,
  unknown or mistyped key is refused, and every problem is listed at once with its path and the fix; a number
  field declared with :func:`in_range` is checked against its :class:`Range` there too (by :func:`check_fields` in
  one built in code). Profiles (:mod:`selfspec.decode.tuning`), bench reports (:mod:`selfspec.bench.report`), head
  configs (:mod:`selfspec.heads.config`) and training configs (:mod:`selfspec.train.config`) are all read by it.
* :func:`read_cached` and :func:`write_cached` read and write a measurement's cache file, where a bad or unwritable
  file is a warning and a new measurement, never an error.

This module is in the bottom layer: it imports nothing of selfspec.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import errno
import functools
import json
import logging
import math
import os
import shutil
import types
import typing
import uuid
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

__all__ = [
    "Range",
    "build_cache_root",
    "cache_root",
    "check_fields",
    "in_range",
    "now_utc",
    "profiles_dir",
    "read_cached",
    "read_dataclass",
    "read_json",
    "record_dict",
    "replace_dir",
    "staging_dir",
    "write_cached",
    "write_json",
]

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    """Root directory of selfspec's caches (cost profiles, settings sweeps; the builds too unless
    :func:`build_cache_root` is set apart): ``$SELFSPEC_CACHE``, else ``$XDG_CACHE_HOME/selfspec``, else
    ``~/.cache/selfspec``."""
    root = os.environ.get("SELFSPEC_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "selfspec"


def build_cache_root() -> Path:
    """Root directory of the expensive builds selfspec makes once per machine and reuses (the converted target of an
    alias, the llama.cpp build, the speculators venv): ``$SELFSPEC_BUILD_CACHE``, else :func:`cache_root`.

    Setting it apart lets the small caches go elsewhere (the test suite puts them in a temporary directory, and
    still reads the builds this machine already paid for)."""
    root = os.environ.get("SELFSPEC_BUILD_CACHE")
    return Path(root).expanduser() if root else cache_root()


def profiles_dir() -> Path:
    """Cache directory of cost profiles: ``<cache root>/profiles``."""
    return cache_root() / "profiles"


def read_cached(path: Path, from_dict: Callable[[Any], T], what: str) -> T | None:
    """The record cached in ``path`` (JSON, parsed by ``from_dict``), or None: no such file, or (with a warning
    that names ``what``) a file that cannot be read or parsed, which the caller measures again. Never raises for a
    bad cache file."""
    if not path.exists():
        return None
    try:
        return from_dict(read_json(path))
    except (OSError, ValueError, TypeError) as err:
        logger.warning("%s %s is unreadable (%s): measuring it again", what, path, err)
        return None


def write_cached(path: Path, data: dict[str, Any], what: str) -> None:
    """Cache ``data`` in ``path`` (JSON, atomically); a cache that cannot be written is only a warning that names
    ``what`` (the caller uses its measurement uncached)."""
    try:
        write_json(path, data)
    except OSError as err:
        logger.warning("cannot cache the %s in %s (%s); using it uncached", what, path, err)
    else:
        logger.info("%s cached in %s", what, path)


def record_dict(record: Any, header: Mapping[str, Any]) -> dict[str, Any]:
    """A dataclass record as its file's JSON object: the ``header`` keys (``format``, ``version``) first, then its
    fields (:func:`dataclasses.asdict`); :func:`read_dataclass` with the same ``header`` reads it back."""
    return {**header, **dataclasses.asdict(record)}


def now_utc() -> str:
    """The current time, ISO 8601 in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------- writing
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


def staging_dir(out: Path, what: str = "tmp") -> Path:
    """A fresh sibling path of ``out`` to build a directory in before :func:`replace_dir` (hidden, unique per
    process and call: ``.<name>.<what>-<pid>-<random>``)."""
    return out.with_name(f".{out.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries to disk (the renames into it survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``).

    Returns:
        False where the C library or the file system does not offer the exchange (nothing was changed).

    Raises:
        OSError: the exchange was refused for another reason.
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(staged: Path, out: Path) -> Path:
    """Put the complete directory ``staged`` at ``out`` atomically, replacing a directory there as a whole.

    An existing ``out`` is swapped with ``staged`` in one ``renameat2(RENAME_EXCHANGE)`` on Linux and then
    removed; elsewhere it is first moved aside (a crash between the two renames leaves the complete old
    directory at ``.<name>.old-*``, never a half-written one). The parent directory is fsynced after.

    Args:
        staged: a fully written directory on the same file system (e.g. at :func:`staging_dir` of ``out``).
        out: where it goes.

    Returns:
        ``out``.

    Raises:
        OSError: a rename was refused; ``out`` is then as it was.
    """
    if out.is_dir():
        if _exchange(staged, out):
            shutil.rmtree(staged, ignore_errors=True)  # now the old directory
        else:  # POSIX cannot rename onto a non-empty directory: move the old one aside first
            old = staging_dir(out, "old")
            os.replace(out, old)
            os.replace(staged, out)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, out)
    fsync_dir(out.parent)
    return out


# ---------------------------------------------------------------------------------------------- reading
def read_json(path: str | Path) -> Any:
    """Parse a JSON file.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON (or not UTF-8); the message names the file.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8-sig"))  # a byte-order mark is no content
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON: {err}") from err


@dataclass(frozen=True)
class Range:
    """The values a number field may hold, declared once on the field (:func:`in_range`) and checked by
    :func:`read_dataclass` (for a tuple field, every item).

    Attributes:
        low / high: the bounds (None: unbounded on that side).
        low_open / high_open: the bound itself is excluded.
        unset: what None means for a field that may be None (``"torch's default"``), for the message.
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    unset: str = ""

    def holds(self, value: float) -> bool:
        """Whether ``value`` lies in the range."""
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        """The range in words: ``"> 0"``, ``">= 1 (null: torch's default)"``, ``"in [0, 1)"``."""
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{text} (null: {self.unset})" if self.unset else text


def in_range(
    default: Any,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    le: float | None = None,
    unset: str = "",
) -> Any:
    """A dataclass field with ``default`` whose values :func:`read_dataclass` checks against a :class:`Range`
    (``lr: float = in_range(1e-3, gt=0)``); ``unset`` says what None means where the field may be None."""
    low, high = (gt, True) if gt is not None else (ge, False), (lt, True) if lt is not None else (le, False)
    bounds = Range(low[0], high[0], low[1], high[1], unset)
    return dataclasses.field(default=default, metadata={"range": bounds})


def check_fields(record: Any, name: Callable[[str], str]) -> None:
    """Check a dataclass built in code (from ``__post_init__``) as :func:`read_dataclass` checks what it reads: each
    field's type hint and :class:`Range` (``name(field)`` names it). Raises ValueError ("--lr must be a number > 0")."""
    for f in dataclasses.fields(record):
        value, kind, bounds, errors = getattr(record, f.name), _hints(type(record))[f.name], f.metadata.get("range"), []
        _read(kind, value, f.name, _Rules("", True, False, {}), errors)
        if errors or (bounds and not isinstance(value, bool | None) and not bounds.holds(value)):
            kinds = [k for k in typing.get_args(kind) if k is not type(None)] if bounds and value is not None else []
            words = " or ".join(_describe(k) for k in kinds or [kind]) + (f" {bounds.describe()}" if bounds else "")
            raise ValueError(f"{name(f.name)} must be {words}, got {value!r:.60}")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(kind: Any) -> str:
    """What a value of type ``kind`` is, in words (for messages)."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(kind))
    if origin is Literal:
        return f"one of {list(typing.get_args(kind))}"
    if origin in (tuple, list):
        return "a list"
    if origin in (dict, Mapping):
        return "an object"
    if dataclasses.is_dataclass(kind):
        return f"a mapping of {kind.__name__} fields"
    words = {type(None): "null", bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return words.get(kind, getattr(kind, "__name__", str(kind)))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


@dataclass(frozen=True)
class _Rules:
    label: str
    defaults: bool
    lenient_numbers: bool
    renamed: Mapping[str, str]


def _number(value: Any, kind: type, rules: _Rules) -> Any:
    if isinstance(value, bool):
        return None
    if kind is int:
        if isinstance(value, int):
            return value
        if rules.lenient_numbers and isinstance(value, float) and value.is_integer():
            return int(value)
        return None
    if isinstance(value, (int, float)):
        number = float(value) if rules.lenient_numbers else value
    elif rules.lenient_numbers and isinstance(value, str):  # YAML reads "3e-4" (no dot) as a string
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _read(kind: Any, value: Any, path: str, rules: _Rules, errors: list[str]) -> Any:
    """``value`` as type ``kind``; what does not fit goes to ``errors`` (one line each, with its path)."""
    origin = typing.get_origin(kind)
    if kind is Any:
        return value
    if dataclasses.is_dataclass(kind):
        return _read_fields(kind, value, path, rules, errors)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        for option in options:
            trial: list[str] = []
            out = _read(option, value, path, rules, trial)
            if not trial:
                return out
        scalars = (int, float, str, bool)
        if len(options) == 2 and type(None) in options and not set(options) <= {type(None), *scalars}:
            # X | None with X a structure: say what X needs (nested paths included)
            (option,) = (o for o in options if o is not type(None))
            return _read(option, value, path, rules, errors)
        errors.append(f"{path} must be {_describe(kind)}, got {value!r:.60}")
        return None
    if value is None and kind is not type(None):
        errors.append(f"{path} cannot be empty (expected {_describe(kind)})")
        return None
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{path} must be a list, got {value!r:.60}")
            return None
        args = typing.get_args(kind)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                errors.append(f"{path} must be a list of {len(args)}, got {value!r:.60}")
                return None
            items = list(args)
        else:
            items = [args[0] if args else Any] * len(value)
        pairs = enumerate(zip(items, value, strict=True))
        out = [_read(item, v, f"{path}[{i}]", rules, errors) for i, (item, v) in pairs]
        return tuple(out) if origin is tuple else out
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            errors.append(f"{path} must be an object, got {value!r:.60}")
            return None
        key_kind, item = typing.get_args(kind) or (str, Any)
        return {
            _read(key_kind, k, f"{path} key", rules, errors): _read(item, v, _join(path, str(k)), rules, errors)
            for k, v in value.items()
        }
    if origin is Literal:
        if value not in typing.get_args(kind):
            errors.append(f"{path} must be {_describe(kind)}, got {value!r:.60}")
        return value
    if kind in (int, float):
        number = _number(value, kind, rules)
        if number is None:
            errors.append(f"{path} must be {_describe(kind)}, got {value!r:.60}")
        return number
    fits = {type(None): value is None, bool: isinstance(value, bool), str: isinstance(value, str)}.get(kind)
    if fits is None:
        raise TypeError(f"read_dataclass cannot read {path}: type {kind!r}")
    if not fits:
        errors.append(f"{path} must be {_describe(kind)}, got {value!r:.60}")
    return value


def _read_fields(cls: type, value: Any, path: str, rules: _Rules, errors: list[str]) -> Any:
    if not isinstance(value, Mapping):
        errors.append(f"{path or 'the file'} must be {_describe(cls)}, got {value!r:.60}")
        return None
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    before = len(errors)
    # a moved key left unset (None: a record written before the move) asks for nothing; a set one is refused below
    unknown = [k for k in value if k not in names and not (_join(path, k) in rules.renamed and value[k] is None)]
    if unknown:
        where = f"{rules.label} " if rules.label else ""
        moved = [f"{k} is now {rules.renamed[_join(path, k)]}" for k in unknown if _join(path, k) in rules.renamed]
        valid = sorted(_join(path, n) for n in names)
        errors.append(
            f"unknown {where}keys {[_join(path, k) for k in unknown]}; valid keys: {valid}"
            + (f" ({'; '.join(moved)})" if moved else "")
        )
    has_default = {f.name for f in fields if f.default is not dataclasses.MISSING}
    has_default |= {f.name for f in fields if f.default_factory is not dataclasses.MISSING}
    missing = [n for n in names if n not in value and not (rules.defaults and n in has_default)]
    errors += [f"{path + ': ' if path else ''}missing key {n!r}" for n in missing]
    hints = _hints(cls)
    kept = {n: _read(hints[n], value[n], _join(path, n), rules, errors) for n in names if n in value}
    for f in fields:
        bounds = f.metadata.get("range")
        got = kept.get(f.name)
        items = got if isinstance(got, (tuple, list)) else (got,)
        numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if bounds is not None and not all(bounds.holds(v) for v in numbers):
            errors.append(f"{_join(path, f.name)} must be {bounds.describe()}, got {got!r:.60}")
    return cls(**kept) if len(errors) == before else None


def read_dataclass(
    cls: type[T],
    data: Any,
    where: str = "",
    *,
    root: str = "",
    label: str = "",
    header: Mapping[str, Any] | None = None,
    derived: Collection[str] = (),
    defaults: bool = False,
    lenient_numbers: bool = False,
    renamed: Mapping[str, str] | None = None,
) -> T:
    """Build the dataclass ``cls`` from parsed JSON or YAML, strictly, following its type hints.

    Types read: nested dataclasses, ``int``, ``float`` (an int is accepted; numbers are finite), ``bool``,
    ``str``, ``None``, ``X | Y``, ``Literal[...]``, ``tuple[X, ...]`` / ``tuple[X, Y]`` (from a list),
    ``list[X]``, ``dict[K, X]`` / ``Mapping[K, X]`` and ``Any``. A field declared with :func:`in_range` must also
    hold a number in its :class:`Range` (every item, for a tuple), or None where its type allows None.

    Args:
        cls: the dataclass; its ``__post_init__`` checks what the types cannot (its errors pass through).
        data: the parsed value (an object for ``cls``).
        where: what is read, for the message (a file path, ``"report"``).
        root: the path of ``data`` inside a larger value (``"eagle"``: keys are named ``eagle.ttt_steps``).
        label: a word for unknown keys (``"config"``: ``unknown config keys [...]``).
        header: keys of the top object that must hold exactly these values (``format``, ``version``); not fields.
        derived: top-level keys written for readers but recomputed from the fields: required, then ignored.
        defaults: a field with a default may be missing (configs); otherwise every field is required.
        lenient_numbers: YAML and command-line values: a number written as text (``"3e-4"``) is read for a
            float field, an integral float (``10.0``) for an int field, and float fields hold floats.
        renamed: ``{old key path: new key path}`` for keys that moved; an old key says where it went, or is
            ignored when it holds None (unset, as records written before the move hold it).

    Returns:
        ``cls(**fields)``.

    Raises:
        ValueError: a header value that differs (``not a version-3 ... file``), or every missing, unknown or
            mistyped key at once (one line each, with its path and what it must be), prefixed by ``where``.
        TypeError: ``cls`` uses a type this reader does not know (a programming error).
    """
    prefix = f"{where}: " if where else ""
    errors: list[str] = []
    if header or derived:
        if not isinstance(data, dict):
            raise ValueError(f"{prefix}a {cls.__name__} file holds a JSON object")
        wrong = [key for key, want in (header or {}).items() if data.get(key) != want]
        if wrong:
            what = " ".join(f"{k}={v!r}" for k, v in (header or {}).items())
            if {"format", "version"} <= set(header or {}):
                what = f"version-{header['version']} {header['format']}"
            raise ValueError(f"{prefix}not a {what} file ({', '.join(f'{k}={data.get(k)!r}' for k in wrong)})")
        errors += [f"missing key {k!r}" for k in derived if k not in data]
        data = {k: v for k, v in data.items() if k not in set(header or {}) | set(derived)}
    rules = _Rules(label, defaults, lenient_numbers, dict(renamed or {}))
    value = _read_fields(cls, data, root, rules, errors)
    if errors:
        if len(errors) == 1:
            raise ValueError(prefix + errors[0])
        raise ValueError(f"{prefix}{len(errors)} problems:\n  " + "\n  ".join(errors))
    return value
