"""TransferQueue: the in-process streaming store where RL stages meet.

Samples are rows, fields are columns. A stage (rollout, reward, train, ...) registers the fields it
reads; a sample becomes *ready* for that stage the moment its written fields cover them, so every
stage can start on partial data instead of waiting for a batch barrier.

Why it is built this way:
- **Event-driven readiness.** `put`/`write`/`release` update, per stage, a priority queue of ready
  `(priority, uid)` entries (in group mode `(group's min priority, group_id)`, pushed when a
  per-(stage, group) ready counter reaches the group's size): a FIFO for entries that arrive in
  priority order (admissions, nearly all) and a heap for the rest. `take` pops the smaller head and skips
  stale entries lazily, so no call ever scans all samples. Waiters sleep until a change makes enough
  samples available for their stage: asyncio waiters on futures resolved with
  `loop.call_soon_threadsafe`, threads on `threading.Event`s; both may be mixed on one store.
- **Leases, not pops.** `take` hands out a lease with a deadline. `ack` marks the samples consumed
  by that stage (they stay for the other stages, or are deleted with `remove=True`); `release`, or
  the lease running out, gives them back with their original priority, so they are served before
  newer ones. A consumer that dies therefore loses nothing, and an expired lease can no longer ack
  samples that were handed to someone else, so nothing is trained twice. Expiry is reaped lazily at
  every call and waits are bounded by the next deadline, so samples come back even if nobody writes.
- **Backpressure.** `put` blocks while the store is full; deleting samples wakes producers.
- **One clock.** Lease deadlines and waits read time only through the injectable `Clock`.

Sampling: sequential (oldest first) is the default; group-complete sampling (whole GRPO groups only)
is `register_stage(..., groups=True)`; length-balanced splitting of a taken batch is in `samplers`.

This module is the public API: each call takes the lock, checks its arguments and waits where it
must. Beside it: `book` (`SampleBook`, the base class: the state and every change to it under the
lock: admission, the readiness index, leasing, lease ends and expiry, removal, waking waiters),
`api` (the public types), `records` (what is kept per sample, group, stage and lease; a stage's
ready queue), `admission` (checks before a put or take), `expiry` (lease deadlines), `waiters`
(sleeping callers), `state` (the checkpoint format), `payload` (value sizes, columnar rows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from asyncflow.transfer_queue.admission import check_new, check_take
from asyncflow.transfer_queue.api import Lease, NewSample, QueueClosed, SampleView, StoreClient
from asyncflow.transfer_queue.book import SampleBook
from asyncflow.transfer_queue.columns import ColumnLease, check_batches, column_batches
from asyncflow.transfer_queue.payload import column_rows, columns_bytes, samples_of
from asyncflow.transfer_queue.records import StageRecord
from asyncflow.transfer_queue.state import check_state, restore, snapshot
from asyncflow.transfer_queue.waiters import On, Tried, Waiter, wait_async, wait_thread

# (the public types are defined in `api` and importable from here, as before)
__all__ = ["Lease", "NewSample", "QueueClosed", "SampleView", "StoreClient", "TransferQueue", "check_state"]


class TransferQueue(SampleBook):
    """Thread-safe streaming store with per-stage readiness, leases and backpressure."""

    in_process = True

    # ----------------------------------------------------------------------------- stages
    def register_stage(self, stage: str, fields: Sequence[str], *, groups: bool = False) -> None:
        """Declare a consumer: a sample is ready for `stage` once all `fields` are written.

        `groups=True` delivers whole groups only. Existing samples are indexed once.
        """
        with self._lock:
            old = self._stages.get(stage)
            if old is not None:
                if set(old.fields) != set(fields) or old.groups != groups:
                    raise ValueError(f"stage {stage!r} is already registered with other fields/mode")
                return
            st = StageRecord(stage, tuple(dict.fromkeys(fields)), groups, self._bit(stage))
            st.wait_s = self._restored_wait_s.pop(stage, 0.0)
            self._stages[stage] = st
            for f in st.fields:
                self._by_field.setdefault(f, []).append(st)
            self._write_stages.clear()
            self._put_stages.clear()
            for s in self._samples.values():
                self._check_ready(st, s)

    # ----------------------------------------------------------------------------- producers
    async def put(self, samples: list[NewSample], timeout: float | None = None) -> list[int]:
        """Admit samples and return their uids; waits while the store is too full (backpressure)."""
        return await wait_async(self._clock, self._lock, lambda on: self._put_or_wait(samples, on), timeout,
                                "room in the store")

    def put_blocking(self, samples: list[NewSample], timeout: float | None = None) -> list[int]:
        """`put` for plain threads."""
        return wait_thread(self._clock, self._lock, lambda on: self._put_or_wait(samples, on), timeout,
                           "room in the store")

    def put_columns_blocking(self, columns: dict[str, Any], group_ids: Sequence[int], group_size: int,
                             timeout: float | None = None) -> list[int]:
        """Put a columnar batch (each value an array or list with one row per sample): sample i
        gets row i of every column, a view. Same as `put_blocking` of the rows, and a columnar take
        (`take_columns_blocking`) hands consecutive rows back as slices of these columns."""
        rows = column_rows(columns, len(group_ids))
        samples = samples_of(rows, group_ids, group_size)
        live = self._samples.__contains__

        def index(uids: list[int]) -> None:  # (under the lock, so no take sees the rows unindexed)
            self._columns.add(uids, columns, rows, live)

        nbytes = columns_bytes(rows, columns)
        return wait_thread(self._clock, self._lock, lambda on: self._put_or_wait(samples, on, index, nbytes), timeout,
                           "room in the store")

    def _put_or_wait(self, samples: list[NewSample], on: On | None, then: Callable[[list[int]], None] | None = None,
                     nbytes: int | None = None) -> Tried[list[int]]:
        with self._lock:
            self._check_open()
            self._reap()
            check_new(samples, self.capacity, self._groups, self._reserved)
            if len(self._samples) + len(samples) <= self.capacity:
                uids = self._insert_many(samples, nbytes)
                if then is not None:
                    then(uids)
                return uids, None, None
            assert on is not None
            w = Waiter(len(samples), self._put_waiters, on)
            self._put_waiters.append(w)
            return None, w, self._wake_at()

    def reserve_uids(self, n: int) -> int:
        """Reserve `n` consecutive uids for a client to assign itself (pipelined puts); returns the first."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"reserve_uids: n must be an int >= 1, got {n!r}")
        with self._lock:
            start = self._next_uid
            self._next_uid += n
            self._reserved.add(start, n)
            return start

    def write(self, uid: int, fields: dict[str, Any], *, version: int | None = None) -> None:
        """Set fields of a live sample; `version` lowers the sample's version to min(current, version)."""
        with self._lock:
            self._reap()
            s = self._samples.get(uid)
            if s is None:
                raise KeyError(uid)
            self._write_locked(s, fields, version)

    # ----------------------------------------------------------------------------- consumers
    async def take(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                   lease_s: float | None = None, min_version: int | None = None,
                   fields_extra: Sequence[str] = ()) -> Lease:
        """Lease up to `max_samples` samples ready for `stage`; wait until `min_samples` are available.

        Counts are in samples and include `lease.expired`. Group stages never split a group, so when
        groups shrank by removals the lease may hold fewer than `min_samples`. Raises `WaitTimeout`
        naming the stage after `timeout` seconds, `QueueClosed` once closed.
        """
        args = (stage, max_samples, min_samples, lease_s, min_version, tuple(fields_extra))
        what = f"{min_samples} sample(s) ready for stage {stage!r}"
        start = self._clock.now()
        try:
            return await wait_async(self._clock, self._lock, lambda on: self._take_or_wait(*args, on),
                                    timeout, what)
        finally:
            self._add_wait(stage, start)

    async def take_each(self, stage: str, max_samples: int, *, timeout: float | None = None,
                        lease_s: float | None = None, min_version: int | None = None,
                        fields_extra: Sequence[str] = (), room: Callable[[], int] | None = None) -> list[Lease]:
        """Up to `max_samples` samples (whole groups for group stages) as one lease each, so each can
        be completed on its own: waits for the first, then takes what is ready. One call instead of
        one per free slot (a round trip each on Ray), and one pass under the lock for all of them.
        `room`: how many the caller would take if woken now (a rollout worker's free slots, which
        grow while it waits), read by a put that decides how many waiting takers its samples serve
        (`wake_in_turn`); without it, `max_samples`."""
        args = (stage, max_samples, lease_s, min_version, tuple(fields_extra), room)
        what = f"1 sample(s) ready for stage {stage!r}"
        start = self._clock.now()
        try:
            return await wait_async(self._clock, self._lock, lambda on: self._take_each_or_wait(*args, on),
                                    timeout, what)
        finally:
            self._add_wait(stage, start)

    def take_each_nowait(self, stage: str, max_samples: int, *, lease_s: float | None = None,
                         min_version: int | None = None, fields_extra: Sequence[str] = ()) -> list[Lease]:
        """`take_each` without waiting: the leases of what is ready now (possibly none). For code on
        the store's own event loop that refills a slot the moment it frees (e.g. in a done callback),
        without a round through a waiting task."""
        return self._take_each_or_wait(stage, max_samples, lease_s, min_version, tuple(fields_extra), None,
                                       None)[0] or []

    def _take_each_or_wait(self, stage: str, max_samples: int, lease_s: float | None, min_version: int | None,
                           extra: tuple[str, ...], room: Callable[[], int] | None,
                           on: On | None) -> Tried[list[Lease]]:
        """As many one-sample (one-group) leases as are ready, up to `max_samples` samples; or a
        waiter for the first. The same leases as one `take(stage, 1)` after another."""
        with self._lock:
            self._check_open()
            st = self._stage(stage)
            check_take(st, max_samples, 1, self.capacity, self._max_group_size)
            self._reap()
            out: list[Lease] = []
            budget = max_samples
            if not st.groups and min_version is None:  # the rollout refill: one sample per lease
                deadline = self._clock.now() + (self.lease_timeout_s if lease_s is None else lease_s)
                names = st.view_fields(extra)
                while budget > 0 and st.depth >= 1:
                    one = self._lease_one(st, deadline, names)
                    if one is None:
                        break
                    out.append(one)
                    budget -= 1
            while budget >= 1 and st.depth >= 1:  # one sample, or one whole group, per lease
                lease = self._lease(st, budget if st.groups else 1, lease_s, min_version, extra, max_keys=1)
                if lease is None:
                    break
                out.append(lease)
                budget -= _count(lease)
            if out or on is None:
                return out or None, None, None
            w = Waiter(1, st.waiters, on, max_samples, room)
            st.waiters.append(w)
            return None, w, self._wake_at()

    def take_blocking(self, stage: str, max_samples: int, *, min_samples: int = 1,
                      timeout: float | None = None, lease_s: float | None = None,
                      min_version: int | None = None, fields_extra: Sequence[str] = ()) -> Lease:
        """`take` for plain threads."""
        args = (stage, max_samples, min_samples, lease_s, min_version, tuple(fields_extra))
        what = f"{min_samples} sample(s) ready for stage {stage!r}"
        start = self._clock.now()
        try:
            return wait_thread(self._clock, self._lock, lambda on: self._take_or_wait(*args, on), timeout, what)
        finally:
            self._add_wait(stage, start)

    def take_nowait(self, stage: str, max_samples: int, *, min_samples: int = 1, lease_s: float | None = None,
                    min_version: int | None = None, fields_extra: Sequence[str] = ()) -> Lease | None:
        """`take` without waiting: None when fewer than `min_samples` are available."""
        args = (stage, max_samples, min_samples, lease_s, min_version, tuple(fields_extra))
        return self._take_or_wait(*args, None)[0]

    def take_columns_blocking(self, stage: str, max_samples: int, *, min_samples: int = 1,
                              timeout: float | None = None, lease_s: float | None = None,
                              fields_extra: Sequence[str] = ()) -> ColumnLease:
        """`take_blocking` with the fields as blocks of columns (`columns.ColumnLease`)."""
        lease = self.take_blocking(stage, max_samples, min_samples=min_samples, timeout=timeout, lease_s=lease_s,
                                   fields_extra=fields_extra)
        return ColumnLease(lease, self._columns.gather(lease.samples))

    def iter_columns(self, stage: str, batch: int, total: int, *, timeout: float | None = None,
                     lease_s: float | None = None, fields_extra: Sequence[str] = (),
                     readahead: int = 0) -> Iterator[ColumnLease]:
        """Take `total` samples of `stage` as columnar leases of `batch` samples (the last one what is
        left), each as `take_columns_blocking` with `min_samples` = its size; ack each one.
        `readahead` is for the Ray client's reader (`RayTransferQueue.iter_columns`); in process a
        take costs no round trip, so each batch is taken when the caller asks for it."""
        check_batches(stage, batch, total, readahead)
        return column_batches(self.take_columns_blocking, stage, batch, total, timeout=timeout, lease_s=lease_s,
                              fields_extra=fields_extra)

    async def take_columns(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                           lease_s: float | None = None, fields_extra: Sequence[str] = ()) -> ColumnLease:
        """`take` with the fields as blocks of columns (`columns.ColumnLease`)."""
        lease = await self.take(stage, max_samples, min_samples=min_samples, timeout=timeout, lease_s=lease_s,
                                fields_extra=fields_extra)
        return ColumnLease(lease, self._columns.gather(lease.samples))

    def _add_wait(self, stage: str, start: float) -> None:
        with self._lock:
            if stage in self._stages:
                self._stages[stage].wait_s += self._clock.now() - start

    def _take_or_wait(self, stage: str, max_samples: int, min_samples: int, lease_s: float | None,
                      min_version: int | None, extra: tuple[str, ...], on: On | None) -> Tried[Lease]:
        with self._lock:
            self._check_open()
            st = self._stage(stage)
            check_take(st, max_samples, min_samples, self.capacity, self._max_group_size)
            self._reap()
            lease = None
            if st.depth >= min_samples:
                lease = self._lease(st, max_samples, lease_s, min_version, extra)
            if lease is not None or on is None:
                return lease, None, None
            w = Waiter(min_samples, st.waiters, on, max_samples)
            st.waiters.append(w)
            return None, w, self._wake_at()

    # ----------------------------------------------------------------------------- lease ends
    def ack(self, lease: Lease, *, remove: bool = False) -> bool:
        """Mark the lease's samples consumed by its stage (`remove=True` deletes them).

        Returns False, touching nothing, when the lease had already ended (expired, released or
        acked): its samples may since have been leased to someone else.
        """
        with self._lock:
            self._reap()
            rec = self._leases.pop(lease.id, None)
            if rec is None:
                return False
            self._consume(rec, remove)
            return True

    def complete(self, lease: Lease, writes: dict[int, dict[str, Any]], *,
                 versions: dict[int, int] | None = None, remove: bool = False) -> bool:
        """Write each sample's results, then ack the lease: one atomic step (one round trip on Ray).

        Nothing is written when the lease had already ended (its samples may be someone else's by
        now), so a result lands exactly once. Samples deleted meanwhile are skipped.
        """
        with self._lock:
            self._reap()
            rec = self._leases.pop(lease.id, None)
            if rec is None:
                return False
            for uid, fields in writes.items():
                s = self._samples.get(uid)
                if s is not None:
                    self._write_locked(s, fields, None if versions is None else versions.get(uid))
            self._consume(rec, remove)
            return True

    def complete_and_take(self, lease: Lease, fields: dict[str, Any], *, version: int | None, stage: str,
                          fields_extra: Sequence[str] = ()) -> tuple[bool, Lease | None]:
        """`complete(lease, {uid: fields}, versions={uid: version})` of a one-sample lease, then
        `take_each_nowait(stage, 1)` of a sample stage, in one step: the per-sample hot path of queue
        scheduling (a request ends; its engine slot takes the next sample) with one lock, one expiry
        check and no per-call dicts. Returns whether the lease was still live (False: nothing was
        written, as with `complete`) and the next sample's lease, or None when none is ready or the
        store is closed."""
        with self._lock:
            st = self._stages.get(stage) or self._stage(stage)  # (the lookup inline; `_stage` raises)
            if st.groups:
                raise ValueError(f"complete_and_take: stage {stage!r} takes whole groups")
            now = self._clock.now()
            fifo, heap = self._expiry.fifo, self._expiry.heap
            if (fifo and fifo[0][0] <= now) or (heap and heap[0][0] <= now):  # (`_reap`'s test, inline)
                self._reap()
            rec = self._leases.get(lease.id)
            if rec is not None:
                if len(rec.uids) != 1 or rec.groups:
                    raise ValueError(f"complete_and_take: lease {lease.id} holds {len(rec.uids)} samples, not 1")
                del self._leases[lease.id]
                s = self._samples.get(rec.uids[0])
                if s is not None:  # (deleted meanwhile: skipped)
                    self._write_locked(s, fields, version)
                    name = rec.stage  # `_consume(rec, False)` for its one sample, inlined
                    if s.taken.get(name) == rec.id:
                        del s.taken[name]
                        rst = self._stages[name]
                        rst.leased -= 1
                        s.consumed |= rst.bit
            if self._closed:
                return rec is not None, None
            nxt = None
            if st.depth >= 1:
                nxt = self._lease_one(st, now + self.lease_timeout_s, st.view_fields(tuple(fields_extra)))
            return rec is not None, nxt

    def __contains__(self, uid: object) -> bool:
        """Whether sample `uid` is live (put and not yet removed)."""
        with self._lock:
            return uid in self._samples

    def lease_live(self, lease_id: int) -> bool:
        """Whether the lease is still held (not acked, released or expired)."""
        with self._lock:
            self._reap()
            return lease_id in self._leases

    def renew(self, leases: Iterable[Lease], lease_s: float | None = None) -> None:
        """Move each live lease's deadline to `lease_s` (default `lease_timeout_s`) from now: a holder
        that is alive but slow (a long train step, a long episode) keeps what it holds. Leases that
        already ended are skipped; a deadline never moves earlier."""
        with self._lock:
            self._reap()
            deadline = self._clock.now() + (self.lease_timeout_s if lease_s is None else lease_s)
            for lease in leases:
                rec = self._leases.get(lease.id)
                if rec is not None and deadline > rec.deadline:
                    rec.deadline = deadline
                    self._push_expiry(deadline, rec.id)  # (its old entry is skipped when it comes due)

    def release(self, lease: Lease) -> bool:
        """Give the samples back to the lease's stage, keeping their priority. False if already ended."""
        with self._lock:
            rec = self._leases.pop(lease.id, None)
            if rec is None:
                return False
            self._release(rec)
            return True

    # ----------------------------------------------------------------------------- removal
    def remove(self, uids: Iterable[int]) -> None:
        """Delete samples regardless of stage (unknown uids are ignored); wakes producers."""
        with self._lock:
            self._remove_many(uids)

    # ----------------------------------------------------------------------------- closing
    def close(self) -> None:
        """Refuse further takes and puts and wake every waiter (they raise `QueueClosed`)."""
        with self._lock:
            self._closed = True
            self._wake_all_waiters()

    def replace_values(self, fix: Callable[[dict[str, Any]], dict[str, Any] | None]) -> int:
        """Give every live sample the field values `fix(fields)` returns (None: unchanged); returns how
        many changed. The names must stay the same: readiness, leases and marks are untouched. For a
        store that must swap values it can no longer serve (the Ray controller's slots into objects
        whose owner died) for ones that say so."""
        with self._lock:
            n = 0
            for s in self._samples.values():
                new = fix(s.fields)
                if new is not None:
                    if new.keys() != s.fields.keys():
                        raise ValueError(f"replace_values: sample {s.uid}'s field names changed")
                    s.fields = new
                    n += 1
            return n

    def drop_all(self) -> int:
        """Delete every sample of a closed store at once (ending its leases) and return how many
        there were: a finished run's leftovers, admitted and never trained. Freed here, they are
        gone before the run's owner lowers the GC threshold again; left in place, the first young
        collection after that scans all of them (~0.2 s for a 49,152-sample store on the 2-core VM)."""
        with self._lock:
            if not self._closed:
                raise RuntimeError("drop_all: the store is still open (close it first)")
            n = len(self._samples)
            if self._on_remove is not None:
                for s in self._samples.values():
                    self._on_remove(s.fields)
            self._samples.clear()
            self._columns.clear()
            self._groups.clear()
            self._leases.clear()
            self._expiry.clear()
            for st in self._stages.values():
                st.heap.clear()
                st.fifo.clear()
                st.queued.clear()
                st.depth = st.leased = 0
            return n

    # ----------------------------------------------------------------------------- introspection
    def size(self) -> int:
        with self._lock:
            return len(self._samples)

    def ready_count(self, stage: str) -> int:
        """Samples available to `stage` now (in complete groups, for group stages)."""
        with self._lock:
            self._reap()  # (an expired lease's samples are available again)
            return self._stage(stage).depth

    def in_flight(self, stage: str) -> int:
        """Live samples currently leased by `stage`."""
        with self._lock:
            self._reap()
            return self._stage(stage).leased

    def metrics(self) -> dict[str, float]:
        with self._lock:
            self._reap()
            out: dict[str, float] = {}
            for st in self._stages.values():
                out[f"depth/{st.name}"] = float(st.depth)
                out[f"leased/{st.name}"] = float(st.leased)
                out[f"wait_s/{st.name}"] = st.wait_s
            out["samples"] = float(len(self._samples))
            out["groups_put"] = float(self._next_group)  # group ids are numbered from 0: groups admitted so far
            out["bytes_put"] = float(self._bytes_put)
            out["expired_leases"] = float(self._expired_leases)
            # grows with every put, write, take and lease end: unchanged means no sample moved
            out["changes"] = float(self._changes + self._next_lease + self._next_uid)
            return out

    def metrics_async(self) -> asyncio.Future[dict[str, float]]:
        """`metrics`, read now, as an awaitable that is already done (awaiting it does not yield):
        the same call as the Ray client's, which answers later."""
        done: asyncio.Future[dict[str, float]] = asyncio.get_running_loop().create_future()
        done.set_result(self.metrics())
        return done

    # ----------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """All live samples with fields, versions, priorities and consumed marks; leases are dropped.
        `next_group_id` is one past the highest group id ever put: with one feeder numbering groups
        in order, the position in its prompt stream that this snapshot is consistent with."""
        with self._lock:
            # running totals that `metrics()` reports, so a resumed run's continue (they restarted at 0)
            totals = {"bytes_put": self._bytes_put, "expired_leases": self._expired_leases,
                      "wait_s": {name: st.wait_s for name, st in self._stages.items()}}
            return snapshot(self._samples.values(), self._groups, self._bits, self._next_uid, self._next_group,
                            totals)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore into an empty store; samples leased at save time become available again. A state
        that is not what `state_dict` writes is refused before anything changes (`check_state`)."""
        check_state(state)
        with self._lock:
            if self._samples or self._leases:
                raise ValueError("load_state_dict needs an empty transfer queue")
            got = restore(state, self._bit)
            self._next_uid, self._next_group = got.next_uid, got.next_group
            self._bytes_put, self._expired_leases = got.bytes_put, got.expired_leases
            for name, waited in got.wait_s.items():
                if name in self._stages:
                    self._stages[name].wait_s = waited
                else:  # (a stage registered after the restore takes it then)
                    self._restored_wait_s[name] = waited
            self._groups.update(got.groups)
            self._max_group_size = max(self._max_group_size, got.max_group_size)
            self._samples.update(got.samples)
            for s in self._samples.values():
                for st in self._stages.values():
                    self._check_ready(st, s)


def _count(lease: Lease) -> int:
    return len(lease.samples) + len(lease.expired)
