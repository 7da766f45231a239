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

Its own iteration (`_run_once`), for what PIPE measures: the loop's CPU is charged to the scheduler,
and the stock one spends it where a production loop (uvloop) would not. Timers sit in a heap of
`(when, seq, handle)` tuples, compared in C (asyncio's heap of `TimerHandle`s calls a Python
`__lt__` ~2 log2(n) times per timer, and thousands of timers are pending when every episode in an
environment step sleeps on one); equal times run in the order they were set. While callbacks are
ready, and before a jump of virtual time, I/O is polled at most every `_poll_every` of real time
(twice the interpreter's GIL switch interval: 10 ms by default) instead of with a system call per
iteration (a callback from another thread is queued directly and
runs next iteration either way; with thread jobs outstanding every jump polls and waits, as above).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import selectors
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from asyncflow.clock import bounded

T = TypeVar("T")
_THREAD_POLL_S = 0.002  # real seconds between polls while a thread job is outstanding
_POLL_EVERY_S = 0.001  # least real seconds between I/O polls while callbacks are ready (see _poll_every)


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
        # runs each ready callback instead of `handle._run()` when set: PIPE's `--set split=true`
        # notes whose callback is running, to say where the scheduler's CPU goes
        self.run_handle: Callable[[asyncio.Handle], None] | None = None
        self._selector = _VirtualSelector(self._selector, self)  # type: ignore[assignment,has-type,arg-type]
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []  # (when, seq, handle): see module doc
        self._timer_seq = itertools.count()
        self._polled_at = 0.0  # perf_counter of the last I/O poll
        # Not more often than the GIL switch interval: each poll releases and at once retakes the GIL,
        # and a thread that waits for it asks for a forced switch only after a whole interval without
        # one, so polls every 1 ms starved plain threads (a `threading.Timer` due in 50 ms ran seconds late).
        self._poll_every = max(_POLL_EVERY_S, 2 * sys.getswitchinterval())

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        """Move virtual time forward (never back)."""
        if seconds > 0:  # (not max(0.0, seconds): a builtin call per jump)
            self._virtual_now += seconds

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,  # type: ignore[override]
                context: Any = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()  # type: ignore[attr-defined]
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        timer._scheduled = True  # type: ignore[attr-defined]  # (so that cancel() counts it, as in asyncio)
        return timer

    def _run_once(self) -> None:
        """One iteration, as asyncio's: drop cancelled timers, poll I/O (or jump virtual time), move
        due timers to the ready queue, run what was ready at the start. See the module doc."""
        base: Any = self  # asyncio's private loop state, read and written as its own _run_once does
        timers = self._timers
        cancelled = base._timer_cancelled_count
        if cancelled > 100 and cancelled * 2 > len(timers):
            keep = []
            for entry in timers:
                if entry[2]._cancelled:  # type: ignore[attr-defined]
                    entry[2]._scheduled = False  # type: ignore[attr-defined]
                else:
                    keep.append(entry)
            heapq.heapify(keep)
            self._timers = timers = keep
            base._timer_cancelled_count = 0
        else:
            while timers and timers[0][2]._cancelled:  # type: ignore[attr-defined]
                base._timer_cancelled_count -= 1
                heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]
        ready = base._ready
        now = time.perf_counter()
        if ready or base._stopping:
            if now - self._polled_at >= self._poll_every:
                self._polled_at = now
                base._process_events(self._selector.select(0))
        elif timers and not self.thread_jobs and now - self._polled_at < self._poll_every:
            self.advance(timers[0][0] - self._virtual_now)  # polled a moment ago: jump without a system call
        else:
            timeout = None if not timers else max(0.0, timers[0][0] - self._virtual_now)
            self._polled_at = now
            base._process_events(self._selector.select(timeout))
        end = self._virtual_now + base._clock_resolution
        while timers and timers[0][0] < end:
            timer: Any = heapq.heappop(timers)[2]
            timer._scheduled = False
            ready.append(timer)
        run = self.run_handle
        if run is None:
            for _ in range(len(ready)):
                handle = ready.popleft()
                if not handle._cancelled:
                    handle._run()
        else:  # (a second loop, not a test per handle: the common case pays nothing)
            for _ in range(len(ready)):
                handle = ready.popleft()
                if not handle._cancelled:
                    run(handle)
        handle = timer = None  # (breaks a cycle when a callback raised, as asyncio does)

    def close(self) -> None:
        self._timers.clear()
        super().close()

    def run_in_executor(self, executor: Any, func: Callable[..., T], *args: Any) -> asyncio.Future[T]:  # type: ignore[override]
        fut = super().run_in_executor(executor, func, *args)
        self.thread_jobs += 1
        fut.add_done_callback(self._job_done)
        return fut

    def _job_done(self, _: asyncio.Future[Any]) -> None:
        self.thread_jobs -= 1


class VirtualClock:
    """The `Clock` of a `VirtualTimeLoop` (see `asyncflow.clock`)."""

    unit = "virtual s"  # how timeouts are worded in messages
    loop_time = True  # `now` is the loop's `time()` (see `RealClock.loop_time`)

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self.loop = loop
        # the loop's own `time`, bound: `now` runs several times per sample, and a method that
        # forwards to it cost a second Python call each time
        self.now: Callable[[], float] = loop.time
        # `asyncio.sleep` itself, not a coroutine that awaits it: one frame less per sleep (every
        # simulated environment step sleeps once)
        self.sleep: Callable[[float], Coroutine[Any, Any, None]] = asyncio.sleep

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
