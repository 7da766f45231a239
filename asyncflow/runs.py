"""Run-length sequences: compact token columns for simulated responses of thousands of tokens.

Why: the PIPE benchmark keeps hundreds of thousands of simulated responses (median 1,000 tokens,
tail 16,384) live in the real store at once. As Python lists their ids, log-probs and versions would
need tens of GB; as runs (`value x count`) they need a few dozen bytes. `Runs` is a read-only
`Sequence`, so code that reads responses (len, index, iterate, compare with a list) works on either;
`oldest` and `concat` keep the hot paths from expanding runs.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Sequence
from itertools import accumulate, repeat
from typing import Any, overload


class Runs(Sequence[Any]):
    """`values[i]` repeated `counts[i]` times, in order."""

    __slots__ = ("_ends", "_n", "counts", "values")

    def __init__(self, pairs: Sequence[tuple[Any, int]] = ()) -> None:
        values: list[Any] = []
        counts: list[int] = []
        for value, count in pairs:
            if count <= 0:
                continue
            if values and values[-1] == value:
                counts[-1] += count
            else:
                values.append(value)
                counts.append(count)
        self.values = values
        self.counts = counts
        self._n = sum(counts)
        self._ends: list[int] | None = None

    @classmethod
    def _of(cls, values: list[Any], counts: list[int], n: int | None = None) -> Runs:
        """Runs from already merged, positive runs (no checks: for `concat`); `n`: their total, when
        the caller knows it."""
        r = cls.__new__(cls)
        r.values, r.counts, r._n, r._ends = values, counts, sum(counts) if n is None else n, None
        return r

    @property
    def pairs(self) -> list[tuple[Any, int]]:
        """(value, count) per run."""
        return list(zip(self.values, self.counts, strict=True))

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                return list(self)[i]
            return self._window(start, max(start, stop))
        if i == -1 and self._n:
            return self.values[-1]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("Runs index out of range")
        if self._ends is None:
            self._ends = list(accumulate(self.counts))
        return self.values[bisect.bisect_right(self._ends, i)]

    def _window(self, start: int, stop: int) -> Runs:
        last = self._n - self.counts[-1] if self.counts else 0  # where the last run begins
        if start == 0 and stop > last:  # cut inside the last run (a response without its EOS): copy, trim
            values, counts = self.values[:], self.counts[:]
            counts[-1] = stop - last
            return Runs._of(values, counts, stop)
        if start == 0 and stop == last:  # the last run dropped (e.g. a final EOS of its own)
            return Runs._of(self.values[:-1], self.counts[:-1], stop)
        out: list[tuple[Any, int]] = []
        pos = 0
        for v, c in zip(self.values, self.counts, strict=True):
            lo, hi = max(start, pos), min(stop, pos + c)
            if lo < hi:
                out.append((v, hi - lo))
            pos += c
            if pos >= stop:
                break
        return Runs(out)

    def __iter__(self) -> Iterator[Any]:
        for v, c in zip(self.values, self.counts, strict=True):
            yield from repeat(v, c)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Runs):
            return self.values == other.values and self.counts == other.counts
        return isinstance(other, Sequence) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash((tuple(self.values), tuple(self.counts)))

    def __repr__(self) -> str:
        return f"Runs({self.pairs!r})"


def oldest(versions: Sequence[int]) -> int:
    """The smallest version in a per-token version column (-1 when it is empty). (Not `min(...,
    default=-1)`: its keyword costs 0.6 us a call on the 2-core VM, and this runs once per response.)"""
    values = versions.values if isinstance(versions, Runs) else versions
    return min(values) if len(values) else -1


def concat(parts: Sequence[Sequence[Any]]) -> Sequence[Any]:
    """The parts one after the other: `Runs` if every non-empty part is one, else a list. (A `Runs`
    part's length is read from its field, not through `len`: an episode concatenates every turn's
    columns, and a Python-level `__len__` call per part was a third of the cost.)"""
    if len(parts) == 2 and type(parts[0]) is Runs and type(parts[1]) is Runs:
        return _join(parts[0], parts[1])
    live: list[Sequence[Any]] = []
    all_runs = True
    for p in parts:
        if type(p) is Runs:
            if p._n:
                live.append(p)
        elif len(p):
            live.append(p)
            all_runs = all_runs and isinstance(p, Runs)
    if live and all_runs:
        values: list[Any] = []
        counts: list[int] = []
        n = 0
        for p in live:
            n += p._n  # type: ignore[attr-defined]
            pv, pc = p.values, p.counts  # type: ignore[attr-defined]
            if values and values[-1] == pv[0]:
                counts[-1] += pc[0]
                values.extend(pv[1:])
                counts.extend(pc[1:])
            else:
                values.extend(pv)
                counts.extend(pc)
        return Runs._of(values, counts, n)
    out: list[Any] = []
    for p in live:
        out.extend(p)
    return out


def without_end(ids: Sequence[Any], ends: Collection[Any]) -> Sequence[Any]:
    """`ids` without its last item when that is one of `ends` (a turn's text is decoded without its
    end token), else `ids` itself. One call per turn where `len`, `[-1]` and `[:-1]` on `Runs` were
    five Python calls."""
    if type(ids) is Runs:
        n = ids._n
        return ids._window(0, n - 1) if n and ids.values[-1] in ends else ids
    return ids[:-1] if len(ids) and ids[-1] in ends else ids


def _join(a: Runs, b: Runs) -> Runs:
    """`concat([a, b])` of two `Runs` (an episode's context grows by one such join per turn):
    2.2 -> 1.7 us here."""
    av, ac, bv, bc = a.values, a.counts, b.values, b.counts
    if av and bv and av[-1] == bv[0]:
        counts = ac + bc[1:]
        counts[len(ac) - 1] += bc[0]
        return Runs._of(av + bv[1:], counts, a._n + b._n)
    return Runs._of(av + bv, ac + bc, a._n + b._n)


def total(values: Sequence[float]) -> float:
    """Sum of a column without expanding runs."""
    if isinstance(values, Runs):
        return float(sum(v * c for v, c in zip(values.values, values.counts, strict=True)))
    return float(sum(values))
