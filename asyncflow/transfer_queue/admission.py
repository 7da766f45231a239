"""What a put or a take must pass before the store changes anything: a put's samples checked
(`check_new`), uids reserved for clients that number their own samples (`UidReservations`), and a
take's counts (`check_take`)."""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Mapping

from asyncflow.transfer_queue.api import NewSample
from asyncflow.transfer_queue.records import GroupRecord, StageRecord


class UidReservations:
    """Reserved uid ranges not yet all put. A client uid must lie in one and not be used already
    (else a uid whose sample was removed could be put again)."""

    def __init__(self) -> None:
        self.ranges: dict[int, list[int]] = {}  # start -> [end, how many are left]
        self.starts: list[int] = []  # its keys, ascending (uids are reserved in order)
        self.used: set[int] = set()

    def add(self, start: int, n: int) -> None:
        """Reserve `start .. start + n - 1` (above every range reserved before)."""
        self.ranges[start] = [start + n, n]
        self.starts.append(start)

    def usable(self, uid: int) -> bool:
        """Whether `uid` is reserved and not put yet."""
        return uid not in self.used and self._range(uid) is not None

    def use(self, uid: int) -> None:
        """Mark a usable uid put."""
        start = self._range(uid)
        assert start is not None  # (validated)
        entry = self.ranges[start]
        entry[1] -= 1
        if entry[1] == 0:  # all of the range put: forget it (its uids are then never reserved)
            del self.ranges[start]
            del self.starts[bisect.bisect_left(self.starts, start)]
            self.used.difference_update(range(start, entry[0]))
        else:
            self.used.add(uid)

    def _range(self, uid: int) -> int | None:
        """The start of the outstanding reserved range holding `uid`, if any."""
        i = bisect.bisect_right(self.starts, uid) - 1
        if i < 0:
            return None
        start = self.starts[i]
        return start if uid < self.ranges[start][0] else None


def check_new(samples: list[NewSample], capacity: int, groups: dict[int, GroupRecord],
              reserved: UidReservations) -> None:
    """Everything `SampleBook._insert_many` relies on, checked before anything changes: a put that
    fails leaves the store as it was (it used to admit the samples before the bad one, unannounced)."""
    client_uids: set[int] = set()
    for ns in samples:
        if ns.uid is not None:
            if ns.uid in client_uids or not reserved.usable(ns.uid):
                raise ValueError(f"uid {ns.uid} is in use, was used before or was never reserved")
            client_uids.add(ns.uid)
        if type(ns.fields) is not dict and not isinstance(ns.fields, Mapping):
            raise TypeError(f"group {ns.group_id}: fields must be a mapping, got {type(ns.fields).__name__}")
        if ns.priority is not None:
            try:
                ok = math.isfinite(float(ns.priority))
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"group {ns.group_id}: priority must be a finite number, got {ns.priority!r}")
    if len(samples) > capacity:
        raise ValueError(f"cannot put {len(samples)} samples into a store of capacity {capacity}")
    counts: dict[int, int] = {}
    sizes: dict[int, int] = {}  # group_size of each group this put names (the first sample's)
    for ns in samples:
        gid, size = ns.group_id, ns.group_size
        # (ints, checked here: a str group id failed half-way through admitting the put, and a
        # fractional size made a group that can never be complete)
        # (`type() is int` first: the ABC check costs ~1 us a call, ~15% of a Ray controller's put)
        if (type(gid) is not int and (not isinstance(gid, numbers.Integral) or isinstance(gid, bool))) or gid < 0:
            raise ValueError(f"group_id must be an int >= 0, got {gid!r}")
        if (type(size) is not int and (not isinstance(size, numbers.Integral) or isinstance(size, bool))) or size < 1:
            raise ValueError(f"group {gid}: group_size must be an int >= 1, got {size!r}")
        g = groups.get(gid)
        first = sizes.setdefault(gid, size if g is None else g.size)
        if first != size:  # (one put naming a new group with two sizes made a group that never completes)
            raise ValueError(f"group {gid}: group_size {size} != {first} put before")
        counts[gid] = counts.get(gid, 0) + 1
        if counts[gid] + (g.put if g else 0) > size:
            raise ValueError(f"group {gid}: more than group_size={size} samples put")


def check_take(st: StageRecord, max_samples: int, min_samples: int, capacity: int, max_group_size: int) -> None:
    """A take's counts make sense for stage `st` (group stages never split a group)."""
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"take({st.name!r}): need 1 <= min_samples <= max_samples")
    if min_samples > capacity:
        raise ValueError(f"take({st.name!r}): min_samples {min_samples} > capacity {capacity}")
    if st.groups and max_group_size > max_samples:
        raise ValueError(f"take({st.name!r}): max_samples {max_samples} < group_size {max_group_size}")
