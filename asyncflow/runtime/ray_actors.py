"""The Ray actors' classes (run in their own processes): the rollout, feeder, reward and trainer
actors, each building its one stage and the stage's context (`ActorParts`), and what they find by
Ray name."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config, episodic
from asyncflow.engines.base import GenRequest, GenResult, LossFn, TrainBatch, pick_device, quiet_transformers
from asyncflow.engines.delta_train import DeltaTrainEngine
from asyncflow.engines.shared_state import SharedState
from asyncflow.errors import WaitTimeout
from asyncflow.malloc_arena import limit_malloc_arenas
from asyncflow.rewards.sandbox import require_layers
from asyncflow.runtime.ray_weights import WeightPort
from asyncflow.stacks import process_stacks
from asyncflow.workflow.build import episode_components, make_gate
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.feeder import Feeder
from asyncflow.workflow.reward import RewardWorker
from asyncflow.workflow.rollout import RolloutWorker
from asyncflow.workflow.settings import (
    ContextSettings,
    FeederSettings,
    GateSettings,
    RewardSettings,
    RolloutSettings,
)

READY_TIMEOUT_S = 300.0  # an actor starting (or restarting: a new process loads the model again)
POLL_S = 0.1  # how often a wait for a restarting actor looks again


def _tokenizer(model_dir: Path) -> Any:
    from asyncflow.tokenizer import Tokenizer, load_tokenizer

    return Tokenizer.of(load_tokenizer(model_dir), model_dir)


@dataclass
class Named:
    """Another actor of the run by its Ray name, as a constructor argument of a rollout or reward actor:
    a restarted actor is constructed again from its arguments and finds the store and the feeder
    again by name (arguments holding object references or actor handles are what ray-project/ray#53727
    is about, and Ray warns about them for actors with restarts)."""

    name: str
    store_options: dict[str, Any] | None = None  # set: the store controller, wrapped in a client

    def get(self) -> Any:
        import ray

        from asyncflow.transfer_queue.ray_store import RayTransferQueue

        handle = ray.get_actor(self.name)
        return handle if self.store_options is None else RayTransferQueue(handle, **self.store_options)


def _store(store: Any) -> Any:
    return store.get() if isinstance(store, Named) else store


def _rows(rows: Any) -> list[dict[str, Any]]:
    """The prompt rows given as such; empty where they come from the feeder actor (`Named`): an
    async actor fetches those on its event loop (`fetch_rows`), as a blocking `ray.get` here would
    block the loop."""
    return [] if isinstance(rows, Named) else list(rows)


async def fetch_rows(rows: Any, into: list[dict[str, Any]]) -> None:
    """Fill `into` (the stage's row list, empty so far) with the rows the feeder actor holds."""
    if not isinstance(rows, Named) or into:
        return
    try:
        into.extend(await asyncio.wait_for(rows.get().rows.remote(), READY_TIMEOUT_S))
    except asyncio.TimeoutError:
        raise WaitTimeout(f"timed out after {READY_TIMEOUT_S:.0f} s waiting for the feeder actor ({rows.name}) "
                          "to hand over the prompt rows") from None


@dataclass
class ActorParts:
    """What the stages of one actor process share, built once per process (the colocated hub hosts
    several stages): the context, the tokenizer and the prompt rows."""

    ctx: StageContext
    tok: Any
    rows: list[dict[str, Any]]  # filled on the event loop where they come from the feeder (`fetch_rows`)
    rows_from: Any  # the rows as given: a list, or the feeder actor by name (`Named`)


def actor_parts(cfg: Config, model_dir: Path, rows: Any, out: Path, store: Any) -> ActorParts:
    """An actor's `ActorParts`; the driver's pipeline registers the stages with the store."""
    from asyncflow.clock import RealClock
    from asyncflow.telemetry.runlog import RUN_TRACE_EVENTS, RunLog, Tracer

    require_layers(cfg.reward.sandbox_require)  # (this process may score: a reward, an environment, an agent)
    clock = RealClock()
    tok, row_list = _tokenizer(model_dir), _rows(rows)
    ctx = StageContext(_store(store), clock, Tracer(now=clock.now, max_events=RUN_TRACE_EVENTS),
                       RunLog(out, metrics=False), ContextSettings.from_config(cfg), rows=row_list, tok=tok)
    return ActorParts(ctx, tok, row_list, rows)


class RolloutActor:
    """Actor: one inference engine and the rollout loop that feeds it from the store."""

    def __init__(self, index: int, cfg: Config, model_dir: str, rows: Any, out: str, store: Any, threads: int,
                 version: int = 0, session: str = "", cwd: str | None = None, parts: ActorParts | None = None) -> None:
        """`parts`: the process's shared parts where another stage of it built them (the hub)."""
        from asyncflow.data import model_positions
        from asyncflow.engines.factory import make_inference_engine

        quiet_transformers()
        limit_malloc_arenas()  # (asyncflow.malloc_arena says why)
        importable(cwd)

        # The engine's decode thread releases the GIL at every torch op; with the default 5 ms switch
        # interval it then waits behind this actor's event loop (store calls, one task per sample);
        # 1 ms lets it back in sooner.
        sys.setswitchinterval(0.001)
        # the engine's decode thread computes with `threads`; this one (the actor's calls) with one, so
        # it never keeps an OpenMP pool beside the engine's (asyncflow.compute_thread says why)
        torch.set_num_threads(1)
        torch.manual_seed(cfg.seed + index)
        self.parts = parts if parts is not None else actor_parts(cfg, Path(model_dir), rows, Path(out), store)
        tok = self.parts.tok
        self.index = index
        # `session`: one per run start, shared by the run's rollout actors, so a server engine's weight
        # folder is written once per version for all of them (`WeightFolderWriter`)
        self.engine = make_inference_engine(cfg, Path(model_dir), tok, index, version, threads=threads,
                                            device=actor_device(cfg.model.device, cfg.runtime.rollout_gpus),
                                            run_dir=Path(out), session=session)
        if cfg.rollout.launch_servers is not None:  # a server the run started: recovered when it dies
            from asyncflow.runtime.ray_servers import server_link

            self.engine.server = server_link(cfg, session, index)  # type: ignore[attr-defined]
        self.connected: asyncio.Task[None] | None = None
        env_factory, agent = episode_components(cfg)
        self.worker = RolloutWorker(self.parts.ctx, RolloutSettings.from_config(cfg, model_positions(Path(model_dir))),
                                    index=index, engine=self.engine, rows=self.parts.rows, tok=tok,
                                    env_factory=env_factory, agent=agent)
        self.port = weight_port(cfg)

    async def _connect(self) -> None:
        """The engine's `connect` and the prompt rows' fetch, once per process (a restarted actor's
        first call does both again)."""
        if self.connected is None:
            self.connected = asyncio.ensure_future(self._setup())
        await self.connected

    async def _setup(self) -> None:
        await self.engine.connect()
        await fetch_rows(self.parts.rows_from, self.parts.rows)

    async def ready(self) -> int:
        await self._connect()
        return self.engine.capacity

    def pid(self) -> int:
        return os.getpid()

    async def run(self) -> None:
        # diagnostics: the policy version the loop starts at (a restarted actor: the version the
        # driver loaded into it first)
        self.run_versions = [*getattr(self, "run_versions", []), self.engine.version]
        await self._connect()
        await self.worker.run()

    async def generate(self, request: GenRequest) -> GenResult:
        await self._connect()
        return await self.engine.generate(request)

    async def load_weights(self, state: dict[str, torch.Tensor] | None, version: int, mode: str) -> dict[str, float]:
        """Load `state` as `version`; None (the trainer has sent a newer version since): nothing to load."""
        import ray

        if isinstance(state, ray.ObjectRef):  # (FSDP on Ray: a reference to the weights rank 0 stored)
            state = await state
        if state is None:
            return {"seconds": 0.0, "skipped": 1.0, **self.stats()}
        seconds = await self.engine.load_weights(state, version, mode)  # type: ignore[arg-type]
        return {"seconds": seconds, **self.stats()}

    async def join_weights(self, host: str, port: int, rank: int, size: int, epoch: int, backend: str) -> None:
        """Join the collective weight group (`asyncflow.runtime.ray_weights`), off the event loop."""
        await asyncio.to_thread(self.port.join, host, port, rank, size, epoch, backend)

    async def receive_weights(self, version: int, mode: str) -> dict[str, float]:
        """Receive `version` by broadcast and load it (`mode` honoured): an engine that can
        (`request_fill`) receives it into its own parameters at the mode's load point (no second
        copy of the weights); any other, and a `drain` while requests run (the broadcast would wait
        for them to finish, and the trainer with it), receives a whole state dict first, then loads
        it as `load_weights` does."""
        fill = getattr(self.engine, "request_fill", None)
        if fill is None or (mode == "drain" and self.engine.load() > 0):
            state = await asyncio.to_thread(self.port.receive, version)
            return await self.load_weights(state, version, mode)
        incoming = await asyncio.to_thread(self.port.announced, version)  # (the wait for the send: off the engine)
        seconds = await asyncio.wrap_future(fill(lambda params: self.port.receive_into(params, version, incoming),
                                                 version, mode))
        return {"seconds": seconds, **self.stats()}

    def where(self) -> dict[str, Any]:
        return where()

    async def stacks(self) -> str:
        """This process's threads and asyncio tasks (the stall watchdog's dump)."""
        return process_stacks(asyncio.get_running_loop(), f"rollout/{self.index} actor")

    def cancel_older_than(self, min_version: int) -> int:
        self.parts.ctx.board.raise_floor(min_version)  # (this actor's episodes check it per turn)
        return self.engine.cancel_older_than(min_version)

    def stats(self) -> dict[str, float]:
        return {"busy_s": self.engine.busy_seconds(), "load": float(self.engine.load()), **self.engine.stats()}

    def spans(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        return self.parts.ctx.tracer.raw()

    async def close_engine(self) -> None:
        await self.engine.close()


class FeederActor:
    """Actor: the feeder and the staleness gate it admits against (the trainer loop in the driver
    publishes versions and drops to it through `RemoteGate`)."""

    def __init__(self, cfg: Config, model_dir: str, rows: Any, out: str, store: Any, cwd: str | None = None,
                 parts: ActorParts | None = None) -> None:
        torch.set_num_threads(1)
        importable(cwd)
        self.parts = parts if parts is not None else actor_parts(cfg, Path(model_dir), rows, Path(out), store)
        self.gate = make_gate(GateSettings.from_config(cfg), self.parts.ctx.clock)
        self.feeder = Feeder(self.parts.ctx, FeederSettings.from_config(cfg), rows=self.parts.rows,
                             tok=self.parts.tok, gate=self.gate)

    def ready(self) -> bool:
        return True

    def where(self) -> dict[str, Any]:
        return where()

    async def stacks(self) -> str:
        return process_stacks(asyncio.get_running_loop(), "feeder actor")

    def rows(self) -> list[dict[str, Any]]:
        """The prompt rows, for the rollout and reward actors (again after a restart)."""
        return list(self.parts.rows)

    async def feed(self) -> None:
        await self.feeder.run()

    def restore(self, next_group: int, version: int, admitted: int) -> None:
        """Resume from a checkpoint (before `run`): see `Feeder.restore`."""
        self.feeder.restore(next_group, version, admitted)

    def publish(self, version: int) -> None:
        self.gate.publish(version)

    def drop(self, groups: int) -> None:
        self.gate.drop(groups)

    def close_gate(self) -> None:
        self.gate.close()


class RewardActor:
    """Actor: the reward loop (one reward-function call per complete group)."""

    def __init__(self, index: int, cfg: Config, model_dir: str, rows: Any, out: str,
                 store: Any, reward_fn_path: str | list[str], parts: ActorParts | None = None) -> None:
        from asyncflow.rewards import load_run_reward

        torch.set_num_threads(1)
        self.index = index
        reward_fn = load_run_reward(cfg, reward_fn_path)  # (as in the driver: no folder joins sys.path)
        self.parts = parts if parts is not None else actor_parts(cfg, Path(model_dir), rows, Path(out), store)
        self.worker = RewardWorker(self.parts.ctx, RewardSettings.from_config(cfg), reward_fn=reward_fn,
                                   rows=self.parts.rows, tok=self.parts.tok, track=f"reward/{index}")
        self.fetched: asyncio.Future[None] | None = None

    async def ready(self) -> bool:
        await self._with_rows()
        return True

    async def _with_rows(self) -> None:
        """The rows' fetch, once per process (`ready` and `run` may both be waiting for it)."""
        if self.fetched is None:
            self.fetched = asyncio.ensure_future(fetch_rows(self.parts.rows_from, self.parts.rows))
        await self.fetched

    def pid(self) -> int:
        return os.getpid()

    async def run(self) -> None:
        await self._with_rows()  # (a restarted process: its first call)
        await self.worker.run()

    def where(self) -> dict[str, Any]:
        return where()

    async def stacks(self) -> str:
        return process_stacks(asyncio.get_running_loop(), f"reward/{self.index} actor")

    def stats(self) -> dict[str, float]:
        """This process's reward call counts (all its reward loops')."""
        c = self.parts.ctx.counters
        return {"reward_calls": float(c.reward_calls), "reward_call_failures": float(c.reward_call_failures)}

    def spans(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        return self.parts.ctx.tracer.raw()


def where() -> dict[str, Any]:
    """The node and process this actor runs in (for the run's summary)."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def weight_port(cfg: Config) -> WeightPort:
    """This actor's end of the collective weight path (unused with `runtime.weight_sync: object_store`)."""
    return WeightPort(int(cfg.runtime.weight_bucket_mb * 2**20), cfg.workflow.step_timeout_s)


def plugin_cwd(cfg: Config) -> str | None:
    """The driver's working directory for `importable`: in a run of `rollout.agent` or `rollout.env`
    only (no reward function is loaded there; `reward.fn` is imported from sys.path as it is)."""
    return os.getcwd() if episodic(cfg) else None


def importable(cwd: str | None) -> None:
    """Make the driver's working directory importable in this actor, as it is in the driver, for the
    plugins a config names as `module:function` (`rollout.agent`, `rollout.env`; `cwd` is None in a
    run without them); Ray adds only the directory the driver was in when it started Ray. Searched
    last, so a file there never shadows an installed or standard module. Skipped where this node
    has no such folder."""
    if cwd is not None and cwd not in sys.path and os.path.isdir(cwd):
        sys.path.append(cwd)


def actor_device(setting: str, gpus: float) -> str:
    """An actor's device under `model.device`: a GPU only when Ray gave it one (`gpus` > 0). Ray 2.x
    no longer hides the node's GPUs from an actor given none (CUDA_VISIBLE_DEVICES is left as it
    is), so `auto` alone would put every such actor on GPU 0, which Ray never reserved for it."""
    return pick_device(setting) if gpus > 0 else "cpu"


class TrainerActor:
    """Actor: the policy's optimizer state and weights."""

    def __init__(self, cfg: Config, model_dir: str, threads: int) -> None:
        from asyncflow.engines.factory import make_train_engine

        quiet_transformers()
        limit_malloc_arenas()  # (asyncflow.malloc_arena says why)

        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)
        self.engine = make_train_engine(cfg, Path(model_dir), threads=threads,
                                        device=actor_device(cfg.model.device, cfg.runtime.train_gpus))
        # calls run one at a time and each export is stored or sent before the next: its memory is reused
        self.engine.reuse_export_memory()
        self.port = weight_port(cfg)

    def ready(self) -> bool:
        return True

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self.engine.logprobs(batch, temperature)

    def published_full(self, seq: int | None) -> SharedState | None:
        """With `runtime.weight_sync_delta`: publication `seq` (None: the last) as full weights, for a
        rollout actor a delta did not apply to, while it is the last (None: a newer one was published
        since: the actor gets that one; also None without deltas)."""
        if not isinstance(self.engine, DeltaTrainEngine):
            return None
        full = self.engine.published_full(seq)
        return None if full is None else SharedState(full)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, proximal: bool = False) -> dict[str, float]:
        return self.engine.train_step(batch, loss_fn, temperature, proximal=proximal)

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self.engine.reference_logprobs(batch, temperature)

    def export_bytes(self) -> int | None:
        return self.engine.export_bytes()

    def export_weights(self) -> SharedState:
        """The weights to publish; they arrive as a plain state dict (`SharedState`: one copy into
        the object store, none out of it)."""
        return SharedState(self.engine.export_weights())

    def weights_address(self) -> tuple[str, int]:
        return self.port.address()

    def join_weights(self, host: str, port: int, rank: int, size: int, epoch: int, backend: str) -> None:
        self.port.join(host, port, rank, size, epoch, backend)

    def send_weights(self, version: int) -> None:
        """Export and broadcast `version` to the weight group (`asyncflow.runtime.ray_weights`)."""
        self.port.send(self.engine.export_weights(), version)

    def published(self, version: int) -> SharedState | None:
        state = self.port.published(version)
        return None if state is None else SharedState(state)

    def stacks(self) -> str:
        """This process's threads; called in a concurrency group of its own (`ray_runtime.WATCH_GROUP`),
        so it answers while a train step or export hangs."""
        return process_stacks(None, "trainer actor")

    def placement(self) -> list[dict[str, Any]]:
        """Where the trainer runs, for the run's summary."""
        return [{"role": "trainer", "index": 0, **where()}]

    def save(self, path: str, with_optimizer: bool) -> None:
        self.engine.save(path, with_optimizer=with_optimizer)

    def load_optimizer(self, path: str) -> None:
        self.engine.load_optimizer(path)
