"""The driver's proxies on the Ray actors: `RemoteEngine` (a rollout actor as an `InferenceEngine`
that survives its restarts), `RemoteTrainEngine` (the trainer actor) and `RemoteGate` (the feeder
actor's staleness gate)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import torch

from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, LossFn, TrainBatch, TrainEngine
from asyncflow.errors import RunFailed, TrainerDied, WaitTimeout
from asyncflow.runtime.ray_actors import POLL_S, READY_TIMEOUT_S
from asyncflow.runtime.ray_errors import actor_id, dead_actor_error, death_error, why_died
from asyncflow.runtime.ray_fsdp import RankDied
from asyncflow.runtime.ray_weights import StoredWeights, WeightChannel


class RemoteEngine(InferenceEngine):
    """The driver's handle on a `RolloutActor`: the `InferenceEngine` interface over Ray calls.

    Survives a restart of its actor (see `RayWorkers`): every publication is remembered (`latest`),
    also one the actor could not take; while the actor is down (`mark_down`) loads are skipped and
    requests wait; `restarted` loads the latest weights into the new process and lets requests through
    again. Loads are serialized and never replace a newer version with an older one. Holding `latest`
    keeps the newest weights in the object store until the next publication replaces them.
    """

    _CUMULATIVE = ("busy_s", "decode_steps", "decode_rows", "prefills", "prefill_rows")

    def __init__(self, handle: Any, capacity: int, timeout_s: float, name: str = "rollout actor",
                 version: int = 0) -> None:
        self.handle = handle
        self.name = name
        self.actor_id = actor_id(handle)
        self.version = version
        self._start_version = version  # what a (re)started process holds: the weights it was constructed from
        self._capacity = capacity
        self._timeout = timeout_s
        self.last_stats: dict[str, float] = {"busy_s": 0.0, "load": 0.0}
        self._base: dict[str, float] = {}  # cumulative stats of the actor's earlier (dead) processes
        self.latest: tuple[Any, int, Any] | None = None  # (weights ref, version, mode) of the newest publication
        self.down = False  # the actor died; the supervisor has not brought it back yet
        self.gone: str | None = None  # the actor is dead for good: why
        self.supervised = False  # a supervisor restarts the actor when it dies (while the run's stages run)
        # unsupervised (evaluations before and after the stages): what brings the actor back (`RayWorkers`)
        self.restart: Callable[[BaseException], Awaitable[None]] | None = None
        self._restarting: asyncio.Future[None] | None = None
        self.incarnation = 0  # restarts seen
        self._lock = asyncio.Lock()  # one weight load at a time

    @property
    def capacity(self) -> int:
        return self._capacity

    def _own(self, exc: BaseException) -> bool:
        """Whether a Ray actor error is about this engine's actor (not, e.g., the trainer that
        produced a weights reference)."""
        return str(getattr(exc, "actor_id", None)) == self.actor_id

    async def _until_up(self, what: str, after: int = -1) -> None:
        """Wait (bounded) until the actor is up, and restarted since incarnation `after` if given."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self.down or self.incarnation <= after:
            if self.gone is not None:
                raise RunFailed(self.gone)
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for {self.name} to come back "
                                  f"after it died, to {what}")
            await asyncio.sleep(POLL_S)

    async def generate(self, request: GenRequest) -> GenResult:
        """A request that meets a dead actor is sent again once the supervisor has restarted it."""
        import ray

        what = f"generate request {request.uid}"
        while True:
            await self._until_up(what)
            seen = self.incarnation
            # (a token callback cannot cross processes: stop strings are then cut from the result)
            ref = self.handle.generate.remote(replace(request, on_token=None) if request.on_token else request)
            try:
                result: GenResult = await asyncio.wait_for(ref, self._timeout)
                return result
            except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                # abandoned (timed out, or its caller cancelled): cancelling here does not reach the
                # actor's task, which would decode to its end for nobody
                with contextlib.suppress(Exception):
                    ray.cancel(ref)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for {self.name} to {what}") from None
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayActorError as exc:
                if not self._own(exc):
                    raise death_error(exc) from exc
                if not self.supervised:  # (no supervisor brings it back: this request does, once for all)
                    if self.restart is None:
                        raise death_error(exc) from exc
                    if self.incarnation == seen and (self._restarting is None or self._restarting.done()):
                        self._restarting = asyncio.ensure_future(self.restart(exc))
                        self._restarting.add_done_callback(retrieve)
                await self._until_up(what, after=seen)

    async def unless_down(self, ref: Any, what: str) -> Any:
        """The call's result; None if the actor dies (or is marked down) meanwhile."""
        import ray

        fut = asyncio.ensure_future(ref)
        deadline = time.monotonic() + self._timeout
        while not fut.done():
            if self.down:
                fut.add_done_callback(retrieve)
                return None
            if time.monotonic() > deadline:
                fut.add_done_callback(retrieve)
                raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for {self.name} to {what}")
            await asyncio.wait({fut}, timeout=POLL_S)
        try:
            return fut.result()
        except ray.exceptions.RayTaskError as exc:
            if dead_actor_error(exc) is not None:  # e.g. the trainer died before its weights were stored
                raise death_error(exc) from exc
            raise
        except ray.exceptions.RayActorError as exc:
            if self._own(exc):
                return None  # dead or restarting: the supervisor loads the latest weights when it is back
            raise death_error(exc) from exc

    async def load_weights(self, state: Any, version: int, mode: Any) -> float:
        """`state` is the trainer's publication (`asyncflow.runtime.ray_weights`: an object-store
        reference or a broadcast): the actor takes the weights itself, so the driver never holds them.
        Skipped (0 s) while the actor is dead or restarting, and for a version older than the one loaded."""
        if self.latest is None or version >= self.latest[1]:
            self.latest = (state, version, mode)
        async with self._lock:
            if self.down or version < self.version:
                return 0.0
            reply = await state.deliver(self, version, mode)
            if reply is None:
                return 0.0
            self.version = version
            self.last_stats = reply
            return float(reply["seconds"])

    def mark_down(self) -> None:
        """The supervisor saw the actor die: skip loads, hold requests until `restarted`."""
        self.down = True

    async def restarted(self) -> int | None:
        """The supervisor saw the actor come back (a new process at the weights it was constructed
        from: the base model, or a resumed run's checkpoint): keep the dead
        process's counters, load the latest published weights before anything else reaches it, and
        let requests through again. Returns the version loaded (None: nothing published yet)."""
        import ray

        async with self._lock:
            for k in self._CUMULATIVE:
                self._base[k] = self._base.get(k, 0.0) + float(self.last_stats.get(k, 0.0))
            self.last_stats = {"busy_s": 0.0, "load": 0.0}
            self.version = self._start_version
            loaded = None
            if self.latest is not None:
                state, version, mode = self.latest
                try:
                    reply = await asyncio.wait_for(self.handle.load_weights.remote(state.catch_up(), version, mode),
                                                   self._timeout)
                except asyncio.TimeoutError:
                    raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for the restarted {self.name} "
                                      f"to load policy version {version}") from None
                except ray.exceptions.RayActorError as exc:
                    if self._own(exc):
                        raise RunFailed(f"{self.name} died again while loading policy version {version} "
                                        f"after its restart ({why_died(exc)})") from exc
                    raise death_error(exc) from exc
                self.last_stats = reply
                if not reply.get("skipped"):  # (skipped: a newer version is on its way to it)
                    self.version = loaded = version
            self.down = False
            self.incarnation += 1
        return loaded

    def cancel_older_than(self, min_version: int) -> int:
        """Sent without waiting (the cancelled samples reach the trainer, which counts them); not
        sent while the actor is down (a restarted engine holds no requests)."""
        if self.down or self.gone is not None:
            return 0
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            _forget(self.handle.cancel_older_than.remote(min_version))
        return 0

    def load(self) -> int:
        return int(self.last_stats["load"])

    def busy_seconds(self) -> float:
        """As of the last weight load (the workflow reads it right after a publication), over all
        the actor's processes."""
        return self._base.get("busy_s", 0.0) + float(self.last_stats["busy_s"])

    def stats(self) -> dict[str, float]:
        """As of the last weight load, over all the actor's processes."""
        keys = ("decode_steps", "decode_rows", "prefills", "prefill_rows")
        return {k: self._base.get(k, 0.0) + float(self.last_stats.get(k, 0.0))
                for k in keys if k in self.last_stats or k in self._base}

    async def close(self) -> None:
        import ray

        if self.down or self.gone is not None:
            return
        with contextlib.suppress(ray.exceptions.RayActorError, asyncio.TimeoutError):
            await asyncio.wait_for(self.handle.close_engine.remote(), 30)


def retrieve(fut: Any) -> None:
    """Done callback: take a future's exception so nothing reports it as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _forget(ref: Any) -> None:
    """A fire-and-forget call's error is retrieved (and dropped) instead of logged as unhandled."""
    ref.future().add_done_callback(retrieve)


class RemoteTrainEngine(TrainEngine):
    """The driver's handle on the `TrainerActor`.

    `steps` (train steps done) and `exported` (weight exports = policy versions) count from this
    engine's start, for the message of `TrainerDied`; a resumed run may set them to where it resumed.
    """

    def __init__(self, handle: Any, timeout_s: float, name: str = "trainer") -> None:
        self.handle = handle
        self.timeout = timeout_s
        self.name = name
        self.steps = 0
        self.exported = 0
        self.channel: WeightChannel | None = None  # set by the runtime for `runtime.weight_sync: collective`
        self._export_bytes: Any = None  # the size of the latest export, asked for with it (`export_weights`)
        self._next_export: Any = None  # the export queued behind the last train step (`train_step`)
        self.delta = False  # the trainer publishes deltas (`runtime.weight_sync_delta`): set by the runtime

    def died(self, exc: BaseException, what: str) -> TrainerDied:
        """The error for the trainer actor's death, found while waiting for it to do `what`."""
        if what == "export its weights":  # seen by a rollout actor fetching them
            step, version = self.steps, self.exported - 1
            when = f"after train step {step}, while the rollout actors fetched its weights of policy version {version + 1}"
        elif what == "save the model":
            step, version = self.steps, self.exported
            when = f"after train step {step}, while it saved the model"
        else:
            step, version = self.steps + 1, self.exported
            when = f"in train step {step}, while the driver waited for it to {what}"
        return TrainerDied(f"the trainer actor ({self.name}) died {when}; the last policy version it exported is "
                           f"{version} ({why_died(exc)})", step=step, version=version)

    def _get(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise WaitTimeout(f"timed out after {self.timeout:.0f} s waiting for the trainer actor to {what}") from None
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, RankDied):  # an FSDP rank actor died: the trainer cannot go on without it
                raise self.died(exc.cause, what) from exc
            raise  # an error in the trainer's code: its traceback is what helps
        except ray.exceptions.RayActorError as exc:
            raise self.died(exc, what) from exc

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self._get(self.handle.logprobs.remote(batch, temperature), "compute log-probs")  # type: ignore[no-any-return]

    def export_bytes(self) -> int | None:
        ref, self._export_bytes = self._export_bytes, None
        if ref is None:
            ref = self.handle.export_bytes.remote()
        return self._get(ref, "report the size of its export")  # type: ignore[no-any-return]

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self._get(self.handle.reference_logprobs.remote(batch, temperature), "compute reference log-probs")  # type: ignore[no-any-return]

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, *,
                   proximal: bool = False) -> dict[str, float]:
        ref = self.handle.train_step.remote(batch, loss_fn, temperature, proximal)
        if self.channel is None:
            # every step is published: its export, queued behind it now, runs as the step ends, not a
            # round trip to the driver later with the trainer idle (`export_ref` hands it out)
            if self._next_export is not None:
                _forget(self._next_export)
            self._next_export = self.handle.export_weights.remote()
        metrics = self._get(ref, "train a step")
        self.steps += 1
        return metrics  # type: ignore[no-any-return]

    @property
    def export_blocks(self) -> bool:  # type: ignore[override]
        """Only a broadcast's publication may block (it rebuilds the weight group when members changed)."""
        return self.channel is not None

    def export_weights(self) -> Any:
        """The new weights' publication (`asyncflow.runtime.ray_weights`): a broadcast over the
        channel (`runtime.weight_sync: collective`), else an object-store reference engines fetch."""
        self.exported += 1
        if self.channel is not None:
            publication: Any = self.channel.publish(self.exported)
        else:
            publication = self.stored_weights()
        # asked for now, queued behind the export in the trainer actor: read after the loads, it is
        # there already (asked for then, it was one more round trip per step with the trainer idle)
        if self._export_bytes is not None:  # (never read: its error, if any, is not logged as unhandled)
            _forget(self._export_bytes)
        self._export_bytes = self.handle.export_bytes.remote()
        return publication

    def stored_weights(self) -> StoredWeights:
        """The current weights in the object store, not published as a new version (a LoRA resume
        loads the checkpoint's adapter into the engines with them)."""
        return StoredWeights(self.export_ref(), self.full_ref if self.delta else None)

    def full_ref(self, seq: int | None) -> Any:
        """A reference to the full weights of the trainer's delta publication `seq` (None: its last),
        or to None where a newer one was published since (`TrainerActor.published_full`)."""
        return self.handle.published_full.remote(seq)

    # the sender's side of `WeightChannel` (calls return object references; the channel waits)

    def export_ref(self) -> Any:
        """A reference to the trainer's current weights in the object store (the export queued
        behind the last train step, if it has not been handed out)."""
        ref, self._next_export = self._next_export, None
        return ref if ref is not None else self.handle.export_weights.remote()

    def weights_address(self) -> tuple[str, int]:
        return self._get(self.handle.weights_address.remote(), "open a port for the weight group")  # type: ignore[no-any-return]

    def join_weights(self, host: str, port: int, size: int, epoch: int, backend: str) -> Any:
        return self.handle.join_weights.remote(host, port, 0, size, epoch, backend)

    def send_weights(self, version: int) -> Any:
        return self.handle.send_weights.remote(version)

    def published(self, version: int) -> Any:
        return self.handle.published.remote(version)

    def save(self, path: str, *, with_optimizer: bool) -> None:
        self._get(self.handle.save.remote(path, with_optimizer), "save the model")

    def load_optimizer(self, path: str) -> None:
        self._get(self.handle.load_optimizer.remote(path), "load the optimizer state")


class RemoteGate:
    """The trainer loop's view of the feeder actor's `StalenessGate` (updates sent without waiting;
    the gate's `publish` never goes back, so their order does not matter)."""

    def __init__(self, handle: Any, max_staleness: int) -> None:
        self.handle = handle
        self.max_staleness = max_staleness
        self.closed = False

    def drop(self, groups: int = 1) -> None:
        self.handle.drop.remote(groups)

    def publish(self, version: int) -> None:
        self.handle.publish.remote(version)

    def min_version(self, trainer_version: int) -> int:
        return trainer_version - self.max_staleness

    def close(self) -> None:
        self.closed = True
        self.handle.close_gate.remote()
