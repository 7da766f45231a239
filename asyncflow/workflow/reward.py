"""The reward stage: one reward-function call per complete group. It waits for a group whose
responses are all written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

from asyncflow.clock import wait_detached
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.rewards import (
    PLAIN_CALLS_PER_HOP,
    PlainCalls,
    RewardFn,
    RewardOutcome,
    TrainerState,
    call_reward_fn_async,
    is_async_reward_fn,
)
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import Lease, QueueClosed, SampleView
from asyncflow.workflow.batch import by_group
from asyncflow.workflow.context import ABORTED, CANCELLED, StageContext
from asyncflow.workflow.flight import Children, Flight
from asyncflow.workflow.settings import RewardSettings

_CANCELLED_OUTCOME = RewardOutcome(None, CANCELLED)  # a group not scored: one of its generations was cancelled


class RewardWorker:
    """The reward loop: scores each complete group with the reward function."""

    def __init__(self, ctx: StageContext, settings: RewardSettings, *, reward_fn: RewardFn,
                 rows: list[dict[str, Any]], tok: Tokenizer, track: str = "reward") -> None:
        """`track`: the trace's row for its calls."""
        self.ctx = ctx
        self.track = track
        self.settings = settings
        self.reward_fn = reward_fn
        self.is_async = is_async_reward_fn(reward_fn)
        self.plain_calls = PlainCalls()  # a plain function's threads (started on first use)
        self.rows = rows
        self.tok = tok

    def close(self) -> None:
        self.plain_calls.close()

    async def run(self) -> None:
        """Score each group as soon as all its responses are written: one reward call per group.
        A plain function: the groups of one take share one hop to a worker thread (a hop costs ~135
        us on a 2-core VM, more than the rest of a sample's way through the store). An `async def`
        function is awaited on this loop, each take in its own task (up to `reward.concurrency`
        groups at once), so a slow judge does not hold the groups behind it."""
        if not self.is_async:
            while True:
                try:
                    lease = await self._take_reward(self.settings.n * PLAIN_CALLS_PER_HOP)
                except WaitTimeout:
                    continue
                except QueueClosed:
                    return
                await self._reward_take(lease)
            return
        flight = Flight(self.settings.concurrency, lambda start: None, self.ctx.clock)
        takes = Children()  # one task per take; the first that fails stops this worker with its error

        def done(groups: int, task: asyncio.Task[None]) -> None:
            for _ in range(groups):
                flight.release()

        try:
            while True:
                free = await flight.free()
                try:
                    lease = await self._take_reward(self.settings.n * min(8, free))
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
        return await self.ctx.store.take("reward", max_samples, timeout=self.settings.step_timeout_s,
                                     fields_extra=["row", "finish_reason", "token_versions"])

    async def _reward_take(self, lease: Lease) -> None:
        """Score the groups of one reward lease and write their rewards (or errors)."""
        groups = by_group(lease.samples)
        writes: dict[int, dict[str, Any]] = {}
        live = []
        for i, g in enumerate(groups):
            reasons = [s.fields.get("finish_reason") for s in g]
            if ABORTED in reasons:  # aborted stragglers (rollout.group_timeout_s) are not scored: no reward, no
                # error (the trainer logs them as `aborted`); their group is its finished samples
                writes.update({s.uid: {"reward": None, "reward_error": None} for s, r in zip(g, reasons, strict=True) if r == ABORTED})
                groups[i] = g = [s for s, r in zip(g, reasons, strict=True) if r != ABORTED]
            if g and "cancelled" not in reasons:  # a group with a cancelled sample is never trained: no reward call
                live.append(g)
        with self.ctx.keeper.holding(lease):
            scored = dict(zip((g[0].group_id for g in live), await self._score_groups(live), strict=True))
        for group in groups:
            if not group:  # (its every sample was a straggler)
                continue
            outcome = scored.get(group[0].group_id, _CANCELLED_OUTCOME)
            rewards, error, parts = outcome.rewards, outcome.error, outcome.parts
            for i, s in enumerate(group):
                write: dict[str, Any] = {"reward": None if rewards is None else rewards[i], "reward_error": error}
                if parts is not None:  # (several reward functions: each one's reward, for `reward/<name>`)
                    write["reward_parts"] = {name: values[i] for name, values in parts.items()}
                writes[s.uid] = write
        with contextlib.suppress(QueueClosed):  # (closed: the run is ending)
            self.ctx.store.complete(lease, writes)  # samples removed meanwhile are skipped

    def _reward_call(self, group: list[SampleView]) -> tuple[Any, ...]:
        """The arguments of `call_reward_fn` for one group."""
        row = self.rows[group[0].fields["row"]]
        key = self.settings.prompt_key
        # lists are copied, so a reward function cannot change what is stored; other (immutable)
        # sequences, such as a simulated engine's run-length ids, are passed as they are
        completions_ids = [r.copy() if isinstance(r, list) else r for r in (s.fields["response_ids"] for s in group)]
        completions = self.tok.completions(completions_ids, conversational=isinstance(row[key], list))
        columns = {c: [v] * len(group) for c, v in row.items() if c != key}
        return self.reward_fn, [row[key]] * len(group), completions, completions_ids, columns, self._trainer_state(group)

    def _trainer_state(self, group: list[SampleView]) -> TrainerState:
        """The group's `trainer_state`, from its samples' versions (this process may be a Ray
        reward actor, which does not see the trainer's): token versions never decrease along a
        response, so its last token's version is its newest."""
        oldest = min((s.version for s in group if s.version is not None), default=0)
        newest = max((s.fields["token_versions"][-1] for s in group if s.fields.get("token_versions")), default=oldest)
        return TrainerState(global_step=newest, step=newest, version=oldest, max_steps=self.settings.max_steps)

    async def _score_groups(self, groups: list[list[SampleView]]) -> list[RewardOutcome]:
        if not groups:
            return []
        calls = [self._reward_call(g) for g in groups]
        start = self.ctx.clock.now()
        ids = [g[0].group_id for g in groups]
        timeout = self.settings.timeout_s
        if self.is_async:
            async def one(call: tuple[Any, ...], gid: int) -> RewardOutcome:
                try:
                    return await wait_detached(self.ctx.swept, call_reward_fn_async(*call), timeout,
                                               f"reward function on group(s) [{gid}]")
                except WaitTimeout as exc:
                    return RewardOutcome(None, str(exc))

            if len(calls) == 1:
                outcomes = [await one(calls[0], ids[0])]
            else:
                outcomes = list(await asyncio.gather(*(one(c, g) for c, g in zip(calls, ids, strict=True))))
        else:
            outcomes = await self.plain_calls.score(calls, self.ctx.clock.wait_for, timeout,
                                                     f"reward function on group(s) {ids}")
        self.ctx.tracer.span(self.track, "reward", start, self.ctx.clock.now(), groups=ids)
        limit = self.settings.fail_fast_calls
        counters = self.ctx.counters
        for outcome in outcomes:
            counters.reward_calls += 1
            if outcome.error is not None:
                counters.reward_call_failures += 1
                if counters.reward_calls == limit and counters.reward_call_failures == limit:
                    # this take's samples are never completed: their errors are recorded here, once
                    self.ctx.samples.write([(s, None, "reward_error", o.error) for g, o in zip(groups, outcomes, strict=True)
                                       if o.error is not None for s in g])
                    raise UserError(f"reward.fn: the first {limit} reward calls all failed; last error: {outcome.error}")
        return outcomes
