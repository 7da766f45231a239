"""The run folder's logs: metrics.jsonl, samples.jsonl and the Chrome trace (trace.json).

Rows are appended and flushed as they happen, so a crashed run still leaves everything up to the
crash on disk. The trace uses Chrome's trace-event format (Perfetto opens it): one track per worker,
one complete ("X") event per span, times in microseconds since the run started.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class RunLog:
    """Appends metric and sample rows to the run folder."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self._metrics = (out / "metrics.jsonl").open("a")
        self._samples = (out / "samples.jsonl").open("a")
        self._lock = threading.Lock()

    def metric(self, row: dict[str, Any]) -> None:
        """One `metrics.jsonl` row (must carry `kind`)."""
        with self._lock:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()

    def samples(self, rows: list[dict[str, Any]]) -> None:
        """Finished samples (`samples.jsonl`)."""
        if not rows:
            return
        with self._lock:
            self._samples.write("".join(json.dumps(r) + "\n" for r in rows))
            self._samples.flush()

    def close(self) -> None:
        with self._lock:
            self._metrics.close()
            self._samples.close()


class Tracer:
    """Collects spans per track and writes Chrome trace JSON.

    `now` is the run's clock (`Clock.now`), so spans share the workflow's time line — virtual time
    included, when the PIPE benchmark drives the workflow on a virtual clock.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.now = now
        self.t0 = now()
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()

    def _tid(self, track: str) -> int:
        if track not in self._tracks:
            self._tracks[track] = len(self._tracks) + 1
        return self._tracks[track]

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """A finished span on `track`, times from the tracer's clock."""
        with self._lock:
            self._events.append(
                {"ph": "X", "name": name, "pid": 1, "tid": self._tid(track), "ts": (start - self.t0) * 1e6,
                 "dur": max(end - start, 0.0) * 1e6, "args": args}
            )

    @contextmanager
    def timed(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Context manager recording a span around its body."""
        start = self.now()
        try:
            yield
        finally:
            self.span(track, name, start, self.now(), **args)

    def write(self, path: Path) -> None:
        with self._lock:
            meta = [
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}}
                for track, tid in self._tracks.items()
            ]
            events = meta + [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "asyncflow"}}] + self._events
        path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
