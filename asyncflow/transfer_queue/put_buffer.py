"""Columnar puts of the Ray store client coalesced into one object-store put and one controller call.

A `ray.put` and an actor call each cost a fixed ~0.5-1 ms of CPU on a small machine whatever their
size (STORE-1: 64 puts of 720 KB spent more time in those two calls than in moving the bytes), so
puts issued within `coalesce_s` of each other go out together, up to `max_bytes`: the columns of
all of them as one object (a tuple, one entry per put, each kept as it was put) and their metadata
in one call. A put that comes alone is sent `coalesce_s` after it was made (a `CoalesceTimer`), so
nothing waits for a later put to become visible; a client's reads and `flush` send what is
buffered first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from asyncflow.transfer_queue.coalesce import CoalesceTimer

Part = tuple[list[int], int, list[int], list[str], list[int]]  # group ids, group size, uids, names, bytes per row


class PutBuffer:
    """Buffered columnar puts; `send_fn(parts, columns, timeout)` ships one batch of them."""

    def __init__(self, send_fn: Callable[[list[Part], list[dict[str, Any]], float | None], None],
                 coalesce_s: float = 0.002, max_bytes: int = 32 << 20) -> None:
        self._send_fn = send_fn
        self.coalesce_s = coalesce_s
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._parts: list[Part] = []
        self._columns: list[dict[str, Any]] = []
        self._bytes = 0
        self._timeout: float | None = None
        self._unbounded = False
        self._timer = CoalesceTimer(self._on_timer)
        self._error: BaseException | None = None

    def add(self, part: Part, columns: dict[str, Any], nbytes: int, timeout: float | None) -> None:
        """Buffer one put; raises the error of an earlier send made by the timer."""
        with self._lock:
            self._raise_error()
            self._parts.append(part)
            self._columns.append(columns)
            self._bytes += nbytes
            # the longest wait any of them allows (None: no limit) bounds the coalesced put's wait for room
            if timeout is None:
                self._unbounded = True
            else:
                self._timeout = max(timeout, self._timeout or 0.0)
            if self._bytes >= self.max_bytes:
                self._send_locked()
            else:
                self._timer.arm(self.coalesce_s)

    def send(self) -> None:
        """Ship what is buffered now (before a read of the client, or its flush)."""
        with self._lock:
            self._send_locked()
            self._raise_error()

    def _on_timer(self) -> None:
        with self._lock:
            try:
                self._send_locked()
            except BaseException as exc:  # (no caller here: the client's next put or flush raises it)
                self._error = exc

    def _send_locked(self) -> None:
        self._timer.cancel()
        if not self._parts:
            return
        parts, columns, timeout = self._parts, self._columns, None if self._unbounded else self._timeout
        self._parts, self._columns, self._bytes, self._timeout, self._unbounded = [], [], 0, None, False
        self._send_fn(parts, columns, timeout)

    def _raise_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
