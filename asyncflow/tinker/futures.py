"""The service's futures: every long call answers its POST with a request id at once, and the client
long-polls `retrieve_future` for the result.

    submit ──► FutureStore.add(kind, cf.Future) ──► {"request_id": ...}
    retrieve_future ──► wait up to `poll_s` ──► done: the result (again on every poll, until its TTL)
                                            └─► pending: {"type": "try_again"} (the SDK re-polls at once)

A result stays retrievable until `ttl_s` after it finished (a poll repeated after a broken connection
gets the same answer); at most `max_kept` finished results are kept, the oldest dropped first.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, TypeVar

POLL_S = 20.0  # how long one retrieve_future waits (the SDK's own read timeout for it is 45 s)
TTL_S = 3600.0
MAX_KEPT = 10_000


T = TypeVar("T")


def resolved(value: T) -> cf.Future[T]:
    """A future already resolved with `value`."""
    future: cf.Future[T] = cf.Future()
    future.set_result(value)
    return future


@dataclass
class Entry:
    kind: str  # "json" or "proto": how its result is sent
    future: cf.Future[Any]
    finished_at: float | None = None


@dataclass
class Poll:
    """What one poll found: `state` is "done", "failed", "pending" or "unknown"."""

    state: str
    kind: str = "json"
    value: Any = None


class FutureStore:
    """Request id -> future, safe for the HTTP threads that add and poll them."""

    def __init__(self, *, poll_s: float = POLL_S, ttl_s: float = TTL_S, max_kept: int = MAX_KEPT) -> None:
        self.poll_s, self.ttl_s, self.max_kept = poll_s, ttl_s, max_kept
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._ids = itertools.count()

    def add(self, kind: str, future: cf.Future[Any]) -> str:
        """Keep `future` under a new request id (its result is sent as `kind`: "json" or "proto")."""
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._entries[request_id] = Entry(kind, future)
            self._prune(time.monotonic())
        return request_id

    def done(self, kind: str, value: Any) -> str:
        """A future already resolved with `value`."""
        return self.add(kind, resolved(value))

    def poll(self, request_id: str, wait_s: float | None = None) -> Poll:
        """Wait up to `wait_s` (default `poll_s`) for the request's result."""
        with self._lock:
            entry = self._entries.get(request_id)
        if entry is None:
            return Poll("unknown")
        try:
            value = entry.future.result(timeout=self.poll_s if wait_s is None else wait_s)
        except cf.TimeoutError:
            return Poll("pending")
        except Exception as exc:  # (the job's own failure: the client gets it as a failed future)
            self._finished(entry)
            return Poll("failed", value=exc)
        self._finished(entry)
        return Poll("done", entry.kind, value)

    def _finished(self, entry: Entry) -> None:
        with self._lock:
            if entry.finished_at is None:
                entry.finished_at = time.monotonic()

    def _prune(self, now: float) -> None:
        """Drop finished results past their TTL, then the oldest finished ones over `max_kept` (under the lock)."""
        finished = [k for k, e in self._entries.items() if e.future.done()]
        over = len(finished) - self.max_kept
        for i, key in enumerate(finished):
            entry = self._entries[key]
            if entry.finished_at is None:
                entry.finished_at = now
            if i < over or now - entry.finished_at > self.ttl_s:
                del self._entries[key]
