"""The Ray placement's controller actor (`StoreController`): a `TransferQueue` of metadata and slots
that every process's `RayTransferQueue` talks to. It hands out the blob refs a lease needs, keeps
blobs alive while a live sample points into them, and gives back the leases of owners that died."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from asyncflow.errors import WaitTimeout
from asyncflow.stacks import process_stacks
from asyncflow.transfer_queue.api import Lease, NewSample
from asyncflow.transfer_queue.put_buffer import Part
from asyncflow.transfer_queue.ray_data import LOST, SLOTS, PartRef, RowsSlot, Slot, compact_views
from asyncflow.transfer_queue.store import TransferQueue

# the controller process's young-generation GC threshold: it allocates ~15 tracked objects per sample
# put and keeps them until the sample is removed, so at Python's 700 collections ran every ~50 samples
# and took ~60% of a put's CPU (STORE-1, profiled)
GC_THRESHOLD = 50_000
OWNER_CHECK_S = 2.0  # how often the controller checks that the owners of live leases are alive


class StoreController:
    """The Ray actor behind `RayTransferQueue`: a `TransferQueue` of metadata and slots."""

    def __init__(self, capacity: int, lease_timeout_s: float, owner_check_s: float = OWNER_CHECK_S,
                 gc_threshold: int = 0) -> None:
        if gc_threshold:  # (its own process: see `RayTransferQueue.create`)
            gc.set_threshold(gc_threshold, *gc.get_threshold()[1:])
        self.q = TransferQueue(capacity=capacity, lease_timeout_s=lease_timeout_s, on_remove=self._unref)
        self.blobs: dict[int, list[Any]] = {}  # blob id -> [ObjectRef or None, live rows, held data or None]
        self.next_blob = 0
        self.blob_part: dict[int, tuple[int, int]] = {}  # blob id -> (object, index) of a coalesced put (`put_parts`)
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
            if isinstance(v, SLOTS) and v.blob not in seen:
                seen.add(v.blob)
                b = self.blobs.get(v.blob)
                if b is not None:
                    b[1] -= 1
                    if b[1] <= 0:
                        del self.blobs[v.blob]
                        self.blob_writer.pop(v.blob, None)
                        self.blob_part.pop(v.blob, None)

    def _materialize(self, payload: list[dict[str, Any]] | None, names: Any, nbytes: Any, ref: Any,
                     held: Any = None) -> list[dict[str, Any]]:
        """Field dicts for `put`/`complete`: the payload itself, or one slot per field into a new blob.
        `names` is one list shared by all rows (then `nbytes` is an int array [rows, fields]) or a
        list per row (then `nbytes` is a list per row)."""
        if payload is not None:
            return payload
        if names and isinstance(names[0], str):
            bid = self._add_blob(ref, len(nbytes), held)
            return [{n: Slot(bid, i, b) for n, b in zip(names, row.tolist(), strict=True)} for i, row in enumerate(nbytes)]
        bid = self._add_blob(ref, len(names), held)
        return [{n: Slot(bid, i, b) for n, b in zip(ns, bs, strict=True)} for i, (ns, bs) in enumerate(zip(names, nbytes, strict=True))]

    # ------------------------------------------------------------------ API
    def ping(self) -> bool:
        return True

    async def stacks(self) -> str:
        """This process's threads and asyncio tasks (the stall watchdog's dump)."""
        return process_stacks(asyncio.get_running_loop(), f"{type(self).__name__} actor")

    def where(self) -> dict[str, Any]:
        """The node and process the controller runs in."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

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

    async def put_parts(self, parts: list[Part], ref: Any, timeout: float | None) -> list[int]:
        """A client's coalesced columnar puts (`put_buffer`): `ref` is [the object of all their column
        dicts]; each part's rows become a blob of their own (freed on its own) and are admitted as
        that put alone would be, in order."""
        fields: list[list[dict[str, Any]]] = []
        obj = self.next_blob  # (the object's id: its first blob's)
        for index, (_, _, uids, names, per_row) in enumerate(parts):
            bid = self._add_blob(ref, len(uids))
            self.blob_part[bid] = (obj, index)
            n = len(uids)
            if n and uids == list(range(uids[0], uids[0] + n)):  # (the client's reserved ranges: always)
                fields.append([dict(zip(names, [RowsSlot(bid, uids[0], b) for b in per_row], strict=True))] * n)
            else:
                fields.append([dict(zip(names, [Slot(bid, r, b) for b in per_row], strict=True)) for r in range(n)])
        out: list[int] = []
        for i, (gids, size, uids, _, _) in enumerate(parts):
            samples = [NewSample(g, size, f, None, u) for g, u, f in zip(gids, uids, fields[i], strict=True)]
            try:
                out += await self.q.put(samples, timeout=timeout)
            except BaseException:  # (a full store's timeout, closed): this part and those after it hold nothing
                for rest in fields[i:]:
                    for f in rest:
                        self._unref(f)
                raise
        return out

    async def take(self, stage: str, max_samples: int, min_samples: int, timeout: float | None,
                   lease_s: float | None, min_version: int | None, fields_extra: Sequence[str],
                   owner: str | None, first: list[tuple[str, tuple[Any, ...]]] | None = None,
                   after: list[tuple[str, tuple[Any, ...]]] | None = None,
                   held: list[int] | None = None) -> tuple[Any, dict[int, Any]]:
        """`first`: the client's queued updates, applied before the take. `after`: its acks and
        renews, applied once this take is answered (the client's next call finds them applied) or,
        when it must wait, at once (a full store may wait for them). `held`: the coalesced objects the
        client holds (their refs are left out, `PartRef`). See `RayTransferQueue._carried`."""
        if first:
            self.apply(first)
        epoch = self.owner_epoch.get(owner, 0) if owner is not None else 0
        lease = None
        if after:
            try:
                lease = self.q.take_nowait(stage, max_samples, min_samples=min_samples, lease_s=lease_s,
                                           min_version=min_version, fields_extra=fields_extra)
            finally:
                if lease is None:
                    self.apply(after)
        if lease is None:
            lease = await self.q.take(stage, max_samples, min_samples=min_samples, timeout=timeout, lease_s=lease_s,
                                      min_version=min_version, fields_extra=fields_extra)
        elif after:
            asyncio.get_running_loop().call_soon(self.apply, after)
        if self._orphaned([lease], owner, epoch):
            raise WaitTimeout(f"take for stage {stage!r}: its caller's process died while it waited")
        return self._hand_out(lease, owner, set(held) if held else ())

    async def take_batches(self, stage: str, sizes: list[int], timeout: float | None, lease_s: float | None,
                           fields_extra: Sequence[str], owner: str | None,
                           first: list[tuple[str, tuple[Any, ...]]] | None = None,
                           after: list[tuple[str, tuple[Any, ...]]] | None = None,
                           held: list[int] | None = None) -> list[tuple[Any, dict[int, Any]]]:
        """A reader's read-ahead (`RayTransferQueue.iter_columns`): a lease of exactly `sizes[0]` samples,
        waited for as `take` waits, then one of each next size while that many are ready now. A
        coalesced object's ref travels once per answer: the leases after the first that reads it get
        a `PartRef` without it."""
        known = set(held) if held else set()
        out = [await self.take(stage, sizes[0], sizes[0], timeout, lease_s, None, fields_extra, owner, first, after,
                               held)]
        for n in sizes[1:]:
            known.update(x.obj for x in out[-1][1].values() if isinstance(x, PartRef))
            lease = self.q.take_nowait(stage, n, min_samples=n, lease_s=lease_s, fields_extra=fields_extra)
            if lease is None:
                break
            out.append(self._hand_out(lease, owner, known))
        return out

    async def take_each(self, stage: str, max_samples: int, timeout: float | None, lease_s: float | None,
                        min_version: int | None, fields_extra: Sequence[str], owner: str | None,
                        first: list[tuple[str, tuple[Any, ...]]] | None = None) -> list[tuple[Any, dict[int, Any]]]:
        if first:  # (as in `take`)
            self.apply(first)
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

    def _hand_out(self, lease: Lease, owner: str | None, known: Collection[int] = ()) -> tuple[Any, dict[int, Any]]:
        """The lease in a compact, fast-to-pickle form, plus what its slots point into: the blob's
        object-store ref, or for blobs held here the needed rows (slots renumbered into them).
        `known`: the coalesced objects the reader holds already (`PartRef`)."""
        if owner is not None:
            self.lease_owner[lease.id] = owner
            self.leases[lease.id] = Lease(lease.id, lease.stage, [], [], lease.deadline)
        samples, expired = compact_views(lease.samples), compact_views(lease.expired)
        out: dict[int, Any] = {}
        for part in (samples, expired):
            names, slots = part[3], part[4]
            for bid in np.unique(slots[:, :, 0]).tolist() if slots.size else []:
                if bid < 0:
                    continue
                ref, _, held = self.blobs[bid]
                if held is None:
                    out[bid] = self._ref_of(bid, ref, known)
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

    def _ref_of(self, bid: int, ref: Any, held: Collection[int] = ()) -> Any:
        """What a reader fetches for blob `bid`: its object, or its part of a coalesced one (without
        the ref when the reader holds that object: `held`)."""
        at = self.blob_part.get(bid)
        if at is None:
            return ref
        obj, part = at
        return PartRef(None if obj in held else ref, obj, part)

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
        """Blobs a reader found gone (or whose writer died): their slots get `LOST` values."""
        lost = {b for b in blob_ids if b in self.blobs}
        if not lost:
            return 0

        def fix(fields: dict[str, Any]) -> dict[str, Any] | None:
            hit = [k for k, v in fields.items() if type(v) in SLOTS and v.blob in lost]
            if not hit:
                return None
            new = dict(fields)
            for k in hit:
                new[k] = LOST.get(k)  # (a response's finish_reason becomes "cancelled")
            return new

        n = self.q.replace_values(fix)
        for b in lost:
            self.blobs.pop(b, None)
            self.blob_writer.pop(b, None)
            self.blob_part.pop(b, None)
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

    def metrics(self, first: list[tuple[str, tuple[Any, ...]]] | None = None) -> dict[str, float]:
        """`first`: the caller's queued updates, applied first (as a take's are)."""
        if first:
            self.apply(first)
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
                if isinstance(v, SLOTS) and v.blob not in refs:
                    ref, _, held = self.blobs[v.blob]
                    refs[v.blob] = self._ref_of(v.blob, ref) if held is None else held
        return state, refs

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.q.load_state_dict(state)


_OPS = ("write", "complete", "ack", "release", "remove", "renew", "lose_blobs")
