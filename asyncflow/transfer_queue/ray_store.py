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
sent without waiting; a failure inside them is counted in `metrics()["op_errors"]`. Takes and puts
wait in the controller with the caller's timeout, and the client waits at most `rpc_grace_s` longer
before deciding the controller is gone.

Leases of a dead consumer: a client created inside an actor registers that actor as the owner of
its leases; the controller pings owners that hold leases every `owner_check_s` seconds and releases
everything a dead owner held, so a consumer actor that dies loses nothing. The lease deadline
remains the backstop (e.g. for a driver that hangs rather than dies).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue.api import Lease, NewSample, QueueClosed, SampleView
from asyncflow.transfer_queue.payload import rows_of
from asyncflow.transfer_queue.store import TransferQueue

_ERRORS_PASSED_THROUGH = (WaitTimeout, QueueClosed, KeyError, ValueError)


class _Slot(NamedTuple):
    """Where a field's value lives: row `row` of blob `blob` in the object store. A tuple, not a
    dataclass, because thousands of them are pickled per take; `nbytes` feeds the bytes metric."""

    blob: int
    row: int
    nbytes: int


def _nbytes(v: Any) -> int:
    n = getattr(v, "nbytes", None)
    if isinstance(n, int):
        return n
    if isinstance(v, (list, tuple)):
        return 8 * len(v)
    if isinstance(v, (bytes, str)):
        return len(v)
    return 8


class StoreController:
    """The Ray actor behind `RayTransferQueue`: a `TransferQueue` of metadata and slots."""

    def __init__(self, capacity: int, lease_timeout_s: float, owner_check_s: float = 2.0) -> None:
        self.q = TransferQueue(capacity=capacity, lease_timeout_s=lease_timeout_s, on_remove=self._unref)
        self.blobs: dict[int, list[Any]] = {}  # blob id -> [ObjectRef or None, live rows, held data or None]
        self.next_blob = 0
        self.owners: dict[str, Any] = {}  # owner id -> actor handle
        self.lease_owner: dict[int, str] = {}
        self.leases: dict[int, Lease] = {}
        self.op_errors = 0
        self.last_error = ""
        self.owner_check_s = owner_check_s
        self.blob_writer: dict[int, str] = {}  # blob id -> the owner (actor id) whose process put it
        self.lost_with_writer = 0
        self._watch: asyncio.Task[None] | None = None
        # owner -> how many times its leases were given back (`release_owner`): a take that began
        # before that (a waiting call of the owner's dead process) hands nothing out when it ends
        self.owner_epoch: dict[str, int] = {}
        self.released_by_owner: dict[str, int] = {}  # owner -> leases given back for it so far (all releases)

    # ------------------------------------------------------------------ data slots
    def _add_blob(self, ref: Any, rows: int, held: Any = None) -> int:
        bid = self.next_blob
        self.next_blob += 1
        self.blobs[bid] = [None if ref is None else ref[0], rows, held]
        return bid

    def _unref(self, fields: dict[str, Any]) -> None:
        seen = set()
        for v in fields.values():
            if isinstance(v, _Slot) and v.blob not in seen:
                seen.add(v.blob)
                b = self.blobs.get(v.blob)
                if b is not None:
                    b[1] -= 1
                    if b[1] <= 0:
                        del self.blobs[v.blob]
                        self.blob_writer.pop(v.blob, None)

    def _materialize(self, payload: list[dict[str, Any]] | None, names: Any, nbytes: Any, ref: Any,
                     held: Any = None) -> list[dict[str, Any]]:
        """Field dicts for `put`/`complete`: the payload itself, or one slot per field into a new blob.
        `names` is one list shared by all rows (then `nbytes` is an int array [rows, fields]) or a
        list per row (then `nbytes` is a list per row)."""
        if payload is not None:
            return payload
        if names and isinstance(names[0], str):
            bid = self._add_blob(ref, len(nbytes), held)
            return [{n: _Slot(bid, i, b) for n, b in zip(names, row.tolist(), strict=True)} for i, row in enumerate(nbytes)]
        bid = self._add_blob(ref, len(names), held)
        return [{n: _Slot(bid, i, b) for n, b in zip(ns, bs, strict=True)} for i, (ns, bs) in enumerate(zip(names, nbytes, strict=True))]

    # ------------------------------------------------------------------ API
    def ping(self) -> bool:
        return True

    def register_stage(self, stage: str, fields: Sequence[str], groups: bool) -> None:
        self.q.register_stage(stage, fields, groups=groups)

    def register_owner(self, owner: str, handle: Any) -> None:
        self.owners[owner] = handle
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_owners())

    def reserve_uids(self, n: int) -> int:
        return self.q.reserve_uids(n)

    async def put(self, meta: tuple[list[int], list[int], list[float | None], list[int | None]],
                  payload: list[dict[str, Any]] | None, names: Any, nbytes: Any, ref: Any, timeout: float | None,
                  held: Any = None) -> list[int]:
        fields = self._materialize(payload, names, nbytes, ref, held)
        samples = [NewSample(g, n, f, p, u) for g, n, p, u, f in zip(*meta, fields, strict=True)]
        try:
            return await self.q.put(samples, timeout=timeout)
        except BaseException:  # (a full store's timeout, closed): nothing was admitted, so nothing holds the blob
            for f in fields:
                self._unref(f)
            raise

    async def take(self, stage: str, max_samples: int, min_samples: int, timeout: float | None,
                   lease_s: float | None, min_version: int | None, fields_extra: Sequence[str],
                   owner: str | None) -> tuple[Any, dict[int, Any]]:
        epoch = self.owner_epoch.get(owner, 0) if owner is not None else 0
        lease = await self.q.take(stage, max_samples, min_samples=min_samples, timeout=timeout, lease_s=lease_s,
                                  min_version=min_version, fields_extra=fields_extra)
        if self._orphaned([lease], owner, epoch):
            raise WaitTimeout(f"take for stage {stage!r}: its caller's process died while it waited")
        return self._hand_out(lease, owner)

    async def take_each(self, stage: str, max_samples: int, timeout: float | None, lease_s: float | None,
                        min_version: int | None, fields_extra: Sequence[str], owner: str | None) -> list[tuple[Any, dict[int, Any]]]:
        epoch = self.owner_epoch.get(owner, 0) if owner is not None else 0
        leases = await self.q.take_each(stage, max_samples, timeout=timeout, lease_s=lease_s, min_version=min_version,
                                        fields_extra=fields_extra)
        if self._orphaned(leases, owner, epoch):
            return []
        return [self._hand_out(lease, owner) for lease in leases]

    def _orphaned(self, leases: list[Lease], owner: str | None, epoch: int) -> bool:
        """A take that waited here while its owner's process died (and the owner's leases were given
        back) would hand its leases to no one: Ray keeps an actor's id across a restart, so neither
        the owner watch nor the restart's `release_owner` (already done) would give them back, and
        they sat leased until `workflow.lease_timeout_s`. They are released at once instead."""
        if owner is None or self.owner_epoch.get(owner, 0) == epoch:
            return False
        for lease in leases:
            self.q.release(lease)
        return True

    def take_nowait(self, stage: str, max_samples: int, min_samples: int, lease_s: float | None,
                    min_version: int | None, fields_extra: Sequence[str], owner: str | None) -> tuple[Any, dict[int, Any]] | None:
        lease = self.q.take_nowait(stage, max_samples, min_samples=min_samples, lease_s=lease_s,
                                   min_version=min_version, fields_extra=fields_extra)
        return None if lease is None else self._hand_out(lease, owner)

    def _hand_out(self, lease: Lease, owner: str | None) -> tuple[Any, dict[int, Any]]:
        """The lease in a compact, fast-to-pickle form, plus what its slots point into: the blob's
        object-store ref, or for blobs held here the needed rows (slots renumbered into them)."""
        if owner is not None:
            self.lease_owner[lease.id] = owner
            self.leases[lease.id] = Lease(lease.id, lease.stage, [], [], lease.deadline)
        samples, expired = _compact(lease.samples), _compact(lease.expired)
        out: dict[int, Any] = {}
        for part in (samples, expired):
            names, slots = part[3], part[4]
            for bid in np.unique(slots[:, :, 0]).tolist() if slots.size else []:
                if bid < 0:
                    continue
                ref, _, held = self.blobs[bid]
                if held is None:
                    out[bid] = ref
                    continue
                mask = slots[:, :, 0] == bid
                rows = np.unique(slots[:, :, 1][mask])
                got: Any
                if isinstance(held, dict):
                    got = {k: held[k][rows] if isinstance(held[k], np.ndarray) else [held[k][r] for r in rows.tolist()]
                           for k in names if k in held}
                else:
                    got = [held[r] for r in rows.tolist()]
                key = -2 - len(out)  # a fresh id for this lease's gathered rows
                out[key] = got
                slots[:, :, 1][mask] = np.searchsorted(rows, slots[:, :, 1][mask])
                slots[:, :, 0][mask] = key
        return (lease.id, lease.stage, lease.deadline, samples, expired), out

    def _run(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # fire-and-forget call: count it, the caller is not waiting
            self.op_errors += 1
            self.last_error = f"{what}: {type(exc).__name__}: {exc}"
            return None

    def _forget(self, lease_id: int) -> None:
        self.lease_owner.pop(lease_id, None)
        self.leases.pop(lease_id, None)

    def write(self, uid: int, payload: dict[str, Any] | None, names: Any, nbytes: Any, ref: Any,
              version: int | None) -> None:
        fields = self._materialize(None if payload is None else [payload], names, nbytes, ref)[0]
        try:
            self.q.write(uid, fields, version=version)
        except KeyError:
            self._unref(fields)  # the sample was deleted meanwhile (e.g. cancelled): nothing to keep

    def complete(self, lease_id: int, stage: str, uids: list[int], payload: list[dict[str, Any]] | None,
                 names: Any, nbytes: Any, ref: Any, versions: dict[int, int] | None,
                 remove: bool) -> bool:
        writer = self.lease_owner.get(lease_id)
        self._forget(lease_id)
        fields = self._materialize(payload, names, nbytes, ref)
        if ref is not None and writer is not None:  # its process owns the object: see `_lose_writer`
            self.blob_writer[self.next_blob - 1] = writer
        writes = dict(zip(uids, fields, strict=True))
        gone = [f for uid, f in writes.items() if uid not in self.q]  # (deleted meanwhile: skipped by complete)
        ok = self._run("complete", lambda: self.q.complete(Lease(lease_id, stage, [], [], 0.0), writes,
                                                           versions=versions, remove=remove))
        for f in fields if not ok else gone:  # nothing holds these rows of the blob: let it go when none does
            self._unref(f)
        return bool(ok)

    def apply(self, ops: list[tuple[str, tuple[Any, ...]]]) -> int:
        """Run a client's coalesced updates in order (write, complete, ack, release, remove)."""
        for name, args in ops:
            if name not in _OPS:
                raise ValueError(f"unknown store operation {name!r}")
            self._run(name, lambda n=name, a=args: getattr(self, n)(*a))
        return len(ops)

    def ack(self, lease_id: int, stage: str, remove: bool, uids: list[int] | None = None) -> bool:
        """`uids` (with `remove`): the lease's samples, removed even when the lease had ended. The
        client answers before this runs, so it cannot do what an in-process caller does on a False
        ack (remove them itself, so that they are never trained again)."""
        self._forget(lease_id)
        ok = bool(self._run("ack", lambda: self.q.ack(Lease(lease_id, stage, [], [], 0.0), remove=remove)))
        if not ok and remove and uids:
            self.q.remove(uids)
        return ok

    def release(self, lease_id: int, stage: str) -> bool:
        self._forget(lease_id)
        return bool(self._run("release", lambda: self.q.release(Lease(lease_id, stage, [], [], 0.0))))

    def remove(self, uids: list[int]) -> None:
        self._run("remove", lambda: self.q.remove(uids))

    def renew(self, lease_ids: list[int], lease_s: float | None) -> None:
        self._run("renew", lambda: self.q.renew([Lease(i, "", [], [], 0.0) for i in lease_ids], lease_s))

    def release_owner(self, owner: str) -> int:
        """Give back every live lease held by `owner`; returns how many leases that was."""
        ids = [lid for lid, o in self.lease_owner.items() if o == owner]
        n = 0
        for lid in ids:
            lease = self.leases.pop(lid)
            self.lease_owner.pop(lid, None)
            n += bool(self.q.release(lease))
        self.owners.pop(owner, None)
        self.owner_epoch[owner] = self.owner_epoch.get(owner, 0) + 1  # (its process's waiting takes: `_orphaned`)
        self.released_by_owner[owner] = self.released_by_owner.get(owner, 0) + n
        self._lose_writer(owner)
        return n

    def released_of(self, owner: str) -> int:
        """How many leases of `owner` were given back because it died, whoever noticed first (the
        owner watch, every 2 s, or the restart)."""
        return self.released_by_owner.get(owner, 0)

    def _lose_writer(self, owner: str) -> int:
        """Results that a dead actor's process put into the object store died with it (Ray frees an
        object with its owner: `OwnerDiedError` for whoever reads it next). Their samples are kept,
        with values that say so: a response is `cancelled` (its group is then dropped and refilled,
        as a cancelled request's is), a reward a `reward_error`. Returns how many samples."""
        return self.lose_blobs([b for b, o in self.blob_writer.items() if o == owner])

    def lose_blobs(self, blob_ids: list[int]) -> int:
        """Blobs a reader found gone (or whose writer died): their slots get `_LOST` values."""
        lost = {b for b in blob_ids if b in self.blobs}
        if not lost:
            return 0

        def fix(fields: dict[str, Any]) -> dict[str, Any] | None:
            hit = [k for k, v in fields.items() if type(v) is _Slot and v.blob in lost]
            if not hit:
                return None
            new = dict(fields)
            for k in hit:
                new[k] = _LOST.get(k)  # (a response's finish_reason becomes "cancelled")
            return new

        n = self.q.replace_values(fix)
        for b in lost:
            self.blobs.pop(b, None)
            self.blob_writer.pop(b, None)
        self.lost_with_writer += n
        return n

    async def _watch_owners(self) -> None:
        import ray

        while True:
            await asyncio.sleep(self.owner_check_s)
            for lid in [lid for lid in self.leases if not self.q.lease_live(lid)]:
                self._forget(lid)  # ended in the store without an ack here (expired): forget it too
            holding = {o for o in self.lease_owner.values()}
            for owner in list(holding):
                handle = self.owners.get(owner)
                if handle is None:
                    continue
                try:
                    await asyncio.wait_for(handle.__ray_ready__.remote(), timeout=max(self.owner_check_s, 5.0))
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError):
                    self.release_owner(owner)
                except asyncio.TimeoutError:
                    pass  # busy, not dead: the lease deadline still applies
                except Exception as exc:  # (e.g. ActorUnschedulableError): it ended this watch for good, unseen
                    self.op_errors += 1
                    self.last_error = f"owner check of {owner}: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        self.q.close()

    def size(self) -> int:
        return self.q.size()

    def ready_count(self, stage: str) -> int:
        return self.q.ready_count(stage)

    def in_flight(self, stage: str) -> int:
        return self.q.in_flight(stage)

    def metrics(self) -> dict[str, float]:
        m = self.q.metrics()
        m["op_errors"] = float(self.op_errors)
        m["blobs"] = float(len(self.blobs))
        m["released_from_dead_owners"] = float(sum(self.released_by_owner.values()))
        m["lost_with_dead_writer"] = float(self.lost_with_writer)  # samples whose results died with their writer
        m["owned_leases"] = float(len(self.leases))  # leases of consumer actors this controller watches
        return m

    def errors(self) -> tuple[int, str]:
        return self.op_errors, self.last_error

    def state_dict(self) -> tuple[dict[str, Any], dict[int, Any]]:
        state = self.q.state_dict()
        refs = {}
        for d in state["samples"]:
            for v in d["fields"].values():
                if isinstance(v, _Slot) and v.blob not in refs:
                    ref, _, held = self.blobs[v.blob]
                    refs[v.blob] = ref if held is None else held
        return state, refs

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state)


_OPS = ("write", "complete", "ack", "release", "remove", "renew", "lose_blobs")


class _LostRow(dict):  # type: ignore[type-arg]
    """A row of a blob that died with its writer: every field reads as its `_LOST` value."""

    def __missing__(self, key: str) -> Any:
        return _LOST.get(key)


class _LostBlob:
    """Stands in for a blob that could not be fetched (`ObjectLostError`): any row is a `_LostRow`."""

    def __getitem__(self, row: int) -> _LostRow:
        return _LostRow()

# what a field whose value died with its writer's process becomes (see `StoreController._lose_writer`;
# any other field: None)
_LOST: dict[str, Any] = {"response_ids": [], "behavior_logprobs": [], "token_versions": [], "loss_mask": [],
                         "finish_reason": "cancelled", "reward": None,
                         "reward_error": "its reward died with the reward actor that wrote it (restarted)"}


def _compact(views: list[SampleView]) -> tuple[Any, ...]:
    """Sample views in a form that pickles fast (a take moves thousands): id lists, one field-name
    list, an int array [samples, fields, 2] of (blob, row) slots (blob -1: inline), and inline values."""
    names: dict[str, int] = {}
    for v in views:
        for k in v.fields:
            names.setdefault(k, len(names))
    slots = np.full((len(views), len(names), 2), -1, dtype=np.int64)
    inline: list[dict[str, Any] | None] = []
    for i, v in enumerate(views):
        own: dict[str, Any] | None = None
        for k, x in v.fields.items():
            if type(x) is _Slot:
                slots[i, names[k]] = x[0], x[1]
            else:
                if own is None:
                    own = {}
                own[k] = x
        inline.append(own)
    return ([v.uid for v in views], [v.group_id for v in views], [v.version for v in views], list(names), slots, inline)


def _expand(compact: tuple[Any, ...], values: dict[int, Any]) -> list[SampleView]:
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


def _columns(dicts: list[dict[str, Any]]) -> dict[str, Any] | None:
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


def _pack(dicts: list[dict[str, Any]], inline_max_bytes: int, put: bool = True) -> tuple[list[dict[str, Any]] | None, Any, Any, Any]:
    """(inline payload | None, names, nbytes, [ref] | None): small data travels inline; larger data
    goes into the object store with one `ray.put`, columnar when the rows allow it. The ref is
    wrapped in a list so Ray passes it on instead of resolving it."""
    import ray

    keys = list(dicts[0]) if dicts else []
    if all(len(d) == len(keys) and list(d) == keys for d in dicts):
        nbytes: Any = np.array([[_nbytes(v) for v in d.values()] for d in dicts], dtype=np.int64).reshape(len(dicts), len(keys))
        names: Any = keys
        total = int(nbytes.sum())
    else:
        names = [list(d) for d in dicts]
        nbytes = [[_nbytes(v) for v in d.values()] for d in dicts]
        total = sum(map(sum, nbytes))
    if total <= inline_max_bytes or not put:
        return dicts, names, nbytes, None
    cols = _columns(dicts) if len(dicts) > 1 and names is keys else None
    return None, names, nbytes, [ray.put(dicts if cols is None else cols)]


class RayTransferQueue:
    """Client of a `StoreController` actor with the same API as the in-process `TransferQueue`.

    Picklable: pass it to actors; each process's copy talks to the same controller.
    """

    def __init__(self, handle: Any, *, inline_max_bytes: int = 16 * 1024, rpc_grace_s: float = 60.0,
                 data_plane: str = "object_store", put_window: int = 2) -> None:
        if data_plane not in ("controller", "object_store"):
            raise ValueError(f"data_plane must be 'controller' or 'object_store', got {data_plane!r}")
        self.handle = handle
        self.data_plane = data_plane
        self.put_window = put_window
        self._pending: collections.deque[tuple[Any, float | None]] = collections.deque()
        self._ops: list[Any] = []  # unanswered fire-and-forget calls (write, complete, ack, ...)
        self._buf: list[tuple[str, tuple[Any, ...]]] = []  # updates not sent yet (coalesced)
        self._flush_at: Any = None
        self._unsettled = False  # an update other than ack is unanswered: takes must wait for it
        self.coalesce_s = 0.002
        self._uid_next = 0
        self._uid_end = 0
        self.inline_max_bytes = inline_max_bytes
        self.rpc_grace_s = rpc_grace_s
        self._owner: str | None = None
        self._owner_known = False

    @classmethod
    def create(cls, capacity: int = 4096, lease_timeout_s: float = 600.0, *, owner_check_s: float = 2.0,
               num_cpus: float = 0.0, name: str | None = None, **kwargs: Any) -> RayTransferQueue:
        """Start a controller actor (max_concurrency high: every waiting take is a pending call)."""
        import ray

        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 10_000}
        if name is not None:
            opts["name"] = name
        actor: Any = ray.remote(StoreController)
        handle = actor.options(**opts).remote(capacity, lease_timeout_s, owner_check_s)
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

    def _fetch(self, refs: dict[int, Any]) -> dict[int, Any]:
        """Blob values: object-store refs fetched (zero-copy), rows sent by the controller as they are."""
        import ray

        fetch = [b for b, r in refs.items() if isinstance(r, ray.ObjectRef)]
        try:
            got = ray.get([refs[b] for b in fetch], timeout=self.rpc_grace_s) if fetch else []
        except ray.exceptions.ObjectLostError:  # one of them died with its writer: see `_lost`
            got = []
            for b in fetch:
                try:
                    got.append(ray.get(refs[b], timeout=self.rpc_grace_s))
                except ray.exceptions.ObjectLostError:
                    got.append(self._lost(b))
        return {**refs, **dict(zip(fetch, got, strict=True))}

    async def _afetch(self, refs: dict[int, Any]) -> dict[int, Any]:
        """`_fetch` on the caller's event loop (bounded by `rpc_grace_s` as well)."""
        import ray

        fetch = [b for b, r in refs.items() if isinstance(r, ray.ObjectRef)]
        if not fetch:
            return dict(refs)
        try:
            got = list(await self._aget(asyncio.gather(*(refs[b] for b in fetch)), 0.0, "a take's data"))
        except ray.exceptions.ObjectLostError:
            got = []
            for b in fetch:
                try:
                    got.append(await self._aget(refs[b], 0.0, "a take's data"))
                except ray.exceptions.ObjectLostError:
                    got.append(self._lost(b))
        return {**refs, **dict(zip(fetch, got, strict=True))}

    def _lost(self, blob: int) -> _LostBlob:
        """A blob that died with the process that put it (a rollout actor Ray restarted, before its
        supervisor told the controller): read as `_LOST` values, and the controller told too."""
        self._op("lose_blobs", ([blob],))
        return _LostBlob()

    @staticmethod
    def _fill(compact: Any, values: dict[int, Any]) -> Lease:
        lid, stage, deadline, samples, expired = compact
        return Lease(lid, stage, _expand(samples, values), _expand(expired, values), deadline)

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
            return (meta, *_pack(dicts, self.inline_max_bytes), timeout)
        payload, names, nbytes, _ = _pack(dicts, 1 << 62, put=False)
        if sum(map(sum, nbytes)) if isinstance(nbytes, list) else int(nbytes.sum()) <= self.inline_max_bytes:
            return (meta, payload, names, nbytes, None, timeout)
        cols = _columns(dicts) if len(dicts) > 1 and isinstance(names[0], str) else None
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
        """`TransferQueue.put_columns_blocking`: the columns go into the object store as they are
        (one `ray.put`, no per-sample dicts, no re-stacking), pipelined like `put_blocking`."""
        import ray

        n = len(group_ids)
        names = list(columns)
        per_row = []
        for k in names:
            col = columns[k]
            if len(col) != n:
                raise ValueError(f"column {k!r} has {len(col)} rows, expected {n} (one per group id)")
            per_row.append(int(col.nbytes) // max(n, 1) if isinstance(col, np.ndarray) else _nbytes(col[0]) if n else 0)
        nbytes = np.tile(np.array(per_row, dtype=np.int64), (n, 1))
        if int(nbytes.sum()) <= self.inline_max_bytes:
            return self.put_blocking(rows_of(columns, group_ids, group_size), timeout=timeout)
        uids = self._uids(n)
        meta = (list(group_ids), [group_size] * n, [None] * n, uids)
        cols = {k: (v if isinstance(v, np.ndarray) else list(v)) for k, v in columns.items()}
        self._pending.append((self.handle.put.remote(meta, None, names, nbytes, [ray.put(cols)], timeout), timeout))
        while len(self._pending) > self.put_window:
            ref, t = self._pending.popleft()
            self._get(ref, t, "put")
        return uids

    def flush(self) -> None:
        """Wait until every earlier call of this client has been applied (read-your-writes: reads
        call it first); raises the first error of a pipelined put."""
        while self._pending:
            ref, t = self._pending.popleft()
            self._get(ref, t, "put")
        self._send_ops()
        ops, self._ops, self._unsettled = self._ops, [], False
        if ops:
            self._get(ops, 0.0, "earlier updates")

    async def flush_async(self) -> None:
        while self._pending:
            ref, t = self._pending.popleft()
            await self._aget(ref, t, "put")
        self._send_ops()
        ops, self._ops, self._unsettled = self._ops, [], False
        if ops:
            await self._aget(asyncio.gather(*ops), 0.0, "earlier updates")

    def _before_take(self) -> bool:
        """Send queued updates; True if the take must first wait for them. Acks need no wait (acked
        samples are this client's lease, never offered again), releases and writes do."""
        self._send_ops()
        return self._unsettled or bool(self._pending)

    def _op(self, name: str, args: tuple[Any, ...]) -> None:
        """Queue an update. Inside an event loop, updates issued within `coalesce_s` (2 ms) go out as
        one call (a Ray call costs ~1 ms of CPU here: one per sample was a third of a rollout actor's
        time); from plain threads each goes at once."""
        self._buf.append((name, args))
        self._unsettled |= name != "ack" and name != "renew"  # (neither changes what a take can see)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or len(self._buf) >= 256:
            self._send_ops()
        elif self._flush_at is None:
            self._flush_at = loop.call_later(self.coalesce_s, self._send_ops)

    def _send_ops(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        if self._buf:
            ops, self._buf = self._buf, []
            self._send(self.handle.apply.remote(ops))

    def _send(self, ref: Any) -> None:
        """Track a call sent without waiting; the controller may run calls out of order (it is an
        async actor), so later reads of this client wait for these first."""
        self._ops.append(ref)
        if len(self._ops) >= 256:
            import ray

            _, self._ops = ray.wait(self._ops, num_returns=len(self._ops), timeout=0)

    async def take(self, stage: str, max_samples: int, *, min_samples: int = 1, timeout: float | None = None,
                   lease_s: float | None = None, min_version: int | None = None,
                   fields_extra: Sequence[str] = ()) -> Lease:
        if self._before_take():
            await self.flush_async()
        ref = self.handle.take.remote(stage, max_samples, min_samples, timeout, lease_s, min_version,
                                      list(fields_extra), self._get_owner())
        lease, refs = await self._aget(ref, timeout, f"take({stage!r})")
        return self._fill(lease, await self._afetch(refs))

    async def take_each(self, stage: str, max_samples: int, *, timeout: float | None = None,
                        lease_s: float | None = None, min_version: int | None = None,
                        fields_extra: Sequence[str] = ()) -> list[Lease]:
        """See `TransferQueue.take_each`: one call, one lease per sample (or group)."""
        if self._before_take():
            await self.flush_async()
        ref = self.handle.take_each.remote(stage, max_samples, timeout, lease_s, min_version, list(fields_extra),
                                           self._get_owner())
        got = await self._aget(ref, timeout, f"take_each({stage!r})")
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

        if self._before_take():
            self.flush()
        ref = self.handle.take.remote(stage, max_samples, min_samples, timeout, lease_s, min_version,
                                      list(fields_extra), self._get_owner())
        lease, refs = self._get(ref, timeout, f"take({stage!r})")
        return self._fill(lease, self._fetch(refs))

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
        payload, names, nbytes, ref = _pack([fields], self.inline_max_bytes)
        self._op("write", (uid, None if payload is None else payload[0], names, nbytes, ref, version))

    def complete(self, lease: Lease, writes: dict[int, dict[str, Any]], *, versions: dict[int, int] | None = None,
                 remove: bool = False) -> bool:
        """Sent without waiting (returns True); see `TransferQueue.complete`."""
        uids = list(writes)
        payload, names, nbytes, ref = _pack([writes[u] for u in uids], self.inline_max_bytes)
        self._op("complete", (lease.id, lease.stage, uids, payload, names, nbytes, ref, versions, remove))
        return True

    def ack(self, lease: Lease, *, remove: bool = False) -> bool:
        """Sent without waiting (returns True). An ack of an ended lease acks nothing, as in process;
        with `remove` its samples are removed anyway (in process the caller sees False and does it)."""
        uids = [s.uid for s in (*lease.samples, *lease.expired)] if remove else None
        self._op("ack", (lease.id, lease.stage, remove, uids))
        return True

    def release(self, lease: Lease) -> bool:
        self._op("release", (lease.id, lease.stage))
        return True

    def remove(self, uids: Iterable[int]) -> None:
        self._op("remove", (list(uids),))

    def renew(self, leases: Iterable[Lease], lease_s: float | None = None) -> None:
        """Sent without waiting; see `TransferQueue.renew`."""
        self._op("renew", ([lease.id for lease in leases], lease_s))

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
            d["fields"] = {k: _value(values, v, k) for k, v in d["fields"].items()}
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


def _value(values: dict[int, Any], v: Any, k: str) -> Any:
    if not isinstance(v, _Slot):
        return v
    blob = values[v.blob]
    return blob[k][v.row] if isinstance(blob, dict) else blob[v.row][k]


def _unwrap(exc: Exception) -> Exception:
    """The original store exception (timeout, closed, ...) out of Ray's task-error wrapper."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, _ERRORS_PASSED_THROUGH):
        return cause
    return exc


__all__ = ["RayTransferQueue", "SampleView", "StoreController"]
