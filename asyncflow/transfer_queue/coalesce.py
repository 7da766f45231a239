"""A one-shot timer that sends what a buffer coalesced: the first item arms it, the buffer's own send
disarms it, and when nothing sent the buffer first it calls `fire` once, `delay_s` after it was armed.

The Ray store client's columnar puts (`put_buffer`) and its updates from plain threads (`op_queue`)
use one each, so an item that comes alone still goes out a few ms later without waiting for another.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

IDLE_EXIT_S = 1.0  # an unarmed timer's thread ends after this; the next arming starts another


class CoalesceTimer:
    """Calls `fire()` on its own thread once per arming. Thread-safe: `arm` and `cancel` may come
    from any thread, with the owner's lock held or not (this lock is never held while `fire` runs,
    so `fire` may take the owner's lock).

    One thread serves every arming while they keep coming (`arm` only sets a deadline and wakes it):
    a thread started per arming cost a put or an ack its start-up (the new thread must be scheduled
    before `Thread.start` returns; up to a millisecond on a busy machine)."""

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._cv = threading.Condition()
        self._due: float | None = None  # monotonic time to fire at; None: not armed
        self._thread: threading.Thread | None = None

    @property
    def armed(self) -> bool:
        return self._due is not None

    def arm(self, delay_s: float) -> None:
        """Fire `delay_s` from now, unless armed already (a later item does not push the send back)."""
        with self._cv:
            if self._due is not None:
                return
            self._due = time.monotonic() + delay_s
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="coalesce-timer", daemon=True)
                self._thread.start()
            else:
                self._cv.notify()

    def cancel(self) -> None:
        """Disarm: the owner sends its buffer itself now; the next `arm` arms it again."""
        with self._cv:
            self._due = None

    def _loop(self) -> None:
        with self._cv:
            while True:
                if self._due is None:
                    if not self._cv.wait(IDLE_EXIT_S) and self._due is None:
                        self._thread = None  # (under the lock: an `arm` now starts a new thread)
                        return
                    continue
                left = self._due - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue  # (re-read: cancelled, or cancelled and armed again, meanwhile)
                self._due = None
                self._cv.release()
                try:
                    self._fire()
                finally:
                    self._cv.acquire()
