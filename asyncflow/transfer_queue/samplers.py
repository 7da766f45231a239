"""Samplers: how a taken batch is split among workers (data-parallel ranks, micro-batches).

Which samples a stage receives is decided by the store itself:
- sequential (the default): lowest priority first, i.e. oldest admitted first;
- group-complete: `TransferQueue.register_stage(stage, fields, groups=True)` delivers whole GRPO
  groups only, once every sample of the group is ready.

What remains is splitting a lease's samples into k parts: `split_sequential` keeps order,
`balance_by_length` equalises the token count per part so no rank waits on a straggler, and
`balance_equal_counts` does so while every part keeps `split_sequential`'s size (data-parallel ranks
must run the same number of passes: the FSDP engine splits each mini-batch with it).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def split_sequential(n: int, k: int) -> list[list[int]]:
    """Split indices 0..n-1 into k contiguous parts whose sizes differ by at most one."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    base, extra = divmod(n, k)
    parts, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        parts.append(list(range(start, end)))
        start = end
    return parts


def balance_by_length(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Partition indices of `lengths` into k bins with balanced sums.

    Greedy longest-processing-time: longest first into the currently lightest bin (ties: the bin
    with fewer items, then the lower bin index). Every bin is non-empty when len(lengths) >= k.
    Indices inside a bin are ascending.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, 0, b) for b in range(k)]  # (sum, item count, bin)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, count, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (total + lengths[i], count + 1, b))
    return [sorted(b) for b in bins]


def balance_equal_counts(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Partition indices of `lengths` into k parts of `split_sequential`'s sizes (differing by at most
    one) with balanced sums: longest first, each into the lightest part that still has room (ties:
    the lower part index). Indices inside a part are ascending."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    room = [len(p) for p in split_sequential(len(lengths), k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k) if room[b]]  # (sum, part)
    heapq.heapify(heap)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        total, b = heapq.heappop(heap)
        parts[b].append(i)
        room[b] -= 1
        if room[b]:
            heapq.heappush(heap, (total + lengths[i], b))
    return [sorted(p) for p in parts]
