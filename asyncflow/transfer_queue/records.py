"""The store's bookkeeping records: per sample (fields, version, stage marks), per group, per lease,
and per stage with its queue of ready entries (the readiness index `TransferQueue` maintains)."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from asyncflow.transfer_queue.waiters import Waiter


@dataclass(eq=False, slots=True)
class SampleRecord:
    """One live sample as the store keeps it."""

    uid: int
    group_id: int
    priority: float
    fields: dict[str, Any]
    version: int | None = None
    # Stage marks are bit masks over the store's stage bits (`SampleBook._bit`), not sets of
    # names: three sets cost ~650 bytes and three allocations per sample, and the store holds tens
    # of thousands of samples whose every visit is then a few more cache misses.
    ready: int = 0  # stages whose fields are all written
    avail: int = 0  # non-group stages counting it in their depth
    taken: dict[str, int] = field(default_factory=dict)  # stage -> lease id
    consumed: int = 0  # stages that acked it


@dataclass(eq=False, slots=True)
class GroupRecord:
    """One group (the samples answering one prompt): its live members and per-stage counts."""

    size: int
    put: int = 0
    removed: int = 0
    uids: list[int] = field(default_factory=list)  # live members, admission order
    ready: dict[str, int] = field(default_factory=dict)  # group stage -> live members ready
    avail: dict[str, int] = field(default_factory=dict)  # group stage -> samples counted in depth
    leased: dict[str, int] = field(default_factory=dict)  # group stage -> lease id
    consumed: set[str] = field(default_factory=set)

    def available(self, stage: str) -> int:
        """Samples this group offers `stage` now: all of them when complete and free, else 0."""
        expected = self.size - self.removed
        n = len(self.uids)
        complete = n > 0 and n == expected and self.ready.get(stage, 0) == expected
        free = stage not in self.leased and stage not in self.consumed
        return n if complete and free else 0


@dataclass(eq=False)
class StageRecord:
    """A registered stage: the fields it reads, its queue of ready entries, its counts and waiters."""

    name: str
    fields: tuple[str, ...]
    groups: bool
    bit: int  # this stage's bit in a sample's marks (`SampleRecord.ready`, `avail`, `consumed`)
    # ready entries `(priority, uid or group_id)`, stale ones skipped when popped: an entry above the
    # newest in `fifo` (admission order with the default priorities: nearly all) is appended there,
    # cheaper than a heap of tens of thousands; others (a released lease, a group completed out of
    # order) go to `heap`. Both stay sorted, so the smaller head is the next entry.
    heap: list[tuple[float, int]] = field(default_factory=list)
    fifo: deque[tuple[float, int]] = field(default_factory=deque)
    queued: set[int] = field(default_factory=set)  # keys with an entry in heap or fifo
    depth: int = 0  # samples available (in complete groups, for group stages)
    leased: int = 0
    wait_s: float = 0.0
    waiters: list[Waiter] = field(default_factory=list)
    names: dict[tuple[str, ...], tuple[str, ...]] = field(default_factory=dict)  # fields_extra -> fields a view gets

    def view_fields(self, extra: tuple[str, ...]) -> tuple[str, ...]:
        names = self.names.get(extra)
        if names is None:
            names = self.names[extra] = self.fields + tuple(f for f in dict.fromkeys(extra) if f not in self.fields)
        return names

    def push(self, priority: float, key: int) -> None:
        """Queue the entry `(priority, key)` unless `key` has one already."""
        if key not in self.queued:
            self.queued.add(key)
            entry = (priority, key)
            fifo = self.fifo
            if not fifo or entry > fifo[-1]:
                fifo.append(entry)
            else:
                heapq.heappush(self.heap, entry)

    def offers(self, key: int, samples: dict[int, SampleRecord], groups: dict[int, GroupRecord]) -> int:
        """Samples the queue entry `key` offers now (0 means the entry is stale)."""
        if self.groups:
            g = groups.get(key)
            return g.avail.get(self.name, 0) if g is not None else 0
        s = samples.get(key)
        return 1 if s is not None and s.avail & self.bit else 0

    def compact(self, samples: dict[int, SampleRecord], groups: dict[int, GroupRecord]) -> None:
        """Drop stale queue entries once they dominate (removed samples are only dropped lazily)."""
        if len(self.heap) + len(self.fifo) > 2 * self.depth + 64:
            self.heap = [e for e in self.heap if self.offers(e[1], samples, groups) > 0]
            heapq.heapify(self.heap)
            self.fifo = deque(e for e in self.fifo if self.offers(e[1], samples, groups) > 0)
            self.queued = {key for _, key in self.heap}
            self.queued.update(key for _, key in self.fifo)

    def pop_keys(self, max_samples: int, max_keys: int | None, samples: dict[int, SampleRecord],
                 groups: dict[int, GroupRecord]) -> list[int]:
        """Pop the lowest-priority available uids (or whole groups) that fit in `max_samples`, at most
        `max_keys` groups."""
        keys: list[int] = []
        heap, fifo, queued = self.heap, self.fifo, self.queued
        if not self.groups:  # one sample per entry: every live entry fits
            bit = self.bit
            while (heap or fifo) and len(keys) < max_samples:
                key = (heapq.heappop(heap) if heap and (not fifo or heap[0] < fifo[0]) else fifo.popleft())[1]
                queued.discard(key)
                s = samples.get(key)
                if s is not None and s.avail & bit:
                    keys.append(key)
            return keys
        total = 0
        while (heap or fifo) and total < max_samples and (max_keys is None or len(keys) < max_keys):
            from_heap = bool(heap) and (not fifo or heap[0] < fifo[0])
            key = (heap[0] if from_heap else fifo[0])[1]
            n = self.offers(key, samples, groups)
            if n > 0 and total + n > max_samples:
                break  # never split a group, never skip an older group for a newer one
            if from_heap:
                heapq.heappop(heap)
            else:
                fifo.popleft()
            queued.discard(key)
            if n > 0:
                keys.append(key)
                total += n
        return keys


@dataclass(eq=False, slots=True)
class LeaseRecord:
    """One live lease: the samples (and, for a group stage, the groups) it holds until `deadline`."""

    id: int
    stage: str
    uids: list[int]
    groups: list[int]
    deadline: float
