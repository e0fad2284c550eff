"""The one rule of every name-keyed registry (the head families of each layer, the training recipes): a name is
registered once; registering an equal record again is a no-op, so a module imported twice (by another name, or
reloaded) does not fail, while two different records under one name are an error."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["register_once"]

T = TypeVar("T")


def register_once(registry: dict[str, T], name: str, record: T, what: str) -> T:
    """Put ``record`` in ``registry`` under ``name``.

    Args:
        registry: the registry's table (insertion order is registration order).
        name: the key.
        record: the value; equal to a record already there, nothing changes.
        what: how the message names the key (``"head family"``).

    Returns:
        ``record``.

    Raises:
        ValueError: another record is registered under ``name``.
    """
    known = registry.get(name)
    if known is not None and known != record:
        raise ValueError(f"{what} {name!r} is registered already ({known!r})")
    registry[name] = record
    return record
