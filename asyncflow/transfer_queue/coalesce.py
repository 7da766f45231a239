"""A one-shot timer that sends what a buffer coalesced: the first item arms it, the buffer's own send
disarms it, and when nothing sent the buffer first it calls `fire` once, `delay_s` after it was armed.

The Ray store client's columnar puts (`put_buffer`) and its updates from plain threads (`op_queue`)
use one each, so an item that comes alone still goes out a few ms later without waiting for another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class CoalesceTimer:
    """Calls `fire()` on a timer thread once per arming. Thread-safe: `arm` and `cancel` may come
    from any thread, with the owner's lock held or not (this lock is never held while `fire` runs,
    so `fire` may take the owner's lock)."""

    def __init__(self, fire: Callable[[], None]) -> None:
        self._fire = fire
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._armings = 0  # which arming the running timer belongs to (see `_run`)

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self, delay_s: float) -> None:
        """Start the timer unless it is armed already (a later item does not push the send back)."""
        with self._lock:
            if self._timer is not None:
                return
            self._armings += 1
            self._timer = threading.Timer(delay_s, self._run, (self._armings,))
            self._timer.daemon = True
            self._timer.start()

    def cancel(self) -> None:
        """Disarm: the owner sends its buffer itself now; the next `arm` starts a new timer."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def _run(self, arming: int) -> None:
        with self._lock:
            # a timer cancelled while it was waking up fires nothing: its buffer was sent, and
            # anything buffered since waits for the timer armed for it
            if self._timer is None or arming != self._armings:
                return
            self._timer = None
        self._fire()
