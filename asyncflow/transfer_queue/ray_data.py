"""The Ray placement's data plane: where a field's value lives (inline, or a `Slot` into a blob in
Ray's object store, possibly one put's part of a coalesced object: `PartRef`), how a put's rows are
packed for the wire, how a lease's views are compacted for the trip and expanded again, how a
take's blobs are fetched, and what a value that died with its writer reads as (`LOST`)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import numpy as np

from asyncflow.transfer_queue.api import SampleView


class Slot(NamedTuple):
    """Where a field's value lives: row `row` of blob `blob` in the object store. A tuple, not a
    dataclass, because thousands of them are pickled per take; `nbytes` feeds the bytes metric."""

    blob: int
    row: int
    nbytes: int


class RowsSlot(NamedTuple):
    """A `Slot` shared by every row of one columnar put whose uids are consecutive: sample `uid`'s
    value is row `uid - first_uid` of blob `blob`. One per field and put instead of one per field
    and row, and the put's samples share one fields dict (its payload bytes are counted once)."""

    blob: int
    first_uid: int
    nbytes: int


SLOTS = (Slot, RowsSlot)


class PartRef(NamedTuple):
    """A blob that is entry `part` of a coalesced put's object (`put_buffer`), which holds a tuple of
    the puts' column dicts (each put's rows are a blob of their own). `obj` names the object (its
    first blob's id); `ref` is None when the reader said it holds the object already (a take of
    256 rows from objects of ~700 then fetches and borrows each object once, not once a take)."""

    ref: Any
    obj: int
    part: int


def value_nbytes(v: Any) -> int:
    """A value's size for the inline-or-object-store choice and the bytes metric (8 for a scalar)."""
    n = getattr(v, "nbytes", None)
    if isinstance(n, int):
        return n
    if isinstance(v, (list, tuple)):
        return 8 * len(v)
    if isinstance(v, (bytes, str)):
        return len(v)
    return 8


# what a field whose value died with its writer's process becomes (see `StoreController._lose_writer`;
# any other field: None)
LOST: dict[str, Any] = {"response_ids": [], "behavior_logprobs": [], "token_versions": [], "loss_mask": [],
                        "finish_reason": "cancelled", "reward": None,
                        "reward_error": "its reward died with the reward actor that wrote it (restarted)"}


class _LostRow(dict):  # type: ignore[type-arg]
    """A row of a blob that died with its writer: every field reads as its `LOST` value."""

    def __missing__(self, key: str) -> Any:
        return LOST.get(key)


class LostBlob:
    """Stands in for a blob that could not be fetched (`ObjectLostError`): any row is a `_LostRow`."""

    def __getitem__(self, row: int) -> _LostRow:
        return _LostRow()


_ABSENT = object()


def compact_views(views: list[SampleView]) -> tuple[Any, ...]:
    """Sample views in a form that pickles fast (a take moves thousands): id lists, one field-name
    list, an int array [samples, fields, 2] of (blob, row) slots (blob -1: inline), and inline values.

    A run of views whose fields are the same `RowsSlot`s (consecutive samples of one columnar put)
    is filled with array operations; any other view field by field."""
    names: dict[str, int] = {}
    last: Any = None
    for v in views:
        keys = v.fields.keys()
        if keys != last:  # (the views of one take nearly always share their names: checked once a run)
            for k in keys:
                names.setdefault(k, len(names))
            last = keys
    order = list(names)
    n = len(views)
    uids = [v.uid for v in views]
    slots = np.full((n, len(order), 2), -1, dtype=np.int64)
    inline: list[dict[str, Any] | None] = [None] * n
    singles: list[int] = []  # views filled field by field, and their rows
    rows: list[list[tuple[int, int]]] = []
    absent = itertools.repeat(_ABSENT)
    i = 0
    while i < n:
        f = views[i].fields
        vals = tuple(map(f.get, order, absent)) if order and type(f.get(order[0])) is RowsSlot else ()
        if vals and all(type(x) is RowsSlot for x in vals):
            j = i + 1
            while j < n and tuple(views[j].fields.values()) == vals:
                j += 1
            run = np.asarray(uids[i:j], dtype=np.int64)
            for c, x in enumerate(vals):
                slots[i:j, c, 0] = x[0]
                slots[i:j, c, 1] = run - x[1]
            i = j
            continue
        uid, own, row = uids[i], None, []
        for k in order:
            x = f.get(k, _ABSENT)
            t = type(x)
            if t is RowsSlot:
                row.append((x[0], uid - x[1]))
            elif t is Slot:
                row.append((x[0], x[1]))
            else:
                row.append((-1, -1))
                if x is not _ABSENT:
                    if own is None:
                        own = {}
                    own[k] = x
        inline[i] = own
        singles.append(i)
        rows.append(row)
        i += 1
    if len(singles) == n:
        slots = np.array(rows, dtype=np.int64).reshape(n, len(order), 2)
    elif singles:
        slots[singles] = np.array(rows, dtype=np.int64).reshape(len(singles), len(order), 2)
    return (uids, [v.group_id for v in views], [v.version for v in views], order, slots, inline)


def expand_views(compact: tuple[Any, ...], values: dict[int, Any]) -> list[SampleView]:
    """`compact_views` undone, each slot read from `values` (blob id -> the blob's rows or columns)."""
    uids, gids, versions, names, slots, inline = compact
    views = []
    present = slots[:, :, 0] != -1
    rows = slots.tolist()
    for i, uid in enumerate(uids):
        fields = {} if inline[i] is None else inline[i]
        for j, k in enumerate(names):
            if present[i, j]:
                blob_id, row = rows[i][j]
                blob = values[blob_id]
                fields[k] = blob[k][row] if isinstance(blob, dict) else blob[row][k]
        views.append(SampleView(uid, gids[i], versions[i], fields))
    return views


def stack_columns(dicts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Stack rows into columns when every row has the same keys and each array field has one shape
    and dtype: one buffer per field instead of one per row makes put and get several times cheaper."""
    keys = list(dicts[0])
    cols: dict[str, Any] = {}
    for k in keys:
        first = dicts[0].get(k)
        if isinstance(first, np.ndarray):
            try:
                if any(list(d) != keys or d[k].shape != first.shape or d[k].dtype != first.dtype for d in dicts):
                    return None
            except AttributeError:
                return None
            cols[k] = np.stack([d[k] for d in dicts])
        else:
            cols[k] = [d[k] for d in dicts]
    return cols


def pack_rows(dicts: list[dict[str, Any]], inline_max_bytes: int,
              put: bool = True) -> tuple[list[dict[str, Any]] | None, Any, Any, Any]:
    """(inline payload | None, names, nbytes, [ref] | None): small data travels inline; larger data
    goes into the object store with one `ray.put`, columnar when the rows allow it. The ref is
    wrapped in a list so Ray passes it on instead of resolving it."""
    import ray

    keys = list(dicts[0]) if dicts else []
    if all(len(d) == len(keys) and list(d) == keys for d in dicts):
        nbytes: Any = np.array([[value_nbytes(v) for v in d.values()] for d in dicts], dtype=np.int64).reshape(len(dicts), len(keys))
        names: Any = keys
        total = int(nbytes.sum())
    else:
        names = [list(d) for d in dicts]
        nbytes = [[value_nbytes(v) for v in d.values()] for d in dicts]
        total = sum(map(sum, nbytes))
    if total <= inline_max_bytes or not put:
        return dicts, names, nbytes, None
    cols = stack_columns(dicts) if len(dicts) > 1 and names is keys else None
    return None, names, nbytes, [ray.put(dicts if cols is None else cols)]


def slot_value(values: dict[int, Any], v: Any, k: str, uid: int) -> Any:
    """Field `k`'s value `v` of sample `uid`, read from its blob in `values` when it is a slot."""
    if not isinstance(v, SLOTS):
        return v
    row = v.row if isinstance(v, Slot) else uid - v.first_uid
    blob = values[v.blob]
    return blob[k][row] if isinstance(blob, dict) else blob[row][k]


def object_refs(refs: dict[int, Any]) -> list[Any]:
    """The distinct object-store refs among a take's blob values (parts of one coalesced put share one)."""
    import ray

    out: dict[Any, None] = {}
    for x in refs.values():
        if isinstance(x, ray.ObjectRef):
            out[x] = None
        elif isinstance(x, PartRef) and x.ref is not None:
            out[x.ref] = None
    return list(out)


def fetch_values(refs: dict[int, Any], objs: dict[int, Any], timeout_s: float,
                 on_lost: Callable[[list[int]], Any]) -> dict[int, Any]:
    """A take's blob values (`resolve`): its object-store refs fetched (zero-copy, each once), rows
    the controller sent as they are. An object that died with its writer reads as `on_lost(its blob ids)`."""
    import ray

    fetch = object_refs(refs)
    try:
        got = ray.get(fetch, timeout=timeout_s) if fetch else []
    except ray.exceptions.ObjectLostError:  # one of them died with its writer: fetched one by one
        got = []
        for r in fetch:
            try:
                got.append(ray.get(r, timeout=timeout_s))
            except ray.exceptions.ObjectLostError:
                got.append(on_lost(blobs_of(refs, r)))
    return resolve(refs, dict(zip(fetch, got, strict=True)), objs)


async def afetch_values(refs: dict[int, Any], wait: Callable[[Any], Awaitable[Any]],
                        on_lost: Callable[[list[int]], Any]) -> dict[int, Any]:
    """`fetch_values` on the caller's event loop; `wait(awaitable)` bounds each wait."""
    import ray

    fetch = object_refs(refs)
    if not fetch:
        return dict(refs)
    try:
        got = list(await wait(asyncio.gather(*fetch)))
    except ray.exceptions.ObjectLostError:
        got = []
        for r in fetch:
            try:
                got.append(await wait(r))
            except ray.exceptions.ObjectLostError:
                got.append(on_lost(blobs_of(refs, r)))
    return resolve(refs, dict(zip(fetch, got, strict=True)), {})


def held_objects(refs: dict[int, Any], objs: dict[int, Any]) -> dict[int, Any]:
    """The coalesced objects a take read (by id, from `objs` as `resolve` filled it), for the
    reader to hold until its next take: that take's answer leaves their refs out (`PartRef`)."""
    return {x.obj: objs[x.obj] for x in refs.values() if isinstance(x, PartRef) and not isinstance(objs[x.obj], LostBlob)}


def blobs_of(refs: dict[int, Any], ref: Any) -> list[int]:
    """The blob ids a take read from object `ref` (several when it holds a coalesced put)."""
    import ray

    return [b for b, x in refs.items()
            if (isinstance(x, ray.ObjectRef) and x == ref) or (isinstance(x, PartRef) and x.ref == ref)]


def resolve(refs: dict[int, Any], got: dict[Any, Any], objs: dict[int, Any]) -> dict[int, Any]:
    """Blob id -> value: a fetched object, its put's entry for a `PartRef`, or what came inline.
    `objs` (coalesced objects by id) has the reader's held objects, read for a `PartRef` without a
    ref; the ones fetched now are added to it."""
    import ray

    out = {}
    for b, x in refs.items():
        if isinstance(x, ray.ObjectRef):
            out[b] = got[x]
        elif isinstance(x, PartRef):
            obj = objs[x.obj] if x.ref is None else objs.setdefault(x.obj, got[x.ref])
            out[b] = obj if isinstance(obj, LostBlob) else obj[x.part]
        else:
            out[b] = x
    return out
