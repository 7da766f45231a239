"""A simulated inference engine: a continuous-batching server whose work is time on a `Clock`.

Used by the PIPE benchmark on a virtual clock (`virtual_loop.py`), where thousands of these
stand in for GPUs while the store, the staleness gate and the weight-sync protocol are the real code.
It behaves like the servers it models, in the ways that matter for scheduling:

- **Continuous batching.** Up to `capacity` sequences decode together; every decode step takes
  `step_s` whatever the batch size (memory-bound decoding); a finished sequence leaves at once and a
  waiting request takes its slot at the next step. Admitting requests costs `prefill_s` per step that
  admits any.
- **Lengths from a profile.** Each request's response length is `lengths(rng)`, capped by the
  request's `max_new_tokens`; the last token is EOS (`finish_reason: stop`) unless the cap cut it.
- **Weight loads in the three modes** (DESIGN.md): `swap` between two decode steps (later tokens carry
  the new version), `drain` (no admissions until the running sequences finish, then load), `abort`
  (running sequences pause, the load happens, they are re-prefilled and continue). Each load costs
  `load_s`.
- **Per-token versions, cancellation** (`cancel_older_than`), busy seconds (time with a non-empty batch).

Event-driven, not token-stepped: a running sequence's last decode step is known when it is admitted,
so the server sleeps straight to the next event (a sequence ends, a request can join a free slot, a
weight load or a cancellation arrives) and takes the decode steps in between as one span. That keeps
a simulated 16,384-token response as cheap as a short one. Columns are run-length (`Runs`): every
token id is `FILL` (EOS last when the sequence stops), every log-prob `-1.0`, versions as runs;
nothing downstream of PIPE reads the ids.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncflow.clock import Clock
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, WeightUpdateMode
from asyncflow.runs import Runs

EOS = 1
FILL = 7


@dataclass(eq=False)
class _Seq:
    request: GenRequest
    target: int  # tokens this request will produce in all
    stops: bool  # the natural length fits: the last token is EOS (else cut at max_new_tokens)
    done: asyncio.Future[GenResult]
    produced: int = 0  # tokens produced before the current admission
    admitted_at: int = 0  # engine step index of the current admission
    runs: list[tuple[int, int]] = field(default_factory=list)  # closed (version, tokens) runs
    run_from: int = 0  # step index where the current version run began
    cancelled: bool = False

    def end_step(self) -> int:
        return self.admitted_at + self.target - self.produced


class _RequestFuture(asyncio.Future[GenResult]):
    """A request's result future whose cancellation by its caller (an abandoned straggler) frees the
    request's slot at the next step boundary, as a real engine does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_cancel: Callable[[], None]) -> None:
        super().__init__(loop=loop)
        self.on_cancel = on_cancel

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self.on_cancel()
        return True


@dataclass(eq=False)
class _Load:
    version: int
    mode: WeightUpdateMode
    requested_at: float
    done: asyncio.Future[float]


class CpuMeter:
    """CPU seconds spent inside simulation code (this thread's), so a benchmark can subtract them
    from the process's CPU time and report what the real code (store, scheduler, gate) cost.
    `thread_time`, not elapsed time: with elapsed time, every moment the process waited for a core
    inside a simulated section would count as simulation CPU, and the scheduler's figure would fall
    as the machine's load rose. The reads' own cost outside the section is measured once
    (`meter_overhead_s`) and subtracted per entry."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.entries = 0
        self.depth = 0  # > 0 inside a section (PIPE's `SplitMeter` reads it)
        self._t = 0.0

    def __enter__(self) -> None:
        self.entries += 1
        self._t = time.thread_time()
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.seconds += time.thread_time() - self._t


def meter_overhead_s(n: int = 20_000) -> float:
    """CPU seconds one metered section costs outside what the meter counts as inside (its reads and
    the `with`): a benchmark subtracts `entries` times this from the scheduler's CPU, so the meter's
    own cost is not reported as scheduling (~5 us a sample for PIPE rlvr on this VM)."""
    meter = CpuMeter()
    start = time.process_time()
    for _ in range(n):
        with meter:
            pass
    return max(0.0, (time.process_time() - start - meter.seconds) / n)


class SimEngine(InferenceEngine):
    """See the module docstring. All waiting goes through `clock`, on the event loop whose time the
    clock reads (both `RealClock` and `VirtualClock` are)."""

    def __init__(self, clock: Clock, *, lengths: Callable[[random.Random], int], capacity: int = 64,
                 step_s: float = 0.03, prefill_s: float = 0.0, load_s: float = 0.0, seed: int = 0,
                 meter: CpuMeter | None = None) -> None:
        self.clock = clock
        self.meter = meter or CpuMeter()
        self.lengths = lengths
        self._capacity = capacity
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.load_s = load_s
        self.rng = random.Random(seed)
        self.version = 0
        self.steps = 0  # decode steps taken (the step index)
        self.requests = 0  # generation requests ended, finished or cancelled (an episode makes one per turn)
        self._busy = 0.0
        self._running: list[tuple[int, int, _Seq]] = []  # heap by end step
        self._waiting: deque[_Seq] = deque()
        self._load: _Load | None = None
        # The server is a state machine driven by one timer callback: "idle" (nothing to do),
        # "scheduled" (a callback will reconsider soon), "decoding" (a span of `_seg_steps` decode
        # steps from `_seg`'s start is under way; the timer fires at its end) or "loading".
        self._state = "idle"
        self._timer: asyncio.Handle | None = None
        self._seg: tuple[float, float] | None = None  # (start, prefill) of the decode span under way
        self._seg_steps = 0
        self._tie = itertools.count()
        self._cancels = 0  # requests marked cancelled and not yet ended

    @property
    def capacity(self) -> int:
        return self._capacity

    def load(self) -> int:
        return len(self._running) + len(self._waiting)

    def busy_seconds(self) -> float:
        return self._busy

    def stats(self) -> dict[str, float]:
        return {"decode_steps": float(self.steps), "requests": float(self.requests)}

    def _kick(self) -> None:
        """Something changed (a request, a load, a cancellation): an idle server starts at once (in a
        callback of this loop iteration's successors); a decoding one ends its span after the step
        under way, then reconsiders (admits into free slots, applies the load, drops cancelled)."""
        if self._state == "idle":
            self._state = "scheduled"
            self._timer = asyncio.get_running_loop().call_soon(self._on_timer)
        elif self._state == "decoding" and self._seg is not None:
            start, pre = self._seg
            k = min(self._seg_steps, max(1, math.floor((self.clock.now() - start - pre) / self.step_s) + 1))
            if k < self._seg_steps:  # cut the span after the step under way
                assert self._timer is not None
                self._timer.cancel()
                self._seg_steps = k
                self._timer = asyncio.get_running_loop().call_later(
                    max(0.0, start + pre + k * self.step_s - self.clock.now()), self._on_timer)
        # "loading" or "scheduled": the server reconsiders everything when that ends

    async def generate(self, request: GenRequest) -> GenResult:
        return await self.start_generate(request)

    def start_generate(self, request: GenRequest) -> asyncio.Future[GenResult]:
        """The request's own result future (resolved by the server loop; cancelling it abandons it)."""
        with self.meter:
            natural = max(1, self.lengths(self.rng))
            done = _RequestFuture(asyncio.get_running_loop(), lambda: self._abandon(seq))
            seq = _Seq(request, min(natural, request.max_new_tokens), natural <= request.max_new_tokens, done)
            self._waiting.append(seq)
            if len(self._running) < self._capacity:
                self._kick()  # a free slot: join at the next step boundary
        return seq.done

    async def load_weights(self, state: Any, version: int, mode: WeightUpdateMode) -> float:
        """`state` is not read (the simulation has no weights); the load's timing is what is modelled."""
        if self._load is not None:
            raise RuntimeError("a weight load is already in progress")
        self._load = _Load(version, mode, self.clock.now(), asyncio.get_running_loop().create_future())
        with self.meter:
            self._kick()
        return await self._load.done

    def cancel_older_than(self, min_version: int) -> int:
        with self.meter:
            return self._cancel_older_than(min_version)

    def _cancel_older_than(self, min_version: int) -> int:
        now = self._steps_now()
        n = 0
        for seq in [*(e[2] for e in self._running), *self._waiting]:
            if seq.cancelled or seq.request.uid < 0:  # (evaluation: see InferenceEngine.cancel_older_than)
                continue
            versions = [v for v, _ in seq.runs]
            if any(e[2] is seq for e in self._running) and now > seq.run_from:
                versions.append(self.version)
            if versions and min(versions) < min_version:
                seq.cancelled = True
                n += 1
        self._cancels += n
        if n:
            self._kick()
        return n

    def _abandon(self, seq: _Seq) -> None:
        """Its caller cancelled the request: it leaves the batch after the step under way."""
        with self.meter:
            if seq.cancelled or self._state == "closed":
                return
            seq.cancelled = True
            self._cancels += 1
            self._kick()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._state = "closed"

    # ------------------------------------------------------------------ the server loop
    def _steps_now(self) -> int:
        """Decode steps completed by now (inside a decode span, counting its finished steps)."""
        if self._seg is None:
            return self.steps
        start, pre = self._seg
        return self.steps + max(0, math.floor((self.clock.now() - start - pre) / self.step_s + 1e-9))

    def _on_timer(self) -> None:
        """The one timer callback: a decode span or a weight load ended, or the server was kicked
        from idle. All of it is simulation, so all of it is metered."""
        with self.meter:
            self._timer = None
            if self._state == "decoding":
                assert self._seg is not None
                start, _ = self._seg
                self._seg = None
                self._busy += self.clock.now() - start
                self.steps += self._seg_steps
                self._finish_due()
            elif self._state == "loading":
                load = self._load
                assert load is not None
                self.version = load.version
                self._load = None
                if not load.done.done():
                    load.done.set_result(self.clock.now() - load.requested_at)
            self._next()

    def _next(self) -> None:
        """From a step boundary: apply a due weight load, else admit and start the next decode span
        (up to the next sequence end), else go idle."""
        self._state = "idle"
        loop = asyncio.get_running_loop()
        load = self._load
        if load is not None and not (load.mode == "drain" and self._running):
            for _, _, seq in self._running:
                self._close_run(seq)  # later tokens carry the new version
            if load.mode == "abort" and self._running:
                paused = [e[2] for e in sorted(self._running)]  # keep their tokens; re-prefilled after the load
                for seq in paused:
                    seq.produced += self.steps - seq.admitted_at
                self._running = []
                self._waiting.extendleft(reversed(paused))
            self._state = "loading"
            self._timer = loop.call_later(self.load_s, self._on_timer)
            return
        admitted = self._admit()
        if not self._running:
            return  # idle (only cancelled requests were waiting, or a drain load waits for nothing)
        n = self._running[0][0] - self.steps  # steps to the next sequence end
        pre = self.prefill_s if admitted else 0.0
        self._seg = (self.clock.now(), pre)
        self._seg_steps = n
        self._state = "decoding"
        self._timer = loop.call_later(pre + n * self.step_s, self._on_timer)

    def _admit(self) -> int:
        if self._load is not None and self._load.mode == "drain":
            return 0
        n = 0
        while self._waiting and len(self._running) < self._capacity:
            seq = self._waiting.popleft()
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            seq.admitted_at = seq.run_from = self.steps
            heapq.heappush(self._running, (seq.end_step(), next(self._tie), seq))
            n += 1
        return n

    def _close_run(self, seq: _Seq) -> None:
        """Count the tokens of the current version run into `seq.runs` (up to the current step)."""
        if self.steps > seq.run_from:
            seq.runs.append((self.version, self.steps - seq.run_from))
        seq.run_from = self.steps

    def _finish_due(self) -> None:
        """End the sequences whose last step has come, and every cancelled one."""
        while self._running and self._running[0][0] <= self.steps:
            seq = heapq.heappop(self._running)[2]
            self._close_run(seq)
            self._finish(seq, "stop" if seq.stops else "length")
        if not self._cancels:
            return
        if any(e[2].cancelled for e in self._running):
            keep: list[tuple[int, int, _Seq]] = []
            for e in self._running:
                if e[2].cancelled:
                    self._close_run(e[2])
                    self._finish(e[2], "cancelled")
                else:
                    keep.append(e)
            heapq.heapify(keep)
            self._running = keep
        if any(s.cancelled for s in self._waiting):
            for seq in [s for s in self._waiting if s.cancelled]:
                self._waiting.remove(seq)
                self._finish(seq, "cancelled")

    def _finish(self, seq: _Seq, reason: str) -> None:
        self.requests += 1  # (also one its caller abandoned: it ran in the engine all the same)
        if seq.cancelled:
            self._cancels -= 1
        if seq.done.done():
            return
        n = sum(c for _, c in seq.runs)
        ids = Runs([(FILL, n - 1), (EOS, 1)]) if reason == "stop" else Runs([(FILL, n)])
        seq.done.set_result(GenResult(seq.request.uid, ids, Runs([(-1.0, n)]), Runs(seq.runs),  # type: ignore[arg-type]
                                      reason))  # type: ignore[arg-type]


class SimTrainer:
    """A trainer whose step costs `token_s` device-seconds per trained token, spread over `devices`,
    plus `overhead_s` per step (a colocated run's switch from generation to training). It has no
    weights: `export_weights` publishes an empty state and only the timing is modelled."""

    export_blocks = True  # (as `TrainEngine`'s: PIPE runs the export as a real run does)

    def __init__(self, clock: Clock, *, token_s: float, devices: int, overhead_s: float = 0.0) -> None:
        self.clock = clock
        self.token_s = token_s
        self.devices = devices
        self.overhead_s = overhead_s
        self.busy = 0.0

    def step_seconds(self, tokens: int) -> float:
        return tokens * self.token_s / self.devices + self.overhead_s

    async def train(self, tokens: int) -> float:
        """One train step over `tokens` trained tokens; returns its seconds."""
        seconds = self.step_seconds(tokens)
        await self.clock.sleep(seconds)
        self.busy += seconds
        return seconds

    def export_weights(self) -> dict[str, Any]:
        return {}
