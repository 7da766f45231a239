"""The one clock through which the workflow and the store read time and wait.

Why a clock object instead of `time.monotonic()` and `asyncio.sleep()` sprinkled around: the PIPE
benchmark drives the *real* workflow, store and staleness gate on a virtual clock, so thousands of
simulated devices fit on two cores. Everything that reads time or waits goes through a `Clock`, and a
virtual clock can then be swapped in without touching that code.

`RealClock` is asyncio's own time base (`loop.time()` is `time.monotonic()`), so deadlines computed
from `now()` mean the same thing to `asyncio.wait_for` and to threads waiting on a `threading.Event`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

from asyncflow.errors import WaitTimeout

T = TypeVar("T")


class Clock(Protocol):
    """Time source and waiting primitives used by the workflow and the store."""

    def now(self) -> float:
        """Seconds on a monotonic time line (only differences are meaningful)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling coroutine for `seconds`."""
        ...

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        """Await `aw`; raise `WaitTimeout` naming `what` if it takes longer than `timeout`."""
        ...


async def bounded(aw: Awaitable[T], timeout: float | None, what: str, unit: str = "s") -> T:
    """Await `aw` with a time limit on the running loop's clock; `WaitTimeout` names `what`.

    On Python >= 3.11 this is `asyncio.timeout`: one timer on the current task, no extra task. That
    matters on the hot path (one bounded wait per generation request): measured on the 2-core VM,
    `asyncio.wait_for` costs 43 us per call and `asyncio.timeout` 12 us.
    """
    try:
        if hasattr(asyncio, "timeout") and asyncio.current_task() is not None:
            async with asyncio.timeout(timeout):  # on expiry the task's await (and `aw`) is cancelled
                return await aw
        return await asyncio.wait_for(aw, timeout)
    except asyncio.TimeoutError as exc:
        raise WaitTimeout(f"timed out after {timeout:.1f} {unit} waiting for {what}") from exc


class RealClock:
    """Wall-clock time, asyncio waits."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        return await bounded(aw, timeout, what)
