"""Columnar takes: a lease's fields handed out as blocks of columns instead of one dict per sample.

A block is a run of consecutive lease samples that are consecutive rows of one columnar put
(`put_columns_blocking`): its columns are slices of the put's columns, views with no copy, so a
consumer works on whole columns (a checksum, a collate) at array speed. A sample whose fields do not
all come from one row of a columnar put (put row by row, or a field written since) is a one-row
block of its own values. Concatenated, the blocks' rows are the lease's samples in order.

- In process (`ColumnIndex`): the store records which uids are which rows of which put's columns;
  a take maps its samples back, checking that each field still is the very row object that was put
  (a later `write` replaced it otherwise).
- Across processes (`blocks_from_slots`): the controller keeps a (blob, row) slot per field anyway,
  so the runs are found on the lease's slot array with array operations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from asyncflow.transfer_queue.api import Lease, SampleView


@dataclass(slots=True)
class ColumnLease:
    """What a columnar take returns: the lease (ack, release and renew it as any other) and its
    samples' fields as blocks of columns."""

    lease: Lease
    """Its samples give each row's uid, group and version (their `fields` may be empty: the data is in
    `blocks`)."""
    blocks: list[dict[str, Any]]
    """Runs of rows in the order of `lease.samples`; in a block every field is a column with one entry
    per row: an array where the put column was one (a view of it), else a list."""

    def column(self, name: str) -> Any:
        """Field `name` over all rows: the blocks' columns joined (a copy when there are several)."""
        parts = [b[name] for b in self.blocks]
        if parts and all(isinstance(p, np.ndarray) for p in parts):
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        return [x for p in parts for x in p]


def check_batches(stage: str, batch: int, total: int, readahead: int) -> None:
    """`iter_columns`' arguments, the same for both placements."""
    if batch < 1 or total < 0 or readahead < 0:
        raise ValueError(f"iter_columns({stage!r}): need batch >= 1, total >= 0 and readahead >= 0, "
                         f"got {batch}, {total} and {readahead}")


def column_batches(take: Callable[..., ColumnLease], stage: str, batch: int, total: int,
                   **kwargs: Any) -> Iterator[ColumnLease]:
    """`total` samples of `stage` as columnar takes of `batch` samples (the last one what is left),
    each waiting for its full size: `take(stage, want, min_samples=want, **kwargs)` (arguments
    checked by the caller: `check_batches`)."""
    left = total
    while left > 0:
        want = min(batch, left)
        left -= want
        yield take(stage, want, min_samples=want, **kwargs)


def one_row(fields: dict[str, Any]) -> dict[str, Any]:
    """A one-row block of a sample's own values (an array value becomes a one-row view of itself)."""
    return {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in fields.items()}


class _Block(NamedTuple):
    uids: list[int]
    columns: dict[str, Any]
    rows: dict[str, list[Any]]  # field -> the per-row objects the store's samples hold


class ColumnIndex:
    """Which uids of an in-process store are which rows of which columnar put. A put's block is kept
    until none of its uids is live (checked when the number of blocks has doubled: amortised O(1))."""

    def __init__(self) -> None:
        self._at: dict[int, tuple[_Block, int]] = {}  # uid -> (block, row)
        self._blocks: list[_Block] = []
        self._prune_at = 16

    def add(self, uids: list[int], columns: dict[str, Any], rows: dict[str, list[Any]],
            live: Callable[[int], bool]) -> None:
        """Record a columnar put (`rows[k][i]` is the object sample `uids[i]` holds as field k)."""
        if len(self._blocks) >= self._prune_at:
            self._prune(live)
            self._prune_at = max(16, 2 * len(self._blocks))
        block = _Block(uids, columns, rows)
        self._blocks.append(block)
        self._at.update(zip(uids, ((block, r) for r in range(len(uids))), strict=True))

    def _prune(self, live: Callable[[int], bool]) -> None:
        keep = []
        for b in self._blocks:
            if any(live(u) for u in b.uids):
                keep.append(b)
            else:
                for u in b.uids:
                    self._at.pop(u, None)
        self._blocks = keep

    def __len__(self) -> int:
        """How many puts' blocks are held."""
        return len(self._blocks)

    def clear(self) -> None:
        self._at.clear()
        self._blocks.clear()

    def gather(self, views: Sequence[SampleView]) -> list[dict[str, Any]]:
        """The views' fields as blocks: runs of consecutive rows of one put sliced from its columns."""
        out: list[dict[str, Any]] = []
        run: _Block | None = None
        start = end = 0
        keys: tuple[str, ...] = ()
        at = self._at
        for v in views:
            hit = at.get(v.uid)
            f = v.fields
            if hit is not None:
                block, r = hit
                rows = block.rows
                for k, x in f.items():
                    col = rows.get(k)
                    if col is None or col[r] is not x:
                        hit = None
                        break
            if hit is not None and run is block and r == end and tuple(f) == keys:
                end += 1
                continue
            if run is not None:
                out.append({k: run.columns[k][start:end] for k in keys})
                run = None
            if hit is None:
                out.append(one_row(f))
            else:
                run, start, end, keys = block, r, r + 1, tuple(f)
        if run is not None:
            out.append({k: run.columns[k][start:end] for k in keys})
        return out


def blocks_from_slots(compact: tuple[Any, ...], values: dict[int, Any]) -> list[dict[str, Any]]:
    """A compacted lease (`ray_data.compact_views`) as blocks: a run of samples whose every field is
    the same row of one columnar blob, rows ascending by one, is one slice per field of that blob's
    columns; any other sample is a one-row block (`values`: blob id -> the blob's columns or rows)."""
    uids, _, _, names, slots, inline = compact
    n = len(uids)
    if n == 0:
        return []
    blob, row = slots[:, :, 0], slots[:, :, 1]
    first_b, first_r = blob[:, 0], row[:, 0]
    whole = (blob != -1).all(axis=1) & (blob == first_b[:, None]).all(axis=1) & (row == first_r[:, None]).all(axis=1)
    columnar = np.array([isinstance(values.get(b), dict) for b in first_b.tolist()], dtype=bool)
    whole &= columnar
    joins = np.zeros(n, dtype=bool)
    joins[1:] = whole[1:] & whole[:-1] & (first_b[1:] == first_b[:-1]) & (first_r[1:] == first_r[:-1] + 1)
    starts = np.flatnonzero(~joins).tolist()
    out: list[dict[str, Any]] = []
    for i, j in zip(starts, [*starts[1:], n], strict=True):
        if whole[i]:
            cols, r0 = values[int(first_b[i])], int(first_r[i])
            out.append({k: cols[k][r0:r0 + j - i] for k in names})
            continue
        for s in range(i, j):  # (not one blob row: the sample's own values, as `expand_views` reads them)
            fields = {} if inline[s] is None else dict(inline[s])
            for c, k in enumerate(names):
                b = int(blob[s, c])
                if b != -1:  # (-1: inline; held rows are numbered from -2)
                    got = values[b]
                    fields[k] = got[k][int(row[s, c])] if isinstance(got, dict) else got[int(row[s, c])][k]
            out.append(one_row(fields))
    return out


def bare_views(compact: tuple[Any, ...]) -> list[SampleView]:
    """The compacted lease's samples with uid, group and version only (a columnar take's rows)."""
    uids, gids, versions = compact[0], compact[1], compact[2]
    return [SampleView(u, g, v, {}) for u, g, v in zip(uids, gids, versions, strict=True)]
