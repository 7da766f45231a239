"""The run folder's logs: metrics.jsonl, samples.jsonl and the Chrome trace (trace.json).

Rows are appended and flushed as they happen, so a crashed run still leaves everything up to the
crash on disk. The trace uses Chrome's trace-event format, as a JSON array streamed as spans end
(Perfetto opens it, whole or cut short by a kill): one track per worker, one complete ("X") event
per span, times in microseconds since the run started.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class MetricSink:
    """Somewhere metric rows also go. A row's numeric values become scalars named `kind/key`
    (`train/reward_mean`; an eval row's `eval_` keys without the doubled prefix: `eval/accuracy`),
    indexed by the row's `step`."""

    def write(self, row: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metric row (booleans and non-finite values left out), as `kind/key`;
    an eval row's `eval_accuracy` is `eval/accuracy` (its metrics.jsonl key keeps the prefix: DESIGN.md)."""
    kind = row.get("kind", "metrics")
    out = {}
    for k, v in row.items():
        if k in ("kind", "step") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if v == v and v not in (float("inf"), float("-inf")):
            name = k.removeprefix("eval_") if kind == "eval" else k
            out[f"{kind}/{name}"] = float(v)
    return out


class TensorBoardSink(MetricSink):
    """`logging.tensorboard`: scalars in `RUN_DIR/tensorboard/` (`tensorboard --logdir RUN_DIR`)."""

    def __init__(self, out: Path, purge_step: int | None = None) -> None:
        """`purge_step`: a resumed run's first redone step; the event files' points from it on are
        dropped (as `cut_logs` cuts metrics.jsonl), so redone steps are not drawn twice."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge_step)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink(MetricSink):
    """`logging.wandb`: one W&B run per asyncflow run (project `logging.wandb_project`); the resolved
    config is its config. Offline mode and API keys are W&B's own environment variables.

    The W&B run's id is kept in `RUN_DIR/wandb_id`, so a resumed asyncflow run goes on in the same W&B
    run (`resume="allow"`; each resume opened a second run of the same name). Rows are placed by their
    own `step` (a metric W&B plots against, not W&B's internal step): an evaluation that ends after a
    later train step, or one redone at a resume, lands at its step (they landed at W&B's current one)."""

    def __init__(self, out: Path, project: str, config: dict[str, Any]) -> None:
        import secrets

        import wandb

        id_file = out / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=out.name, dir=str(out), config=config, id=run_id,
                              resume="allow")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict[str, Any]) -> None:
        self.run.log({"step": int(row.get("step", 0)), **scalars(row)})

    def close(self) -> None:
        self.run.finish()


def make_sinks(out: Path, *, tensorboard: bool, wandb_project: str | None, config: dict[str, Any],
               resume_step: int | None = None, redo_eval: bool = False) -> list[MetricSink]:
    """The sinks a run's `logging` section asks for (their packages were checked at config load).
    `resume_step`: the checkpoint a resumed run goes on from; `redo_eval`: it evaluates again at that
    step (an evaluation begins after its step's checkpoint, so the one due there is never in it)."""
    sinks: list[MetricSink] = []
    if tensorboard:
        if resume_step is not None and redo_eval:
            # TensorBoard's points from the checkpoint's own step on are purged (its evaluation, drawn
            # before the stop, was drawn twice), and that step's kept rows (metrics.jsonl, already cut
            # back to the checkpoint) drawn again
            sink = TensorBoardSink(out, resume_step)
            for row in _rows_at(out / "metrics.jsonl", resume_step):
                sink.write(row)
            sinks.append(sink)
        else:
            sinks.append(TensorBoardSink(out, None if resume_step is None else resume_step + 1))
    if wandb_project is not None:
        sinks.append(WandbSink(out, wandb_project, config))
    return sinks


def _rows_at(path: Path, step: int) -> list[dict[str, Any]]:
    """The rows of a JSON-lines metrics file logged for `step` (unreadable lines skipped)."""
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and row.get("step") == step:
                    rows.append(row)
    return rows


class RunLog:
    """Appends metric and sample rows to the run folder.

    `samples.jsonl` may be appended to by several processes at once (Ray actors log the samples they
    end): each batch of rows is one `write` on an O_APPEND descriptor, so lines never interleave.
    """

    def __init__(self, out: Path, *, metrics: bool = True, sinks: list[MetricSink] | None = None) -> None:
        """`sinks`: more places every metric row also goes to (TensorBoard, W&B; see `make_sinks`)."""
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.sinks = list(sinks or [])
        self._metrics = (out / "metrics.jsonl").open("a") if metrics else None
        self._samples_fd: int | None = os.open(out / "samples.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def metric(self, row: dict[str, Any]) -> None:
        """One `metrics.jsonl` row (must carry `kind`)."""
        if self._metrics is None:
            raise RuntimeError("this RunLog was opened without metrics.jsonl")
        # a non-finite number (a skipped step's NaN or inf grad_norm) is written as null: bare NaN and
        # Infinity are not JSON, and strict readers (JavaScript's JSON.parse, Go, serde) refused the file
        line = json.dumps(_finite_or_null(row))
        with self._lock:
            self._metrics.write(line + "\n")
            self._metrics.flush()
            for sink in self.sinks:
                sink.write(row)

    def sample_lines(self, lines: list[str]) -> None:
        """Finished samples (`samples.jsonl`), each already one JSON line (`jsonl.sample_line`)."""
        if not lines:
            return
        data = "".join(lines).encode()
        with self._lock:
            if self._samples_fd is None:
                raise RuntimeError("samples.jsonl is closed")
            view = memoryview(data)
            while view:
                view = view[os.write(self._samples_fd, view):]

    def close(self) -> None:
        with self._lock:
            for sink in self.sinks:
                sink.close()
            self.sinks = []
            if self._metrics is not None:
                self._metrics.close()
            if self._samples_fd is not None:
                os.close(self._samples_fd)
                self._samples_fd = None


def _finite_or_null(value: Any) -> Any:
    """`value` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


RUN_TRACE_EVENTS = 300_000  # an in-memory tracer (a Ray actor's, merged into the run's at its end): ~140 MB
# at most; later spans are counted as dropped. The run's own trace streams to disk and has no cap.
TRACE_FLUSH_S = 1.0  # a streamed trace reaches the disk at least this often (a kill -9 loses at most this)
TRACE_FLUSH_EVENTS = 2000  # ... and whenever this many events are buffered
DROPPED = "asyncflow_dropped_spans"  # the metadata event an in-memory trace that hit its cap ends with


class Tracer:
    """Collects spans per track as Chrome trace events (JSON array format; Perfetto opens it).

    With `path`, events are streamed to that file as they happen: `[` and one event per line, each
    line after the first led by a comma, flushed every `TRACE_FLUSH_S` seconds or `TRACE_FLUSH_EVENTS`
    events; `close` adds the `]`. The array format allows a missing `]`, so a killed run's file is a
    readable trace up to its last flush (`parse_trace`). Without `path`, events are kept in memory
    (`raw`, `write`), at most `max_events`.

    `now` is the run's clock (`Clock.now`), so spans share the workflow's time line — virtual time
    included, when the PIPE benchmark drives the workflow on a virtual clock.
    """

    def __init__(self, now: Callable[[], float] = time.monotonic, max_events: int | None = None,
                 path: Path | None = None) -> None:
        """`max_events`: an in-memory tracer keeps at most this many spans (later ones are counted in
        `dropped`); 0 records nothing."""
        self.now = now
        self.t0 = now()
        self.max_events = max_events
        self.dropped = 0
        self._events: list[dict[str, Any]] = []
        self._tracks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._buffer: list[str] = []
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if path is not None and max_events != 0:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write("[" + json.dumps(_PROCESS_NAME))
            self._flusher = threading.Thread(target=self._flush_every, name="trace-flush", daemon=True)
            self._flusher.start()

    @property
    def off(self) -> bool:
        """Built with `max_events=0`: records nothing, so hot paths can skip formatting span names."""
        return self.max_events == 0

    def _tid(self, track: str) -> int:
        if track not in self._tracks:
            self._tracks[track] = tid = len(self._tracks) + 1
            if self._fd is not None:
                self._buffer.append(",\n" + json.dumps(_thread_name(track, tid)))
        return self._tracks[track]

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """A finished span on `track`, times from the tracer's clock."""
        with self._lock:
            if self.max_events == 0 or (self._fd is None and self.max_events is not None
                                        and len(self._events) >= self.max_events):
                self.dropped += 1
                return
            event = {"ph": "X", "name": name, "pid": 1, "tid": self._tid(track), "ts": (start - self.t0) * 1e6,
                     "dur": max(end - start, 0.0) * 1e6, "args": args}
            if self._fd is None:
                self._events.append(event)
                return
            self._buffer.append(",\n" + json.dumps(event))
            if len(self._buffer) >= TRACE_FLUSH_EVENTS:
                self._flush_locked()

    def _write(self, text: str) -> None:
        """One write call per flush (a kill lands between events, not inside one)."""
        assert self._fd is not None
        view = memoryview(text.encode())
        while view:
            view = view[os.write(self._fd, view):]

    def _flush_locked(self) -> None:
        if self._buffer and self._fd is not None:
            self._write("".join(self._buffer))
            self._buffer.clear()

    def _flush_every(self) -> None:
        while not self._stop.wait(TRACE_FLUSH_S):
            with self._lock:
                self._flush_locked()

    def close(self) -> None:
        """Write what is buffered and end the streamed file with `]` (a JSON document from then on)."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5 * TRACE_FLUSH_S)
        with self._lock:
            if self._fd is None:
                return
            self._flush_locked()
            self._write("\n]\n")
            os.close(self._fd)
            self._fd = None

    @contextmanager
    def timed(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Context manager recording a span around its body."""
        start = self.now()
        try:
            yield
        finally:
            self.span(track, name, start, self.now(), **args)

    def raw(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        """An in-memory tracer's spans as (track, name, start, end, args) on its clock (to merge into another)."""
        names = {tid: track for track, tid in self._tracks.items()}
        with self._lock:
            return [
                (names[e["tid"]], e["name"], e["ts"] / 1e6 + self.t0, (e["ts"] + e["dur"]) / 1e6 + self.t0, e["args"])
                for e in self._events
            ]

    def write(self, path: Path) -> None:
        """An in-memory tracer's events as one trace file (array format), written whole or not at all."""
        with self._lock:
            events = [_thread_name(track, tid) for track, tid in self._tracks.items()]
            events += [_PROCESS_NAME, *self._events]
            if self.dropped:
                events.append({"ph": "M", "name": DROPPED, "pid": 1,
                               "args": {"dropped_spans": self.dropped, "max_events": self.max_events}})
        # whole or not at all: a run killed while writing (or a full disk) left half a file
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(events))
        os.replace(tmp, path)


_PROCESS_NAME = {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "asyncflow"}}


def _thread_name(track: str, tid: int) -> dict[str, Any]:
    return {"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}}


def parse_trace(text: str) -> tuple[Any, bool]:
    """A Chrome trace file's JSON (array or object format) and whether it was cut short. An array
    without its `]` (a run killed mid-way) is read as Perfetto reads it, up to its last whole event.
    ValueError when it is neither."""
    try:
        return _json(text), False
    except ValueError:
        if not text.lstrip().startswith("["):
            raise
    body = text.rstrip()
    for candidate in (body, body[:body.rfind("\n")].rstrip()):  # (the last line may be cut mid-event)
        try:
            return _json(candidate.rstrip(",") + "]"), True
        except ValueError:
            continue
    raise ValueError("a Chrome trace array cut short inside its first event")


def _json(text: str) -> Any:
    """`json.loads`, a document nested past Python's recursion limit being a ValueError too."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deep to read") from None
