"""The Ray runtime: every rollout worker, reward worker and the trainer is an actor in its own process.

```
 FeederWorker (feeder + staleness gate) ── put prompts ─┐    placement group (PACK by default)
 driver (trainer loop, eval) ── publish/drop ─► gate    ▼
   │                             StoreController actor ◄──── take/complete ──── RolloutWorker i
   │ take batches ◄───────────  (metadata; data in        ◄─ take/write ───── RewardWorker j
   │                             Ray's object store)
   │ train_step(batch) ───────► TrainerWorker ── export_weights() ─► object store (once per version)
   └ load_weights(ref, v, mode) ─► every RolloutWorker (fetches the ref itself; drain | swap | abort)
```

The workflow code is the same as in process: the feeder actor runs `Pipeline.feeder` with the
staleness gate, the driver runs `Pipeline.trainer_loop` (talking to that gate through `RemoteGate`);
each rollout actor runs `Pipeline.rollout_worker` on its own engine and each
reward actor runs `Pipeline.reward_worker`, all against one `RayTransferQueue`. Per-sample traffic
(take a prompt, write a response, score a group) goes between the actors and the store controller,
never through the driver. The trainer's weights go into the object store once per version as the
return value of `export_weights`; the driver only passes the reference on, and each rollout actor
fetches it (on GPUs the same interface leaves room for an NCCL broadcast).

Assumptions on a cluster: the model folder, the dataset and the run folder are on storage every node
sees (the actors read the model and append to `samples.jsonl` themselves), and the trace's spans use
each process's monotonic clock, which is one time line only within a machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config, episodic
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, LossFn, TrainBatch, TrainEngine
from asyncflow.errors import UserError, WaitTimeout

READY_TIMEOUT_S = 300.0


def _tokenizer(model_dir: Path) -> Any:
    from asyncflow.runner import load_tokenizer
    from asyncflow.workflow.pipeline import Tokenizer

    hf = load_tokenizer(model_dir)
    return Tokenizer(hf, int(hf.eos_token_id), int(hf.pad_token_id))


def _stage_pipeline(cfg: Config, rows: list[dict[str, Any]], model_dir: Path, out: Path, store: Any,
                    engines: list[Any], reward_fn: Any = None) -> Any:
    """A `Pipeline` holding only what one remote stage needs."""
    from asyncflow.runtime.clock import RealClock
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.workflow.pipeline import Pipeline

    clock = RealClock()
    return Pipeline(
        cfg, rows=rows, tokenizer=_tokenizer(model_dir), reward_fn=reward_fn, engines=engines,
        trainer=None, loss_fn=None, clock=clock, log=RunLog(out, metrics=False),  # type: ignore[arg-type]
        tracer=Tracer(now=clock.now), store=store,
    )


class RolloutWorker:
    """Actor: one inference engine and the rollout loop that feeds it from the store."""

    def __init__(self, index: int, cfg: Config, model_dir: str, rows: list[dict[str, Any]], out: str,
                 store: Any, threads: int, version: int = 0) -> None:
        from asyncflow.engines.hf import HFEngine

        # The engine's decode thread releases the GIL at every torch op; with the default 5 ms switch
        # interval it then waits behind this actor's event loop (store calls, one task per sample).
        # 1 ms measured 0.84 -> 0.68 s for 256 requests through this actor.
        sys.setswitchinterval(0.001)
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed + index)
        tok = _tokenizer(Path(model_dir))
        self.index = index
        self.engine = HFEngine(
            Path(model_dir), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            max_batch=cfg.rollout.max_batch, dtype=getattr(torch, cfg.model.dtype), seed=cfg.seed + index,
            name=f"rollout-{index}", version=version,
        )
        self.pipeline = _stage_pipeline(cfg, rows, Path(model_dir), Path(out), store, [self.engine])

    def ready(self) -> int:
        return self.engine.capacity

    async def run(self) -> None:
        await self.pipeline.rollout_worker(self.index, self.engine)

    async def generate(self, request: GenRequest) -> GenResult:
        return await self.engine.generate(request)

    async def load_weights(self, state: dict[str, torch.Tensor], version: int, mode: str) -> dict[str, float]:
        seconds = await self.engine.load_weights(state, version, mode)  # type: ignore[arg-type]
        return {"seconds": seconds, **self.stats()}

    def cancel_older_than(self, min_version: int) -> int:
        return self.engine.cancel_older_than(min_version)

    def stats(self) -> dict[str, float]:
        return {"busy_s": self.engine.busy_seconds(), "load": float(self.engine.load()), **self.engine.stats()}

    def spans(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        return self.pipeline.tracer.raw()

    async def close(self) -> None:
        await self.engine.close()


class FeederWorker:
    """Actor: the feeder and the staleness gate it admits against (the trainer loop in the driver
    publishes versions and drops to it through `RemoteGate`)."""

    def __init__(self, cfg: Config, model_dir: str, rows: list[dict[str, Any]], out: str, store: Any) -> None:
        torch.set_num_threads(1)
        self.pipeline = _stage_pipeline(cfg, rows, Path(model_dir), Path(out), store, [])

    def ready(self) -> bool:
        return True

    async def run(self) -> None:
        await self.pipeline.feeder()

    def restore(self, next_group: int, version: int, admitted: int) -> None:
        """Resume from a checkpoint (before `run`): see `Pipeline.restore_feeder`."""
        self.pipeline.restore_feeder(next_group, version, admitted)

    def publish(self, version: int) -> None:
        self.pipeline.gate.publish(version)

    def drop(self, groups: int) -> None:
        self.pipeline.gate.drop(groups)

    def close(self) -> None:
        self.pipeline.gate.close()


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
        self.handle.close.remote()


class RewardWorker:
    """Actor: the reward loop (one reward-function call per complete group)."""

    def __init__(self, index: int, cfg: Config, model_dir: str, rows: list[dict[str, Any]], out: str,
                 store: Any, reward_fn_path: str) -> None:
        from asyncflow.rewards import load_reward_fn

        torch.set_num_threads(1)
        self.index = index
        reward_fn = load_reward_fn(reward_fn_path, [model_dir])
        self.pipeline = _stage_pipeline(cfg, rows, Path(model_dir), Path(out), store, [], reward_fn)

    def ready(self) -> bool:
        return True

    async def run(self) -> None:
        await self.pipeline.reward_worker()

    def stats(self) -> dict[str, float]:
        c = self.pipeline.counters
        return {"reward_calls": float(c.reward_calls), "reward_call_failures": float(c.reward_call_failures)}

    def spans(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        return [(f"{t}/{self.index}" if t == "reward" else t, *rest) for t, *rest in self.pipeline.tracer.raw()]


class TrainerWorker:
    """Actor: the policy's optimizer state and weights."""

    def __init__(self, cfg: Config, model_dir: str, threads: int) -> None:
        from asyncflow.engines.torch_train import TorchTrainEngine

        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)
        self.engine = TorchTrainEngine(
            Path(model_dir), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
            mini_batches=cfg.train.mini_batches, micro_batch_size=cfg.train.micro_batch_size,
            max_grad_norm=cfg.train.max_grad_norm, dtype=getattr(torch, cfg.model.dtype),
        )

    def ready(self) -> bool:
        return True

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self.engine.logprobs(batch, temperature)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float) -> dict[str, float]:
        return self.engine.train_step(batch, loss_fn, temperature)

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.engine.export_weights()

    def save(self, path: str, with_optimizer: bool) -> None:
        self.engine.save(path, with_optimizer=with_optimizer)

    def load_optimizer(self, path: str) -> None:
        self.engine.load_optimizer(path)


class RemoteEngine(InferenceEngine):
    """The driver's handle on a `RolloutWorker`: the `InferenceEngine` interface over Ray calls."""

    def __init__(self, handle: Any, capacity: int, timeout_s: float, version: int = 0) -> None:
        self.handle = handle
        self.version = version
        self._capacity = capacity
        self._timeout = timeout_s
        self.last_stats: dict[str, float] = {"busy_s": 0.0, "load": 0.0}

    @property
    def capacity(self) -> int:
        return self._capacity

    async def generate(self, request: GenRequest) -> GenResult:
        result: GenResult = await self.handle.generate.remote(request)
        return result

    async def load_weights(self, state: Any, version: int, mode: Any) -> float:
        """`state` is the object-store reference from `RemoteTrainEngine.export_weights`: the actor
        fetches the weights itself, so the driver never holds them."""
        reply = await asyncio.wait_for(self.handle.load_weights.remote(state, version, mode), self._timeout)
        self.version = version
        self.last_stats = reply
        return float(reply["seconds"])

    def cancel_older_than(self, min_version: int) -> int:
        """Sent without waiting (the cancelled samples reach the trainer, which counts them)."""
        self.handle.cancel_older_than.remote(min_version)
        return 0

    def load(self) -> int:
        return int(self.last_stats["load"])

    def busy_seconds(self) -> float:
        """As of the last weight load (the workflow reads it right after a publication)."""
        return float(self.last_stats["busy_s"])

    def stats(self) -> dict[str, float]:
        """As of the last weight load."""
        return {k: v for k, v in self.last_stats.items() if k in ("decode_steps", "decode_rows", "prefills", "prefill_rows")}

    async def close(self) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayActorError, asyncio.TimeoutError):
            await asyncio.wait_for(self.handle.close.remote(), 30)


class RemoteTrainEngine(TrainEngine):
    """The driver's handle on the `TrainerWorker`."""

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle = handle
        self.timeout = timeout_s

    def _get(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise WaitTimeout(f"timed out after {self.timeout:.0f} s waiting for the trainer actor to {what}") from None

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self._get(self.handle.logprobs.remote(batch, temperature), "compute log-probs")  # type: ignore[no-any-return]

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float) -> dict[str, float]:
        return self._get(self.handle.train_step.remote(batch, loss_fn, temperature), "train a step")  # type: ignore[no-any-return]

    def export_weights(self) -> Any:
        """An object-store reference to the new weights (published once; engines fetch it)."""
        return self.handle.export_weights.remote()

    def save(self, path: str, *, with_optimizer: bool) -> None:
        self._get(self.handle.save.remote(path, with_optimizer), "save the model")

    def load_optimizer(self, path: str) -> None:
        self._get(self.handle.load_optimizer.remote(path), "load the optimizer state")


@dataclass
class RayWorkers:
    """The actors of one run, and how to supervise and stop them."""

    store: Any
    engines: list[RemoteEngine]
    trainer: RemoteTrainEngine
    rollout_actors: list[Any]
    reward_actors: list[Any]
    trainer_actor: Any
    feeder_actor: Any
    gate: RemoteGate
    placement_group: Any
    runs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, cfg: Config, model_dir: Path, rows: list[dict[str, Any]], out: Path, reward_fn_path: str,
              threads: int, log: Any = print, version: int = 0) -> RayWorkers:
        """Start (or join) Ray, reserve a placement group, start the store and every actor. The policy's
        weights come from `model_dir` as `version` (a resumed run's checkpoint)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from asyncflow.runtime.ray_init import ensure_ray
        from asyncflow.transfer_queue.ray_store import RayTransferQueue
        from asyncflow.workflow.pipeline import store_capacity

        rt = cfg.runtime
        n_reward = 0 if episodic(cfg) else rt.reward_workers  # episodes carry their reward
        need = rt.rollout_cpus * cfg.rollout.workers + rt.train_cpus + rt.reward_cpus * n_reward
        t0 = time.monotonic()
        ensure_ray(rt.address, num_cpus=max(os.cpu_count() or 1, int(need + 0.999)))
        roles = [("rollout", rt.rollout_cpus, rt.rollout_gpus)] * cfg.rollout.workers + [("train", rt.train_cpus, rt.train_gpus)]
        roles += [("reward", rt.reward_cpus, 0.0)] * n_reward
        bundles = [{k: v for k, v in (("CPU", c), ("GPU", g)) if v > 0} for _, c, g in roles]
        placed = [i for i, b in enumerate(bundles) if b]
        pg = None
        if placed:
            pg = placement_group([bundles[i] for i in placed], strategy=rt.placement_strategy)
            if not pg.wait(timeout_seconds=120):
                remove_placement_group(pg)
                raise UserError(
                    f"runtime: Ray cannot place the worker bundles {[bundles[i] for i in placed]} "
                    f"(cluster resources: {ray.cluster_resources()}); lower runtime.*_cpus / *_gpus or add nodes"
                )

        def opts(i: int) -> dict[str, Any]:
            role, c, g = roles[i]
            o: dict[str, Any] = {"num_cpus": c, "num_gpus": g, "max_concurrency": 1000 if role != "train" else 1}
            if pg is not None and i in placed:
                o["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=placed.index(i))
            return o

        store = RayTransferQueue.create(store_capacity(cfg), cfg.workflow.lease_timeout_s)
        rows_ref = ray.put(rows)
        w = cfg.rollout.workers
        rollout_cls: Any = ray.remote(RolloutWorker)
        reward_cls: Any = ray.remote(RewardWorker)
        trainer_cls: Any = ray.remote(TrainerWorker)
        feeder_cls: Any = ray.remote(FeederWorker)
        rollout_actors = [
            rollout_cls.options(**opts(i)).remote(i, cfg, str(model_dir), rows_ref, str(out), store, threads, version)
            for i in range(w)
        ]
        trainer_actor = trainer_cls.options(**opts(w)).remote(cfg, str(model_dir), threads)
        feeder_actor = feeder_cls.options(num_cpus=0, max_concurrency=1000).remote(cfg, str(model_dir), rows_ref, str(out), store)
        reward_actors = [
            reward_cls.options(**opts(w + 1 + j)).remote(j, cfg, str(model_dir), rows_ref, str(out), store, reward_fn_path)
            for j in range(n_reward)
        ]
        try:
            capacities = _ready([a.ready.remote() for a in rollout_actors])
            _ready([trainer_actor.ready.remote(), feeder_actor.ready.remote(), *(a.ready.remote() for a in reward_actors)])
        except BaseException:
            for a in [*rollout_actors, trainer_actor, feeder_actor, *reward_actors]:
                ray.kill(a)
            store.kill()
            if pg is not None:
                remove_placement_group(pg)
            raise
        timeout = cfg.workflow.step_timeout_s
        engines = [RemoteEngine(a, int(c), timeout, version) for a, c in zip(rollout_actors, capacities, strict=True)]
        log(f"[asyncflow] ray: feeder, {w} rollout, 1 trainer, {n_reward} reward actor(s) ready in "
            f"{time.monotonic() - t0:.1f} s")
        return cls(store, engines, RemoteTrainEngine(trainer_actor, timeout), rollout_actors, reward_actors,
                   trainer_actor, feeder_actor, RemoteGate(feeder_actor, cfg.staleness), pg)

    def restore_feeder(self, next_group: int, version: int, admitted: int) -> None:
        """Resume the feeder actor's position and gate (before `stages`)."""
        import ray

        ray.get(self.feeder_actor.restore.remote(next_group, version, admitted), timeout=READY_TIMEOUT_S)

    def stages(self) -> dict[str, Any]:
        """Start the remote stage loops; awaitables by stage name for `Pipeline.run(remote=...)`."""
        runs = {"feeder": self.feeder_actor.run.remote()}
        runs.update({f"rollout/{i}": a.run.remote() for i, a in enumerate(self.rollout_actors)})
        runs.update({f"reward/{j}": a.run.remote() for j, a in enumerate(self.reward_actors)})
        self.runs = runs
        return {name: _stage(name, ref) for name, ref in runs.items()}

    def collect(self, tracer: Any, counters: Any) -> None:
        """Merge the actors' trace spans and counters into the driver's."""
        import ray

        for actor in [*self.rollout_actors, *self.reward_actors]:
            try:
                for track, name, start, end, args in ray.get(actor.spans.remote(), timeout=60):
                    tracer.span(track, name, start, end, **args)
            except ray.exceptions.RayError:
                continue
        try:
            rstats = ray.get([a.stats.remote() for a in self.reward_actors], timeout=60)
            counters.reward_calls = int(sum(s["reward_calls"] for s in rstats))
            counters.reward_call_failures = int(sum(s["reward_call_failures"] for s in rstats))
        except ray.exceptions.RayError:
            pass

    def shutdown(self) -> None:
        """Kill every actor and free the placement group (Ray itself stays up for the caller)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in [*self.rollout_actors, *self.reward_actors, self.trainer_actor, self.feeder_actor]:
            ray.kill(a)
        self.store.kill()
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)


def _ready(refs: list[Any]) -> list[Any]:
    import ray

    try:
        return list(ray.get(refs, timeout=READY_TIMEOUT_S))
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for Ray worker actors to start") from None
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise


async def _stage(name: str, ref: Any) -> None:
    """Await a remote stage loop; its user errors come out as themselves, a dead actor as a clear error."""
    import ray

    try:
        await ref
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, UserError):
            raise exc.cause from None
        raise RuntimeError(f"Ray stage {name} failed: {exc.cause!r}") from exc
    except ray.exceptions.RayActorError as exc:
        raise RuntimeError(f"Ray stage {name}: its actor died ({exc})") from exc
