"""Task bookkeeping the stage loops share: the child tasks of a worker (the first failure stops it)
and a counter of requests in flight with a wait for a free slot.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from asyncflow.clock import Clock


class Children:
    """Child tasks of a stage loop (episodes, reward takes) whose first error stops the loop: `fail`
    records it and cancels the loop's task, whose `except CancelledError` calls `reraise` so the loop
    ends with that error instead of a bare cancellation. Create it inside the loop's task."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.errors: list[BaseException] = []
        self._parent = asyncio.current_task()

    def fail(self, exc: BaseException) -> None:
        if not self.errors:
            self.errors.append(exc)
            if self._parent is not None:
                self._parent.cancel()

    def spawn(self, coro: Coroutine[Any, Any, Any], on_done: Callable[[asyncio.Task[Any]], None] | None = None) -> None:
        """Run `coro` as a child; `on_done(task)` runs when it ends, before its error is looked at
        (in the same done callback: one event-loop callback per child, not two)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done if on_done is None else functools.partial(self._done_after, on_done))

    def _done_after(self, on_done: Callable[[asyncio.Task[Any]], None], task: asyncio.Task[Any]) -> None:
        try:
            on_done(task)
        finally:
            self._done(task)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]

    def reraise(self) -> None:
        if self.errors:
            raise self.errors[0] from None

    def cancel_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()


class Flight:
    """A rollout worker's slots: how many requests or episodes it has in flight, up to `limit`.

    A plain counter and one future for the worker to sleep on (cheaper per sample than an
    `asyncio.Semaphore` acquired and released once per request). `on_idle(start)` is told when the
    worker runs dry, with the time its first request of the busy period started (tracing)."""

    def __init__(self, limit: int, on_idle: Callable[[float], None], clock: Clock) -> None:
        self.limit = limit
        self.n = 0
        self._on_idle = on_idle
        self._clock = clock
        self._since = 0.0
        self._wake: asyncio.Future[None] | None = None
        self._below = limit - 1

    def acquire(self) -> None:
        if self.n == 0:
            self._since = self._clock.now()
        self.n += 1

    def release(self) -> None:
        self.n -= 1
        if self.n == 0:
            self._on_idle(self._since)
        wake = self._wake
        if wake is not None and self.n <= self._below and not wake.done():
            wake.set_result(None)

    def room(self) -> int:
        """Slots free now."""
        return self.limit - self.n

    async def free(self, at_least: int = 1) -> int:
        """Wait until `at_least` slots are free (at most `limit`); the number free."""
        self._below = self.limit - min(at_least, self.limit)  # wake when at most this many are in flight
        while self.n > self._below:
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        return self.limit - self.n
