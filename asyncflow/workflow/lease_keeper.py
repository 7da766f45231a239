"""Renewal of the store leases a process's stages hold while they work on them (`LeaseKeeper`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator

from asyncflow.clock import Clock
from asyncflow.transfer_queue import Lease, QueueClosed, StoreClient


class LeaseKeeper:
    """Renews the store leases that this process's stages hold while they work on them, every
    quarter of `workflow.lease_timeout_s`. A lease's deadline is the backstop for a holder that died
    or hung (its samples go back to the queue); a live holder may legitimately hold longer than
    that: the trainer holds its batch's groups while it collects the rest and trains, an episode
    holds its sample for all of its turns. Without renewal those leases expired under them, and the
    trainer took the same groups again (trained twice, admission credit freed twice) or an episode
    was started over and over. One timer per process, not per lease; stops when nothing is held."""

    def __init__(self, store: StoreClient, clock: Clock, lease_s: float) -> None:
        self.store = store
        self.clock = clock
        self.every = lease_s / 4
        self.held: dict[int, Lease] = {}
        self.sources: list[Callable[[], Iterable[Lease]]] = []  # leases held elsewhere (requests in flight)
        self._task: asyncio.Task[None] | None = None

    def hold(self, lease: Lease) -> None:
        self.held[lease.id] = lease
        if self._task is None:
            self._start()

    def drop(self, lease: Lease) -> None:
        self.held.pop(lease.id, None)

    @contextlib.contextmanager
    def holding(self, lease: Lease) -> Iterator[None]:
        """`hold(lease)` for the block, `drop(lease)` after it, however it ends."""
        self.hold(lease)
        try:
            yield
        finally:
            self.drop(lease)

    def watch(self, source: Callable[[], Iterable[Lease]]) -> None:
        """Also renew what `source()` lists at each tick, until `unwatch(source)`."""
        self.sources.append(source)
        if self._task is None:
            self._start()

    def unwatch(self, source: Callable[[], Iterable[Lease]]) -> None:
        with contextlib.suppress(ValueError):
            self.sources.remove(source)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease keeper")

    async def _run(self) -> None:
        try:
            while self.held or self.sources:
                await self.clock.sleep(self.every)
                leases = list(self.held.values())
                for source in self.sources:
                    leases.extend(source())
                if leases:
                    with contextlib.suppress(QueueClosed):
                        self.store.renew(leases)
        finally:
            self._task = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
