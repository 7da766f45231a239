"""A simulated inference engine: a continuous-batching server whose work is time on a `Clock`.

Used by the PIPE benchmark on a virtual clock (`runtime/virtual_loop.py`), where thousands of these
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

Token ids are drawn at random and every log-prob is `-1.0`: nothing downstream of PIPE reads them.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, WeightUpdateMode
from asyncflow.runtime.clock import Clock

EOS = 1


@dataclass(eq=False)
class _Seq:
    request: GenRequest
    target: int
    stops: bool  # the natural length fits: the last token is EOS (else cut at max_new_tokens)
    done: asyncio.Future[GenResult]
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cancelled: bool = False


@dataclass(eq=False)
class _Load:
    version: int
    mode: WeightUpdateMode
    requested_at: float
    done: asyncio.Future[float]


class SimEngine(InferenceEngine):
    """See the module docstring. All waiting goes through `clock`."""

    def __init__(self, clock: Clock, *, lengths: Callable[[random.Random], int], capacity: int = 64,
                 step_s: float = 0.03, prefill_s: float = 0.0, load_s: float = 0.0, seed: int = 0) -> None:
        self.clock = clock
        self.lengths = lengths
        self._capacity = capacity
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.load_s = load_s
        self.rng = random.Random(seed)
        self.version = 0
        self.steps = 0
        self._busy = 0.0
        self._running: list[_Seq] = []
        self._waiting: deque[_Seq] = deque()
        self._load: _Load | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def capacity(self) -> int:
        return self._capacity

    def load(self) -> int:
        return len(self._running) + len(self._waiting)

    def busy_seconds(self) -> float:
        return self._busy

    def stats(self) -> dict[str, float]:
        return {"decode_steps": float(self.steps)}

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def generate(self, request: GenRequest) -> GenResult:
        natural = max(1, self.lengths(self.rng))
        seq = _Seq(request, min(natural, request.max_new_tokens), natural <= request.max_new_tokens,
                   asyncio.get_running_loop().create_future())
        self._waiting.append(seq)
        self._ensure_loop()
        return await seq.done

    async def load_weights(self, state: Any, version: int, mode: WeightUpdateMode) -> float:
        """`state` is not read (the simulation has no weights); the load's timing is what is modelled."""
        if self._load is not None:
            raise RuntimeError("a weight load is already in progress")
        self._load = _Load(version, mode, self.clock.now(), asyncio.get_running_loop().create_future())
        self._ensure_loop()
        return await self._load.done

    def cancel_older_than(self, min_version: int) -> int:
        n = 0
        for seq in [*self._running, *self._waiting]:
            if seq.versions and min(seq.versions) < min_version and not seq.cancelled:
                seq.cancelled = True
                n += 1
        if n:
            self._ensure_loop()
        return n

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ------------------------------------------------------------------ the server loop
    async def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting and self._load is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._apply_load()
            admitted = self._admit()
            if not self._running:
                continue  # (a load was just applied, or only cancelled requests were waiting)
            start = self.clock.now()
            await self.clock.sleep(self.step_s + (self.prefill_s if admitted else 0.0))
            self._busy += self.clock.now() - start
            self.steps += 1
            self._step_tokens()

    def _admit(self) -> int:
        if self._load is not None and self._load.mode == "drain":
            return 0
        n = 0
        while self._waiting and len(self._running) < self._capacity:
            self._running.append(self._waiting.popleft())
            n += 1
        return n

    async def _apply_load(self) -> None:
        load = self._load
        if load is None or (load.mode == "drain" and self._running):
            return
        if load.mode == "abort" and self._running:
            paused = self._running  # keep their tokens; re-prefilled (admitted again) after the load
            self._running = []
            self._waiting.extendleft(reversed(paused))
        await self.clock.sleep(self.load_s)
        self.version = load.version
        self._load = None
        load.done.set_result(self.clock.now() - load.requested_at)

    def _step_tokens(self) -> None:
        keep = []
        for seq in self._running:
            if seq.cancelled:
                self._finish(seq, "cancelled")
                continue
            last = len(seq.tokens) + 1 == seq.target
            seq.tokens.append(EOS if last and seq.stops else self.rng.randrange(2, 1000))
            seq.versions.append(self.version)
            if last:
                self._finish(seq, "stop" if seq.stops else "length")
            else:
                keep.append(seq)
        self._running = keep
        # a cancelled request that is still waiting ends now too
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            self._finish(seq, "cancelled")

    def _finish(self, seq: _Seq, reason: str) -> None:
        if not seq.done.done():
            seq.done.set_result(GenResult(seq.request.uid, list(seq.tokens), [-1.0] * len(seq.tokens),
                                          list(seq.versions), reason))  # type: ignore[arg-type]
