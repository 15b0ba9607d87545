"""Name → implementation lookup, so that a misspelt config value fails with the allowed names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, what: str) -> T:
    """Return ``table[name]``; raise ``ValueError`` naming the allowed names if it is absent."""
    try:
        return table[name]
    except KeyError:
        allowed = ", ".join(repr(k) for k in table)
        raise ValueError(f"unknown {what} {name!r}; allowed: {allowed}") from None
