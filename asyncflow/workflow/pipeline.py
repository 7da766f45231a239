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
import contextlib
import functools
import gc
import math
import random
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncflow.algorithms.advantages import make_advantage_fn, overlong_penalty
from asyncflow.algorithms.losses import NEEDS_PROXIMAL
from asyncflow.clock import Clock, SweptClock, run_guarded, wait_detached
from asyncflow.config import Config, max_generated_tokens
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, LossFn, TrainBatch, TrainEngine
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.rewards import (
    PLAIN_CALLS_PER_HOP,
    PlainCalls,
    RewardFn,
    RewardOutcome,
    call_reward_fn_async,
    is_async_reward_fn,
)
from asyncflow.runs import oldest
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import Lease, NewSample, QueueClosed, SampleView, StoreClient, TransferQueue
from asyncflow.workflow.agent import AgentFn, load_agent, run_agent_episode
from asyncflow.workflow.agent_proxy import AgentProxy, recorder_settings
from asyncflow.workflow.episode import (
    EpisodeResult,
    EpisodeSettings,
    TurnBarrier,
    generated_tokens,
    hung_episode,
    run_episode,
)
from asyncflow.workflow.gate import StalenessGate

CANCELLED = "cancelled: could no longer meet max_staleness"
FEED_BURST = 32  # most prompts the feeder admits in one store put
_CANCELLED_OUTCOME = RewardOutcome(None, CANCELLED)  # a group not scored: one of its generations was cancelled
TRAIN_FIELDS = ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions", "behavior_version", "reward_error",
                "row", "finish_reason", "reward", "loss_mask", "turns", "ref_logprobs", "agent_calls", "agent_calls_dropped")


@dataclass
class Counters:
    """Cumulative counts of what happened to samples."""

    produced: int = 0  # samples whose rollout (generation or episode) finished and was written
    trained: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    filter_overflow: int = 0  # equal-reward groups trained because a step hit its filter budget
    response_tokens: dict[str, int] = field(default_factory=dict)  # by final status, for bias metrics
    response_count: dict[str, int] = field(default_factory=dict)
    reward_errors: int = 0
    cancelled: int = 0
    reward_calls: int = 0  # reward calls made by this process (a resume starts them again: fail-fast)
    reward_call_failures: int = 0
    episodes: int = 0  # multi-turn episodes ended (environment or agent), and those that failed (likewise)
    episode_failures: int = 0
    train_busy_s: float = 0.0


@dataclass
class StepResult:
    """What the trainer hands to the logger after a step."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


class Pipeline:
    """Runs feeder, rollout workers, reward worker and trainer until `train.max_steps` steps."""

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
        store: StoreClient | None = None,
        gate: Any = None,
        env_factory: Callable[[Clock], Any] | None = None,
    ) -> None:
        """`store`: a store client shared with other processes (the Ray runtime); default: a new
        in-process `TransferQueue`. A Ray actor that hosts a single stage builds a Pipeline with
        only what that stage uses (e.g. no trainer in a rollout actor) and runs that stage's loop.
        `env_factory`: a factory of episodes' environments given directly (PIPE's simulated
        environment); default: the one `rollout.env` names."""
        self.cfg = cfg
        self.rows = rows
        self.tok = tokenizer
        self.reward_fn = reward_fn
        self._reward_async = reward_fn is not None and is_async_reward_fn(reward_fn)
        self._plain_calls = PlainCalls()  # a plain reward function's threads (started on first use)
        self.engines = list(engines)
        self.trainer = trainer
        self.loss_fn = loss_fn
        self.clock = clock
        # episodes wait twice per turn (generation, environment step), an async reward function once
        # per group: one sweeping timer for all of those bounded waits instead of a timer each (SweptClock)
        self._swept = SweptClock(clock)
        self.log = log
        self.tracer = tracer
        self.ref_logprobs = ref_logprobs
        self.on_step = on_step
        self.n = cfg.rollout.n
        self.groups_per_step = cfg.train.batch_size // self.n
        self.k = cfg.staleness
        # `gate`: the feeder's gate when the feeder runs elsewhere (a Ray actor); see RemoteGate
        extra = math.ceil(cfg.workflow.redundancy * self.groups_per_step)
        self.gate = gate if gate is not None else StalenessGate(
            self.groups_per_step, self.k, cfg.train.max_steps, clock, extra=extra
        )
        # a store of its own (none given) ends with the run: see `run`
        self._own_store: TransferQueue | None = None
        if store is None:
            store = self._own_store = TransferQueue(
                capacity=store_capacity(cfg), lease_timeout_s=cfg.workflow.lease_timeout_s, clock=clock
            )
        self.store: StoreClient = store
        self.keeper = LeaseKeeper(store, clock, cfg.workflow.lease_timeout_s)
        # the staleness floor the engines were last told (`cancel_older_than`): episodes older than
        # it end before their next turn
        self.floor: float = -math.inf
        # queue scheduling: one "rollout" stage every worker pulls from, or with affinity a stage per
        # worker, whose samples carry that worker's routing field (per-field readiness does the routing)
        self.rollout_stages = [f"rollout/{i}" for i in range(cfg.rollout.workers)] if cfg.rollout.affinity else ["rollout"]
        for i, stage in enumerate(self.rollout_stages):
            self.store.register_stage(stage, ["prompt_ids", f"to/{i}"] if cfg.rollout.affinity else ["prompt_ids"])
        self.env_factory: Callable[[Clock], Any] | None = env_factory
        if env_factory is None and cfg.rollout.env is not None:
            from asyncflow.envs import make_env_factory

            self.env_factory = make_env_factory(cfg.rollout.env, latency_s=cfg.rollout.env_latency_s,
                                                max_turns=cfg.rollout.max_turns)
        self.agent: AgentFn | None = None
        if cfg.rollout.agent is not None:
            self.agent = load_agent(cfg.rollout.agent)
        self.episodic = self.env_factory is not None or self.agent is not None
        if not self.episodic:  # multi-turn episodes carry their environment's (or agent's) reward: no reward stage
            self.store.register_stage("reward", ["response_ids"], groups=True)
        # reference log-probs (KL to the frozen initial policy) are a stage of their own: computed as
        # responses arrive, off the trainer's critical path; the trainer then needs that field too
        if ref_logprobs is not None:
            self.store.register_stage("reference", ["response_ids"])
        self.store.register_stage("train", ["reward", "ref_logprobs"] if ref_logprobs is not None else ["reward"],
                                  groups=True)
        self.advantage_fn = make_advantage_fn(cfg.algorithm.advantage)
        self.needs_proximal = cfg.algorithm.loss in NEEDS_PROXIMAL
        self.counters = Counters()
        self.version = 0
        self.t_start = clock.now()
        self._last_row_time = self.t_start
        self._last_busy = (0.0, 0.0)
        self._order = self._row_order()
        self.next_group = 0  # the feeder's next group id: also how many prompts it has drawn
        self.first_step = 1
        self.last_step = 0  # the last step trained (train.max_steps, or earlier after `stop_early`)
        self._stop_early = False
        self.final_accounting: dict[str, int] = {}
        self.max_context: int | None = None  # the model's positions, for multi-turn episodes (set by the runner)
        self._filter_budget = cfg.algorithm.filter_max_groups_per_step or 4 * self.groups_per_step

    # ------------------------------------------------------------------ feeder

    def restore_feeder(self, next_group: int, version: int, admitted: int) -> None:
        """Resume the feeder at draw `next_group` of its prompt stream, with the gate at `version`
        and `admitted` groups counted against it (see `asyncflow/checkpoint.py`)."""
        self.next_group = next_group
        self._order = self._row_order()
        for _ in range(next_group):
            next(self._order)
        self.gate.restore(version, admitted)

    def restore_trainer(self, step: int, version: int, counters: dict[str, Any], elapsed_s: float) -> None:
        """Resume the trainer loop after `step` (weights at `version` are loaded by the caller)."""
        self.first_step = step + 1
        self.last_step = step
        self.version = version
        # the fail-fast rule is about this process's first calls: restored counts (all past the limit)
        # turned it off, and a resumed run whose reward function always fails ran on, logging errors
        self.counters = Counters(**{**counters, "reward_calls": 0, "reward_call_failures": 0, "episodes": 0,
                                    "episode_failures": 0})
        self.t_start = self.clock.now() - elapsed_s
        self._last_row_time = self.clock.now()
        self._last_busy = (0.0, self.counters.train_busy_s)  # (engines are new: their busy time starts at 0)

    def _row_order(self) -> Any:
        rng = random.Random(self.cfg.seed)
        epoch = 0
        while True:
            idx = list(range(len(self.rows)))
            if self.cfg.dataset.shuffle:
                rng.shuffle(idx)
            yield from idx
            epoch += 1

    async def feeder(self) -> None:
        """Admit prompts as `n` single-sample requests each, while the staleness gate allows: every
        prompt the credit allows at that moment (up to `FEED_BURST`) in one store put. A publication
        frees a whole step's credit at once; one put per prompt cost a gate check, a put call and its
        wake-ups per prompt. With affinity routing, one prompt per put: each goes to the worker that
        is least loaded once the previous one has been counted."""
        key, n, affinity = self.cfg.dataset.prompt_key, self.n, self.cfg.rollout.affinity
        while not self.gate.closed:
            if not await self.gate.wait_for_credit(self.cfg.workflow.step_timeout_s):
                continue  # the trainer is slow; credit comes with the next publication
            burst = 1 if affinity else max(1, min(self.gate.credit(), FEED_BURST))
            samples: list[NewSample] = []
            for group_id in range(self.next_group, self.next_group + burst):
                row_index = next(self._order)
                fields = {"prompt_ids": self.tok.prompt_ids(self.rows[row_index][key]), "row": row_index}
                if affinity:
                    fields[f"to/{self._least_loaded_worker()}"] = True
                # one NewSample (and one fields dict) for the group's n samples: the store reads it and
                # copies the fields for each sample it admits, and assigns each its own uid
                samples += [NewSample(group_id, n, fields, priority=float(group_id))] * n
            self.gate.admit(burst)
            try:
                await self.store.put(samples, timeout=self.cfg.workflow.step_timeout_s)
            except QueueClosed:
                return
            self.next_group += burst
            # neither wait above yields while there is credit and room: without this the feeder kept the
            # loop to itself for as long as a huge batch's admission took (no rollout, no Ctrl-C)
            await asyncio.sleep(0)

    def _least_loaded_worker(self) -> int:
        """The rollout worker with the fewest samples queued for it or in flight (affinity routing)."""
        m = self.store.metrics()
        return min(range(len(self.rollout_stages)),
                   key=lambda i: m.get(f"depth/rollout/{i}", 0.0) + m.get(f"leased/rollout/{i}", 0.0))

    # ------------------------------------------------------------------ rollout

    async def rollout_worker(self, index: int, engine: InferenceEngine) -> None:
        """Keep up to twice the engine's batch slots in flight, taking all free slots' worth in one
        store call (one lease each); write each response the moment it ends. The extra half waits
        in the engine's own queue, so a batch slot that frees is refilled at the next decode step
        instead of after a store round trip (measured: local sync 253-308 -> 320-327 samples/s).

        A single-turn request is no task of its own: it is started on the engine (`start_generate`) and
        written to the store in a callback on its result future (a task per request cost two extra
        event-loop callbacks and a task step each way). With the in-process store that callback
        also refills the slot at once (`complete_and_take`); only when nothing is ready does it wake
        this worker, which then waits in the store. With an environment, each taken sample is a
        whole episode (its own task)."""
        track = f"rollout/{index}"
        if self.cfg.rollout.turn_barrier:
            await self._barrier_batches(index, engine, track)
            return
        flight = _Flight(engine.capacity * 2, lambda start: self.tracer.span(track, "generating", start, self.clock.now()),
                         self.clock)
        episodes = _Children()  # episode tasks; also where a failed request stops this worker
        extra = ("row",) if self.episodic else ()
        stage = self._rollout_stage(index)
        # single-turn requests in flight: (deadline, uid, lease); see _watch. (The lease rides here, not
        # in a functools.partial per request: request_done is the future's callback as it is.)
        deadlines: dict[asyncio.Future[Any], tuple[float, int, Lease]] = {}
        expired: dict[asyncio.Future[Any], str] = {}
        ro = self.cfg.rollout
        # in process: a finished request's write and its slot's next sample in one store call
        fused = getattr(self.store, "complete_and_take", None) if not self.episodic else None

        fail = episodes.fail  # a request failed or timed out: stop this worker with its error

        sampling = (ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k)
        now, timeout_s = self.clock.now, ro.request_timeout_s

        def start(lease: Lease) -> None:
            sample = lease.samples[0]
            fut = engine.start_generate(GenRequest(sample.uid, sample.fields["prompt_ids"], *sampling))
            flight.acquire()
            deadlines[fut] = (now() + timeout_s, sample.uid, lease)
            fut.add_done_callback(request_done)

        def request_done(fut: asyncio.Future[GenResult]) -> None:
            lease = deadlines.pop(fut)[2]
            try:
                if expired and fut in expired:
                    fail(WaitTimeout(expired.pop(fut)))
                elif not fut.cancelled():  # cancelled otherwise: this worker is stopping
                    if fused is None or episodes.errors:
                        self._write_response(lease, fut.result())
                    else:  # write, and refill the freed slot without a wake-up
                        fields, version = _response_fields(fut.result())
                        written, new = fused(lease, fields, version=version, stage=stage)
                        if written:
                            self.counters.produced += 1
                        if new is not None:
                            start(new)
            except QueueClosed:
                pass  # the run is ending
            except Exception as exc:
                fail(exc)
            finally:
                flight.release()

        proxy = None
        if self.agent is not None:  # this worker's recording endpoint for its agent episodes
            proxy = AgentProxy()
            await proxy.start()
        watchdog = asyncio.create_task(self._watch(deadlines, expired))

        def in_flight() -> list[Lease]:  # (request_timeout_s may exceed lease_timeout_s)
            return [entry[2] for entry in deadlines.values()]

        self.keeper.watch(in_flight)
        try:
            while True:
                free = await flight.free()
                try:
                    leases = await self.store.take_each(stage, free, timeout=self.cfg.workflow.step_timeout_s,
                                                        fields_extra=extra)
                except WaitTimeout:
                    continue  # nothing admitted for a while: normal while the trainer catches up
                except QueueClosed:
                    return
                for lease in leases:
                    if not self.episodic:
                        start(lease)
                    else:
                        flight.acquire()
                        episodes.spawn(self._episode(index, engine, lease, flight, proxy=proxy))
        except asyncio.CancelledError:
            episodes.reraise()
            raise
        finally:
            watchdog.cancel()
            self.keeper.unwatch(in_flight)
            episodes.cancel_all()
            for f in list(deadlines):
                f.cancel()
            if episodes.tasks and self.env_factory is not None and self.agent is None:
                # each cancelled episode closes its environment (`run_guarded` gives it env_timeout_s):
                # waited for here, within the stages' stop bound, or asyncio.run's teardown cut it
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(list(episodes.tasks), timeout=self.cfg.rollout.env_timeout_s + 1.0)
            if proxy is not None:
                await proxy.close()

    def _rollout_stage(self, index: int) -> str:
        return self.rollout_stages[index] if self.cfg.rollout.affinity else "rollout"

    async def _barrier_batches(self, index: int, engine: InferenceEngine, track: str) -> None:
        """`rollout.turn_barrier`: take a batch of episodes (the engine's capacity), run them turn by
        turn in lock step, take the next batch only when all have ended — the batch-synchronous
        baseline for environment-level asynchrony."""
        while True:
            try:
                leases = await self.store.take_each(self._rollout_stage(index), engine.capacity,
                                                    timeout=self.cfg.workflow.step_timeout_s, fields_extra=("row",))
            except WaitTimeout:
                continue
            except QueueClosed:
                return
            barrier = TurnBarrier(len(leases))
            slots = asyncio.Semaphore(len(leases))
            start = self.clock.now()
            await asyncio.gather(*(self._episode(index, engine, lease, slots, barrier) for lease in leases))
            self.tracer.span(track, "generating", start, self.clock.now())

    async def _watch(self, deadlines: dict[asyncio.Future[Any], tuple[float, int, Lease]],
                     expired: dict[asyncio.Future[Any], str]) -> None:
        """Cancel generation requests past `rollout.request_timeout_s`, checking every eighth of it:
        one timer per worker instead of one per request, which keeps the event loop's timer heap
        small (measured: per-request timers cost ~40 us per sample at 1,500 requests in flight).
        A request therefore fails between 1 and 1.125 times its timeout after it started."""
        timeout = self.cfg.rollout.request_timeout_s
        while True:
            await self.clock.sleep(timeout / 8)
            now = self.clock.now()
            for fut, (deadline, uid, _) in list(deadlines.items()):
                if now >= deadline and not fut.done():
                    expired[fut] = f"timed out after {timeout:g} s waiting for generation of sample {uid}"
                    fut.cancel()

    def _write_response(self, lease: Lease, res: GenResult) -> None:
        """Write one single-turn request's response and end its lease (the request's done callback)."""
        # A cancelled request (it could no longer meet max_staleness) is written like any other,
        # with its partial response: its group then reaches the trainer, which drops the whole
        # group and frees its admission slot. Removing it here would leak that slot.
        uid = lease.samples[0].uid
        fields, version = _response_fields(res)
        try:
            if self.store.complete(lease, {uid: fields}, versions={uid: version}):
                self.counters.produced += 1
        except (QueueClosed, KeyError):
            return  # the run is ending, or the sample was removed meanwhile

    def _floor(self) -> float:
        return self.floor

    async def _episode(self, index: int, engine: InferenceEngine, lease: Lease, slots: _Flight | asyncio.Semaphore,
                       barrier: TurnBarrier | None = None, proxy: AgentProxy | None = None) -> None:
        """One multi-turn episode (see `workflow/episode.py`, or `workflow/agent.py` with `proxy`),
        written to the store with its reward: episodes carry their environment's (or agent's)
        reward, so they skip the reward stage."""
        sample = lease.samples[0]
        ro = self.cfg.rollout
        track = f"env/{index}"
        self.keeper.hold(lease)  # an episode of many turns may outlast workflow.lease_timeout_s

        def on_env_step(turn: int, start: float, end: float) -> None:
            self.tracer.span(track, f"episode {sample.uid} step {turn}", start, end)

        try:
            if proxy is not None:
                assert self.agent is not None
                start = self.clock.now()
                result = await run_agent_episode(
                    agent=self.agent, proxy=proxy, engine=engine, clock=self.clock, tok=self.tok, uid=sample.uid,
                    row=dict(self.rows[sample.fields["row"]]), seed=self.cfg.seed * 1_000_003 + sample.uid,
                    settings=recorder_settings(self.cfg, ro.temperature, self.max_context), timeout_s=ro.agent_timeout_s,
                    floor=self._floor,
                )
                self.tracer.span(track, f"agent episode {sample.uid}", start, self.clock.now())
            else:
                assert self.env_factory is not None
                prompt_ids = sample.fields["prompt_ids"]
                party = None if barrier is None else barrier.party()

                def abandoned(error: str) -> EpisodeResult:
                    if party is not None:  # (its own `finally`, which leaves the barrier, may never run)
                        party.leave()
                    return hung_episode(prompt_ids, error)

                # in a task of its own, abandoned if the environment ignores the cancellation of a
                # timed-out call (awaited in place, the episode, its lease and its group hung for good)
                result = await run_guarded(self._swept, run_episode(
                    env=self.env_factory(self.clock), engine=engine, clock=self._swept, tok=self.tok, uid=sample.uid,
                    # (a copy: an env that pops a column changed the row for its group's other episodes
                    # and every later epoch)
                    prompt_ids=prompt_ids, row=dict(self.rows[sample.fields["row"]]),
                    seed=self.cfg.seed * 1_000_003 + sample.uid,
                    settings=EpisodeSettings(ro.max_new_tokens, ro.temperature, ro.request_timeout_s, ro.env_timeout_s,
                                             ro.top_p, ro.top_k, self.max_context),
                    on_env_step=None if self.tracer.off else on_env_step, barrier=party, floor=self._floor,
                ), abandoned, ro.env_timeout_s + 1.0)
            cancelled = result.fields["finish_reason"] == "cancelled"  # (not a failure of the env or agent)
            self._count_episode(None if cancelled else result.fields["reward_error"],
                                "rollout.agent" if proxy is not None else "rollout.env")
            version: int | None = result.fields["behavior_version"]
            if version is not None and version < 0 and not cancelled:
                # no generated token (an environment or agent failed first): the sample has no
                # version, rather than one older than any floor that would drop its whole group as
                # stale; its reward_error keeps it out of the loss and its siblings train
                version = None
            if self.store.complete(lease, {sample.uid: result.fields},
                                   versions=None if version is None else {sample.uid: version}):
                self.counters.produced += 1
        except (QueueClosed, KeyError):
            return  # the run is ending, or the sample was removed meanwhile
        finally:
            self.keeper.drop(lease)
            slots.release()

    def _count_episode(self, error: str | None, key: str) -> None:
        """Episodes share the reward function's fail-fast rule: if the first `reward.fail_fast_calls`
        episodes all failed (an environment or agent that never works), stop the run with the last
        error instead of logging failed samples until a timeout."""
        c = self.counters
        c.episodes += 1
        if error is not None:
            c.episode_failures += 1
            limit = self.cfg.reward.fail_fast_calls
            if c.episodes == limit and c.episode_failures == limit:
                raise UserError(f"{key}: the first {limit} episodes all failed (reward.fail_fast_calls); "
                                f"last error: {error}")

    # ------------------------------------------------------------------ reward

    async def reward_worker(self) -> None:
        """Score each group as soon as all its responses are written: one reward call per group.
        A plain function: the groups of one take share one hop to a worker thread (a hop costs ~135
        us on a 2-core VM, more than the rest of a sample's way through the store). An `async def`
        function is awaited on this loop, each take in its own task (up to `reward.concurrency`
        groups at once), so a slow judge does not hold the groups behind it."""
        if not self._reward_async:
            while True:
                try:
                    lease = await self._take_reward(self.n * PLAIN_CALLS_PER_HOP)
                except WaitTimeout:
                    continue
                except QueueClosed:
                    return
                await self._reward_take(lease)
            return
        flight = _Flight(self.cfg.reward.concurrency, lambda start: None, self.clock)
        takes = _Children()  # one task per take; the first that fails stops this worker with its error

        def done(groups: int, task: asyncio.Task[None]) -> None:
            for _ in range(groups):
                flight.release()

        try:
            while True:
                free = await flight.free()
                try:
                    lease = await self._take_reward(self.n * min(8, free))
                except WaitTimeout:
                    continue
                except QueueClosed:
                    return
                groups = len({s.group_id for s in lease.samples}) or 1
                for _ in range(groups):
                    flight.acquire()
                takes.spawn(self._reward_take(lease), functools.partial(done, groups))
        except asyncio.CancelledError:
            takes.reraise()
            raise
        finally:
            takes.cancel_all()

    async def _take_reward(self, max_samples: int) -> Lease:
        return await self.store.take("reward", max_samples, timeout=self.cfg.workflow.step_timeout_s,
                                     fields_extra=["row", "finish_reason"])

    async def _reward_take(self, lease: Lease) -> None:
        """Score the groups of one reward lease and write their rewards (or errors)."""
        groups = _by_group(lease.samples)
        # a group with a cancelled sample is never trained: do not spend a reward call on it
        live = [g for g in groups if "cancelled" not in [s.fields.get("finish_reason") for s in g]]
        with self.keeper.holding(lease):
            scored = dict(zip((g[0].group_id for g in live), await self._score_groups(live), strict=True))
        writes = {}
        for group in groups:
            outcome = scored.get(group[0].group_id, _CANCELLED_OUTCOME)
            rewards, error = outcome.rewards, outcome.error
            for i, s in enumerate(group):
                writes[s.uid] = {"reward": None if rewards is None else rewards[i], "reward_error": error}
        with contextlib.suppress(QueueClosed):  # (closed: the run is ending)
            self.store.complete(lease, writes)  # samples removed meanwhile are skipped

    def _reward_call(self, group: list[SampleView]) -> tuple[Any, ...]:
        """The arguments of `call_reward_fn` for one group."""
        row = self.rows[group[0].fields["row"]]
        key = self.cfg.dataset.prompt_key
        # lists are copied, so a reward function cannot change what is stored; other (immutable)
        # sequences, such as a simulated engine's run-length ids, are passed as they are
        completions_ids = [r.copy() if isinstance(r, list) else r for r in (s.fields["response_ids"] for s in group)]
        completions = self.tok.completions(completions_ids, conversational=isinstance(row[key], list))
        columns = {c: [v] * len(group) for c, v in row.items() if c != key}
        return self.reward_fn, [row[key]] * len(group), completions, completions_ids, columns

    async def _score_groups(self, groups: list[list[SampleView]]) -> list[RewardOutcome]:
        if not groups:
            return []
        calls = [self._reward_call(g) for g in groups]
        start = self.clock.now()
        ids = [g[0].group_id for g in groups]
        timeout = self.cfg.reward.timeout_s
        if self._reward_async:
            async def one(call: tuple[Any, ...], gid: int) -> RewardOutcome:
                try:
                    return await wait_detached(self._swept, call_reward_fn_async(*call), timeout,
                                               f"reward function on group(s) [{gid}]")
                except WaitTimeout as exc:
                    return RewardOutcome(None, str(exc))

            if len(calls) == 1:
                outcomes = [await one(calls[0], ids[0])]
            else:
                outcomes = list(await asyncio.gather(*(one(c, g) for c, g in zip(calls, ids, strict=True))))
        else:
            outcomes = await self._plain_calls.score(calls, self.clock.wait_for, timeout,
                                                     f"reward function on group(s) {ids}")
        self.tracer.span("reward", "reward", start, self.clock.now(), groups=ids)
        limit = self.cfg.reward.fail_fast_calls
        for outcome in outcomes:
            self.counters.reward_calls += 1
            if outcome.error is not None:
                self.counters.reward_call_failures += 1
                if self.counters.reward_calls == limit and self.counters.reward_call_failures == limit:
                    raise UserError(f"reward.fn: the first {limit} reward calls all failed; last error: {outcome.error}")
        return outcomes

    # ------------------------------------------------------------------ reference

    async def ref_worker(self) -> None:
        """Reference log-probs of each response as soon as it is written (up to a batch per forward
        pass, in a worker thread), stored as the sample's `ref_logprobs` field."""
        assert self.ref_logprobs is not None
        while True:
            try:
                lease = await self.store.take("reference", self.cfg.train.batch_size,
                                              timeout=self.cfg.workflow.step_timeout_s, fields_extra=["prompt_ids"])
            except WaitTimeout:
                continue
            except QueueClosed:
                return
            samples = lease.samples
            start = self.clock.now()
            with self.keeper.holding(lease):
                rows = await self.clock.wait_for(
                    asyncio.to_thread(self._ref_rows, samples), self.cfg.workflow.step_timeout_s,
                    f"reference log-probs of {len(samples)} samples",
                )
            self.tracer.span("reference", f"ref log-probs x{len(samples)}", start, self.clock.now())
            self.store.complete(lease, {s.uid: {"ref_logprobs": r} for s, r in zip(samples, rows, strict=True)})

    def _ref_rows(self, samples: list[SampleView]) -> list[list[float]]:
        assert self.ref_logprobs is not None
        prompts = [s.fields["prompt_ids"] for s in samples]
        responses = [s.fields["response_ids"] for s in samples]
        batch = build_train_batch(prompts, responses, [[0.0] * len(r) for r in responses],
                                  torch.zeros(len(samples)), [True] * len(samples), self.tok.pad_token_id)
        lp = self.ref_logprobs(batch)
        return [lp[i, len(p) - 1 : len(p) - 1 + len(r)].tolist() for i, (p, r) in enumerate(zip(prompts, responses,
                                                                                                 strict=True))]

    # ------------------------------------------------------------------ trainer

    def stop_early(self) -> None:
        """End the run after the step being trained (`eval.patience`: the eval curve has flattened)."""
        self._stop_early = True

    async def trainer_loop(self) -> None:
        """Assemble batches of whole groups within the staleness bound, train, publish; until
        `train.max_steps`, or the step after `stop_early()` was called."""
        for step in range(self.first_step, self.cfg.train.max_steps + 1):
            groups, leases = await self._collect_batch()
            result = await self._train_on(step, groups)
            for lease in leases:
                self.keeper.drop(lease)
                if not self.store.ack(lease, remove=True):  # (kept alive by the keeper: should not happen)
                    self.store.remove([s.uid for s in (*lease.samples, *lease.expired)])  # never train them again
            self.last_step = step
            if self.on_step is not None:
                await self.on_step(result)
            if self._stop_early:
                break

    async def _collect_batch(self) -> tuple[list[list[SampleView]], list[Lease]]:
        groups: list[list[SampleView]] = []
        leases: list[Lease] = []
        have = 0
        filtered = 0
        failed = 0  # groups whose every reward call failed, in this batch's wait
        start = self.clock.now()
        # one deadline for the whole batch, not per take: while every group fails (a verifier that went
        # down after the run's first calls) each take succeeds, and the batch never filled nor ended
        limit = self.cfg.workflow.step_timeout_s
        while len(groups) < self.groups_per_step:
            left = start + limit - self.clock.now()
            try:
                if left <= 0:
                    raise WaitTimeout("the batch's deadline passed")
                lease = await self.store.take(
                    "train",
                    max(self.n, self.cfg.train.batch_size - have),
                    timeout=left,
                    min_version=self.gate.min_version(self.version),
                    fields_extra=TRAIN_FIELDS,
                )
            except WaitTimeout:  # name the setting that bounds this wait, and what the wait saw
                raise WaitTimeout(
                    f"timed out after {limit:g} s waiting for a training batch from stage 'train': {len(groups)} of "
                    f"{self.groups_per_step} groups; meanwhile {failed} groups failed every reward call and "
                    f"{filtered} were filtered (workflow.step_timeout_s: the trainer's wait for a batch)") from None
            self.keeper.hold(lease)
            self._drop_stale(lease)
            for group in _by_group(lease.samples):
                if any(s.fields.get("finish_reason") == "cancelled" for s in group):
                    self._drop_groups(group, "dropped with its group: a sample of the group was cancelled")
                    continue
                if all(s.fields["reward_error"] is not None for s in group):
                    failed += 1
                    self.counters.reward_errors += len(group)
                    self._log_samples([(s, None, "reward_error", s.fields["reward_error"]) for s in group])
                    self._discard(group)
                    continue
                if self.cfg.algorithm.filter_groups and _all_equal(group):
                    if filtered < self._filter_budget:
                        filtered += 1
                        msg = "filtered: all rewards in the group are equal (DAPO dynamic sampling, before over-long shaping)"
                        # a sample whose reward failed (an episode's environment) keeps its own status and error
                        logged: list[tuple[SampleView, int | None, str, str | None]] = [
                            (s, None, "filtered", msg) if s.fields["reward_error"] is None
                            else (s, None, "reward_error", s.fields["reward_error"]) for s in group]
                        failures = sum(1 for item in logged if item[2] == "reward_error")
                        self.counters.filtered += len(group) - failures
                        self.counters.reward_errors += failures
                        self._log_samples(logged)
                        self._discard(group)
                        continue
                    self.counters.filter_overflow += 1
                groups.append(group)
                have += len(group)
            leases.append(lease)
        self.tracer.span("trainer", "wait for batch", start, self.clock.now())
        return groups, leases

    def _drop_stale(self, lease: Lease) -> None:
        """Drop groups below the version floor, freeing their admission slots. A sample whose
        generation was cancelled is logged as `cancelled`, the rest of its group as `dropped_stale`."""
        if not lease.expired:
            return
        self._drop_groups(lease.expired, f"older than max_staleness={self.k} at trainer version {self.version}")

    def _drop_groups(self, samples: list[SampleView], msg: str) -> None:
        """Log whole groups as never trained (`cancelled` samples as such, the rest `dropped_stale`)
        and free their admission slots."""
        logged: list[tuple[SampleView, int | None, str, str | None]] = []
        for s in samples:
            if s.fields.get("finish_reason") == "cancelled":
                self.counters.cancelled += 1
                logged.append((s, None, "cancelled", CANCELLED))
            else:
                self.counters.dropped_stale += 1
                logged.append((s, None, "dropped_stale", msg))
        self._log_samples(logged)
        self._discard(samples)

    def _discard(self, samples: list[SampleView]) -> None:
        """Remove groups the trainer will not train from the store at once (their lease's ack skips
        them) and free their admission slots. Freeing the slot while the group still took store room
        until the step's ack let a dynamic-sampling filter fill the store with groups it had dropped:
        the feeder then blocked on a full store and the trainer waited for groups never admitted."""
        self.store.remove([s.uid for s in samples])
        self.gate.drop(len({s.group_id for s in samples}))

    async def _train_on(self, step: int, groups: list[list[SampleView]]) -> StepResult:
        samples = [s for g in groups for s in g]
        valid: list[bool] = []
        rewards: list[float] = []
        reward_sum = 0.0
        # one pass over the batch for what the optimizer reads, one after it for the log and the
        # step's metrics (each pass costs ~0.1 us a sample)
        for s in samples:
            f = s.fields
            ok = f["reward_error"] is None
            r = float(f["reward"]) if ok else 0.0
            valid.append(ok)
            rewards.append(r)
            reward_sum += r
        t0 = self.clock.now()
        with self.tracer.timed("trainer", f"train step {step}", samples=len(samples)):
            metrics, tokens = await self._optimize(samples, valid, rewards)
        self.counters.train_busy_s += self.clock.now() - t0
        sync_s = await self._publish()
        trained_version = self.version - 1
        staleness: list[int] = []
        logged: list[tuple[SampleView, int | None, str, str | None]] = []
        length = 0
        for s, ok in zip(samples, valid, strict=True):
            f = s.fields
            length += len(f["response_ids"])
            if ok:
                staleness.append(trained_version - f["behavior_version"])
                logged.append((s, trained_version, "trained", None))
            else:
                logged.append((s, None, "reward_error", f["reward_error"]))
        # (a reward_error sample trains with reward 0 masked out: it is logged with none)
        self._log_samples(logged, rewards=[r if ok else None for r, ok in zip(rewards, valid, strict=True)])
        n_valid = len(staleness)
        self.counters.trained += n_valid
        self.counters.reward_errors += len(samples) - n_valid
        self.counters.tokens += tokens
        metrics.update(
            reward_mean=reward_sum / max(n_valid, 1),
            staleness_mean=sum(staleness) / max(n_valid, 1),
            staleness_max=float(max(staleness, default=0)),
            weight_sync_s=sync_s,
            response_len_mean=length / len(samples),
        )
        return StepResult(step, self.version, metrics)

    async def _optimize(self, samples: list[SampleView], valid: list[bool], rewards: list[float]) -> tuple[dict[str, Any], int]:
        """Advantages, the padded batch and the optimizer steps (in a worker thread); returns the
        train metrics and the number of trained tokens. PIPE's simulated trainer replaces this."""
        batch, extra = self._make_batch(samples, valid, rewards)
        metrics = await asyncio.to_thread(self._compute_step, batch, self.cfg.rollout.temperature, samples)
        metrics.update(extra)
        return metrics, int(batch.response_mask.sum())

    def _make_batch(
        self, samples: list[SampleView], valid: list[bool], rewards: list[float]
    ) -> tuple[TrainBatch, dict[str, Any]]:
        """The padded batch: rewards (plus the over-long penalty, if on) -> advantages over the whole
        batch; reference log-probs from the samples' `ref_logprobs` field (the reference stage)."""
        valid_t = torch.tensor(valid)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        algo = self.cfg.algorithm
        extra: dict[str, Any] = {}
        if algo.overlong_buffer > 0:
            lengths = torch.tensor([_generated(s) for s in samples])
            penalty = overlong_penalty(lengths, max_generated_tokens(self.cfg), algo.overlong_buffer,
                                       algo.overlong_penalty)
            reward_t = reward_t + torch.where(valid_t, penalty, torch.zeros_like(penalty))
            extra["overlong_penalty_mean"] = float(penalty[valid_t].mean()) if any(valid) else 0.0
        adv = self.advantage_fn(reward_t, torch.tensor([s.group_id for s in samples]), valid_t)
        batch = build_train_batch(
            [s.fields["prompt_ids"] for s in samples],
            [s.fields["response_ids"] for s in samples],
            [s.fields["behavior_logprobs"] for s in samples],
            adv,
            valid,
            self.tok.pad_token_id,
            [s.fields.get("loss_mask") for s in samples],
        )
        if self.ref_logprobs is not None:
            ref = torch.zeros_like(batch.behavior_logprobs)
            for i, s in enumerate(samples):
                start = len(s.fields["prompt_ids"]) - 1
                values = s.fields["ref_logprobs"]
                ref[i, start : start + len(values)] = torch.tensor(values, dtype=ref.dtype)
            batch.ref_logprobs = ref
        return batch, extra

    def _compute_step(self, batch: TrainBatch, temperature: float, samples: list[SampleView]) -> dict[str, Any]:
        """Runs in a worker thread: the optimizer steps, plus train/inference mismatch diagnostics.

        `mismatch_kl` compares behavior log-probs with the trainer's, on the tokens that the
        trainer's own version generated (elsewhere the two policies differ by design). It needs
        one extra forward pass, so it is computed only when the batch holds such tokens.
        """
        same = torch.zeros_like(batch.response_mask)
        for i, s in enumerate(samples):
            versions = s.fields["token_versions"]
            p = len(s.fields["prompt_ids"])
            # (one array comparison: a Python loop per token held the GIL ~0.4 us a token, every step)
            ids = np.fromiter(versions, dtype=np.int64, count=len(versions))
            same[i, p - 1 : p - 1 + len(versions)] = torch.from_numpy(ids == self.version)
        same = same * batch.response_mask
        n = float(same.sum())
        # the trainer's log-probs before this step's first optimizer step: the proximal policy of
        # decoupled PPO, and the trainer side of mismatch_kl
        current = self.trainer.logprobs(batch, temperature) if n or self.needs_proximal else None
        if self.needs_proximal:
            batch.proximal_logprobs = current
        metrics: dict[str, Any] = dict(self.trainer.train_step(batch, self.loss_fn, temperature))
        # None (null in metrics.jsonl) when no token of the batch came from the trainer's own version
        metrics["mismatch_kl"] = None
        if current is not None and n:
            d = (current - batch.behavior_logprobs) * same
            metrics["mismatch_kl"] = float((torch.exp(d) - d - 1).mul(same).sum() / n)
        return metrics

    async def _publish(self) -> float:
        """Version v -> v+1: export weights and load them into every engine."""
        start = self.clock.now()
        # in a worker thread, as the train step is: a full copy of the weights (an FSDP gather) held the
        # event loop for it, stalling rollout callbacks, new requests and evaluation (0.7 s at 156M
        # parameters on CPU); the trainer is idle meanwhile (the step is done, the next waits for this)
        state = await asyncio.to_thread(self.trainer.export_weights)
        new_version = self.version + 1
        # requests that the new version's floor drops are cancelled before the load, not after it:
        # a `drain` load waits for what is running, and at max_staleness 0 (sync) everything running
        # is below the floor, so redundant stragglers were waited for, then dropped (none cancelled)
        floor = self.gate.min_version(new_version)
        for e in self.engines:
            e.cancel_older_than(floor)
        await self.clock.wait_for(
            asyncio.gather(*(e.load_weights(state, new_version, self.cfg.workflow.weight_update) for e in self.engines)),
            self.cfg.workflow.step_timeout_s,
            f"weight sync of version {new_version}",
        )
        self.version = new_version
        self.gate.publish(new_version)
        self.floor = floor
        for e in self.engines:  # (again: what started meanwhile from the old version, or an abort put back)
            e.cancel_older_than(floor)
        self.tracer.span("weight sync", f"v{new_version}", start, self.clock.now())
        return self.clock.now() - start

    # ------------------------------------------------------------------ bookkeeping

    def _log_samples(
        self, items: list[tuple[SampleView, int | None, str, str | None]], rewards: list[float | None] | None = None
    ) -> None:
        """One samples.jsonl row per item; `rewards`: the reward each was trained with, item by item
        (default: its `reward` field)."""
        key = self.cfg.dataset.prompt_key
        rows, decode = self.rows, self.tok.decode
        tokens_by, count_by = self.counters.response_tokens, self.counters.response_count
        out = []
        for i, (s, trained_version, status, error) in enumerate(items):
            f = s.fields
            resp = f.get("response_ids")
            n_resp = 0 if resp is None else len(resp)
            if n_resp:
                tokens_by[status] = tokens_by.get(status, 0) + n_resp
                count_by[status] = count_by.get(status, 0) + 1
            version = f.get("behavior_version")
            reward = f.get("reward") if rewards is None else rewards[i]
            row = {
                "uid": s.uid,
                "group_id": s.group_id,
                "prompt": rows[f["row"]].get(key) if "row" in f else None,
                "response": None if resp is None else decode(resp),
                "reward": None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else reward,
                "behavior_version": None if version is None or version < 0 else version,
                "trained_version": trained_version,
                "status": status,
                "error": error,
            }
            if "loss_mask" in f:
                row["turns"] = f.get("turns")
                row["generated_tokens"] = generated_tokens(f["loss_mask"])
            if "agent_calls" in f:
                row["agent_calls"] = f["agent_calls"]
                row["agent_calls_dropped"] = f["agent_calls_dropped"]
            out.append(row)
        self.log.samples(out)

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


class LeaseKeeper:
    """Renews the store leases that this process's stages hold while they work on them, every
    quarter of `workflow.lease_timeout_s`. A lease's deadline is the backstop for a holder that died
    or hung (its samples go back to the queue); a live holder may legitimately hold longer than
    that: the trainer holds its batch's groups while it collects the rest and trains, an episode
    holds its sample for all of its turns. Without renewal those leases expired under them, and the
    trainer took the same groups again (trained twice, admission credit freed twice) or an episode
    was started over and over. One timer per process, not per lease; stops when nothing is held."""

    def __init__(self, store: StoreClient, clock: Clock, lease_s: float) -> None:
        self.store = store
        self.clock = clock
        self.every = lease_s / 4
        self.held: dict[int, Lease] = {}
        self.sources: list[Callable[[], Iterable[Lease]]] = []  # leases held elsewhere (requests in flight)
        self._task: asyncio.Task[None] | None = None

    def hold(self, lease: Lease) -> None:
        self.held[lease.id] = lease
        if self._task is None:
            self._start()

    def drop(self, lease: Lease) -> None:
        self.held.pop(lease.id, None)

    @contextlib.contextmanager
    def holding(self, lease: Lease) -> Iterator[None]:
        """`hold(lease)` for the block, `drop(lease)` after it, however it ends."""
        self.hold(lease)
        try:
            yield
        finally:
            self.drop(lease)

    def watch(self, source: Callable[[], Iterable[Lease]]) -> None:
        """Also renew what `source()` lists at each tick, until `unwatch(source)`."""
        self.sources.append(source)
        if self._task is None:
            self._start()

    def unwatch(self, source: Callable[[], Iterable[Lease]]) -> None:
        with contextlib.suppress(ValueError):
            self.sources.remove(source)

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lease keeper")

    async def _run(self) -> None:
        try:
            while self.held or self.sources:
                await self.clock.sleep(self.every)
                leases = list(self.held.values())
                for source in self.sources:
                    leases.extend(source())
                if leases:
                    with contextlib.suppress(QueueClosed):
                        self.store.renew(leases)
        finally:
            self._task = None

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None


class _Children:
    """Child tasks of a stage loop (episodes, reward takes) whose first error stops the loop: `fail`
    records it and cancels the loop's task, whose `except CancelledError` calls `reraise` so the loop
    ends with that error instead of a bare cancellation. Create it inside the loop's task."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.errors: list[BaseException] = []
        self._parent = asyncio.current_task()

    def fail(self, exc: BaseException) -> None:
        if not self.errors:
            self.errors.append(exc)
            if self._parent is not None:
                self._parent.cancel()

    def spawn(self, coro: Coroutine[Any, Any, Any], on_done: Callable[[asyncio.Task[Any]], None] | None = None) -> None:
        """Run `coro` as a child; `on_done(task)` runs when it ends, before its error is looked at
        (in the same done callback: one event-loop callback per child, not two)."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._done if on_done is None else functools.partial(self._done_after, on_done))

    def _done_after(self, on_done: Callable[[asyncio.Task[Any]], None], task: asyncio.Task[Any]) -> None:
        try:
            on_done(task)
        finally:
            self._done(task)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]

    def reraise(self) -> None:
        if self.errors:
            raise self.errors[0] from None

    def cancel_all(self) -> None:
        for t in list(self.tasks):
            t.cancel()


def _response_fields(res: GenResult) -> tuple[dict[str, Any], int]:
    """The fields a single-turn response writes, and its behavior version (the oldest of its
    tokens; -1 for no token, older than any floor)."""
    version = oldest(res.token_versions)
    return {
        "response_ids": res.response_ids,
        "behavior_logprobs": res.behavior_logprobs,
        "token_versions": res.token_versions,
        "behavior_version": version,
        "finish_reason": res.finish_reason,
    }, version


class _Flight:
    """A rollout worker's slots: how many requests or episodes it has in flight, up to `limit`.

    A plain counter and one future for the worker to sleep on (cheaper per sample than an
    `asyncio.Semaphore` acquired and released once per request). `on_idle(start)` is told when the
    worker runs dry, with the time its first request of the busy period started (tracing)."""

    def __init__(self, limit: int, on_idle: Callable[[float], None], clock: Clock) -> None:
        self.limit = limit
        self.n = 0
        self._on_idle = on_idle
        self._clock = clock
        self._since = 0.0
        self._wake: asyncio.Future[None] | None = None

    def acquire(self) -> None:
        if self.n == 0:
            self._since = self._clock.now()
        self.n += 1

    def release(self) -> None:
        self.n -= 1
        if self.n == 0:
            self._on_idle(self._since)
        wake = self._wake
        if wake is not None and self.n < self.limit and not wake.done():
            wake.set_result(None)

    async def free(self) -> int:
        """Wait until a slot is free; the number free."""
        while self.n >= self.limit:
            self._wake = asyncio.get_running_loop().create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        return self.limit - self.n


def store_capacity(cfg: Config) -> int:
    """Room for every admitted sample: the gate admits at most (k+1) steps' worth (plus the redundant
    share), plus slack."""
    steps = cfg.staleness + 2 + math.ceil(cfg.workflow.redundancy)
    return max(cfg.workflow.store_capacity, steps * cfg.train.batch_size)


def build_train_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    behavior: list[list[float]],
    advantages: torch.Tensor,
    valid: list[bool],
    pad_token_id: int,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> TrainBatch:
    """Right-padded prompt+response rows; the mask marks response tokens (EOS included) of valid rows,
    and of those only the generated ones where `loss_masks` (multi-turn episodes) says so."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    b = len(prompts)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    blp = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, behavior, strict=True)):
        ids[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attn[i, : lengths[i]] = 1
        start = len(p) - 1  # logits at position t predict token t+1
        if valid[i]:
            lm = None if loss_masks is None else loss_masks[i]
            mask[i, start : start + len(r)] = 1.0 if lm is None else torch.tensor(list(lm), dtype=torch.float32)
        blp[i, start : start + len(r)] = torch.tensor(list(lp), dtype=torch.float32)
    return TrainBatch(ids, attn, mask, advantages, blp)


def _generated(sample: SampleView) -> int:
    """Tokens the policy generated for a sample (an episode's environment tokens excluded)."""
    mask = sample.fields.get("loss_mask")
    return int(sum(mask)) if mask is not None else len(sample.fields["response_ids"])


def _all_equal(group: list[SampleView]) -> bool:
    """True when every scored sample of the group has the same reward (and there are >= 2)."""
    rewards = [s.fields["reward"] for s in group if s.fields["reward_error"] is None]
    return len(rewards) >= 2 and all(r == rewards[0] for r in rewards)


def _by_group(samples: list[SampleView]) -> list[list[SampleView]]:
    groups: dict[int, list[SampleView]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())
