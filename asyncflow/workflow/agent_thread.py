"""Each black-box agent episode runs its `async def agent(...)` on an event loop of its own, in a
thread of its own, never on the rollout worker's loop.

Why: the worker's loop runs the agent's recording endpoint (`AgentProxy`), the inference engine,
every wait's timeout and the lease keeper. An `async def` agent that makes one synchronous call
(`urllib.request.urlopen` to its own endpoint, `time.sleep`, a blocking SDK) stalled that loop:
the endpoint could not answer the call that blocked it, so the run froze with no timeout or lease
renewal left to fire. On a loop of its own, a blocking agent blocks only its own thread: its calls
are still answered, and `rollout.agent_timeout_s` (awaited on the worker's loop) still ends its
episode — with an error saying where it is blocked when its loop is stuck in a synchronous call.

A thread cannot be killed: an agent that never returns keeps its (daemon) thread until it does.
At its timeout it is cancelled (and its loop stopped a grace later, for one that swallows the
cancellation); the thread ends as soon as the agent yields to its loop again.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import sysconfig
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from asyncflow.clock import Clock
from asyncflow.errors import WaitTimeout

STOP_GRACE_S = 5.0  # after its cancel, how long an agent's loop runs before it is stopped
CLEANUP_S = 5.0  # bound on an agent loop's own cleanup (its leftover tasks, generators, executor)


class AgentBlocked(WaitTimeout):
    """An agent's timeout, while its event loop was stuck in a synchronous call at `where`."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


class AgentCancelled(Exception):
    """The agent raised `CancelledError` itself (it awaited a task it had cancelled): its failure."""


class AgentThread:
    """One agent call on a fresh event loop in a daemon thread; the result comes back to the
    caller's loop through a future (set only while that loop still runs)."""

    def __init__(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], name: str) -> None:
        self.caller = asyncio.get_running_loop()
        self.result: asyncio.Future[Any] = self.caller.create_future()
        self._fn, self._args = fn, args
        self._lock = threading.Lock()  # guards _loop/_task/_stopping between the two threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stopping = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            with self._lock:
                self._loop = loop
                self._task = task = loop.create_task(_call(self._fn, self._args))
                if self._stopping:
                    task.cancel()
            try:
                outcome: tuple[bool, Any] = (True, loop.run_until_complete(task))
            except asyncio.CancelledError:
                outcome = (False, asyncio.CancelledError() if self._stopping else AgentCancelled(
                    "CancelledError raised by the agent itself (e.g. it awaited a task it had cancelled)"))
            except Exception as exc:  # (RuntimeError "Event loop stopped" too: outcome discarded then)
                outcome = (False, exc)
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the agent's failure, not the run's
                outcome = (False, RuntimeError(f"the agent raised {type(exc).__name__}: {exc}"))
            self._settle(outcome)
            _cleanup(loop)
        finally:
            with self._lock:
                self._loop = None
            asyncio.set_event_loop(None)
            loop.close()

    def _settle(self, outcome: tuple[bool, Any]) -> None:
        def settle() -> None:
            if not self.result.done():
                ok, value = outcome
                self.result.set_result(value) if ok else self.result.set_exception(value)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
            self.caller.call_soon_threadsafe(settle)

    def stop(self) -> None:
        """Cancel the agent; its loop is stopped `STOP_GRACE_S` later if it swallows the cancel."""
        with self._lock:
            self._stopping = True
            loop, task = self._loop, self._task
            if loop is None or task is None:
                return
            with contextlib.suppress(RuntimeError):  # (its loop just closed)
                loop.call_soon_threadsafe(task.cancel)
                loop.call_soon_threadsafe(loop.call_later, STOP_GRACE_S, loop.stop)

    def blocked_at(self) -> str | None:
        """Where the agent's thread is, when it is not waiting in its event loop's selector: the
        innermost frame outside the Python library (the agent's own line), else the innermost."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        if frame is None or frame.f_code.co_filename.endswith("selectors.py"):
            return None
        stdlib = sysconfig.get_paths()["stdlib"]
        f: FrameType | None = frame
        while f is not None and f.f_code.co_filename.startswith(stdlib):
            f = f.f_back
        f = f or frame
        return f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"


async def _call(fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> Any:
    return await fn(*args)


def _cleanup(loop: asyncio.AbstractEventLoop) -> None:
    """What `asyncio.run` does after its main task, but bounded: cancel the tasks the agent left,
    close async generators and the default executor."""
    async def tidy() -> None:
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in left:
            t.cancel()
        if left:
            await asyncio.wait(left, timeout=CLEANUP_S)
        await asyncio.wait_for(loop.shutdown_asyncgens(), CLEANUP_S)
        await asyncio.wait_for(loop.shutdown_default_executor(), CLEANUP_S)

    with contextlib.suppress(Exception, asyncio.CancelledError):
        loop.run_until_complete(tidy())


async def run_agent_thread(clock: Clock, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                           timeout_s: float, what: str) -> Any:
    """`await fn(*args)` on a loop and thread of its own, bounded by `timeout_s` on `clock`. On
    timeout `WaitTimeout` names `what` and, when the agent's loop is stuck in a synchronous call,
    where; on timeout or cancellation of the caller the agent is stopped (see `AgentThread.stop`)."""
    runner = AgentThread(fn, args, f"asyncflow-{what.replace(' ', '-')}")
    try:
        return await clock.wait_for(asyncio.shield(runner.result), timeout_s, what)
    except WaitTimeout as exc:
        where = runner.blocked_at()
        if where is not None:  # (two looks: a loop caught mid-step is not a blocked one)
            await asyncio.sleep(0.05)
            where = runner.blocked_at()
        if where is not None:
            raise AgentBlocked(str(exc), where) from None
        raise
    finally:
        if not runner.result.done():
            runner.stop()
            runner.result.cancel()
