"""An asyncio event loop on virtual time, for running the real workflow code at simulated scale.

The PIPE benchmark (DESIGN.md) drives the real store, staleness gate and weight-sync protocol with
simulated engines whose "work" is `await clock.sleep(seconds)`. On this loop such sleeps cost no wall
time: whenever nothing is ready to run, virtual time jumps to the next timer. So a thousand simulated
devices decoding for hours finish in seconds, and every timeout in the code under test (`wait_for`,
lease deadlines) is measured in the same virtual seconds.

What keeps virtual time honest: work handed to threads (`loop.run_in_executor`, `asyncio.to_thread`,
e.g. the trainer's step or a reward call) is real work of unknown virtual duration, so while any is
outstanding the loop waits for it in real time and does **not** advance the clock. I/O and callbacks
from other threads (`call_soon_threadsafe`) are still served: the loop polls its selector before
every jump. Code that blocks the loop itself (a plain `time.sleep`) takes no virtual time.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from asyncflow.runtime.clock import bounded

T = TypeVar("T")
_THREAD_POLL_S = 0.002  # real seconds between polls while a thread job is outstanding


class _VirtualSelector:
    """Wraps the loop's selector: waiting becomes a jump of virtual time when nothing else can happen."""

    def __init__(self, inner: selectors.BaseSelector, loop: VirtualTimeLoop) -> None:
        self._inner = inner
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout <= 0:
            return self._inner.select(0)
        if self._loop.thread_jobs:
            wait = _THREAD_POLL_S if timeout is None else min(timeout, _THREAD_POLL_S)
            return self._inner.select(wait)  # real wait for the thread; virtual time stands still
        events = self._inner.select(0)
        if events or timeout is None:
            return events if events else self._inner.select(None)
        self._loop.advance(timeout)
        return []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """`time()` is virtual; idle waits jump it forward instead of sleeping."""

    def __init__(self, start: float = 0.0) -> None:
        super().__init__()
        self._virtual_now = float(start)
        self.thread_jobs = 0
        self._selector = _VirtualSelector(self._selector, self)  # type: ignore[assignment,has-type,arg-type]

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move virtual time forward (never back)."""
        self._virtual_now += max(0.0, seconds)

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        fut = super().run_in_executor(executor, func, *args)
        self.thread_jobs += 1
        fut.add_done_callback(self._job_done)
        return fut

    def _job_done(self, _: asyncio.Future[Any]) -> None:
        self.thread_jobs -= 1


class VirtualClock:
    """The `Clock` of a `VirtualTimeLoop` (see `asyncflow.runtime.clock`)."""

    unit = "virtual s"  # how timeouts are worded in messages

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop

    def now(self) -> float:
        return self.loop.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        return await bounded(aw, timeout, what, unit=self.unit)


def run_virtual(main: Callable[[VirtualClock], Coroutine[Any, Any, T]], start: float = 0.0) -> T:
    """Run `main(clock)` to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop(start)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main(VirtualClock(loop)))
    finally:
        asyncio.set_event_loop(None)
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
