"""The rollout stage: each worker keeps its engine's batch slots full with samples taken from the
store, one request or one multi-turn episode each, and writes each response as it ends. It waits
for an admitted sample and a free slot; a publication's staleness floor cancels what can no longer train.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from asyncflow.clock import run_guarded
from asyncflow.data import row_copy
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.runs import oldest
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import Lease, QueueClosed
from asyncflow.workflow.agent import AgentFn, run_agent_episode
from asyncflow.workflow.agent_proxy import AgentProxy
from asyncflow.workflow.context import ABORTED, StageContext
from asyncflow.workflow.episode import (
    EpisodeResult,
    TurnBarrier,
    hung_episode,
    run_episode,
)
from asyncflow.workflow.flight import Children, Flight
from asyncflow.workflow.settings import RolloutSettings

EnvFactory = Callable[[Any], Any]  # a clock -> a fresh environment (`asyncflow.envs`)


def response_fields(res: GenResult) -> tuple[dict[str, Any], int]:
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


def straggler_fields() -> dict[str, Any]:
    """What an aborted straggler's sample is written with: no tokens (its request was abandoned), no
    version (its group's version floor is its finished samples'), finish_reason `aborted`."""
    return {"response_ids": [], "behavior_logprobs": [], "token_versions": [], "behavior_version": None,
            "finish_reason": ABORTED}


def _held(deadlines: dict[asyncio.Future[Any], tuple[float, int, Lease]]) -> list[Lease]:
    """The leases of the single-turn requests in flight."""
    return [entry[2] for entry in deadlines.values()]


class RolloutWorker:
    """One engine's rollout loop (single requests, episodes, turn barriers). With `env_factory` or
    `agent`, each sample is a multi-turn episode that carries its own reward."""

    def __init__(self, ctx: StageContext, settings: RolloutSettings, *, index: int, engine: InferenceEngine,
                 rows: list[dict[str, Any]], tok: Tokenizer, env_factory: EnvFactory | None = None,
                 agent: AgentFn | None = None) -> None:
        self.ctx = ctx
        self.settings = settings
        self.index = index
        self.engine = engine
        self.rows = rows
        self.tok = tok
        self.env_factory = env_factory
        self.agent = agent
        self.episodic = env_factory is not None or agent is not None
        self.stage = f"rollout/{index}" if settings.affinity else "rollout"  # (the store's stage it takes from)

    async def run(self) -> None:
        """Keep up to twice the engine's batch slots in flight, taking all free slots' worth in one
        store call (one lease each); the extra half waits in the engine's queue, so a freed slot is
        refilled at the next decode step, not after a store round trip. A single-turn request is no
        task of its own: started on the engine (`start_generate`), it is written in a callback on its
        result future, which with the in-process store also refills the slot (`complete_and_take`)
        and wakes this worker only when nothing is ready. With an environment or an agent, each
        taken sample is a whole episode (its own task)."""
        index, engine, ctx = self.index, self.engine, self.ctx
        track = f"rollout/{index}"
        if self.settings.turn_barrier:
            await self._barrier_batches(index, engine, track)
            return
        flight = Flight(engine.capacity * 2, lambda start: ctx.tracer.span(track, "generating", start, ctx.clock.now()),
                        ctx.clock)
        episodes = Children()  # episode tasks; also where a failed request stops this worker
        extra = ("row",) if self.episodic else ()
        stage = self.stage
        # single-turn requests in flight: (deadline, uid, lease); see _watch. (The lease rides here, not
        # in a functools.partial per request: request_done is the future's callback as it is.)
        deadlines: dict[asyncio.Future[Any], tuple[float, int, Lease]] = {}
        expired: dict[asyncio.Future[Any], str] = {}
        aborted: set[asyncio.Future[Any]] = set()  # stragglers cut at rollout.group_timeout_s (see _watch)
        ro = self.settings
        # in process: a finished request's write and its slot's next sample in one store call
        fused = ctx.store.complete_and_take if ctx.store.in_process and not self.episodic else None
        # otherwise (a store in another process) freed slots are refilled in batches of half the
        # engine's slots, one store call each (the other half of the flight still waits in the
        # engine's queue meanwhile, so the engine stays full), while the store has more ready; once a
        # take got fewer than it asked for, the next waits in the store at once, for one slot's worth
        # (this worker's last writes then go out at once, not with a later refill)
        batch = max(1, engine.capacity // 2) if fused is None and not self.episodic else 1
        refill = 1
        fail = episodes.fail  # a request failed or timed out: stop this worker with its error
        sampling = (ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k)
        now, timeout_s = self.ctx.clock.now, ro.request_timeout_s

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
                elif not fut.cancelled() or (aborted and fut in aborted):  # else: this worker is stopping
                    fields, version = (straggler_fields(), None) if fut.cancelled() else response_fields(fut.result())
                    if fused is None or episodes.errors:
                        self._write_response(lease, fields, version)
                    else:  # write, and refill the freed slot without a wake-up
                        written, new = fused(lease, fields, version=version, stage=stage)
                        if written:
                            self.ctx.counters.produced += 1
                        if new is not None:
                            start(new)
            except QueueClosed:
                pass  # the run is ending
            except Exception as exc:
                fail(exc)
            finally:
                aborted.discard(fut)
                flight.release()

        proxy = await self._agent_proxy()
        watchdog = asyncio.create_task(self._watch(deadlines, expired, aborted))
        in_flight = functools.partial(_held, deadlines)  # renewed too: request_timeout_s may exceed lease_timeout_s
        self.ctx.keeper.watch(in_flight)
        try:
            while True:
                free = await flight.free(refill)
                leases = await self._take_rollouts(stage, free, extra, flight.room)
                if leases is None:
                    return
                refill = batch if len(leases) == free else 1
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
            self.ctx.keeper.unwatch(in_flight)
            await self._stop_requests(episodes, deadlines, proxy)

    async def _agent_proxy(self) -> AgentProxy | None:
        """This worker's recording endpoint for its agent episodes (None without `rollout.agent`)."""
        if self.agent is None:
            return None
        proxy = AgentProxy(wait_s=self.settings.request_timeout_s)  # (a queued connection waits behind calls)
        await proxy.start()
        return proxy

    async def _take_rollouts(self, stage: str, free: int, extra: tuple[str, ...],
                             room: Callable[[], int]) -> list[Lease] | None:
        """Up to `free` samples of `stage`, one lease each; [] after a quiet wait, None once the store
        closed. `room`: the worker's free slots when the store wakes it (they grow while it waits)."""
        try:
            return await self.ctx.store.take_each(stage, free, timeout=self.settings.step_timeout_s, fields_extra=extra,
                                              room=room)
        except WaitTimeout:
            return []  # nothing admitted for a while: normal while the trainer catches up
        except QueueClosed:
            return None

    async def _stop_requests(self, episodes: Children, deadlines: dict[asyncio.Future[Any], Any],
                             proxy: AgentProxy | None) -> None:
        """End a stopping worker's episodes and requests, and its agent endpoint."""
        episodes.cancel_all()
        for f in list(deadlines):
            f.cancel()
        if episodes.tasks and self.env_factory is not None and self.agent is None:
            # each cancelled episode closes its environment (`run_guarded` gives it env_timeout_s):
            # waited for here, within the stages' stop bound, or asyncio.run's teardown cut it
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(list(episodes.tasks), timeout=self.settings.env_timeout_s + 1.0)
        if proxy is not None:
            await proxy.close()

    async def _barrier_batches(self, index: int, engine: InferenceEngine, track: str) -> None:
        """`rollout.turn_barrier`: take a batch of episodes (the engine's capacity), run them turn by
        turn in lock step, take the next batch only when all have ended — the batch-synchronous
        baseline for environment-level asynchrony."""
        while True:
            try:
                leases = await self.ctx.store.take_each(self.stage, engine.capacity,
                                                    timeout=self.settings.step_timeout_s, fields_extra=("row",))
            except WaitTimeout:
                continue
            except QueueClosed:
                return
            # each other episode's phase ends within its generation or environment timeout, or it is
            # abandoned and leaves: waiting longer than both means the barrier itself is stuck
            ro = self.settings
            barrier = TurnBarrier(len(leases), ro.request_timeout_s + ro.env_timeout_s + 1.0)
            slots = asyncio.Semaphore(len(leases))
            start = self.ctx.clock.now()
            await asyncio.gather(*(self._episode(index, engine, lease, slots, barrier) for lease in leases))
            self.ctx.tracer.span(track, "generating", start, self.ctx.clock.now())

    async def _watch(self, deadlines: dict[asyncio.Future[Any], tuple[float, int, Lease]],
                     expired: dict[asyncio.Future[Any], str], aborted: set[asyncio.Future[Any]]) -> None:
        """Cancel generation requests past `rollout.request_timeout_s`, checking every eighth of it:
        one timer per worker instead of one per request, which keeps the event loop's timer heap
        small (measured: per-request timers cost ~40 us per sample at 1,500 requests in flight).
        A request therefore fails between 1 and 1.125 times its timeout after it started. With
        `rollout.group_timeout_s`, a request past that (checked every eighth of it) is a straggler:
        abandoned in the engine (its future cancelled) and written as `aborted` (`request_done`)."""
        timeout, cut = self.settings.request_timeout_s, self.settings.group_timeout_s
        early = timeout - cut if cut is not None else -1.0  # a straggler's deadline is this much before its timeout
        while True:
            await self.ctx.clock.sleep(min(timeout, cut or timeout) / 8)
            now = self.ctx.clock.now()
            for fut, (deadline, uid, _) in list(deadlines.items()):
                if fut.done():
                    continue
                if now >= deadline:
                    expired[fut] = f"timed out after {timeout:g} s waiting for generation of sample {uid}"
                    fut.cancel()
                elif now >= deadline - early:
                    aborted.add(fut)
                    fut.cancel()

    def _write_response(self, lease: Lease, fields: dict[str, Any], version: int | None) -> None:
        """Write one single-turn request's response (`response_fields`, or an aborted straggler's
        `straggler_fields` with no version) and end its lease (the request's done callback)."""
        # A cancelled request (it could no longer meet max_staleness) is written like any other,
        # with its partial response: its group then reaches the trainer, which drops the whole
        # group and frees its admission slot. Removing it here would leak that slot. (Likewise a
        # straggler: its group becomes complete, and the trainer logs it and trains the rest.)
        uid = lease.samples[0].uid
        try:
            if self.ctx.store.complete(lease, {uid: fields}, versions=None if version is None else {uid: version}):
                self.ctx.counters.produced += 1
        except (QueueClosed, KeyError):
            return  # the run is ending, or the sample was removed meanwhile

    def _floor(self) -> float:
        return self.ctx.board.floor

    async def _episode(self, index: int, engine: InferenceEngine, lease: Lease, slots: Flight | asyncio.Semaphore,
                       barrier: TurnBarrier | None = None, proxy: AgentProxy | None = None) -> None:
        """One multi-turn episode (see `workflow/episode.py`, or `workflow/agent.py` with `proxy`),
        written to the store with its reward: episodes carry their environment's (or agent's)
        reward, so they skip the reward stage."""
        sample = lease.samples[0]
        ro = self.settings
        track = f"env/{index}"
        self.ctx.keeper.hold(lease)  # an episode of many turns may outlast workflow.lease_timeout_s

        def on_env_step(turn: int, start: float, end: float) -> None:
            self.ctx.tracer.span(track, f"episode {sample.uid} step {turn}", start, end)

        try:
            if proxy is not None:
                assert self.agent is not None
                start = self.ctx.clock.now()
                result = await run_agent_episode(
                    agent=self.agent, proxy=proxy, engine=engine, clock=self.ctx.clock, tok=self.tok, uid=sample.uid,
                    row=row_copy(self.rows[sample.fields["row"]]), seed=self.settings.seed * 1_000_003 + sample.uid,
                    settings=ro.recorder, timeout_s=ro.agent_timeout_s,
                    floor=self._floor,
                )
                self.ctx.tracer.span(track, f"agent episode {sample.uid}", start, self.ctx.clock.now())
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
                result = await run_guarded(self.ctx.swept, run_episode(
                    env=self.env_factory(self.ctx.clock), engine=engine, clock=self.ctx.swept, tok=self.tok, uid=sample.uid,
                    # (a copy sharing no mutable value: an env that pops a column, or appends to one,
                    # changed the row for its group's other episodes and every later epoch)
                    prompt_ids=prompt_ids, row=row_copy(self.rows[sample.fields["row"]]),
                    seed=self.settings.seed * 1_000_003 + sample.uid,
                    settings=ro.episode,
                    on_env_step=None if self.ctx.tracer.off else on_env_step, barrier=party, floor=self._floor,
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
            if self.ctx.store.complete(lease, {sample.uid: result.fields},
                                   versions=None if version is None else {sample.uid: version}):
                self.ctx.counters.produced += 1
        except (QueueClosed, KeyError):
            return  # the run is ending, or the sample was removed meanwhile
        finally:
            self.ctx.keeper.drop(lease)
            slots.release()

    def _count_episode(self, error: str | None, key: str) -> None:
        """Episodes share the reward function's fail-fast rule: if the first `reward.fail_fast_calls`
        episodes all failed (an environment or agent that never works), stop the run with the last
        error instead of logging failed samples until a timeout."""
        c = self.ctx.counters
        c.episodes += 1
        if error is not None:
            c.episode_failures += 1
            limit = self.settings.fail_fast_calls
            if c.episodes == limit and c.episode_failures == limit:
                raise UserError(f"{key}: the first {limit} episodes all failed (reward.fail_fast_calls); "
                                f"last error: {error}")
