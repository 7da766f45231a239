"""How callers of the store sleep until it can serve them: a `Waiter` per sleeping caller (an
asyncio future or a `threading.Event`), waking the ones whose need is met, and the retry loops that
`put` and `take` run (for coroutines and for plain threads) around an attempt under the lock."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

from asyncflow.clock import Clock, seconds_text
from asyncflow.errors import WaitTimeout

T = TypeVar("T")

THREAD = "thread"  # `Waiter`'s `on` for a plain thread (it sleeps on a `threading.Event`)


class Waiter:
    """One sleeping caller: an asyncio future on its loop, or a `threading.Event` for a thread.

    Created under the store's lock only when the caller has to wait (a call that succeeds at once
    allocates nothing). Woken on its own loop's thread (the common case: the store is used from
    the loop that waits on it) the future is resolved directly; from any other thread through
    `call_soon_threadsafe`, whose self-pipe write (a system call) and extra callback are then
    needed."""

    __slots__ = ("event", "fut", "home", "loop", "need", "room", "want", "woken")

    def __init__(self, need: int, home: list[Waiter], on: On, want: int = 0,
                 room: Callable[[], int] | None = None) -> None:
        self.need = need  # wake once this many samples are available (or this much room, for producers)
        self.want = want or need  # at most this many it takes once woken (`wake_in_turn`'s budget)
        self.room = room  # how many it would take if woken now, when that grows while it waits
        self.home = home
        self.woken = False
        self.event: threading.Event | None = None
        self.fut: asyncio.Future[None] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        if isinstance(on, str):
            self.event = threading.Event()
        else:
            self.loop = on
            self.fut = on.create_future()

    def wake(self) -> None:
        self.woken = True
        if self.event is not None:
            self.event.set()
            return
        fut, loop = self.fut, self.loop
        assert fut is not None and loop is not None
        if asyncio._get_running_loop() is loop:
            if not fut.done():
                fut.set_result(None)  # schedules the waiting task; nothing runs under the lock
        else:
            call_soon(loop, fut)


# Where a caller sleeps: on its event loop, or on an event (`THREAD`).
On = asyncio.AbstractEventLoop | str
# What an attempt returns: the result, or (None, the waiter to sleep on, when to retry at the latest).
Tried = tuple[T | None, Waiter | None, float | None]
Attempt = Callable[[On], Tried[T]]


def resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def call_soon(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Resolve `fut` on its loop from any thread (a closed loop means the waiter is gone)."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve, fut)


def wake(waiters: list[Waiter], have: int) -> None:
    """Wake (and drop from `waiters`) every waiter whose need is at most `have`."""
    keep = []
    for w in waiters:
        if w.need <= have:
            w.wake()
        else:
            keep.append(w)
    waiters[:] = keep


def wake_in_turn(waiters: list[Waiter], have: int, lock: threading.Lock, ready: Callable[[int], bool]) -> None:
    """`wake(waiters, have)` for a stage's takers, without a herd: the first met waiters are woken
    while the `have` samples last (each takes up to its `want`, or its `room()` now when it has one
    and that is more: a rollout worker woken for one slot fills every slot freed meanwhile, and
    waking a worker per sample left all but the first without one); the other met waiters on this loop
    get one callback, queued where their woken tasks would have retried (one after another), which
    puts each back at the end of the list or, when `ready(need)` holds by then, wakes it. So the
    takes and the list's order are those of waking all of them, without a task switch and a failed
    retry per waiter (at 1,024 rollout workers, about one per sample)."""
    loop = asyncio._get_running_loop()
    keep: list[Waiter] = []
    later: list[Waiter] = []
    left = have  # samples not yet claimed by a woken waiter
    for w in waiters:
        if w.need > have:
            keep.append(w)
        elif left > 0 or w.loop is not loop or loop is None:
            w.wake()
            left -= _takes(w)
        else:
            later.append(w)
    waiters[:] = keep
    if later:
        assert loop is not None
        loop.call_soon(_retry_later, later, lock, ready)


def _retry_later(later: list[Waiter], lock: threading.Lock, ready: Callable[[int], bool]) -> None:
    """`wake_in_turn`'s deferred waiters, in order: gone if the wait ended meanwhile, woken if it
    can go on with what the ones woken before it here leave (their `want` or `room()`), asked
    again after those have taken theirs if only they stand in its way, else back on its list."""
    claimed = 0  # what the waiters woken here take first (they retry after this callback)
    again: list[Waiter] = []
    with lock:
        for w in later:
            if w.fut is None or w.fut.done():
                continue
            if ready(w.need + claimed):
                w.wake()
                claimed += _takes(w)
            elif claimed:
                again.append(w)
            else:
                w.home.append(w)
    if again:
        asyncio.get_running_loop().call_soon(_retry_later, again, lock, ready)


def _takes(w: Waiter) -> int:
    """How many a woken waiter takes at most before any other retries."""
    return w.want if w.room is None else max(w.want, w.room())


def drop(w: Waiter | None, lock: threading.Lock) -> None:
    """Take a waiter that stopped waiting (it was served, timed out or cancelled) off its list."""
    if w is not None and not w.woken:  # a woken waiter has already left its list
        with lock:
            if w in w.home:
                w.home.remove(w)


def _delay(clock: Clock, deadline: float | None, wake_at: float | None) -> float | None:
    ends = [t for t in (deadline, wake_at) if t is not None]
    return max(0.0, min(ends) - clock.now()) if ends else None


def _timed_out(clock: Clock, deadline: float | None, timeout: float | None, what: str) -> None:
    if deadline is not None and clock.now() >= deadline:
        unit = getattr(clock, "unit", "s")  # ("virtual s" on a virtual clock, as `bounded` words it)
        raise WaitTimeout(f"timed out after {seconds_text(timeout or 0.0)} {unit} waiting for {what}")


async def wait_async(clock: Clock, lock: threading.Lock, attempt: Attempt[T], timeout: float | None,
                     what: str) -> T:
    """Retry `attempt` until it returns a result, sleeping on its waiter's future between tries;
    `WaitTimeout` naming `what` after `timeout` seconds of `clock`. `lock` is the store's."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else clock.now() + timeout
    # A clock on the loop's own time line: a plain loop timer ends the sleep (`call_later` and
    # `cancel`: 5.2 us on the 2-core VM, against 11.5 for an `asyncio.timeout`); the loop below
    # then retries, and raises once the deadline has passed.
    loop_timer = getattr(clock, "loop_time", False)
    while True:
        result, waiter, wake_at = attempt(loop)
        if result is not None:
            return result
        assert waiter is not None and waiter.fut is not None
        try:
            _timed_out(clock, deadline, timeout, what)
            delay = _delay(clock, deadline, wake_at)
            if loop_timer:
                timer = None if delay is None else loop.call_later(delay, resolve, waiter.fut)
                try:
                    await waiter.fut
                finally:
                    if timer is not None:
                        timer.cancel()
            else:
                # Timing out here means a lease may have expired or the caller's deadline passed: retry.
                with contextlib.suppress(WaitTimeout):
                    await clock.wait_for(waiter.fut, delay, what)
        finally:
            drop(waiter, lock)


def wait_thread(clock: Clock, lock: threading.Lock, attempt: Attempt[T], timeout: float | None,
                what: str) -> T:
    """`wait_async` for threads, sleeping on a `threading.Event`."""
    deadline = None if timeout is None else clock.now() + timeout
    while True:
        result, waiter, wake_at = attempt(THREAD)
        if result is not None:
            return result
        assert waiter is not None and waiter.event is not None
        try:
            _timed_out(clock, deadline, timeout, what)
            waiter.event.wait(_delay(clock, deadline, wake_at))
        finally:
            drop(waiter, lock)
