"""The Ray runtime: every rollout worker, reward worker and the trainer is an actor in its own process.

```
 FeederActor (feeder + staleness gate) ── put prompts ──┐    placement group (PACK by default)
 driver (trainer loop, eval) ── publish/drop ─► gate    ▼
   │                             StoreController actor ◄──── take/complete ──── RolloutActor i
   │ take batches ◄───────────  (metadata; data in        ◄─ take/write ───── RewardActor j
   │                             Ray's object store)
   │ train_step(batch) ───────► TrainerActor ── export_weights() ─► object store (once per version)
   └ load_weights(ref, v, mode) ─► every RolloutActor (fetches the ref itself; drain | swap | abort)
```

The workflow code is the same as in process: the feeder actor runs a `Feeder` with the
staleness gate, the driver runs the `Trainer` (talking to that gate through `RemoteGate`);
each rollout actor runs a `RolloutWorker` on its own engine and each
reward actor a `RewardWorker`, all against one `RayTransferQueue`. Per-sample traffic
(take a prompt, write a response, score a group) goes between the actors and the store controller,
never through the driver. The trainer's weights go into the object store once per version as the
return value of `export_weights`; the driver only passes the reference on, and each rollout actor
fetches it (on GPUs the same interface leaves room for an NCCL broadcast).

With `runtime.colocate`, rollout actor 0 is also the store controller, the feeder and the reward
workers (`ray_hub.HubActor`, named as the store): its engine's per-sample traffic stays in its
process; it is never restarted (it holds the store).

When an actor dies. Every actor of a run has a Ray name `asyncflow-<8 hex>-<role>` (`RayWorkers.prefix`;
roles `rollout-i`, `reward-j`, `trainer`, `feeder`, `store`). Rollout and reward actors are created
with `max_restarts=runtime.max_restarts` and the driver supervises their `run` calls: when one fails
because its actor died, the driver waits for Ray to restart the actor (a new process, same actor id),
has the store give back every lease the dead process held at once (not at the lease deadline), loads
the latest published weights into a rollout actor, and only then starts its loop again; one log line
per restart, counted in `RayWorkers.restarts`. Meanwhile a publication skips that engine (the driver
keeps the latest weights reference for it) and eval requests to it wait for it. A death with no
restart left, or of the trainer (`TrainerDied`), the feeder or the store controller, ends the run
with a `RunFailed` whose one-line message names the actor and why it died. Every wait on an actor is
bounded and says what it waited for.

Assumptions on a cluster: the model folder, the dataset and the run folder are on storage every node
sees (the actors read the model and append to `samples.jsonl` themselves), and the trace's spans use
each process's monotonic clock, which is one time line only within a machine.

This module is `RayWorkers` (start, supervise and restart, collect, shut down). The actor classes are
in `ray_actors`, the driver's proxies on them in `ray_remote`, the bundles and actor options in
`ray_placement`, and the messages about an actor's death in `ray_errors`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from asyncflow.config import Config, episodic
from asyncflow.config_schema import colocated
from asyncflow.engines.factory import loads_initial_weights
from asyncflow.errors import RunFailed, UserError, WaitTimeout
from asyncflow.rewards import absolute_reward_path
from asyncflow.runtime.base import RuntimeSetup
from asyncflow.runtime.ray_actors import (
    POLL_S,
    READY_TIMEOUT_S,
    FeederActor,
    Named,
    RewardActor,
    RolloutActor,
    TrainerActor,
    actor_device,
    plugin_cwd,
)
from asyncflow.runtime.ray_errors import (
    actor_death,
    actor_id,
    death_error,
    forget,
    one_line,
    remember,
    stage_error,
    who_died,
    why_died,
)
from asyncflow.runtime.ray_hub import hub_client, start_hub
from asyncflow.runtime.ray_placement import Placement, driver_node, reserve, train_ranks
from asyncflow.runtime.ray_remote import RemoteEngine, RemoteGate, RemoteTrainEngine, retrieve
from asyncflow.runtime.ray_weights import WeightChannel

# importable from here as before the split (the actor classes, proxies and helpers live in ray_*.py)
__all__ = [
    "READY_TIMEOUT_S", "STORE_CALL_TIMEOUT_S", "FeederActor", "RayWorkers", "RemoteEngine", "RemoteGate",
    "RemoteTrainEngine", "RewardActor", "RolloutActor", "TrainerActor", "actor_death", "actor_device",
]

STORE_CALL_TIMEOUT_S = 60.0  # one supervision call to the store controller
WATCH_GROUP = "watch"  # the trainer actor's second concurrency group: its stack dump, answered mid-call
STACKS_TIMEOUT_S = 30.0  # one actor's stack dump for the stall watchdog


@dataclass
class RayWorkers:
    """The `ray` runtime (`asyncflow.runtime.base.Runtime`): the actors of one run, and how to
    supervise and stop them."""

    absolute_folder: ClassVar[bool] = True  # actors of a joined cluster start in its raylet's directory
    # the actors open samples.jsonl to append: a fresh run claims its folder before they start
    opens_folder_first: ClassVar[bool] = True
    trainer_here: ClassVar[bool] = False  # the trainer is an actor: the driver keeps no device for it
    # a restarted actor is rebuilt from the folder the run started from: keep a resumed run's checkpoint
    restarts_from_start: ClassVar[bool] = True
    # the trainer collects its next batch during a train step: a store round trip to hide
    collect_ahead: ClassVar[bool] = True
    stages_elsewhere: ClassVar[bool] = True

    store: Any
    engines: list[RemoteEngine]
    trainer: RemoteTrainEngine
    rollout_actors: list[Any]
    reward_actors: list[Any]
    trainer_actor: Any
    feeder_actor: Any
    gate: RemoteGate
    placement_group: Any
    prefix: str = ""  # every actor's Ray name starts with it: asyncflow-<8 hex>
    max_restarts: int = 0
    log: Any = print
    runs: dict[str, Any] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)  # by stage ("rollout/0"): restarts so far
    pids: dict[str, int] = field(default_factory=dict)  # by stage: the actor's current process
    released: dict[str, int] = field(default_factory=dict)  # by stage: its actor's leases given back so far
    servers: Any = None  # the servers the run started (`ray_servers.Servers`; rollout.launch_servers)
    hub: Any = None  # runtime.colocate: rollout actor 0, also the store, the feeder and the reward workers
    hub_rewards: int = 0  # the reward loops the hub runs

    def __post_init__(self) -> None:
        # outside the stages' supervision (the step-0 and final evaluations), a request that meets
        # its dead rollout actor brings it back itself: such a death ended the run with max_restarts
        # left (in the final evaluation: a fully trained run without final/). The hub is never restarted.
        for i, engine in enumerate(self.engines):
            if self.rollout_actors[i] is not self.hub:
                engine.restart = functools.partial(self._restart, f"rollout/{i}", self.rollout_actors[i], engine)

    @classmethod
    def start(cls, cfg: Config, model_dir: Path, rows: list[dict[str, Any]], out: Path, reward_fn_path: str | list[str],
              threads: int, log: Any = print, version: int = 0) -> RayWorkers:
        """Start (or join) Ray, reserve a placement group, start the store and every actor. The policy's
        weights come from `model_dir` as `version` (a resumed run's checkpoint)."""
        from asyncflow.runtime.ray_init import ensure_ray

        rt = cfg.runtime
        n_reward = 0 if episodic(cfg) else rt.reward_workers  # episodes carry their reward
        colocate = colocated(cfg)
        reward_actors = 0 if colocate else n_reward  # (colocated: loops of the hub)
        need = rt.rollout_cpus * cfg.rollout.workers + rt.train_cpus * train_ranks(cfg) + rt.reward_cpus * reward_actors
        t0 = time.monotonic()
        ensure_ray(rt.address, num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
        place = reserve(cfg, reward_actors, prefix=f"asyncflow-{secrets.token_hex(4)}")
        prefix = place.prefix
        servers = None
        if cfg.rollout.launch_servers is not None:  # the rollout actors are built with their servers' URLs
            from asyncflow.runtime.ray_servers import start_servers

            servers = start_servers(cfg, place, str(model_dir), out, log)
            cfg = replace(cfg, rollout=replace(cfg.rollout, server_urls=servers.urls))
        try:
            setup = (str(model_dir), rows, str(out), reward_fn_path, threads, version)
            hub = start_hub(_absolute_paths(cfg), place, n_reward, *setup) if colocate else None
            store = _start_store(cfg, place) if hub is None else hub_client(hub)
            actors = _start_actors(cfg, place, store, reward_actors, *setup, hub=hub)
            timeout = cfg.workflow.step_timeout_s
            trainer = RemoteTrainEngine(actors.trainer, timeout, name=f"{prefix}-trainer")
            trainer.delta = cfg.runtime.weight_sync_delta
            _remember(actors, store, trainer, prefix)
            capacities, pids = _wait_ready(actors, store, place)
        except BaseException:
            if servers is not None:
                servers.stop()
            raise
        stages, w = actors.stages, cfg.rollout.workers
        engines = [RemoteEngine(a, int(c), timeout, name=f"the rollout/{i} actor ({prefix}-rollout-{i})", version=version)
                   for i, (a, c) in enumerate(zip(actors.rollout, capacities, strict=True))]
        if rt.weight_sync == "collective":
            trainer.channel = WeightChannel(trainer, engines, weight_backend(cfg), timeout, log)
        ranks = f" ({cfg.train.world_size} FSDP ranks)" if cfg.train.engine == "fsdp" else ""
        hosted = " (rollout/0 is also the store, the feeder and the reward workers)" if hub is not None else ""
        log(f"[asyncflow] ray: feeder, {w} rollout, 1 trainer{ranks}, {n_reward} reward actor(s) ready in "
            f"{time.monotonic() - t0:.1f} s (names {prefix}-*){hosted}")
        workers = cls(store, engines, trainer, actors.rollout, actors.reward, actors.trainer, actors.feeder,
                   RemoteGate(actors.feeder, cfg.staleness), place.group, prefix=prefix,
                   max_restarts=rt.max_restarts, log=log, restarts={s: 0 for s in stages},
                   pids=dict(zip(stages, map(int, pids), strict=True)), servers=servers,
                   hub=hub, hub_rewards=n_reward if hub is not None else 0)
        log("[asyncflow] ray: nodes: " + ", ".join(f"{a['role']}/{a['index']}@{str(a['node_id'])[:8]}"
                                                   for a in workers.actors()))
        return workers

    @classmethod
    async def launch(cls, setup: RuntimeSetup) -> RayWorkers:
        """`start` from a `RuntimeSetup`, with the trainer's counts at the setup's version."""
        workers = cls.start(setup.cfg, setup.policy_dir.resolve(), setup.rows, setup.out, setup.reward_fn_path,
                            setup.threads, log=setup.log, version=setup.version)
        try:
            if loads_initial_weights(setup.cfg):  # servers hold whatever they held: the trainer's weights first
                ref = workers.trainer.export_weights()
                await asyncio.gather(*(e.load_weights(ref, setup.version, "drain") for e in workers.engines))
        except BaseException:
            workers.shutdown()
            raise
        workers.trainer.steps, workers.trainer.exported = setup.steps, setup.version
        return workers

    def restore_feeder(self, pipeline: Any, next_group: int, version: int, admitted: int) -> None:
        """Resume the feeder actor's position and gate (before `stages`)."""
        import ray

        ray.get(self.feeder_actor.restore.remote(next_group, version, admitted), timeout=READY_TIMEOUT_S)

    def stages(self) -> dict[str, Any]:
        """Start the remote stage loops; awaitables by stage name for `Pipeline.run(remote=...)`.
        Rollout and reward stages restart their actor when it dies (`_supervise`)."""
        self.runs = {"feeder": self.feeder_actor.feed.remote()}
        stages: dict[str, Any] = {"feeder": _stage("feeder", self.runs["feeder"])}
        first = 0 if self.hub is None else 1
        stages.update({f"rollout/{i}": self._supervise("rollout", i) for i in range(first, len(self.rollout_actors))})
        stages.update({f"reward/{j}": self._supervise("reward", j) for j in range(len(self.reward_actors))})
        if self.hub is not None:  # its loops end the run when it dies: it holds the store
            self.runs["rollout/0"] = self.hub.run.remote()
            stages["rollout/0"] = _stage("rollout/0", self.runs["rollout/0"])
            for j in range(self.hub_rewards):
                self.runs[f"reward/{j}"] = self.hub.run_reward.remote(j)
                stages[f"reward/{j}"] = _stage(f"reward/{j}", self.runs[f"reward/{j}"])
        return stages

    @property
    def restarts_total(self) -> int:
        return sum(self.restarts.values())

    async def _supervise(self, kind: str, index: int) -> None:
        """Run one rollout or reward stage loop; when its actor dies, bring the restarted actor back
        into the run (`_restart`) and run the loop again."""
        import ray

        stage = f"{kind}/{index}"
        actor = (self.rollout_actors if kind == "rollout" else self.reward_actors)[index]
        engine = self.engines[index] if kind == "rollout" else None
        if engine is not None:
            engine.supervised = True
        try:
            while True:
                ref = actor.run.remote()
                self.runs[stage] = ref
                try:
                    await ref
                    return
                except ray.exceptions.RayTaskError as exc:  # first: a task error can also be a RayActorError
                    raise stage_error(stage, exc) from exc
                except ray.exceptions.RayActorError as exc:
                    # shielded: if the run ends meanwhile, the restart still completes (bounded), so
                    # the final evaluation finds the engine back, with the latest weights
                    restart = asyncio.ensure_future(self._restart(stage, actor, engine, exc))
                    restart.add_done_callback(retrieve)
                    await asyncio.shield(restart)
        finally:
            if engine is not None:
                engine.supervised = False

    async def _restart(self, stage: str, actor: Any, engine: RemoteEngine | None, exc: BaseException) -> None:
        """After `stage`'s actor died: wait for Ray's restart, give the dead process's leases back
        to the queue, load the latest weights into a rollout actor, log one line."""
        who = who_died(exc)
        if engine is not None:
            engine.mark_down()
        try:
            await self._bring_back(stage, actor, engine, exc, who)
        except BaseException as failed:
            if engine is not None:  # requests waiting for it fail with this
                engine.gone = str(failed) if isinstance(failed, (RunFailed, WaitTimeout)) else f"{who} died"
            raise

    async def _bring_back(self, stage: str, actor: Any, engine: RemoteEngine | None, exc: BaseException,
                          who: str) -> None:
        import ray

        t0 = time.monotonic()
        why = why_died(exc)
        used = self.restarts.get(stage, 0)
        if used >= self.max_restarts:
            if self.max_restarts == 0:
                raise RunFailed(f"{who} died ({why}); runtime.max_restarts=0 allows no restart")
            raise RunFailed(f"{who} died ({why}) after {used} restart(s); runtime.max_restarts={self.max_restarts} "
                            f"allows no more")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # the restarted process answers once its constructor (model load) is done
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for {who} to be ready again "
                                  f"after it died ({why})")
            try:
                pid = int(await asyncio.wait_for(actor.pid.remote(), left))
                break
            except asyncio.TimeoutError:
                continue
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(POLL_S)
            except ray.exceptions.RayActorError as again:
                raise RunFailed(f"{who} died ({why}) and could not be restarted ({why_died(again)})") from again
        if pid == self.pids.get(stage):
            raise RunFailed(f"lost contact with {who} ({why}), although its process did not restart")
        self.pids[stage] = pid
        # same actor id across restarts: the new process registers as the same owner at its first take,
        # so this must come before the loop runs again
        await self._store_call("release_owner", f"return the leases of {stage} to the queue", actor_id(actor))
        # counted per owner since its last restart: the store's owner watch often gives them back
        # first (within 2 s of the death), and a total read here before and after said 0
        total = int(await self._store_call("released_of", "report the leases it gave back", actor_id(actor)))
        returned, self.released[stage] = total - self.released.get(stage, 0), total
        loaded = await engine.restarted() if engine is not None else None
        self.restarts[stage] = used + 1
        weights = "" if engine is None else f"; loaded policy version {loaded or 0} before any request"
        self.log(f"[asyncflow] ray: {stage} died ({why}); restarted ({used + 1} of {self.max_restarts}) in "
                 f"{time.monotonic() - t0:.1f} s; {int(returned)} lease(s) returned to the queue{weights}")

    async def _store_call(self, method: str, what: str, *args: Any) -> Any:
        import ray

        try:
            return await asyncio.wait_for(getattr(self.store.handle, method).remote(*args), STORE_CALL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise WaitTimeout(f"timed out after {STORE_CALL_TIMEOUT_S:.0f} s waiting for the store controller "
                              f"to {what}") from None
        except ray.exceptions.RayTaskError as exc:
            raise RunFailed(f"the store controller failed to {what}: {type(exc.cause).__name__}: "
                            f"{one_line(str(exc.cause))}") from exc
        except ray.exceptions.RayActorError as exc:
            raise death_error(exc) from exc

    def collect(self, tracer: Any, counters: Any) -> None:
        """Merge the actors' trace spans and counters into the driver's (a restarted actor's spans
        and counts start again with its new process)."""
        import ray

        stages = [f"rollout/{i}" for i in range(len(self.rollout_actors))]
        stages += [f"reward/{j}" for j in range(len(self.reward_actors))]
        for stage, actor in zip(stages, [*self.rollout_actors, *self.reward_actors], strict=True):
            try:
                for track, name, start, end, args in ray.get(actor.spans.remote(), timeout=60):
                    tracer.span(track, name, start, end, **args)
            except ray.exceptions.RayError as exc:
                why = "no answer within 60 s" if isinstance(exc, ray.exceptions.GetTimeoutError) else type(exc).__name__
                self.log(f"[asyncflow] ray: the trace spans of {stage} are missing ({why})")
        try:
            calls = [a.stats.remote() for a in self.reward_actors] if self.hub is None else [self.hub.reward_stats.remote()]
            rstats = ray.get(calls, timeout=60)
            counters.reward_calls = int(sum(s["reward_calls"] for s in rstats))
            counters.reward_call_failures = int(sum(s["reward_call_failures"] for s in rstats))
        except ray.exceptions.RayError as exc:
            self.log(f"[asyncflow] ray: the reward actors' call counts are missing ({type(exc).__name__})")

    @property
    def remote_stacks(self) -> Any:
        """Every actor's stack dump, for the stall watchdog (`actor_stacks`)."""
        return self.actor_stacks

    async def actor_stacks(self) -> dict[str, str]:
        """Each actor's threads and asyncio tasks by its stage name, asked of all at once; an actor
        that does not answer within `STACKS_TIMEOUT_S` (busy, or its event loop blocked) says so."""
        named = [(f"rollout/{i}", a) for i, a in enumerate(self.rollout_actors)]
        named += [(f"reward/{j}", a) for j, a in enumerate(self.reward_actors)]
        named += [("trainer", self.trainer_actor), ("feeder", self.feeder_actor), ("store", self.store.handle)]
        distinct = [(name, a) for k, (name, a) in enumerate(named) if all(a is not b for _, b in named[:k])]

        async def one(actor: Any) -> str:
            # (the trainer's calls run one at a time: its dump goes in a group of its own, beside a hung one)
            call = actor.stacks.options(concurrency_group=WATCH_GROUP) if actor is self.trainer_actor else actor.stacks
            try:
                return str(await asyncio.wait_for(call.remote(), STACKS_TIMEOUT_S))
            except asyncio.TimeoutError:
                return f"(no answer within {STACKS_TIMEOUT_S:.0f} s: the actor is busy or its event loop is blocked)\n"
            except Exception as exc:  # (a dead actor: its death is the run's error, not this dump's)
                return f"(no stacks: {type(exc).__name__}: {one_line(str(exc))})\n"

        texts = await asyncio.gather(*(one(a) for _, a in distinct))
        return {name: text for (name, _), text in zip(distinct, texts, strict=True)}

    def row_fields(self) -> dict[str, float]:
        return {"restarts": self.restarts_total}

    def summary(self) -> dict[str, Any]:
        """Restarts by stage, where each actor runs, and how the weights travelled (`summary.json`)."""
        out: dict[str, Any] = {"restarts": {k: v for k, v in self.restarts.items() if v}, "actors": self.actors()}
        channel = self.trainer.channel
        out["weight_sync"] = {"path": "object_store"} if channel is None else {
            "path": "collective", "backend": channel.backend, "groups_built": channel.epoch,
            "broadcast": channel.delivered, "from_object_store": channel.fallbacks}
        return out

    def actors(self) -> list[dict[str, Any]]:
        """Where each actor runs now: role, index, node id, process id; one entry per actor. The
        colocated hub is rollout 0's entry, whose `hosts` names the other roles its process plays."""
        import ray

        named = [("rollout", i, a) for i, a in enumerate(self.rollout_actors)]
        named += [("reward", j, a) for j, a in enumerate(self.reward_actors)]
        if self.hub is None:
            named += [("feeder", 0, self.feeder_actor), ("store", 0, self.store.handle)]
        out = []
        for role, index, actor in named:
            try:
                spot = ray.get(actor.where.remote(), timeout=STORE_CALL_TIMEOUT_S)
            except ray.exceptions.RayError as exc:
                spot = {"node_id": None, "pid": None, "error": type(exc).__name__}
            out.append({"role": role, "index": index, **spot})
            if actor is self.hub:
                out[-1]["hosts"] = ["store", "feeder", *(f"reward/{j}" for j in range(self.hub_rewards))]
        try:  # (the trainer's ranks, with train.engine: fsdp)
            out += ray.get(self.trainer_actor.placement.remote(), timeout=STORE_CALL_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            out.append({"role": "trainer", "index": 0, "node_id": None, "pid": None, "error": type(exc).__name__})
        if self.servers is not None:  # (pid: the server process; its actor's is actor_pid)
            out += [{"role": "server", **s} for s in self.servers.info()]
        return out

    def shutdown(self) -> None:
        """Kill every actor and free the placement group (Ray itself stays up for the caller)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in [*self.rollout_actors, *self.reward_actors, self.trainer_actor, self.feeder_actor, self.store.handle]:
            forget(a)
        for a in _distinct([*self.rollout_actors, *self.reward_actors, self.trainer_actor, self.feeder_actor],
                           but=self.store.handle):
            ray.kill(a)
        if self.servers is not None:  # (their process groups killed first: a bare ray.kill could orphan them)
            self.servers.stop()
        self.store.kill()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


@dataclass
class _Actors:
    """The worker actors `RayWorkers.start` started (the store controller aside)."""

    rollout: list[Any]
    reward: list[Any]
    trainer: Any
    feeder: Any

    @property
    def stages(self) -> list[str]:
        """The restartable actors' stage names: "rollout/i", then "reward/j"."""
        return [f"rollout/{i}" for i in range(len(self.rollout))] + [
            f"reward/{j}" for j in range(len(self.reward))]


def _start_store(cfg: Config, place: Placement) -> Any:
    """The store controller actor, wrapped in its client; on a timeout the placement group is freed."""
    import ray

    from asyncflow.transfer_queue.ray_store import RayTransferQueue
    from asyncflow.workflow.settings import store_capacity

    try:
        return RayTransferQueue.create(store_capacity(cfg), cfg.workflow.lease_timeout_s,
                                       name=f"{place.prefix}-store", scheduling_strategy=driver_node())
    except ray.exceptions.GetTimeoutError:
        place.remove()
        raise WaitTimeout("timed out after 120 s waiting for the store controller actor to start") from None


def _absolute_paths(cfg: Config) -> Config:
    """`rollout.sync_dir` and the files `rollout.env` / `rollout.agent` name made absolute: the actors
    use them relative to the driver, not to their own working directory."""
    r = cfg.rollout
    sync_dir = None if r.sync_dir is None else str(Path(r.sync_dir).resolve())
    env, agent = (None if spec is None else absolute_reward_path(spec) for spec in (r.env, r.agent))
    return replace(cfg, rollout=replace(r, sync_dir=sync_dir, env=env, agent=agent))


def _distinct(actors: list[Any], but: Any = None) -> list[Any]:
    """Each actor once (the hub is rollout 0 and the feeder), without `but`."""
    out: list[Any] = []
    for a in actors:
        if a is not but and all(a is not b for b in out):
            out.append(a)
    return out


def _start_actors(cfg: Config, place: Placement, store: Any, n_reward: int, model_dir: str,
                  rows: list[dict[str, Any]], out: str, reward_fn_path: str | list[str], threads: int, version: int,
                  hub: Any = None) -> _Actors:
    """Create the feeder, rollout, trainer and reward actors (in that order; without waiting for them).
    With a `hub` (`runtime.colocate`) it is the feeder and rollout actor 0, and `n_reward` is 0."""
    import ray

    prefix, opts = place.prefix, place.options
    w = cfg.rollout.workers
    rollout_cls: Any = ray.remote(RolloutActor)
    reward_cls: Any = ray.remote(RewardActor)
    # (its calls run one at a time; the stall watchdog's stack dump has a group of its own, beside them)
    watched: Any = ray.remote(concurrency_groups={WATCH_GROUP: 1})  # type: ignore[call-overload]  # (not in Ray's stubs)
    trainer_cls: Any = watched(TrainerActor)
    feeder_cls: Any = ray.remote(FeederActor)
    cwd = plugin_cwd(cfg)
    cfg = _absolute_paths(cfg)
    feeder_actor = hub if hub is not None else feeder_cls.options(
        num_cpus=0, max_concurrency=1000, name=f"{prefix}-feeder", scheduling_strategy=driver_node()).remote(
        cfg, model_dir, ray.put(rows), out, store, cwd=cwd)
    # rollout and reward actors (restartable) get the store and the feeder (which holds the prompt
    # rows) by name, not as handles or object references
    client = {"inline_max_bytes": store.inline_max_bytes, "rpc_grace_s": store.rpc_grace_s,
              "data_plane": store.data_plane, "put_window": store.put_window}
    store_by_name = Named(f"{prefix}-store", client)
    feeder_by_name = Named(f"{prefix}-store" if hub is not None else f"{prefix}-feeder")
    rollout_opts = [opts(i, f"rollout-{i}") for i in range(w)]
    if cfg.rollout.launch_servers is not None:  # the bundle's resources are its server's
        from asyncflow.runtime.ray_servers import rollout_options

        rollout_opts = [rollout_options(o) for o in rollout_opts]
    rollout_actors = [hub] if hub is not None else []
    rollout_actors += [
        rollout_cls.options(**rollout_opts[i]).remote(i, cfg, model_dir, feeder_by_name, out,
                                                               store_by_name, threads, version, session=prefix,
                                                               cwd=cwd)
        for i in range(len(rollout_actors), w)
    ]
    if cfg.train.engine == "fsdp":  # a coordinator on the driver's node; the ranks hold the bundles
        from asyncflow.runtime.ray_fsdp import FSDPTrainerActor

        ranks = [opts(w + r, f"trainer-rank-{r}") for r in range(cfg.train.world_size)]
        trainer_actor = watched(FSDPTrainerActor).options(
            num_cpus=0, max_concurrency=1, name=f"{prefix}-trainer", scheduling_strategy=driver_node(),
        ).remote(cfg, model_dir, max(1, round(cfg.runtime.train_cpus)), ranks)
    else:
        trainer_actor = trainer_cls.options(**opts(w, "trainer")).remote(cfg, model_dir, threads)
    reward_actors = [
        reward_cls.options(**opts(w + train_ranks(cfg) + j, f"reward-{j}")).remote(
            j, cfg, model_dir, feeder_by_name, out, store_by_name, reward_fn_path)
        for j in range(n_reward)
    ]
    return _Actors(rollout_actors, reward_actors, trainer_actor, feeder_actor)


def _remember(actors: _Actors, store: Any, trainer: RemoteTrainEngine, prefix: str) -> None:
    """Register every actor of the run by its Ray actor id, for the messages about its death."""
    stages = actors.stages
    hub = "rollout/0, store controller and feeder" if actors.feeder is store.handle else "store controller"
    for label, actor in [*zip(stages, [*actors.rollout, *actors.reward], strict=True), ("trainer", actors.trainer),
                         ("feeder", actors.feeder), (hub, store.handle)]:
        name = f"{prefix}-{'store' if actor is store.handle else label.replace('/', '-')}"
        remember(actor, label, name, trainer if actor is actors.trainer else None)


def _wait_ready(actors: _Actors, store: Any, place: Placement) -> tuple[list[Any], list[Any]]:
    """Wait for every actor to be constructed: the rollout actors' capacities and the restartable
    actors' process ids. On any failure, kill them all and free the placement group."""
    import ray

    stages, w = actors.stages, len(actors.rollout)
    try:
        capacities = _ready([a.ready.remote() for a in actors.rollout], stages[:w])
        _ready([actors.trainer.ready.remote(), actors.feeder.ready.remote(), *(a.ready.remote() for a in actors.reward)],
               ["trainer", "feeder", *stages[w:]])
        pids = _ready([a.pid.remote() for a in [*actors.rollout, *actors.reward]], stages)
    except BaseException:
        for a in [*actors.rollout, actors.trainer, actors.feeder, *actors.reward, store.handle]:
            forget(a)
        for a in _distinct([*actors.rollout, actors.trainer, actors.feeder, *actors.reward], but=store.handle):
            ray.kill(a)
        store.kill()
        place.remove()
        raise
    return capacities, pids


def _ready(refs: list[Any], names: list[str]) -> list[Any]:
    import ray

    _, pending = ray.wait(refs, num_returns=len(refs), timeout=READY_TIMEOUT_S)
    if pending:
        late = [n for n, r in zip(names, refs, strict=True) if r in pending]
        raise WaitTimeout(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for Ray worker actors to start "
                          f"(not ready: {', '.join(late)})")
    try:
        return list(ray.get(refs, timeout=READY_TIMEOUT_S))
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise
    except ray.exceptions.ActorDiedError as exc:  # an error in an actor's constructor arrives as its death, with
        last = str(getattr(exc, "error_msg", "")).strip().splitlines()[-1:]  # the error only as text
        prefix = f"{UserError.__module__}.{UserError.__name__}: "
        if getattr(exc, "actor_init_failed", False) and last and last[0].startswith(prefix):
            raise UserError(last[0][len(prefix):]) from None  # (bad input on a node: one line, exit 2)
        raise


async def _stage(name: str, ref: Any) -> None:
    """Await a remote stage loop that is not restarted (the feeder): its user errors come out as
    themselves, its actor's death as a one-line `RunFailed`."""
    import ray

    try:
        await ref
    except ray.exceptions.RayTaskError as exc:
        raise stage_error(name, exc) from exc
    except ray.exceptions.RayActorError as exc:
        raise death_error(exc) from exc


def weight_backend(cfg: Config) -> str:
    """The collective weight group's backend: NCCL when the trainer and every rollout actor hold a
    GPU and run on it, else gloo (CPU tensors)."""
    rt = cfg.runtime
    on_gpus = cfg.model.device != "cpu" and rt.train_gpus > 0 and rt.rollout_gpus > 0
    return "nccl" if on_gpus and cfg.rollout.engine != "openai" else "gloo"
