"""TransferQueue across processes: a controller actor for metadata, Ray's object store for data.

```
 producer process                   controller actor (metadata only)           consumer process
 put(samples) ─ ray.put(payload) ─► [uid, group, readiness, leases, versions] ◄─ take(stage, B)
              ─ put(meta, ref) ───►  fields = slots (blob id, row)          ──► lease + blob refs
                                                                               ray.get(refs): zero-copy
```

Why this split (measured with `asyncflow bench store`, docs/performance.md): the controller is one
single-threaded actor that every stage talks to, so it must never touch bulk data. A producer puts
a payload large enough to matter (`inline_max_bytes`, default 16 KiB) into the object store once, and
the controller keeps only a *slot* (blob id, row) per field; a consumer receives the blob refs its
lease needs and reads the arrays zero-copy from shared memory. Small payloads (one response's token
ids) travel inline in the call, which is cheaper than a `ray.put`. A blob is released when the last
live sample that points into it is deleted.

The client has the in-process `TransferQueue`'s API, so the workflow code is the same on both
placements. Mutations that need no answer (`write`, `complete`, `ack`, `release`, `remove`) are
sent without waiting; a failure inside them is counted in `metrics()["op_errors"]`. Queued updates
ride on the client's next take or metrics read when one comes first (`op_queue`). Takes and puts
wait in the controller with the caller's timeout, and the client waits at most `rpc_grace_s` longer
before deciding the controller is gone.

Leases of a dead consumer: a client created inside an actor registers that actor as the owner of
its leases; the controller pings owners that hold leases every `owner_check_s` seconds and releases
everything a dead owner held, so a consumer actor that dies loses nothing. The lease deadline
remains the backstop (e.g. for a driver that hangs rather than dies).

This module is the client; the actor is `ray_controller.StoreController` (importable from here too)
and what travels between them (slots, packed rows, compacted views) is in `ray_data`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue.api import Lease, NewSample, QueueClosed, SampleView
from asyncflow.transfer_queue.columns import (
    ColumnLease,
    bare_views,
    blocks_from_slots,
    check_batches,
    column_batches,
)
from asyncflow.transfer_queue.op_queue import Op, OpQueue
from asyncflow.transfer_queue.payload import rows_of
from asyncflow.transfer_queue.put_buffer import Part, PutBuffer
from asyncflow.transfer_queue.ray_controller import GC_THRESHOLD, StoreController
from asyncflow.transfer_queue.ray_data import (
    LostBlob,
    afetch_values,
    expand_views,
    fetch_values,
    held_objects,
    pack_rows,
    slot_value,
    stack_columns,
    value_nbytes,
)

_ERRORS_PASSED_THROUGH = (WaitTimeout, QueueClosed, KeyError, ValueError)


class RayTransferQueue:
    """Client of a `StoreController` actor with the same API as the in-process `TransferQueue`.

    Picklable: pass it to actors; each process's copy talks to the same controller.
    """

    in_process = False

    def __init__(self, handle: Any, *, inline_max_bytes: int = 16 * 1024, rpc_grace_s: float = 60.0,
                 data_plane: str = "object_store", put_window: int = 2) -> None:
        if data_plane not in ("controller", "object_store"):
            raise ValueError(f"data_plane must be 'controller' or 'object_store', got {data_plane!r}")
        self.handle = handle
        self.data_plane = data_plane
        self.put_window = put_window
        self._pending: collections.deque[tuple[Any, float | None]] = collections.deque()
        # write, complete, ack, ...: sent without waiting, coalesced, carried by takes (`op_queue`)
        self._updates = OpQueue(lambda ops: self.handle.apply.remote(ops))
        self._uid_next = 0
        self._uid_end = 0
        self.inline_max_bytes = inline_max_bytes
        self.rpc_grace_s = rpc_grace_s
        self._owner: str | None = None
        self._owner_known = False
        self._puts = PutBuffer(self._send_parts)  # columnar puts, coalesced (`put_buffer`)
        # coalesced objects the last blocking take read, by id (`PartRef`): the next one that reads
        # them gets no ref again (replaced, never changed in place: a take works on its snapshot)
        self._held: dict[int, Any] = {}

    @classmethod
    def create(cls, capacity: int = 4096, lease_timeout_s: float = 600.0, *, owner_check_s: float = 2.0,
               num_cpus: float = 0.0, name: str | None = None, scheduling_strategy: Any = None,
               gc_threshold: int = GC_THRESHOLD, **kwargs: Any) -> RayTransferQueue:
        """Start a controller actor (max_concurrency high: every waiting take is a pending call).

        `gc_threshold`: the controller process's young-generation GC threshold (0: Python's 700;
        `ray_controller.GC_THRESHOLD` says why it is higher)."""
        import ray

        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 10_000}
        if scheduling_strategy is not None:
            opts["scheduling_strategy"] = scheduling_strategy
        if name is not None:
            opts["name"] = name
        actor: Any = ray.remote(StoreController)
        handle = actor.options(**opts).remote(capacity, lease_timeout_s, owner_check_s, gc_threshold)
        ray.get(handle.ping.remote(), timeout=120)
        return cls(handle, **kwargs)

    def __reduce__(self) -> Any:
        return (_rebuild, (self.handle, self.inline_max_bytes, self.rpc_grace_s, self.data_plane, self.put_window))

    # ------------------------------------------------------------------ helpers
    def _get_owner(self) -> str | None:
        """The current actor's id, registered with the controller once (None in a driver)."""
        if not self._owner_known:
            import ray

            self._owner_known = True
            ctx = ray.get_runtime_context()
            actor_id = ctx.get_actor_id()
            if actor_id is not None:
                self._owner = actor_id
                self.handle.register_owner.remote(actor_id, ctx.current_actor)
        return self._owner

    def _limit(self, timeout: float | None) -> float | None:
        return None if timeout is None else timeout + self.rpc_grace_s

    def _get(self, ref: Any, timeout: float | None, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self._limit(timeout))
        except ray.exceptions.GetTimeoutError:
            raise WaitTimeout(f"the store controller did not answer {what} within {self._limit(timeout):.0f} s") from None
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc) from None

    async def _aget(self, ref: Any, timeout: float | None, what: str) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, self._limit(timeout))
        except asyncio.TimeoutError:
            raise WaitTimeout(f"the store controller did not answer {what} within {self._limit(timeout):.0f} s") from None
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc) from None

    def _fetch(self, refs: dict[int, Any], objs: dict[int, Any] | None = None) -> dict[int, Any]:
        """A take's blob values (`ray_data.fetch_values`; an object lost with its writer: `_lost`)."""
        return fetch_values(refs, {} if objs is None else objs, self.rpc_grace_s, self._lost)

    async def _afetch(self, refs: dict[int, Any]) -> dict[int, Any]:
        """`_fetch` on the caller's event loop (bounded by `rpc_grace_s` as well)."""
        return await afetch_values(refs, lambda aw: self._aget(aw, 0.0, "a take's data"), self._lost)

    def _lost(self, blobs: list[int]) -> LostBlob:
        """Blobs that died with the process that put them (a rollout actor Ray restarted, before its
        supervisor told the controller): read as `LOST` values, and the controller told too."""
        self._updates.add("lose_blobs", (blobs,))
        return LostBlob()

    @staticmethod
    def _fill(compact: Any, values: dict[int, Any]) -> Lease:
        lid, stage, deadline, samples, expired = compact
        return Lease(lid, stage, expand_views(samples, values), expand_views(expired, values), deadline)

    def _uids(self, n: int) -> list[int]:
        """Client-assigned uids from a reserved range, so a put can return before the controller answers."""
        if self._uid_end - self._uid_next < n:
            block = max(n, 4096)
            self._uid_next = int(self._get(self.handle.reserve_uids.remote(block), 60, "reserve_uids"))
            self._uid_end = self._uid_next + block
        start = self._uid_next
        self._uid_next += n
        return list(range(start, start + n))

    def _put_args(self, samples: list[NewSample], timeout: float | None) -> tuple[Any, ...]:
        uids = [s.uid for s in samples] if all(s.uid is not None for s in samples) else self._uids(len(samples))
        meta = ([s.group_id for s in samples], [s.group_size for s in samples], [s.priority for s in samples], uids)
        dicts = [s.fields for s in samples]
        if self.data_plane == "object_store":
            return (meta, *pack_rows(dicts, self.inline_max_bytes), timeout)
        payload, names, nbytes, _ = pack_rows(dicts, 1 << 62, put=False)
        if sum(map(sum, nbytes)) if isinstance(nbytes, list) else int(nbytes.sum()) <= self.inline_max_bytes:
            return (meta, payload, names, nbytes, None, timeout)
        cols = stack_columns(dicts) if len(dicts) > 1 and isinstance(names[0], str) else None
        return (meta, None, names, nbytes, None, timeout, dicts if cols is None else cols)

    # ------------------------------------------------------------------ API (same as TransferQueue)
    def register_stage(self, stage: str, fields: Sequence[str], *, groups: bool = False) -> None:
        self._get(self.handle.register_stage.remote(stage, list(fields), groups), 60, "register_stage")

    async def put(self, samples: list[NewSample], timeout: float | None = None) -> list[int]:
        """Admit samples; returns their uids as soon as at most `put_window` puts are in flight.

        Pipelined: the uids come from a reserved range, so the call does not wait for the controller
        unless `put_window` earlier puts are still unanswered (that wait is the backpressure). An
        error of a pipelined put (closed store, timeout) is raised by a later put or by `flush`.
        """
        if self._uid_end - self._uid_next < len(samples):  # (awaited here: `_uids` would block the loop)
            block = max(len(samples), 4096)
            self._uid_next = int(await self._aget(self.handle.reserve_uids.remote(block), 60, "reserve_uids"))
            self._uid_end = self._uid_next + block
        args = self._put_args(samples, timeout)
        self._pending.append((self.handle.put.remote(*args), timeout))
        while len(self._pending) > self.put_window:
            ref, t = self._pending.popleft()
            await self._aget(ref, t, "put")
        return list(args[0][3])

    def put_blocking(self, samples: list[NewSample], timeout: float | None = None) -> list[int]:
        """`put` for plain threads."""
        args = self._put_args(samples, timeout)
        self._pending.append((self.handle.put.remote(*args), timeout))
        while len(self._pending) > self.put_window:
            ref, t = self._pending.popleft()
            self._get(ref, t, "put")
        return list(args[0][3])

    def put_columns_blocking(self, columns: dict[str, Any], group_ids: Sequence[int], group_size: int,
                             timeout: float | None = None) -> list[int]:
        """`TransferQueue.put_columns_blocking`: the columns go into the object store as they are (no
        per-sample dicts, no re-stacking). Pipelined like `put_blocking`, and puts made within
        `coalesce_s` of each other share one `ray.put` and one controller call (`put_buffer`)."""
        n = len(group_ids)
        names = list(columns)
        per_row = []
        for k in names:
            col = columns[k]
            if len(col) != n:
                raise ValueError(f"column {k!r} has {len(col)} rows, expected {n} (one per group id)")
            per_row.append(int(col.nbytes) // max(n, 1) if isinstance(col, np.ndarray) else value_nbytes(col[0]) if n else 0)
        if n * sum(per_row) <= self.inline_max_bytes:
            return self.put_blocking(rows_of(columns, group_ids, group_size), timeout=timeout)
        uids = self._uids(n)
        cols = {k: (v if isinstance(v, np.ndarray) else list(v)) for k, v in columns.items()}
        part: Part = (list(group_ids), group_size, uids, names, per_row)
        self._puts.add(part, cols, n * sum(per_row), timeout)
        while len(self._pending) > self.put_window:
            ref, t = self._pending.popleft()
            self._get(ref, t, "put")
        return uids

    def _send_parts(self, parts: list[Part], columns: list[dict[str, Any]], timeout: float | None) -> None:
        """One `ray.put` of the buffered puts' columns and one controller call (may run on the timer thread)."""
        import ray

        ref = ray.put(tuple(columns))
        self._pending.append((self.handle.put_parts.remote(parts, [ref], timeout), timeout))

    def flush(self) -> None:
        """Wait until every earlier call of this client has been applied (read-your-writes: reads
        call it first); raises the first error of a pipelined put."""
        self._puts.send()
        while self._pending:
            ref, t = self._pending.popleft()
            self._get(ref, t, "put")
        ops = self._updates.drain()
        if ops:
            self._get(ops, 0.0, "earlier updates")

    async def flush_async(self) -> None:
        self._puts.send()
        while self._pending:
            ref, t = self._pending.popleft()
            await self._aget(ref, t, "put")
        ops = self._updates.drain()
        if ops:
            await self._aget(asyncio.gather(*ops), 0.0, "earlier updates")

    def _before_take(self) -> bool:
        """Send queued updates; True if the take must first wait for them (`OpQueue.unsettled`) or
        for this client's puts."""
        self._puts.send()
        self._updates.send()
        return self._updates.unsettled or bool(self._pending)

    def _carried(self) -> tuple[list[Op], list[Op]]:
        """(first, after): the queued updates for the next take or metrics read (`OpQueue.carried`);
        none ride while this client's puts are unanswered."""
        return self._updates.carried(bool(self._pending))

    async def _ready_to_read(self) -> tuple[list[Op], list[Op]]:
        """Before a take or metrics read on an event loop: the updates it carries (`_carried`), after
        waiting for this client's earlier calls it must see applied (`_before_take`)."""
        carried = self._carried()
        if self._before_take():
            await self.flush_async()
        return carried

    def _ready_to_read_blocking(self) -> tuple[list[Op], list[Op]]:
        """`_ready_to_read` for plain threads."""
        carried = self._carried()
        if self._before_take():
            self.flush()
        return carried

    async def _waiting(self, ref: Any, timeout: float | None, what: str) -> Any:
        """A take's answer; meanwhile queued updates go out after `coalesce_s`, not `ride_along_s`."""
        with self._updates.taking():
            return await self._aget(ref, timeout, what)

    def _take_call(self, stage: str, max_samples: int, min_samples: int, timeout: float | None,
                   lease_s: float | None, min_version: int | None, fields_extra: Sequence[str],
                   carried: tuple[list[Any], list[Any]], held: dict[int, Any] | None = None) -> Any:
        first, after = carried
        return self.handle.take.remote(stage, max_samples, min_samples, timeout, lease_s, min_version,
                                       list(fields_extra), self._get_owner(), first or None, after or None,
                                       list(held) if held else None)

    def _take_held(self, stage: str, max_samples: int, min_samples: int, timeout: float | None,
                   lease_s: float | None, min_version: int | None, fields_extra: Sequence[str],
                   what: str) -> tuple[Any, dict[int, Any]]:
        """A blocking take that leaves out the refs of coalesced objects this client read last time
        (`_held`); returns the compacted lease and its blob values."""
        carried = self._ready_to_read_blocking()
        held = self._held
        ref = self._take_call(stage, max_samples, min_samples, timeout, lease_s, min_version, fields_extra, carried,
                              held)
        compact, refs = self._get(ref, timeout, what)
        objs = dict(held)
        values = self._fetch(refs, objs)
        self._held = held_objects(refs, objs)
        return compact, values

    def _send_batches(self, stage: str, sizes: list[int], timeout: float | None, lease_s: float | None,
                      fields_extra: Sequence[str]) -> tuple[Any, dict[int, Any], int]:
        """A `take_batches` call, sent: (its answer's ref, the held objects it named, kept until it is
        read: its answer leaves their refs out, how many samples it asked for)."""
        first, after = self._ready_to_read_blocking()
        held = self._held
        ref = self.handle.take_batches.remote(stage, sizes, timeout, lease_s, list(fields_extra), self._get_owner(),
                                              first or None, after or None, list(held) if held else None)
        return ref, held, sum(sizes)

    def _receive_batches(self, sent: tuple[Any, dict[int, Any], int], timeout: float | None,
                         what: str) -> tuple[list[ColumnLease], int]:
        """A `take_batches` answer as column leases, and how many of the samples asked for it did not
        give (the batches that were not ready)."""
        ref, held, asked = sent
        got = self._get(ref, timeout, what)
        objs = dict(held)  # (filled as the leases are read: a later lease's `PartRef`s name earlier ones' objects)
        out, given, now_held = [], 0, {}
        for compact, refs in got:
            values = self._fetch(refs, objs)
            now_held.update(held_objects(refs, objs))
            taken = _columns(compact, values)
            given += len(taken.lease.samples)
            out.append(taken)
        self._held = now_held
        return out, asked - given

    def _drop_batches(self, ref: Any, wait_s: float = 1.0) -> None:
        """A `take_batches` call nobody will read: its leases released once it is answered (a read-ahead
        of ready batches is, within ms), or, still waiting for samples after `wait_s`, the call
        cancelled and waited for (up to `wait_s` again), so that samples put after this returns are not
        leased to it; an answer that beat the cancel has its leases released too (a lease it gets
        later all the same ends at its deadline)."""
        import ray

        ready, _ = ray.wait([ref], timeout=wait_s)
        if not ready:
            ray.cancel(ref)
            ready, _ = ray.wait([ref], timeout=wait_s)
            if not ready:
                return
        with contextlib.suppress(Exception):  # (it failed: it holds no lease)
            for compact, _ in ray.get(ref):
                self._updates.add("release", (compact[0], compact[1]))

    async def take(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                   lease_s: float | None = None, min_version: int | None = None,
                   fields_extra: Sequence[str] = ()) -> Lease:
        carried = await self._ready_to_read()
        ref = self._take_call(stage, max_samples, min_samples, timeout, lease_s, min_version, fields_extra, carried)
        lease, refs = await self._waiting(ref, timeout, f"take({stage!r})")
        return self._fill(lease, await self._afetch(refs))

    async def take_each(self, stage: str, max_samples: int, *, timeout: float | None = None,
                        lease_s: float | None = None, min_version: int | None = None,
                        fields_extra: Sequence[str] = (), room: Callable[[], int] | None = None) -> list[Lease]:
        """See `TransferQueue.take_each`: one call, one lease per sample (or group). `room` stays
        here (the controller cannot call back into this process): its waiter counts `max_samples`."""
        first, after = await self._ready_to_read()
        ref = self.handle.take_each.remote(stage, max_samples, timeout, lease_s, min_version, list(fields_extra),
                                           self._get_owner(), first + after or None)
        got = await self._waiting(ref, timeout, f"take_each({stage!r})")
        # Blob ids (>= 0) name object-store refs that leases share: fetched once for all of them.
        # Negative keys name one lease's own rows gathered by the controller (`_hand_out`): each
        # lease numbers them from -2, so they stay with their lease (merged, the last lease's rows
        # replaced every other's).
        refs: dict[int, Any] = {b: x for _, r in got for b, x in r.items() if b >= 0}
        values = await self._afetch(refs)
        return [self._fill(compact, {**r, **values}) for compact, r in got]

    def take_blocking(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                      lease_s: float | None = None, min_version: int | None = None,
                      fields_extra: Sequence[str] = ()) -> Lease:
        lease, values = self._take_held(stage, max_samples, min_samples, timeout, lease_s, min_version, fields_extra,
                                        f"take({stage!r})")
        return self._fill(lease, values)

    def take_columns_blocking(self, stage: str, max_samples: int, *, min_samples: int = 1,
                              timeout: float | None = None, lease_s: float | None = None,
                              fields_extra: Sequence[str] = ()) -> ColumnLease:
        """`take_blocking` with the fields as blocks of columns (`columns.ColumnLease`): the blobs'
        columns sliced (zero-copy views of the object store), no per-sample dicts."""
        compact, values = self._take_held(stage, max_samples, min_samples, timeout, lease_s, None, fields_extra,
                                          f"take_columns({stage!r})")
        return _columns(compact, values)

    def iter_columns(self, stage: str, batch: int, total: int, *, timeout: float | None = None,
                     lease_s: float | None = None, fields_extra: Sequence[str] = (),
                     readahead: int = 4) -> Iterator[ColumnLease]:
        """`TransferQueue.iter_columns`, reading up to `readahead` batches ahead of the caller.

        One call to the controller asks for up to `readahead` batches (the first waited for, the
        others taken only if ready then), and the next call goes out as soon as one is answered,
        before its batches are handed out. A Ray call costs ~1 ms of CPU and a 1-4 ms round trip on
        a small machine: a reader of many small batches then pays it once per call, not once per
        batch, and not while it works on a batch. Batches read ahead hold their leases from when the
        controller answers (up to 2 x `readahead` at a time); acks ride on the next call. A caller
        that stops early gets every lease it was not handed released. `readahead=0`: one
        `take_columns_blocking` per batch, when the caller asks for it."""
        check_batches(stage, batch, total, readahead)
        if readahead == 0:
            yield from column_batches(self.take_columns_blocking, stage, batch, total, timeout=timeout,
                                      lease_s=lease_s, fields_extra=fields_extra)
            return
        what = f"iter_columns({stage!r})"
        left = total  # samples not yet asked for (or asked for and not given: asked again)
        ready: collections.deque[ColumnLease] = collections.deque()
        ahead = None

        def send() -> Any:
            nonlocal left
            sizes = [min(batch, left - i * batch) for i in range(min(readahead, -(-left // batch)))]
            left -= sum(sizes)
            return self._send_batches(stage, sizes, timeout, lease_s, fields_extra)

        try:
            while left > 0 or ahead is not None or ready:
                if not ready:
                    got, missing = self._receive_batches(ahead if ahead is not None else send(), timeout, what)
                    ahead = None
                    left += missing
                    ready.extend(got)
                    if left > 0:
                        ahead = send()
                yield ready.popleft()
        finally:
            for taken in ready:
                self.release(taken.lease)
            if ahead is not None:
                self._drop_batches(ahead[0])

    async def take_columns(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                           lease_s: float | None = None, fields_extra: Sequence[str] = ()) -> ColumnLease:
        """`take` with the fields as blocks of columns (`take_columns_blocking`)."""
        carried = await self._ready_to_read()
        ref = self._take_call(stage, max_samples, min_samples, timeout, lease_s, None, fields_extra, carried)
        compact, refs = await self._waiting(ref, timeout, f"take_columns({stage!r})")
        return _columns(compact, await self._afetch(refs))

    def take_nowait(self, stage: str, max_samples: int, *, min_samples: int = 1, lease_s: float | None = None,
                    min_version: int | None = None, fields_extra: Sequence[str] = ()) -> Lease | None:

        if self._before_take():
            self.flush()
        ref = self.handle.take_nowait.remote(stage, max_samples, min_samples, lease_s, min_version,
                                             list(fields_extra), self._get_owner())
        got = self._get(ref, 0.0, f"take_nowait({stage!r})")
        if got is None:
            return None
        lease, refs = got
        return self._fill(lease, self._fetch(refs))

    def write(self, uid: int, fields: dict[str, Any], *, version: int | None = None) -> None:
        """Sent without waiting; a write to a deleted sample is dropped (as `complete` does)."""
        payload, names, nbytes, ref = pack_rows([fields], self.inline_max_bytes)
        self._updates.add("write", (uid, None if payload is None else payload[0], names, nbytes, ref, version))

    def complete(self, lease: Lease, writes: dict[int, dict[str, Any]], *, versions: dict[int, int] | None = None,
                 remove: bool = False) -> bool:
        """Sent without waiting (returns True); see `TransferQueue.complete`."""
        uids = list(writes)
        payload, names, nbytes, ref = pack_rows([writes[u] for u in uids], self.inline_max_bytes)
        self._updates.add("complete", (lease.id, lease.stage, uids, payload, names, nbytes, ref, versions, remove))
        return True

    def complete_and_take(self, lease: Lease, fields: dict[str, Any], *, version: int | None, stage: str,
                          fields_extra: Sequence[str] = ()) -> tuple[bool, Lease | None]:
        """`complete` of a one-sample lease, then `take_nowait(stage, 1)`: the in-process store's fused
        call, here two calls and a blocking round trip (so the rollout stage batches its refills instead).
        None for the next lease when none is ready or the store is closed, as in process."""
        written = self.complete(lease, {s.uid: fields for s in lease.samples},
                                versions=None if version is None else {s.uid: version for s in lease.samples})
        try:
            return written, self.take_nowait(stage, 1, fields_extra=fields_extra)
        except QueueClosed:
            return written, None

    def ack(self, lease: Lease, *, remove: bool = False) -> bool:
        """Sent without waiting (returns True). An ack of an ended lease acks nothing, as in process;
        with `remove` its samples are removed anyway (in process the caller sees False and does it)."""
        uids = [s.uid for s in (*lease.samples, *lease.expired)] if remove else None
        self._updates.add("ack", (lease.id, lease.stage, remove, uids))
        return True

    def release(self, lease: Lease) -> bool:
        self._updates.add("release", (lease.id, lease.stage))
        return True

    def remove(self, uids: Iterable[int]) -> None:
        self._updates.add("remove", (list(uids),))

    def renew(self, leases: Iterable[Lease], lease_s: float | None = None) -> None:
        """Sent without waiting; see `TransferQueue.renew`."""
        self._updates.add("renew", ([lease.id for lease in leases], lease_s))

    def release_owner(self, owner: str) -> int:
        """Release every lease held by `owner` (an actor id) now, e.g. when a supervisor saw it die."""
        self.flush()
        return int(self._get(self.handle.release_owner.remote(owner), 60, "release_owner"))

    def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError, QueueClosed, WaitTimeout):
            self.flush()
        with contextlib.suppress(ray.exceptions.RayActorError):
            self._get(self.handle.close.remote(), 60, "close")

    def size(self) -> int:
        self.flush()
        return int(self._get(self.handle.size.remote(), 60, "size"))

    def ready_count(self, stage: str) -> int:
        self.flush()
        return int(self._get(self.handle.ready_count.remote(stage), 60, "ready_count"))

    def in_flight(self, stage: str) -> int:
        self.flush()
        return int(self._get(self.handle.in_flight.remote(stage), 60, "in_flight"))

    async def metrics_async(self) -> dict[str, float]:
        """`metrics` for a caller on an event loop (a blocking `ray.get` there stalls the loop), in one
        call that carries this client's queued updates (`_carried`)."""
        first, after = await self._ready_to_read()
        return dict(await self._aget(self.handle.metrics.remote(first + after or None), 60, "metrics"))

    def metrics(self) -> dict[str, float]:
        self.flush()
        return dict(self._get(self.handle.metrics.remote(), 60, "metrics"))

    def errors(self) -> tuple[int, str]:
        """(count, last message) of failed fire-and-forget operations."""
        self.flush()
        n, msg = self._get(self.handle.errors.remote(), 60, "errors")
        return int(n), str(msg)

    def state_dict(self) -> dict[str, Any]:
        """As `TransferQueue.state_dict`, with every field's value fetched from the object store."""
        self.flush()

        state, refs = self._get(self.handle.state_dict.remote(), 600, "state_dict")
        values = self._fetch(refs)
        for d in state["samples"]:
            d["fields"] = {k: slot_value(values, v, k, d["uid"]) for k, v in d["fields"].items()}
        return dict(state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._get(self.handle.load_state_dict.remote(state), 600, "load_state_dict")

    def kill(self) -> None:
        """Stop the controller actor (its data goes with it)."""
        import ray

        ray.kill(self.handle)


def _rebuild(handle: Any, inline_max_bytes: int, rpc_grace_s: float, data_plane: str, put_window: int) -> RayTransferQueue:
    return RayTransferQueue(handle, inline_max_bytes=inline_max_bytes, rpc_grace_s=rpc_grace_s, data_plane=data_plane,
                            put_window=put_window)


def _columns(compact: Any, values: dict[int, Any]) -> ColumnLease:
    """A take's compacted lease (no version floor: nothing expired) as a `ColumnLease`."""
    lid, stage, deadline, samples, _ = compact
    return ColumnLease(Lease(lid, stage, bare_views(samples), [], deadline), blocks_from_slots(samples, values))


def _unwrap(exc: Exception) -> Exception:
    """The original store exception (timeout, closed, ...) out of Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, _ERRORS_PASSED_THROUGH):
        return cause
    return exc


__all__ = ["RayTransferQueue", "SampleView", "StoreController"]
