"""The producer–consumer RL workflow: four stage loops that meet only in the TransferQueue.

```
             admission credit (StalenessGate: live groups <= (max_staleness+1) x groups/step)
                   │
 dataset ──► feeder ──put n samples/prompt──►┌──────────────── TransferQueue ────────────────┐
                                             │ prompt_ids ─► rollout  (per sample, no batch   │
  rollout workers ◄──take 1 sample/free slot─┤                barrier; a free slot refills)  │
  (continuous batching) ──write response────►│ response_ids ─► reward (whole group, one call) │
  reward worker ◄──take complete groups──────┤                                                │
               ──write reward───────────────►│ reward ─► train (whole groups, oldest first)   │
  trainer ◄──take groups within staleness────┘────────────────────────────────────────────────┘
     │ advantages, log-probs, loss, `mini_batches` optimizer steps
     └─► publish v+1 ─► weight sync (drain | swap | abort) ─► every engine ─► gate.publish(v+1)
```

What unblocks what: the feeder waits for admission credit (freed by a publication or a dropped
group); a rollout worker waits for an admitted sample and a free engine slot; the reward worker
waits for a group whose responses are all written; the trainer waits for `batch_size / n` groups
with rewards. Sync mode is the same code with `max_staleness = 0`: the next step's prompts are
admitted only after the new weights are loaded, which is the barrier.

Every wait is bounded (`workflow.step_timeout_s`, `rollout.request_timeout_s`, `reward.timeout_s`)
and says what it waited for; a stall watchdog (`workflow.stall_timeout_s`, watchdog.py) ends a run in
which no sample moved for that long. All time and waiting goes through the injected `Clock`.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any

from asyncflow.engines.base import InferenceEngine
from asyncflow.transfer_queue import StoreClient, TransferQueue
from asyncflow.workflow.context import Counters, StageContext
from asyncflow.workflow.feeder import Feeder
from asyncflow.workflow.gate import GateControl
from asyncflow.workflow.reference import ReferenceWorker
from asyncflow.workflow.reward import RewardWorker
from asyncflow.workflow.rollout import RolloutWorker
from asyncflow.workflow.settings import PipelineSettings
from asyncflow.workflow.trainer import Trainer
from asyncflow.workflow.watchdog import RemoteStacks, StallWatchdog


class Pipeline:
    """The composition: the stages that run in this process (built by `build_pipeline`), each stage's
    readiness rule registered with the store, and the run of them all until the trainer finishes,
    supervising the stages that run elsewhere (Ray actors) the same way."""

    def __init__(self, ctx: StageContext, settings: PipelineSettings, *, trainer: Trainer, gate: GateControl,
                 engines: Sequence[InferenceEngine], episodic: bool, feeder: Feeder | None = None,
                 rollout: Sequence[RolloutWorker] = (), rewards: Sequence[RewardWorker] = (),
                 scorers: Sequence[ReferenceWorker] = (), own_store: TransferQueue | None = None) -> None:
        """`episodic`: samples are multi-turn episodes carrying their own reward (no reward stage).
        `feeder`, `rollout`, `rewards`: none where those stages run elsewhere. `scorers`: the KL
        reference and the distillation teacher, where on (they run here, beside the trainer).
        `own_store`: the store when this pipeline made it (it ends with the run)."""
        self.ctx = ctx
        self.settings = settings
        self.trainer = trainer
        self.gate = gate
        self.engines = list(engines)
        self.episodic = episodic
        self.feeder = feeder
        self.rollout = list(rollout)
        self.rewards = list(rewards)
        self.scorers = list(scorers)
        self.own_store = own_store
        self.t_start = ctx.clock.now()
        self._last_row_time = self.t_start
        self._last_busy = (0.0, 0.0)
        self.final_accounting: dict[str, int] = {}
        self.remote_stacks: RemoteStacks | None = None  # (given to `run`)
        self.register_stages()

    @property
    def store(self) -> StoreClient:
        return self.ctx.store

    @property
    def counters(self) -> Counters:
        return self.ctx.counters

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def last_step(self) -> int:
        return self.trainer.last_step

    def stop_early(self) -> int:
        return self.trainer.stop_early()

    def stage_rules(self) -> list[tuple[str, list[str], bool]]:
        """Each stage's readiness rule, rollout first: (name, the fields a sample needs before that
        stage may take it, whether it takes whole groups)."""
        s = self.settings
        rules = [(stage, ["prompt_ids", f"to/{i}"] if s.affinity else ["prompt_ids"], False)
                 for i, stage in enumerate(s.rollout_stages)]
        if not self.episodic:  # multi-turn episodes carry their environment's (or agent's) reward: no reward stage
            rules.append(("reward", ["response_ids"], True))
        # the reference's and the teacher's log-probs are stages of their own: computed as responses
        # arrive, off the trainer's critical path; the trainer then needs their fields too
        rules += [(w.stage, ["response_ids"], False) for w in self.scorers]
        rules.append(("train", ["reward", *(w.field for w in self.scorers)], True))
        return rules

    def register_stages(self) -> None:
        for name, fields, groups in self.stage_rules():
            self.ctx.store.register_stage(name, fields, groups=groups)

    def restore(self, step: int, version: int, counters: dict[str, Any], elapsed_s: float) -> None:
        """Resume after `step` of a checkpoint: the trainer at `version` (its weights are loaded by the
        caller), the counters, and the run's clock `elapsed_s` in."""
        self.trainer.restore(step, version)
        self.ctx.counters.restore(counters)
        now = self.ctx.clock.now()
        self.t_start = now - elapsed_s
        self._last_row_time = now
        self._last_busy = (0.0, self.ctx.counters.train_busy_s)  # (engines are new: their busy time starts at 0)

    def accounting(self) -> dict[str, int]:
        """Where every admitted sample went: logged to samples.jsonl (trained, or why not) or still in
        the store; `lost` is what is neither and must be 0. One store call, so the admitted count and
        the live count are of the same moment. Cumulative across a resume (counters are restored)."""
        m = self.ctx.store.metrics()
        c = self.ctx.counters
        admitted = int(m["groups_put"]) * self.settings.n
        logged = {"trained": c.trained, "reward_error": c.reward_errors, "filtered": c.filtered,
                  "dropped_stale": c.dropped_stale, "cancelled": c.cancelled, "aborted": c.aborted}
        live = int(m["samples"])
        return {"admitted": admitted, **logged, "in_store_at_end": live,
                "lost": admitted - sum(logged.values()) - live}

    def busy_fractions(self) -> tuple[float, float]:
        """Fractions of wall time since the last call that rollout engines / the trainer computed."""
        now = self.ctx.clock.now()
        wall = max(now - self._last_row_time, 1e-9)
        rollout_busy = sum(e.busy_seconds() for e in self.engines)
        train_busy = self.ctx.counters.train_busy_s
        r = (rollout_busy - self._last_busy[0]) / (wall * len(self.engines))
        t = (train_busy - self._last_busy[1]) / wall
        self._last_row_time, self._last_busy = now, (rollout_busy, train_busy)
        return min(r, 1.0), min(t, 1.0)

    async def run(self, remote: dict[str, Awaitable[None]] | None = None, *,
                  worker_context: contextvars.Context | None = None, remote_stacks: RemoteStacks | None = None) -> None:
        """Run every stage until the trainer finishes; the first failing stage stops them all.

        `remote`: stages that run elsewhere (Ray actors), by name, as awaitables that end when the
        stage ends; they are supervised as the local ones are. `worker_context`: the context the
        rollout and reward loops run in (PIPE tells their callbacks apart by it). `remote_stacks`:
        the other processes' stack dumps, for the stall watchdog (`workflow.stall_timeout_s`).
        """
        self.remote_stacks = remote_stacks
        gc_before = gc.get_threshold()
        if self.settings.gc_threshold:
            gc.set_threshold(self.settings.gc_threshold, *gc_before[1:])
        try:
            await self._run(remote or {}, worker_context)
            if self.own_store is not None and self.settings.gc_threshold:
                # the run is over: its leftovers (admitted, never trained; up to a store's worth,
                # counted in `final_accounting`) are freed now rather than scanned by the young
                # collection that lowering the threshold again triggers at once
                self.own_store.drop_all()
        finally:
            gc.set_threshold(*gc_before)

    def _start(self, remote: dict[str, Awaitable[None]],
               worker_context: contextvars.Context | None) -> list[asyncio.Future[None]]:
        """The stage tasks besides the trainer: remote stages' awaitables and this process's loops."""
        def worker(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
            if worker_context is None:
                return asyncio.create_task(coro, name=name)
            return worker_context.run(asyncio.create_task, coro, name=name)  # (the task copies that context)

        stages: list[asyncio.Future[None]] = []
        for name, aw in remote.items():
            t = asyncio.ensure_future(aw)
            t.set_name(name)  # type: ignore[attr-defined]
            stages.append(t)
        stages += [worker(w.run(), f"rollout/{w.index}") for w in self.rollout]
        stages += [worker(r.run(), "reward" if len(self.rewards) == 1 else f"reward/{j}")
                   for j, r in enumerate(self.rewards)]
        if self.feeder is not None:
            stages.append(asyncio.create_task(self.feeder.run(), name="feeder"))
        # (they run where the trainer runs: the reference model lives there)
        stages += [asyncio.create_task(w.run(), name=w.stage) for w in self.scorers]
        if self.settings.stall_timeout_s > 0:
            watchdog = StallWatchdog(self.ctx.store, self.ctx.clock, self.settings.stall_timeout_s,
                                     folder=self.ctx.samples.log.out, stages=self.stage_names(),
                                     busy=lambda: sum(e.busy_seconds() for e in self.engines),
                                     remote_stacks=self.remote_stacks)
            stages.append(asyncio.create_task(watchdog.run(), name="stall watchdog"))
        return stages

    def stage_names(self) -> list[str]:
        """The store's stage names, rollout first."""
        return [name for name, _, _ in self.stage_rules()]

    async def _run(self, remote: dict[str, Awaitable[None]], worker_context: contextvars.Context | None) -> None:
        tasks = self._start(remote, worker_context)
        trainer = asyncio.create_task(self.trainer.run(), name="trainer")
        try:
            done, _ = await asyncio.wait([trainer, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if trainer not in done:
                raise RuntimeError(f"stage {next(iter(done)).get_name()} stopped before the trainer finished")  # type: ignore[attr-defined]
            self.gate.close()  # no more admissions: the accounting below is final
            self.final_accounting = self.accounting()
        finally:
            await self._stop(tasks, trainer)

    async def _stop(self, tasks: list[asyncio.Future[None]], trainer: asyncio.Task[None]) -> None:
        # Close first, then cancel: a loop whose cancellation was swallowed by a wait that completed
        # at the same moment still sees the closed gate/store and exits.
        self.gate.close()
        self.ctx.store.close()
        for t in [*tasks, trainer]:
            t.cancel()
        # (60 s, plus an episode's grace to close its environment: `run_guarded`)
        bound = 60.0 + (self.settings.env_timeout_s + 1.0 if self.episodic else 0.0)
        stopped, stuck = await asyncio.wait([*tasks, trainer], timeout=bound)
        self.ctx.close()  # the episodes' and reward calls' deadline sweeper, the lease keeper
        for r in self.rewards:
            r.close()
        for t in stopped:  # retrieve shutdown errors (QueueClosed, ...) so asyncio does not log them
            if not t.cancelled():
                t.exception()
        if stuck:
            raise RuntimeError(f"stages did not stop within {bound:g} s: "
                               f"{sorted(t.get_name() for t in stuck)}")  # type: ignore[attr-defined]
