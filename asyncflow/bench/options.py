"""A bench workload's `--set key=value` items: read against its known keys, lists of names, numbers;
each bad item a one-line `UserError` naming the workload and the key."""

from __future__ import annotations

from typing import Any

from asyncflow.errors import UserError


def read_sets(workload: str, overrides: list[str], known: tuple[str, ...]) -> dict[str, str]:
    """The items as key -> value text; an unknown key or an item without `=` is refused."""
    raw: dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise UserError(f"bench {workload} --set: expected one of {', '.join(k + '=...' for k in known)}, got {item!r}")
        raw[key] = value
    return raw


def names(workload: str, raw: dict[str, str], key: str, default: str, known: tuple[str, ...]) -> list[str]:
    """A comma-separated list of names, each one of `known` (`default` where the key is not given)."""
    found = [v.strip() for v in raw.get(key, default).split(",") if v.strip()]
    bad = [v for v in found if v not in known]
    if bad or not found:
        raise UserError(f"bench {workload} --set {key}: unknown {bad or found}; use {', '.join(known)}")
    return found


def positive(workload: str, key: str, value: str, kind: type) -> Any:
    """`value` as a `kind` (int or float) above 0."""
    try:
        number = kind(value)
    except ValueError:
        raise UserError(f"bench {workload} --set {key}: expected a number, got {value!r}") from None
    if number <= 0:
        raise UserError(f"bench {workload} --set {key}: must be > 0, got {value}")
    return number
