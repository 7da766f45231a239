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
import contextlib
import math
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from asyncflow.errors import WaitTimeout

T = TypeVar("T")


class Clock(Protocol):
    """Time source and waiting primitives used by the workflow and the store. A clock whose `now` is
    the running event loop's `time()` may say so with a class attribute `loop_time = True`: the store
    then bounds its waits with plain loop timers."""

    def now(self) -> float:
        """Seconds on a monotonic time line (only differences are meaningful)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend the calling coroutine for `seconds`."""
        ...

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        """Await `aw`; raise `WaitTimeout` naming `what` if it takes longer than `timeout`."""
        ...


def seconds_text(t: float) -> str:
    """A timeout for a message: one decimal ("30.0"), or as many as it needs ("0.01", not "0.0")."""
    text = f"{t:.1f}"
    return text if float(text) == t else f"{t:g}"


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
        raise WaitTimeout(f"timed out after {seconds_text(timeout or 0.0)} {unit} waiting for {what}") from exc


class RealClock:
    """Wall-clock time, asyncio waits."""

    unit = "s"  # how timeouts are worded in messages
    # its seconds are the running event loop's (`loop.time()` is `time.monotonic()`), so a wait may be
    # bounded by a plain `loop.call_later` (the store's waits are)
    loop_time = True

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        return await bounded(aw, timeout, what)


if sys.version_info >= (3, 12):
    _current_task: Callable[[asyncio.AbstractEventLoop], asyncio.Task[Any] | None] = asyncio.current_task
else:  # 3.11's `asyncio.current_task` is Python over this dict (0.41 against 0.10 us a call here)
    _current_task = getattr(asyncio.tasks, "_current_tasks", {}).get


# A bounded wait of a `SweptClock`: [deadline, task, timeout, what, fired]. A list, not an object:
# one is made per wait (twice per turn of every episode), and an object's `__init__` call was a
# third of `wait_for`'s own cost.
_TASK, _FIRED = 1, 4


class SweptClock:
    """A `Clock` whose `wait_for` costs no timer per wait: one sweeping task per clock cancels the
    waits past their deadline, checking every eighth of the shortest timeout in use. For hot paths
    with many concurrent bounded waits (every turn of every multi-turn episode waits twice): each
    `asyncio.timeout` puts a timer into the event loop's heap, whose Python-level comparisons cost
    ~15 us per wait with thousands of episodes in flight (measured: PIPE agentic, 16 devices).

    A wait therefore times out between 1 and 1.125 times its timeout after it began, with the same
    `WaitTimeout` message as `bounded`. `now` and `sleep` are the wrapped clock's."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.unit: str = getattr(clock, "unit", "s")
        self._waits: dict[int, list[Any]] = {}  # key -> [deadline, task, timeout, what, fired]
        self._next = 0
        self._tick = math.inf
        self._sweeper: asyncio.Task[None] | None = None
        # task -> what to call when a wait of it is stuck (`guard`): a wait cancelled at its deadline
        # that has not ended a whole timeout later, because the awaited plugin swallows the cancel
        self._guards: dict[asyncio.Task[Any], Callable[[str], None]] = {}
        # tasks given up on (`abandon`): their waits end at once, and the sweeper does not wait for them
        self._abandoned: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.now: Callable[[], float] = clock.now  # bound, not forwarded: one Python call instead of two
        self.sleep: Callable[[float], Coroutine[Any, Any, None]] = clock.sleep  # (likewise: one frame less per sleep)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        task = _current_task(asyncio.get_running_loop())
        if self._abandoned and task in self._abandoned:  # (an abandoned episode that came back to life:
            if asyncio.iscoroutine(aw):  # it must not go on generating for nobody)
                aw.close()
            elif isinstance(aw, asyncio.Future):  # (a request already handed to its engine)
                aw.cancel()
            raise Abandoned(what)
        if timeout is None or task is None or self._closed:
            return await self.clock.wait_for(aw, timeout, what)
        key = self._next
        self._next = key + 1
        w = self._waits[key] = [self.now() + timeout, task, timeout, what, False]
        restart = timeout / 8 < self._tick  # a shorter timeout than the sweeper's: sweep more often from now
        if restart:
            self._tick = timeout / 8
        if self._sweeper is None or self._sweeper.done() or restart:
            if self._sweeper is not None:
                self._sweeper.cancel()
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        try:
            result = await aw
        except asyncio.CancelledError:
            if not w[_FIRED]:
                raise
            _uncancel(task)
            raise WaitTimeout(f"timed out after {seconds_text(timeout)} {self.unit} waiting for {what}") from None
        except Exception as exc:
            if not w[_FIRED]:
                raise
            # the call turned our cancel into an error of its own (a client's ConnectionError): it timed
            # out all the same, and the cancel is taken back (left, a CancelledError the plugin raised
            # itself later in the episode was read as the run's)
            _uncancel(task)
            raise WaitTimeout(f"timed out after {seconds_text(timeout)} {self.unit} waiting for {what}") from exc
        finally:
            del self._waits[key]
        if w[_FIRED]:  # `aw` finished anyway, swallowing our cancel: take it back
            _uncancel(task)
        return result

    def close(self) -> None:
        """Stop the sweeper (the owner's run is over). Later waits are bounded by the wrapped clock
        (an abandoned episode that came back to life restarted a sweeper nobody would stop)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def for_cleanup(self) -> Clock:
        """The clock for a cleanup call (an environment's `close`) of the current task: this one,
        or for a task given up on the wrapped clock, which still bounds it (refused, the abandoned
        episode that came back to life left its environment unclosed)."""
        if self._abandoned and _current_task(asyncio.get_running_loop()) in self._abandoned:
            return self.clock
        return self

    def abandon(self, task: asyncio.Task[Any]) -> None:
        """`task` is given up on: its later waits raise `Abandoned` at once, and the sweeper no longer
        waits for its stuck ones."""
        if not task.done():
            self._abandoned.add(task)
            task.add_done_callback(self._abandoned.discard)

    async def _sweep(self) -> None:
        """Cancel the tasks of overdue waits; ends at a tick that finds no wait left (the next wait
        restarts it). It sleeps first: waits that end before it first runs (an `async def` reward
        function that returns at once) would otherwise start and end a sweeper task each."""
        while True:
            await self.clock.sleep(self._tick)
            waits = list(self._waits.values())
            if self._abandoned:  # (a stuck wait of an abandoned task never ends: not waited for)
                waits = [w for w in waits if w[_TASK] not in self._abandoned]
            if not waits:
                break
            now = self.clock.now()
            for w in waits:
                deadline, task, timeout, what, fired = w
                if not fired:
                    if now >= deadline:
                        w[_FIRED] = True
                        task.cancel()
                elif now >= deadline + timeout and task in self._guards:
                    # cancelled a whole timeout ago and still waiting: the plugin ignores cancellation
                    self._guards.pop(task)(f"{what} did not end within {seconds_text(timeout)} {self.unit} "
                                           f"after its timeout of {seconds_text(timeout)} {self.unit}: it ignores "
                                           "cancellation, and was abandoned")
        self._tick = math.inf

    def guard(self, task: asyncio.Task[Any], on_stuck: Callable[[str], None]) -> None:
        """Call `on_stuck(message)` (once) if a wait of `task` is stuck: cancelled at its deadline and
        not ended a whole timeout later (the awaited plugin swallows the cancel). `run_guarded` uses it."""
        self._guards[task] = on_stuck

    def unguard(self, task: asyncio.Task[Any]) -> None:
        self._guards.pop(task, None)


async def wait_detached(clock: Clock, aw: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
    """`clock.wait_for(aw, ...)` for a plugin's coroutine that may swallow its cancellation (a judge
    client's retry loop with a bare `except:`): it runs as a task of its own, waited for through a
    shield, so the wait ends at its deadline whatever the coroutine does (awaited in place, a
    swallowed cancel meant no timeout at all: the wait never ended, or a late result was taken).
    On timeout, or when the caller is cancelled, the task is cancelled and left to end; whatever it
    ends with is discarded, and it is taken out of asyncio's task registry (`asyncio.run` waits, at
    its end, for every registered task, without a bound: one that never ends hung the process after
    the run). A task and a shield per call: for calls per group, not per token."""
    task = asyncio.ensure_future(aw)
    try:
        return await clock.wait_for(asyncio.shield(task), timeout, what)
    except BaseException:
        if not task.done():
            _abandon(task)
        raise


class Abandoned(BaseException):
    """Raised in a task given up on (`SweptClock.abandon`) at its next bounded wait. A BaseException,
    so that the plugin's and the episode's `except Exception` let it through and the task ends."""


async def run_guarded(clock: SweptClock, coro: Coroutine[Any, Any, T], on_stuck: Callable[[str], T],
                      grace_s: float) -> T:
    """Run `coro` (a whole episode: many bounded waits on `clock`) as a task of its own and return
    its result; if one of its waits is stuck (the environment or agent swallows the cancellation of
    its timeout, so awaited in place nothing could end it), return `on_stuck(message)` instead and
    abandon the task (cancelled, its outcome discarded, its later waits refused, out of asyncio's
    registry so that `asyncio.run` does not wait for it at exit). Costs a task and a future per call:
    once per episode, not per environment call. Cancelling the caller cancels the task and waits up
    to `grace_s` for it to end (its environment's `close`, as when it ran in place), then abandons it."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(coro)
    waiter: asyncio.Future[str | None] = loop.create_future()

    def finished(_: asyncio.Task[Any]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    def stuck(message: str) -> None:
        if not waiter.done():
            waiter.set_result(message)

    def give_up() -> None:
        clock.abandon(task)
        _abandon(task)

    task.add_done_callback(finished)
    clock.guard(task, stuck)
    try:
        message = await waiter
    except asyncio.CancelledError:  # the caller is cancelled (the run ends, Ctrl-C, an eval cut short)
        task.cancel()
        deadline = loop.time() + grace_s
        try:
            while not task.done() and loop.time() < deadline:
                try:
                    await asyncio.wait([task], timeout=deadline - loop.time())
                except asyncio.CancelledError:  # cancelled again (asyncio.run's teardown cancels every task
                    continue  # left): the grace holds, bounded, so the environment's close still runs
        finally:
            if task.done():
                _discard_outcome(task)
            else:
                give_up()
        raise
    except BaseException:
        give_up()
        raise
    finally:
        clock.unguard(task)
    if message is not None and not task.done():
        give_up()
        return on_stuck(message)
    return task.result()


def _abandon(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and leave it to end: its outcome is discarded and it is taken out of asyncio's
    registry (`asyncio.run` waits, unbounded, for every registered task at its end)."""
    if task.done():
        _discard_outcome(task)
        return
    task.cancel()
    task.add_done_callback(_discard_outcome)
    unregister = getattr(asyncio.tasks, "_unregister_task", None)  # (asyncio's own, for task implementations)
    if unregister is not None:
        unregister(task)
    with contextlib.suppress(AttributeError):  # its failure is already reported: no "Task was destroyed but
        task._log_destroy_pending = False  # type: ignore[attr-defined]  # it is pending!" at exit


def _discard_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # (retrieved: asyncio does not log an abandoned call's error)


def _uncancel(task: asyncio.Task[Any]) -> None:
    uncancel = getattr(task, "uncancel", None)  # Python >= 3.11: the cancel was a timeout's, not the task's
    if uncancel is not None:
        uncancel()
