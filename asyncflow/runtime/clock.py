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


class RealClock:
    """Wall-clock time, asyncio waits."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        try:
            return await asyncio.wait_for(aw, timeout)
        except asyncio.TimeoutError as exc:
            raise WaitTimeout(f"timed out after {timeout:.1f} s waiting for {what}") from exc
