"""Stack dumps of one process: every thread's Python stack and every asyncio task's await chain.

What a stalled run leaves behind to read (the stall watchdog writes one per process into the run
folder): which line each thread is on, and where each task of the event loop waits. Read from any
thread without stopping the others, so a process whose stage hangs can still be dumped.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import traceback
from types import FrameType
from typing import Any

# what a task's chain shows past the caller's code: the event loop's own frames
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def thread_stacks() -> str:
    """Every thread's stack, innermost frame last, headed by its name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, '?')} (id {ident})\n{stack}")
    return "\n".join(parts)


def task_frames(task: asyncio.Task[object]) -> list[FrameType]:
    """The frames a task waits in, outermost first: its coroutine's await chain, followed through
    each awaited coroutine (`Task.get_stack` gives only the outermost frame), up to a future."""
    frames: list[FrameType] = []
    coro: Any = task.get_coro()
    while coro is not None and len(frames) < 200:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # (finished, or a future: what it waits for is not a frame)
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames


def all_tasks(loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[object]]:
    """The loop's unfinished tasks, read from any thread (retried while the loop changes the set)."""
    for _ in range(10):
        try:
            return sorted(asyncio.all_tasks(loop), key=lambda t: t.get_name())
        except RuntimeError:  # ("set changed size during iteration": the loop's thread added one)
            continue
    return []


def task_stacks(loop: asyncio.AbstractEventLoop | None) -> str:
    """Every unfinished task of `loop` with the frames it waits in."""
    if loop is None:
        return "(no event loop)\n"
    parts = []
    for task in all_tasks(loop):
        frames = task_frames(task)
        lines = "".join(traceback.format_list(traceback.StackSummary.extract((f, f.f_lineno) for f in frames)))
        parts.append(f"--- task {task.get_name()}\n" + (lines or "  (no frames: not started or done)\n"))
    return "\n".join(parts)


def process_stacks(loop: asyncio.AbstractEventLoop | None, title: str) -> str:
    """`title`'s dump: its pid, then its threads, then its event loop's tasks."""
    return (f"=== {title} (pid {os.getpid()})\n\n== threads\n{thread_stacks()}\n"
            f"== asyncio tasks\n{task_stacks(loop)}")


def waiting_in(frames: list[FrameType], depth: int = 3) -> str:
    """Where a chain of frames waits: its innermost `depth` frames outside asyncio, outermost first,
    as `caller > callee (file:line)`."""
    own = [f for f in frames if not f.f_code.co_filename.startswith(_ASYNCIO_DIR)][-depth:]
    if not own:
        return "?"
    names = [getattr(f.f_code, "co_qualname", f.f_code.co_name) for f in own]  # (Python 3.10: bare names)
    last = own[-1]
    return " > ".join(names) + f" ({os.path.basename(last.f_code.co_filename)}:{last.f_lineno})"
