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
and says what it waited for. All time and waiting goes through the injected `Clock`.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from asyncflow.clock import Clock
from asyncflow.config import Config
from asyncflow.engines.base import InferenceEngine, LossFn, TrainBatch, TrainEngine
from asyncflow.rewards import (
    RewardFn,
)
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import StoreClient
from asyncflow.workflow.batch import build_train_batch
from asyncflow.workflow.feeder import FEED_BURST, FeederStage
from asyncflow.workflow.learner import EngineLearner, Learner
from asyncflow.workflow.reward import RewardStage
from asyncflow.workflow.rollout import RolloutStage
from asyncflow.workflow.stage_base import CANCELLED, Counters, StepResult, store_capacity
from asyncflow.workflow.trainer import TrainerStage

__all__ = ["CANCELLED", "FEED_BURST", "Counters", "Pipeline", "StepResult", "build_train_batch", "store_capacity"]


class Pipeline(FeederStage, RolloutStage, RewardStage, TrainerStage):
    """The wiring: builds the store, gate, lease keeper and counters the stages share, then runs
    feeder, rollout workers, reward worker and trainer (each in its own module) until
    `train.max_steps` steps, or supervises the stages that run elsewhere."""

    def __init__(
        self,
        cfg: Config,
        *,
        rows: list[dict[str, Any]],
        tokenizer: Tokenizer,
        reward_fn: RewardFn,
        engines: Sequence[InferenceEngine],
        trainer: TrainEngine,
        loss_fn: LossFn,
        clock: Clock,
        log: RunLog,
        tracer: Tracer,
        ref_logprobs: Callable[[TrainBatch], torch.Tensor] | None = None,
        on_step: Callable[[StepResult], Awaitable[None]] | None = None,
        on_trained: Callable[[], None] | None = None,
        store: StoreClient | None = None,
        gate: Any = None,
        env_factory: Callable[[Clock], Any] | None = None,
        learner: Learner | None = None,
        collect_ahead: bool | None = None,
    ) -> None:
        """The stages' shared state (`StageBase`), the trainer's engine, learner and reference, and
        each stage's readiness rule registered with the store. A Ray actor that hosts one stage builds
        only that stage's class (`StageBase` holds what it needs). `learner`: the optimizer step;
        default: `trainer`'s with `loss_fn` (`EngineLearner`). `collect_ahead`: the trainer collects
        the next step's batch during a train step; default: when the store is in another process."""
        self.trainer = trainer
        self.ref_logprobs = ref_logprobs
        self.on_step = on_step
        self.on_trained = on_trained
        super().__init__(cfg, rows=rows, tokenizer=tokenizer, engines=engines, clock=clock, log=log, tracer=tracer,
                         reward_fn=reward_fn, store=store, gate=gate, env_factory=env_factory)
        self.learner = learner if learner is not None else EngineLearner(
            cfg, trainer, loss_fn, pad_token_id=tokenizer.pad_token_id, with_reference=ref_logprobs is not None)
        self.collect_ahead = not self.store.in_process if collect_ahead is None else collect_ahead
        self.final_accounting: dict[str, int] = {}
        self._register_stages()

    def _register_stages(self) -> None:
        """Each stage's readiness rule: the fields a sample needs before that stage may take it."""
        cfg, store = self.cfg, self.store
        for i, stage in enumerate(self.rollout_stages):
            store.register_stage(stage, ["prompt_ids", f"to/{i}"] if cfg.rollout.affinity else ["prompt_ids"])
        if not self.episodic:  # multi-turn episodes carry their environment's (or agent's) reward: no reward stage
            store.register_stage("reward", ["response_ids"], groups=True)
        # reference log-probs (KL to the frozen initial policy) are a stage of their own: computed as
        # responses arrive, off the trainer's critical path; the trainer then needs that field too
        if self.ref_logprobs is not None:
            store.register_stage("reference", ["response_ids"])
        store.register_stage("train", ["reward", "ref_logprobs"] if self.ref_logprobs is not None else ["reward"],
                             groups=True)

    def accounting(self) -> dict[str, int]:
        """Where every admitted sample went: logged to samples.jsonl (trained, or why not) or still in
        the store; `lost` is what is neither and must be 0. One store call, so the admitted count and
        the live count are of the same moment. Cumulative across a resume (counters are restored)."""
        m = self.store.metrics()
        c = self.counters
        admitted = int(m["groups_put"]) * self.n
        logged = {"trained": c.trained, "reward_error": c.reward_errors, "filtered": c.filtered,
                  "dropped_stale": c.dropped_stale, "cancelled": c.cancelled}
        live = int(m["samples"])
        return {"admitted": admitted, **logged, "in_store_at_end": live,
                "lost": admitted - sum(logged.values()) - live}

    def busy_fractions(self) -> tuple[float, float]:
        """Fractions of wall time since the last call that rollout engines / the trainer computed."""
        now = self.clock.now()
        wall = max(now - self._last_row_time, 1e-9)
        rollout_busy = sum(e.busy_seconds() for e in self.engines)
        train_busy = self.counters.train_busy_s
        r = (rollout_busy - self._last_busy[0]) / (wall * len(self.engines))
        t = (train_busy - self._last_busy[1]) / wall
        self._last_row_time, self._last_busy = now, (rollout_busy, train_busy)
        return min(r, 1.0), min(t, 1.0)

    async def run(self, remote: dict[str, Awaitable[None]] | None = None) -> None:
        """Run every stage until the trainer finishes; the first failing stage stops them all.

        `remote`: stages that run elsewhere (Ray actors), by name, as awaitables that end when the
        stage ends; they replace the local rollout and reward loops and are supervised the same way.
        """
        gc_before = gc.get_threshold()
        if self.cfg.workflow.gc_threshold:
            gc.set_threshold(self.cfg.workflow.gc_threshold, *gc_before[1:])
        try:
            await self._run(remote)
            if self._own_store is not None and self.cfg.workflow.gc_threshold:
                # the run is over: its leftovers (admitted, never trained; up to a store's worth,
                # counted in `final_accounting`) are freed now rather than scanned by the young
                # collection that lowering the threshold again triggers at once
                self._own_store.drop_all()
        finally:
            gc.set_threshold(*gc_before)

    async def _run(self, remote: dict[str, Awaitable[None]] | None) -> None:
        if remote is None:
            stages = [asyncio.create_task(self.rollout_worker(i, e), name=f"rollout/{i}") for i, e in enumerate(self.engines)]
            if not self.episodic:
                stages.append(asyncio.create_task(self.reward_worker(), name="reward"))
        else:
            stages = [asyncio.ensure_future(aw) for aw in remote.values()]
            for name, t in zip(remote, stages, strict=True):
                t.set_name(name)
        if remote is None or "feeder" not in remote:
            stages.append(asyncio.create_task(self.feeder(), name="feeder"))
        if self.ref_logprobs is not None:  # runs where the trainer runs (its reference model lives there)
            stages.append(asyncio.create_task(self.ref_worker(), name="reference"))
        tasks = stages
        trainer = asyncio.create_task(self.trainer_loop(), name="trainer")
        try:
            done, _ = await asyncio.wait([trainer, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if trainer not in done:
                raise RuntimeError(f"stage {next(iter(done)).get_name()} stopped before the trainer finished")
            self.gate.close()  # no more admissions: the accounting below is final
            self.final_accounting = self.accounting()
        finally:
            # Close first, then cancel: a loop whose cancellation was swallowed by a wait that completed
            # at the same moment still sees the closed gate/store and exits.
            self.gate.close()
            self.store.close()
            for t in [*tasks, trainer]:
                t.cancel()
            # (60 s, plus an episode's grace to close its environment: `run_guarded`)
            bound = 60.0 + (self.cfg.rollout.env_timeout_s + 1.0 if self.env_factory is not None else 0.0)
            stopped, stuck = await asyncio.wait([*tasks, trainer], timeout=bound)
            self._swept.close()  # the episodes' and reward calls' deadline sweeper (a task of its own)
            self.keeper.close()
            self._plain_calls.close()
            for t in stopped:  # retrieve shutdown errors (QueueClosed, ...) so asyncio does not log them
                if not t.cancelled():
                    t.exception()
            if stuck:
                raise RuntimeError(f"stages did not stop within {bound:g} s: {sorted(t.get_name() for t in stuck)}")
