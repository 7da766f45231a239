"""The trainer stage: takes `batch_size / n` whole groups within the staleness bound, has its `Learner`
(workflow/learner.py) step the optimizer on them and publishes the new weights to every engine.
It waits for enough rewarded groups; a publication frees the feeder's credit for the next step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncflow.compute_thread import in_own_thread
from asyncflow.engines.base import InferenceEngine, TrainEngine, changed_share, state_bytes
from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import Lease, SampleView
from asyncflow.workflow.batch import (
    TRAIN_FIELDS,
    all_equal,
    batch_metrics,
    by_group,
)
from asyncflow.workflow.context import ABORTED, CANCELLED, STRAGGLER, LoggedSample, StageContext
from asyncflow.workflow.gate import GateControl
from asyncflow.workflow.learner import Learner
from asyncflow.workflow.settings import TrainerSettings

Batch = tuple[list[list[SampleView]], list[Lease], int]  # groups, their leases, groups filtered meanwhile


@dataclass
class StepResult:
    """What the trainer hands to its `on_step` hook (the run's logger) after a step's publication."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class BatchWait:
    """When the trainer began to wait for a batch: its deadline counts from then. None while the
    batch is collected ahead, during the step before."""

    since: float | None = None


class Trainer:
    """The trainer loop: batches, steps (`learner`), publications (`publish`)."""

    def __init__(self, ctx: StageContext, settings: TrainerSettings, *, learner: Learner, engine: TrainEngine,
                 engines: Sequence[InferenceEngine], gate: GateControl, collect_ahead: bool,
                 on_step: Callable[[StepResult], Awaitable[None]] | None = None,
                 on_trained: Callable[[], None] | None = None) -> None:
        """`engine`: the train engine the weights are exported from; `engines`: the inference engines
        they are published to. `collect_ahead`: collect the next step's batch during a train step (the
        runtime's choice: see `run`). `on_trained`: after a step's optimizer steps and ack, before its
        publication; `on_step`: after its publication."""
        self.ctx = ctx
        self.settings = settings
        self.learner = learner
        self.engine = engine
        self.engines = list(engines)
        self.gate = gate
        self.collect_ahead = collect_ahead
        self.on_step = on_step
        self.on_trained = on_trained
        self.first_step = 1
        self.last_step = 0  # the last step trained (max_steps, or earlier after `stop_early`)
        self.training_step = 0  # the step being collected or trained (the last after `stop_early`)
        self.stopping = False

    @property
    def version(self) -> int:
        """The trainer's policy version (the version board's)."""
        return self.ctx.board.version

    def restore(self, step: int, version: int) -> None:
        """Resume the loop after `step` (weights at `version` are loaded by the caller)."""
        self.first_step = step + 1
        self.last_step = step
        self.ctx.board.version = version

    def stop_early(self) -> int:
        """End the run after the step being collected or trained (`eval.patience`: the eval curve has
        flattened); returns that step, the run's last."""
        self.stopping = True
        return self.training_step

    async def run(self) -> None:
        """Assemble batches of whole groups within the staleness bound, train, publish; until
        `train.max_steps`, or the step being collected or trained when `stop_early()` was called.

        With `collect_ahead` (the store and engines in other processes: Ray), two round trips overlap
        a train step: the next step's batch is collected during it, within the floor of the version it publishes,
        and the previous step's weights load into the engines during it, its row and hooks
        (`on_step`) following the loads. A step whose checkpoint is due, or the last, waits for its
        own publication and hooks (a checkpoint is taken with the trainer idle and every engine on the
        saved version). Without it (in process: no round trip to hide) the trainer publishes, then asks
        for its next batch, which is then the oldest groups ready once the new version is live (a
        batch asked for earlier holds newer groups and leaves more old ones to go stale)."""
        ahead: tuple[asyncio.Task[Batch], BatchWait] | None = None
        publishing: asyncio.Task[None] | None = None
        try:
            for step in range(self.first_step, self.settings.max_steps + 1):
                self.training_step = step
                start = self.ctx.clock.now()
                if ahead is None:  # (no collecting ahead, or this is the first step: no publication runs)
                    batch = await self._collect_batch(self.version, BatchWait(start))
                else:
                    ahead[1].since = start
                    batch = await self._unless_failed(ahead[0], publishing)
                    ahead = None
                self.ctx.tracer.span("trainer", "wait for batch", start, self.ctx.clock.now())
                if step < self.settings.max_steps and self.collect_ahead:
                    wait = BatchWait()
                    ahead = (asyncio.create_task(self._collect_batch(self.version + 1, wait), name="trainer: next batch"),
                             wait)
                publishing = await self._train_on(step, *batch, after=publishing)
                self.last_step = step
                every = self.settings.checkpoint_every
                if not self.collect_ahead or self.stopping or step == self.settings.max_steps or (
                        every > 0 and step % every == 0):
                    await publishing
                    publishing = None
                if self.stopping:
                    break
        except BaseException:
            if publishing is not None:  # (a load that hangs must not hold the failure up)
                publishing.cancel()
                await asyncio.wait([publishing])
                if not publishing.cancelled():  # (its own error, if any, is this one's consequence or beside it)
                    publishing.exception()
            raise
        finally:
            if ahead is not None:
                await self._give_back(ahead[0])

    @staticmethod
    async def _unless_failed(collecting: asyncio.Task[Batch], publishing: asyncio.Task[None] | None) -> Batch:
        """The batch; a publication that fails meanwhile ends the wait with its error (in sync mode
        the batch cannot come without it)."""
        if publishing is not None and not publishing.done():
            await asyncio.wait([collecting, publishing], return_when=asyncio.FIRST_COMPLETED)
        if publishing is not None and publishing.done():
            publishing.result()  # (raises its error)
        return await collecting

    async def _give_back(self, collecting: asyncio.Task[Batch]) -> None:
        """Return the batch collected for a step that will not run (an early stop, a failure): its
        samples go back to the store for a resumed run, not held until their leases expire."""
        collecting.cancel()  # (a collection cancelled midway gives back what it took itself)
        await asyncio.wait([collecting])
        if collecting.cancelled() or collecting.exception() is not None:
            return
        self._release(collecting.result()[1])

    def _release(self, leases: list[Lease]) -> None:
        for lease in leases:
            self.ctx.keeper.drop(lease)
            self.ctx.store.release(lease)

    async def _collect_batch(self, version: int, wait: BatchWait) -> Batch:
        """Whole groups for the step that trains from `version`, their leases, and how many groups
        the filter dropped meanwhile. The deadline counts from `wait.since`, when the trainer began
        to wait for this batch (None while it still trains the step before)."""
        leases: list[Lease] = []
        try:
            return await self._collect_into(leases, version, wait)
        except BaseException:  # (cancelled, or the run fails: what was taken goes back at once)
            self._release(leases)
            raise

    async def _collect_into(self, leases: list[Lease], version: int, wait: BatchWait) -> Batch:
        groups: list[list[SampleView]] = []
        filtered = 0
        failed = 0  # groups whose every reward call failed, in this batch's wait
        # one deadline for the whole batch, not per take: while every group fails (a verifier that went
        # down after the run's first calls) each take succeeds, and the batch never filled nor ended
        limit = self.settings.step_timeout_s
        while len(groups) < self.settings.groups_per_step:
            left = limit if wait.since is None else wait.since + limit - self.ctx.clock.now()
            try:
                if left <= 0:
                    raise WaitTimeout("the batch's deadline passed")
                # the rest of the batch in one lease, woken once when all of it is ready: not a wake-up,
                # a lease and an ack per group (PIPE: ~10% of a sample's scheduling CPU)
                need = (self.settings.groups_per_step - len(groups)) * self.settings.n  # (a partial group is one)
                lease = await self.ctx.store.take(
                    "train",
                    max(self.settings.n, need),
                    min_samples=max(1, need),
                    timeout=left,
                    min_version=self.gate.min_version(version),
                    fields_extra=TRAIN_FIELDS,
                )
            except WaitTimeout:  # name the setting that bounds this wait, and what the wait saw
                if wait.since is None or self.ctx.clock.now() < wait.since + limit:
                    continue  # (a take begun before the trainer waited: its deadline is later)
                raise WaitTimeout(
                    f"timed out after {limit:g} s waiting for a training batch from stage 'train': {len(groups)} of "
                    f"{self.settings.groups_per_step} groups; meanwhile {failed} groups failed every reward call and "
                    f"{filtered} were filtered (workflow.step_timeout_s: the trainer's wait for a batch)") from None
            self.ctx.keeper.hold(lease)
            leases.append(lease)
            self._drop_stale(lease, version)
            for group in by_group(lease.samples):
                reasons = [s.fields.get("finish_reason") for s in group]
                if "cancelled" in reasons:
                    self._drop_groups(group, "dropped with its group: a sample of the group was cancelled")
                    continue
                if ABORTED in reasons:
                    group = self._without_stragglers(group, reasons)
                    if not group:
                        continue
                if all(s.fields["reward_error"] is not None for s in group):
                    failed += 1
                    self.ctx.counters.reward_errors += len(group)
                    self.ctx.samples.write([(s, None, "reward_error", s.fields["reward_error"]) for s in group])
                    self._discard(group)
                    continue
                if self.settings.filter_groups and all_equal(group):
                    if filtered < self.settings.filter_budget:
                        filtered += 1
                        msg = "filtered: all rewards in the group are equal (DAPO dynamic sampling, before over-long shaping)"
                        # a sample whose reward failed (an episode's environment) keeps its own status and error
                        logged: list[LoggedSample] = [
                            (s, None, "filtered", msg) if s.fields["reward_error"] is None
                            else (s, None, "reward_error", s.fields["reward_error"]) for s in group]
                        failures = sum(1 for item in logged if item[2] == "reward_error")
                        self.ctx.counters.filtered += len(group) - failures
                        self.ctx.counters.reward_errors += failures
                        self.ctx.samples.write(logged)
                        self._discard(group)
                        continue
                    self.ctx.counters.filter_overflow += 1
                groups.append(group)
        return groups, leases, filtered

    def _without_stragglers(self, group: list[SampleView], reasons: list[Any]) -> list[SampleView]:
        """The group less its aborted stragglers (rollout.group_timeout_s; `reasons`: the samples'
        finish reasons), which are logged as `aborted` and leave the store now (the group's slot
        stays: it trains); [] when fewer than `group_min_samples` finished, the whole group then
        dropped and its slot freed."""
        present = [s for s, r in zip(group, reasons, strict=True) if r != ABORTED]
        least = self.settings.group_min_samples
        if len(present) < least:
            self._drop_groups(group, f"aborted with its group: {len(present)} of its samples finished by "
                                     f"rollout.group_timeout_s, fewer than rollout.group_min_samples={least}",
                              status="aborted")
            return []
        stragglers = [s for s, r in zip(group, reasons, strict=True) if r == ABORTED]
        self.ctx.counters.aborted += len(stragglers)
        self.ctx.counters.stragglers_aborted += len(stragglers)
        self.ctx.samples.write([(s, None, "aborted", STRAGGLER) for s in stragglers])
        # (the lease's ack or release skips them; the store then offers the rest as the whole group)
        self.ctx.store.remove([s.uid for s in stragglers])
        return present

    def _drop_stale(self, lease: Lease, version: int) -> None:
        """Drop groups below the version floor, freeing their admission slots. A sample whose
        generation was cancelled is logged as `cancelled`, the rest of its group as `dropped_stale`."""
        if not lease.expired:
            return
        self._drop_groups(lease.expired, f"older than max_staleness={self.settings.max_staleness} at trainer version {version}")

    def _drop_groups(self, samples: list[SampleView], msg: str, status: str = "dropped_stale") -> None:
        """Log whole groups as never trained (`cancelled` samples and aborted stragglers as such, the
        rest with `status`: `dropped_stale` or `aborted`) and free their admission slots."""
        logged: list[LoggedSample] = []
        c = self.ctx.counters
        for s in samples:
            reason = s.fields.get("finish_reason")
            if reason == "cancelled":
                c.cancelled += 1
                logged.append((s, None, "cancelled", CANCELLED))
            elif reason == ABORTED:
                c.aborted += 1
                c.stragglers_aborted += 1
                logged.append((s, None, "aborted", STRAGGLER))
            elif status == "aborted":
                c.aborted += 1
                logged.append((s, None, "aborted", msg))
            else:
                c.dropped_stale += 1
                logged.append((s, None, "dropped_stale", msg))
        self.ctx.samples.write(logged)
        self._discard(samples)

    def _discard(self, samples: list[SampleView]) -> None:
        """Remove groups the trainer will not train from the store at once (their lease's ack skips
        them) and free their admission slots. Freeing the slot while the group still took store room
        until the step's ack let a dynamic-sampling filter fill the store with groups it had dropped:
        the feeder then blocked on a full store and the trainer waited for groups never admitted."""
        self.ctx.store.remove([s.uid for s in samples])
        self.gate.drop(len({s.group_id for s in samples}))

    def _ack(self, leases: list[Lease]) -> None:
        """The trained batch leaves the store."""
        for lease in leases:
            self.ctx.keeper.drop(lease)
            if not self.ctx.store.ack(lease, remove=True):  # (kept alive by the keeper: should not happen)
                self.ctx.store.remove([s.uid for s in (*lease.samples, *lease.expired)])  # never train them again

    async def _train_on(self, step: int, groups: list[list[SampleView]], leases: list[Lease], filtered: int = 0, *,
                        after: asyncio.Task[None] | None = None) -> asyncio.Task[None]:
        """Train the step, log and ack its samples and export its weights; returns its publication
        (the engines' loads, then the step's row: `on_step`), running. `after`, the previous step's
        publication, ends before this step's samples are logged: each row counts its own step."""
        samples = [s for g in groups for s in g]
        self.ctx.counters.groups_partial += sum(1 for g in groups if len(g) < self.settings.n)
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
        t0 = self.ctx.clock.now()
        with self.ctx.tracer.timed("trainer", f"train step {step}", samples=len(samples)):
            metrics, tokens = await self.learner.step(samples, valid, rewards, self.version)
        busy = self.ctx.clock.now() - t0
        if after is not None:
            await after
        self.ctx.counters.train_busy_s += busy
        staleness, length = self._log_trained(samples, valid, rewards, self.version)
        self.ctx.counters.tokens += tokens
        # logged and acked before the publication, not after it: the samples are trained, and a hook's
        # store read (`on_trained`) then sees them gone and, with a store in another process, overlaps
        # the engines' loads
        self._ack(leases)
        if self.on_trained is not None:
            self.on_trained()
        start = self.ctx.clock.now()
        state = await self._export()
        n_valid = len(staleness)
        metrics.update(
            reward_mean=reward_sum / max(n_valid, 1),
            staleness_mean=sum(staleness) / max(n_valid, 1),
            staleness_max=float(max(staleness, default=0)),
        )
        after_sync = {"response_len_mean": length / len(samples), **batch_metrics(groups, valid, rewards, filtered)}
        return asyncio.create_task(self.publish(step, state, self.version, start, metrics, after_sync),
                                   name=f"trainer: publish v{self.version}")

    def _log_trained(self, samples: list[SampleView], valid: list[bool], rewards: list[float],
                     version: int) -> tuple[list[int], int]:
        """Log the batch's samples as trained by `version` (a reward_error sample trains with reward 0
        masked out: it is logged with none) and count them; returns the trained samples' staleness
        and the batch's response tokens."""
        staleness: list[int] = []
        logged: list[LoggedSample] = []
        length = 0
        for s, ok in zip(samples, valid, strict=True):
            f = s.fields
            length += len(f["response_ids"])
            if ok:
                staleness.append(version - f["behavior_version"])
                logged.append((s, version, "trained", None))
            else:
                logged.append((s, None, "reward_error", f["reward_error"]))
        self.ctx.samples.write(logged, rewards=[r if ok else None for r, ok in zip(rewards, valid, strict=True)])
        self.ctx.counters.trained += len(staleness)
        self.ctx.counters.reward_errors += len(samples) - len(staleness)
        return staleness, length

    async def _export(self) -> Any:
        """The trained weights, version v -> v+1 (the trainer's own version from now on)."""
        # in a worker thread, as the train step is: a full copy of the weights (an FSDP gather) held the
        # event loop for it, stalling rollout callbacks, new requests and evaluation (0.7 s at 156M
        # parameters on CPU); the trainer waits for it (the next step changes the weights it copies)
        engine = self.engine
        state = (await in_own_thread(engine.export_weights, threads=self.settings.threads) if engine.export_blocks
                 else engine.export_weights())
        self.ctx.board.advance()
        return state

    async def publish(self, step: int, state: Any, new_version: int, start: float, metrics: dict[str, Any],
                       after_sync: dict[str, Any]) -> None:
        """The publication of a trained step (a task the trainer starts): load `state`, the export of
        `new_version`, into every engine, then open that version to the feeder and hand the step's
        metrics (`weight_sync_s` from `start`, the export's; then `after_sync`) to `on_step`."""
        # requests that the new version's floor drops are cancelled before the load, not after it:
        # a `drain` load waits for what is running, and at max_staleness 0 (sync) everything running
        # is below the floor, so redundant stragglers were waited for, then dropped (none cancelled)
        floor = self.gate.min_version(new_version)
        for e in self.engines:
            e.cancel_older_than(floor)
        await self.ctx.clock.wait_for(
            asyncio.gather(*(e.load_weights(state, new_version, self.settings.weight_update) for e in self.engines)),
            self.settings.step_timeout_s,
            f"weight sync of version {new_version}",
        )
        self.gate.publish(new_version)
        self.ctx.board.raise_floor(floor)
        for e in self.engines:  # (again: what started meanwhile from the old version, or an abort put back)
            e.cancel_older_than(floor)
        self.ctx.tracer.span("weight sync", f"v{new_version}", start, self.ctx.clock.now())
        metrics["weight_sync_s"] = self.ctx.clock.now() - start
        sent = state_bytes(state)
        if sent is None:  # (a Ray reference: the trainer actor knows the size; asked after the loads)
            sent = await asyncio.to_thread(self.engine.export_bytes)
        if sent is not None:
            metrics["weight_sync_bytes"] = float(sent)
        share = changed_share(state)
        if share is not None:
            metrics["weight_sync_changed_frac"] = share
        metrics.update(after_sync)
        if self.on_step is not None:
            await self.on_step(StepResult(step, new_version, metrics))
