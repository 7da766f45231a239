"""Sizes and shapes of field values: the payload bytes a put or write adds to the store's metrics,
and a columnar batch split into per-sample rows (`column_rows`, `rows_of`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from asyncflow.transfer_queue.api import NewSample

_KINDS: dict[type, int] = {}  # value type -> 0: no payload, 1: ask the value, 2: a plain list or tuple


def _kind(t: type) -> int:
    """Decided once per type: a type without an `nbytes` attribute whose instances cannot carry one
    (no instance `__dict__`: e.g. numbers, strings, `Runs`) has no payload, and a plain list or
    tuple is counted by length; anything else is asked each time."""
    k = _KINDS.get(t)
    if k is None:
        if hasattr(t, "nbytes") or t.__dictoffset__ != 0:
            k = 1
        elif issubclass(t, (list, tuple)):
            k = 2
        else:
            k = 0
        _KINDS[t] = k
    return k


def payload_bytes(fields: dict[str, Any]) -> int:
    """Payload bytes: tensors/arrays by `nbytes`; lists of numbers (token ids, log-probs) at 8 bytes
    an element, as they would be as int64/float64 tensors; other Python values count 0."""
    total = 0
    for v in fields.values():
        t = type(v)
        if t is list:  # (token ids, log-probs: the common case, without the table lookup)
            total += 8 * len(v)
            continue
        k = _KINDS.get(t)
        if k is None:
            k = _kind(t)
        if k == 0:
            continue
        if k == 2:
            total += 8 * len(v)
            continue
        n = getattr(v, "nbytes", None)
        if isinstance(n, int):
            total += n
        elif isinstance(v, (list, tuple)):
            total += 8 * len(v)
    return total


def columns_bytes(rows: dict[str, list[Any]], columns: dict[str, Any]) -> int:
    """`payload_bytes` summed over the rows of a columnar batch (`column_rows`): an array column's
    rows together are its `nbytes` (an object array's rows are asked one by one)."""
    total = 0
    for k, col in columns.items():
        if isinstance(col, np.ndarray) and col.dtype != object:
            total += int(col.nbytes)
        else:
            total += sum(payload_bytes({k: v}) for v in rows[k])
    return total


def column_rows(columns: dict[str, Any], n: int) -> dict[str, list[Any]]:
    """Each column of a batch of `n` rows as a list of its rows (an array's rows are views of it)."""
    out = {}
    for k, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {k!r} has {len(col)} rows, expected {n} (one per group id)")
        out[k] = list(col)
    return out


def samples_of(rows: dict[str, list[Any]], group_ids: Sequence[int], group_size: int) -> list[NewSample]:
    """One `NewSample` per row of `column_rows`: sample i gets row i of every column."""
    names = list(rows)
    return [NewSample(g, group_size, dict(zip(names, vals, strict=True)))
            for g, vals in zip(group_ids, zip(*rows.values(), strict=True) if names else ((),) * len(group_ids),
                               strict=True)]


def rows_of(columns: dict[str, Any], group_ids: Sequence[int], group_size: int) -> list[NewSample]:
    """One `NewSample` per row of a columnar batch (views, no copies)."""
    return samples_of(column_rows(columns, len(group_ids)), group_ids, group_size)
