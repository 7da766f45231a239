"""SampleBook: the transfer queue's bookkeeping and every change made to it under its lock.

It holds what a `TransferQueue` keeps (samples, groups, stages, leases, lease deadlines, waiters,
counters) and the machinery that changes it without waiting: admitting validated samples, the
per-stage readiness index, handing out leases, ending them (ack, release, lazy expiry), removal,
and waking waiters. Every method runs with `_lock` held by its caller; `store.TransferQueue`, its
subclass, is the public API that takes the lock, checks arguments and waits.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

from asyncflow.clock import Clock, RealClock
from asyncflow.transfer_queue.admission import UidReservations
from asyncflow.transfer_queue.api import Lease, NewSample, QueueClosed, SampleView
from asyncflow.transfer_queue.columns import ColumnIndex
from asyncflow.transfer_queue.expiry import ExpiryQueue
from asyncflow.transfer_queue.payload import payload_bytes
from asyncflow.transfer_queue.records import GroupRecord, LeaseRecord, SampleRecord, StageRecord
from asyncflow.transfer_queue.waiters import Waiter, wake, wake_in_turn


class SampleBook:
    """The state of a transfer queue and its changes; each method expects the caller to hold `_lock`."""

    def __init__(self, capacity: int = 4096, lease_timeout_s: float = 600.0, clock: Clock | None = None,
                 on_remove: Callable[[dict[str, Any]], None] | None = None):
        """`on_remove(fields)` is called (under the store's lock) for every deleted sample; the Ray
        placement uses it to drop object-store references once no live sample needs them."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.lease_timeout_s = lease_timeout_s
        self._clock: Clock = clock if clock is not None else RealClock()
        self._lock = threading.Lock()
        self._samples: dict[int, SampleRecord] = {}
        self._groups: dict[int, GroupRecord] = {}
        self._stages: dict[str, StageRecord] = {}
        self._bits: dict[str, int] = {}  # stage name -> its bit in sample marks (also names only restored)
        self._by_field: dict[str, list[StageRecord]] = {}  # field -> stages that read it (readiness index)
        self._write_stages: dict[tuple[str, ...], tuple[StageRecord, ...]] = {}  # written names -> stages reading any
        # a new sample's field names -> (sample stages, group stages) its fields make ready
        self._put_stages: dict[tuple[str, ...], tuple[tuple[StageRecord, ...], tuple[StageRecord, ...]]] = {}
        self._leases: dict[int, LeaseRecord] = {}
        self._expiry = ExpiryQueue()  # (deadline, lease id) of every lease
        self._put_waiters: list[Waiter] = []
        self._latest_wake = -math.inf  # the latest wake time handed to a waiter since all were last woken
        self._wake_epoch = 0  # counts `_wake_all_waiters` calls
        self._next_uid = 0
        self._reserved = UidReservations()  # uid ranges handed to clients (`reserve_uids`)
        self._next_group = 0  # one past the highest group id ever put (a feeder's position, checkpoints)
        self._next_lease = 1
        self._max_group_size = 1
        self._bytes_put = 0
        self._expired_leases = 0
        # writes and lease ends so far; with the uids and leases handed out, every change to a
        # sample's state is counted (`changes` in `metrics`: a stall watchdog's progress signal)
        self._changes = 0
        self._restored_wait_s: dict[str, float] = {}  # restored wait totals of stages not registered yet
        self._closed = False
        self._on_remove = on_remove
        self._columns = ColumnIndex()  # columnar puts, for columnar takes (`columns`)

    # ----------------------------------------------------------------------------- lookups and checks
    def _bit(self, name: str) -> int:
        """The bit that marks stage `name` in a sample's `ready`/`avail`/`consumed` (allocated on first
        sight: a restored sample may name a stage registered later)."""
        bit = self._bits.get(name)
        if bit is None:
            bit = self._bits[name] = 1 << len(self._bits)
        return bit

    def _stage(self, stage: str) -> StageRecord:
        st = self._stages.get(stage)
        if st is None:
            raise ValueError(f"stage {stage!r} is not registered (known: {sorted(self._stages)})")
        return st

    def _check_open(self) -> None:
        if self._closed:
            raise QueueClosed("the transfer queue is closed")

    # ----------------------------------------------------------------------------- admission and writes
    def _insert_many(self, samples: list[NewSample], nbytes: int | None = None) -> list[int]:
        """Admit validated samples; returns their uids. Per initial-fields dict (by identity: a feeder
        lists one `NewSample` n times) its payload bytes are worked out once (`nbytes`: the put's,
        worked out by the caller, e.g. from a columnar put's columns), and per set of field
        names (kept across puts until a stage is registered) the stages they make ready. A new
        sample is in no lease and consumed by no stage, so a sample stage its fields make ready
        simply counts it and queues it here, and wakes its waiters once, after the whole put (the
        feeder's path); a group stage goes through `_check_ready` (the sample may complete its
        group)."""
        uids: list[int] = []
        memo: dict[int, tuple[tuple[StageRecord, ...], tuple[StageRecord, ...], int]] = {}
        touched: dict[str, StageRecord] = {}
        groups, by_uid = self._groups, self._samples
        try:  # (validated before: nothing below should fail; if it does, what was admitted is announced)
            for ns in samples:
                if ns.uid is None:
                    uid = self._next_uid
                    self._next_uid = uid + 1
                else:
                    uid = ns.uid
                    self._reserved.use(uid)
                priority = float(uid) if ns.priority is None else float(ns.priority)
                s = SampleRecord(uid, ns.group_id, priority, dict(ns.fields))
                g = groups.get(ns.group_id)
                if g is None:  # (not setdefault: that would build a GroupRecord per sample and drop all but one)
                    g = groups[ns.group_id] = GroupRecord(ns.group_size)
                if ns.group_id >= self._next_group:
                    self._next_group = ns.group_id + 1
                g.put += 1
                g.uids.append(uid)
                if ns.group_size > self._max_group_size:
                    self._max_group_size = ns.group_size
                by_uid[uid] = s
                known = memo.get(id(ns.fields))
                if known is None:
                    fields = s.fields
                    names = tuple(fields)
                    split = self._put_stages.get(names)
                    if split is None:
                        ready = [st for st in self._stages.values() if all(f in fields for f in st.fields)]
                        split = self._put_stages[names] = (tuple(st for st in ready if not st.groups),
                                                           tuple(st for st in ready if st.groups))
                    known = memo[id(ns.fields)] = (*split, 0 if nbytes is not None else payload_bytes(fields))
                flat, grouped, size = known
                self._bytes_put += size
                for st in flat:  # `_check_ready` + `_sync_sample` for a new sample, inlined
                    s.ready |= st.bit
                    s.avail |= st.bit
                    st.depth += 1
                    st.push(priority, uid)
                    touched[st.name] = st
                for st in grouped:
                    self._check_ready(st, s)
                uids.append(uid)
            self._bytes_put += nbytes or 0
        finally:
            for st in touched.values():
                self._notify(st)
        return uids

    def _write_locked(self, s: SampleRecord, fields: dict[str, Any], version: int | None) -> None:
        s.fields.update(fields)
        self._bytes_put += payload_bytes(fields)
        self._changes += 1
        if version is not None:
            s.version = version if s.version is None else min(s.version, version)
        # a write can only make ready the stages that read one of the fields it wrote; which those
        # are is worked out once per set of written names (a run writes a handful of kinds)
        key = tuple(fields)
        stages = self._write_stages.get(key)
        if stages is None:
            stages = self._write_stages[key] = tuple(
                dict.fromkeys(st for f in key for st in self._by_field.get(f, ())))
        ready = s.ready  # (each stage's check sets only its own bit)
        for st in stages:
            if not ready & st.bit:
                self._check_ready(st, s)

    # ----------------------------------------------------------------------------- readiness index
    def _check_ready(self, st: StageRecord, s: SampleRecord) -> None:
        """Index `s` for `st` the first time its fields cover the stage's fields."""
        name = st.name
        if s.ready & st.bit:
            return
        fields = s.fields
        for f in st.fields:
            if f not in fields:
                return
        s.ready |= st.bit
        if st.groups:
            g = self._groups[s.group_id]
            ready = g.ready[name] = g.ready.get(name, 0) + 1
            if ready < len(g.uids) and not g.avail.get(name):
                return  # the group is not complete yet (and was not available): nothing changes
            self._sync_group(st, s.group_id, g)
        else:
            self._sync_sample(st, s)

    def _sync_sample(self, st: StageRecord, s: SampleRecord) -> None:
        """Bring the stage's depth, heap and waiters in line with whether `s` is available now."""
        bit = st.bit
        now = bool(s.ready & bit) and st.name not in s.taken and not (s.consumed & bit)
        if now == bool(s.avail & bit):
            return
        if not now:
            s.avail &= ~bit
            st.depth -= 1
            return
        s.avail |= bit
        st.depth += 1
        st.push(s.priority, s.uid)
        self._notify(st)

    def _sync_group(self, st: StageRecord, gid: int, g: GroupRecord) -> None:
        """Same as `_sync_sample` for a group (pushed once all its live members are ready)."""
        now, was = g.available(st.name), g.avail.get(st.name, 0)
        if now == was:
            return
        st.depth += now - was
        g.avail[st.name] = now
        if now > 0:
            st.push(min(self._samples[u].priority for u in g.uids), gid)
        if now > was:
            self._notify(st)

    # ----------------------------------------------------------------------------- leasing
    def _lease(self, st: StageRecord, max_samples: int, lease_s: float | None, min_version: int | None,
               extra: tuple[str, ...], max_keys: int | None = None) -> Lease | None:
        keys = st.pop_keys(max_samples, max_keys, self._samples, self._groups)
        if not keys:
            return None
        rec = LeaseRecord(self._next_lease, st.name, [], [], 0.0)
        self._next_lease += 1
        rec.deadline = self._clock.now() + (self.lease_timeout_s if lease_s is None else lease_s)
        names = st.view_fields(extra)
        lease = Lease(rec.id, st.name, [], [], rec.deadline)
        if not st.groups:
            self._claim_samples(st, rec, keys, names, min_version, lease)
            keys = []
        # whole groups: each member is marked taken (inlined: the per-sample part of the reward and
        # train stages' takes); the group's offer ends in `_sync_group`
        name, lid, samples, groups = st.name, rec.id, self._samples, self._groups
        cover = frozenset(names)  # a sample with no other field is viewed by a plain copy (C speed)
        for key in keys:
            g = groups[key]
            views = []
            oldest_version = None
            for uid in g.uids:
                s = samples[uid]
                s.taken[name] = lid
                f = s.fields
                v = s.version
                if v is not None and (oldest_version is None or v < oldest_version):
                    oldest_version = v
                if cover.issuperset(f):
                    fields = dict(f)
                else:
                    fields = {}
                    for k in names:
                        if k in f:
                            fields[k] = f[k]
                views.append(SampleView(uid, s.group_id, v, fields))
            rec.uids.extend(g.uids)
            st.leased += len(views)
            rec.groups.append(key)
            g.leased[name] = lid
            self._sync_group(st, key, g)
            old = min_version is not None and oldest_version is not None and oldest_version < min_version
            (lease.expired if old else lease.samples).extend(views)
        self._leases[rec.id] = rec
        self._push_expiry(rec.deadline, rec.id)
        return lease

    def _lease_one(self, st: StageRecord, deadline: float, names: tuple[str, ...]) -> Lease | None:
        """`_lease(st, 1, ...)` for a sample stage without a version floor, in one function: the
        per-sample hot path of queue scheduling (a freed engine slot takes the next sample). It
        inlines `StageRecord.pop_keys` and `_claim_samples` for one sample (built from those two calls,
        `take_each_nowait(stage, 1)` measured 13.5 instead of 11.8 us here); the randomized model
        check in tests/test_transfer_queue.py recounts what this path leaves after every take."""
        heap, fifo, queued, samples, bit = st.heap, st.fifo, st.queued, self._samples, st.bit
        while heap or fifo:
            uid = (heapq.heappop(heap) if heap and (not fifo or heap[0] < fifo[0]) else fifo.popleft())[1]
            queued.discard(uid)
            s = samples.get(uid)
            if s is not None and s.avail & bit:
                break
        else:
            return None
        lid = self._next_lease
        self._next_lease = lid + 1
        name = st.name
        s.taken[name] = lid
        s.avail &= ~bit
        st.depth -= 1
        st.leased += 1
        self._leases[lid] = LeaseRecord(lid, name, [uid], [], deadline)
        self._push_expiry(deadline, lid)
        f = s.fields
        view = {}  # (a loop, not a comprehension: no function call for the usual one to three names)
        for k in names:
            if k in f:
                view[k] = f[k]
        return Lease(lid, name, [SampleView(uid, s.group_id, s.version, view)], [], deadline)

    def _push_expiry(self, deadline: float, lid: int) -> None:
        if deadline < self._latest_wake:  # a waiter sleeps past this lease's expiry: let it retry then
            self._latest_wake = -math.inf
            self._wake_all_waiters()
        self._expiry.push(deadline, lid, self._leases)

    def _claim_samples(self, st: StageRecord, rec: LeaseRecord, uids: list[int], names: tuple[str, ...],
                       min_version: int | None, lease: Lease) -> None:
        """Mark each uid of a sample (non-group) stage's lease taken and add its view to `lease`: each
        was available (its queue entry offered it), so it simply stops being."""
        name, lid, samples, clear = st.name, rec.id, self._samples, ~st.bit
        for uid in uids:
            s = samples[uid]
            s.taken[name] = lid
            s.avail &= clear
            f = s.fields
            fields = {}
            for k in names:
                if k in f:
                    fields[k] = f[k]
            view = SampleView(uid, s.group_id, s.version, fields)
            old = min_version is not None and s.version is not None and s.version < min_version
            (lease.expired if old else lease.samples).append(view)
        rec.uids.extend(uids)
        st.depth -= len(uids)
        st.leased += len(uids)

    # ----------------------------------------------------------------------------- lease ends
    def _consume(self, rec: LeaseRecord, remove: bool) -> None:
        """End an acked lease: its live samples (and groups) are consumed by its stage."""
        live = self._end_lease(rec)
        name = rec.stage
        if rec.groups:
            for g in map(self._groups.get, rec.groups):
                if g is not None and g.uids:
                    g.consumed.add(name)
        if remove:  # (its samples are deleted at once: no need to mark them)
            self._remove_many([s.uid for s in live])
            return
        bit = self._stages[name].bit
        for s in live:
            s.consumed |= bit


    def _release(self, rec: LeaseRecord) -> None:
        st = self._stages[rec.stage]
        for s in self._end_lease(rec):
            if not st.groups:
                self._sync_sample(st, s)
        for gid in rec.groups:
            g = self._groups.get(gid)
            if g is not None:
                self._sync_group(st, gid, g)

    def _end_lease(self, rec: LeaseRecord) -> list[SampleRecord]:
        """Clear the lease's marks on its live samples and groups; return those samples."""
        self._changes += 1
        st = self._stages[rec.stage]
        live = []
        name, lid, samples = rec.stage, rec.id, self._samples
        for uid in rec.uids:
            s = samples.get(uid)
            if s is not None and s.taken.get(name) == lid:
                del s.taken[name]
                live.append(s)
        st.leased -= len(live)
        for gid in rec.groups:
            g = self._groups.get(gid)
            if g is not None and g.leased.get(rec.stage) == rec.id:
                del g.leased[rec.stage]
        return live

    def _reap(self) -> None:
        """Release every lease whose deadline has passed (lazy expiry)."""
        now = self._clock.now()
        fifo, heap = self._expiry.fifo, self._expiry.heap
        if not ((fifo and fifo[0][0] <= now) or (heap and heap[0][0] <= now)):
            return
        leases = self._leases
        for lid in self._expiry.pop_due(now):
            rec = leases.get(lid)
            if rec is not None and rec.deadline <= now:  # (a renewed lease has a later entry too)
                del leases[lid]
                self._expired_leases += 1
                self._release(rec)

    def _wake_at(self) -> float:
        """When a waiter registered now should retry at the latest (the next lease expiry, which may
        make samples available again); remembered so a lease that expires earlier wakes it. With no
        lease live: the soonest a lease taken from now on with the default term can expire. (Not
        never: then every waiter was woken, to retry and fail, by the first lease taken after the
        store had none, a herd of every idle rollout worker at each sync step's start.)"""
        at = self._expiry.next_deadline(self._leases)
        if at is None:
            at = self._clock.now() + self.lease_timeout_s
        if at > self._latest_wake:
            self._latest_wake = at
        return at

    # ----------------------------------------------------------------------------- removal
    def _remove_many(self, uids: Iterable[int]) -> None:
        self._changes += 1
        by_group: dict[int, list[int]] = {}
        for uid in dict.fromkeys(uids):
            s = self._samples.get(uid)
            if s is not None:
                by_group.setdefault(s.group_id, []).append(uid)
        for gid, members in by_group.items():
            g = self._groups[gid]
            if len(members) == len(g.uids) and g.put == g.size:
                self._remove_group(gid, g)  # the usual case: a trained group leaves whole
            else:
                for uid in members:
                    self._remove_one(uid)
        if by_group:
            for st in self._stages.values():
                st.compact(self._samples, self._groups)
            self._notify_put()

    def _remove_group(self, gid: int, g: GroupRecord) -> None:
        """Remove every live member of a fully put group and the group itself: the same counts as
        `_remove_one` of each member, with one pass over the stages instead of one per member."""
        stages, samples = self._stages, self._samples
        for uid in g.uids:
            s = samples.pop(uid)
            self._uncount(s)
            if self._on_remove is not None:
                self._on_remove(s.fields)
        for name, n in g.avail.items():
            stages[name].depth -= n  # the group's offer ends (its heap entries go stale)
        del self._groups[gid]

    def _uncount(self, s: SampleRecord) -> None:
        """A removed sample leaves the depth of the sample stages it was available to and the leased
        count of the stages holding it."""
        if s.avail:
            for st in self._stages.values():
                if s.avail & st.bit:
                    st.depth -= 1
        for name in s.taken:
            self._stages[name].leased -= 1

    def _remove_one(self, uid: int) -> bool:
        s = self._samples.pop(uid, None)
        if s is None:
            return False
        self._uncount(s)
        g = self._groups[s.group_id]
        g.uids.remove(uid)
        g.removed += 1
        for st in self._stages.values():
            if st.groups:
                if s.ready & st.bit:
                    g.ready[st.name] -= 1
                self._sync_group(st, s.group_id, g)
        if not g.uids and g.put == g.size:
            del self._groups[s.group_id]
        if self._on_remove is not None:
            self._on_remove(s.fields)
        return True

    # ----------------------------------------------------------------------------- waiting
    def _wake_all_waiters(self) -> None:
        """Every waiter retries (and, if it still cannot go on, sleeps with a fresh wake time)."""
        self._wake_epoch += 1
        for st in self._stages.values():
            if st.waiters:
                wake(st.waiters, 1 << 62)
        wake(self._put_waiters, 1 << 62)

    def _notify(self, st: StageRecord) -> None:
        if st.waiters:
            epoch = self._wake_epoch  # (a deferred taker goes on if all were woken meanwhile)
            wake_in_turn(st.waiters, st.depth, self._lock, lambda n: st.depth >= n or self._wake_epoch != epoch)

    def _notify_put(self) -> None:
        if self._put_waiters:
            wake(self._put_waiters, self.capacity - len(self._samples))
