"""Lease deadlines in the order they come due, for the store's lazy expiry: `(deadline, lease id)`
entries, skipped once stale (the lease ended early, or a renewal queued a later entry)."""

from __future__ import annotations

import heapq
from collections import deque

from asyncflow.transfer_queue.records import LeaseRecord


class ExpiryQueue:
    """Deadlines that only grow (the default lease time on a monotonic clock: nearly all) queue in
    order in `fifo`, cheaper than a heap; others go to the `heap`. The earlier head is the next."""

    __slots__ = ("fifo", "heap")

    def __init__(self) -> None:
        self.fifo: deque[tuple[float, int]] = deque()
        self.heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def push(self, deadline: float, lid: int, leases: dict[int, LeaseRecord]) -> None:
        """Queue lease `lid`'s deadline (`leases`: the live leases by id, to drop stale entries)."""
        fifo = self.fifo
        if not fifo or deadline >= fifo[-1][0]:
            fifo.append((deadline, lid))
            if len(fifo) > 2 * len(leases) + 1024:  # mostly leases that ended early or were renewed: drop those
                self.fifo = deque(e for e in fifo if _current(e, leases))
        else:
            heapq.heappush(self.heap, (deadline, lid))
            if len(self.heap) > 2 * len(leases) + 1024:
                self.heap = [e for e in self.heap if _current(e, leases)]
                heapq.heapify(self.heap)

    def pop_due(self, now: float) -> list[int]:
        """The lease ids of every entry due at `now`, taken off the queue (stale ones too)."""
        fifo, heap = self.fifo, self.heap
        due = []
        while fifo and fifo[0][0] <= now:
            due.append(fifo.popleft()[1])
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap)[1])
        return due

    def next_deadline(self, leases: dict[int, LeaseRecord]) -> float | None:
        """The earliest deadline of a live lease, dropping stale entries ahead of it."""
        fifo, heap = self.fifo, self.heap
        while fifo and not _current(fifo[0], leases):
            fifo.popleft()  # (ended, or renewed: its later entry stands)
        while heap and not _current(heap[0], leases):
            heapq.heappop(heap)
        nexts = [q[0][0] for q in (fifo, heap) if q]
        return min(nexts) if nexts else None

    def clear(self) -> None:
        self.fifo.clear()
        self.heap.clear()


def _current(entry: tuple[float, int], leases: dict[int, LeaseRecord]) -> bool:
    """Whether an expiry entry is its lease's deadline now (not ended, not superseded by a renewal)."""
    rec = leases.get(entry[1])
    return rec is not None and rec.deadline == entry[0]
