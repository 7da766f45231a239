"""FSDP ranks as Ray actors: `start_ray_fsdp` builds an `FSDPTrainEngine` whose ranks are
`FSDPRankActor`s (one per set of actor options the runtime gives, e.g. one placement-group bundle
each), reached through `RayRankLinks`.

```
 driver: RayFSDPTrainEngine ── .remote() per rank ──► FSDPRankActor 0 (node A): FSDPRank ─┐ process group at
   shares, metrics, saves: FSDPTrainEngine's  ──────► FSDPRankActor 1 (node B): FSDPRank ─┘ node A's IP:port
```

Start-up takes two steps because the rendezvous is known only once the actors exist: rank 0's actor
reports its node's IP and a port free there; then every actor builds its `FSDPRank` at that address,
all at once (joining the process group waits for every rank). On GPU each actor sees only the GPUs Ray
gave it and uses the first as cuda:0 (NCCL); on CPU the ranks talk gloo.

Every wait polls `ray.wait` briefly, so a dead rank is an error naming it within about a second, never a
hang; a failed rank's traceback comes with its rank; after any failure every rank actor is killed
(the others may be stuck in a collective without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from asyncflow.config import Config
from asyncflow.engines.base import quiet_transformers, state_bytes
from asyncflow.engines.fsdp_train import FSDPRank, FSDPTrainEngine, RankMethod, WorkerSpec, build_rank
from asyncflow.engines.shared_state import SharedState
from asyncflow.errors import WaitTimeout
from asyncflow.malloc_arena import limit_malloc_arenas
from asyncflow.runtime.ray_actors import TrainerActor, weight_port
from asyncflow.runtime.ray_errors import why_died
from asyncflow.runtime.ray_weights import WeightPort

POLL_S = 0.5  # how often a wait on the ranks looks for a dead or failed one
STOP_TIMEOUT_S = 10.0  # a polite shutdown (leaving the process group) before the actors are killed
DEATH_GRACE_S = 5.0  # after a rank's error, how long a death of another rank (its likely cause) may take to show
GET_TIMEOUT_S = 60.0  # reading a reply that `ray.wait` already reported as here (no task is waited on)


class FSDPRankActor:
    """One rank in its own Ray actor; its `FSDPRank` is built by `build`, once every rank's actor exists."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Any = None  # (an `FSDPRank` unless the spec names another `rank_class`)

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it now: the rendezvous, asked of rank 0's actor."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return str(ray.util.get_node_ip_address()), port

    def build(self, spec: WorkerSpec) -> None:
        """Join the process group at `spec`'s rendezvous, load and shard the model."""
        quiet_transformers()
        limit_malloc_arenas()  # (asyncflow.malloc_arena says why)
        self.worker = build_rank(self.rank, spec)

    def run(self, method: RankMethod, args: tuple[Any, ...]) -> Any:
        if self.worker is None:
            raise RuntimeError(f"FSDP rank {self.rank} was asked to run {method!r} before it was built")
        return self.worker.run(method, args)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        """Leave the process group (the actor is killed next)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _kill(actors: list[Any]) -> None:
    """Kill every rank actor (on errors, at close and at garbage collection)."""
    import ray

    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


class RayRankLinks:
    """`RankLinks` over Ray: each call is one `.remote()` per rank actor, waited in short polls."""

    def __init__(self, spec: WorkerSpec, actor_options: list[dict[str, Any]]) -> None:
        import ray

        if len(actor_options) != spec.world_size:
            raise ValueError(f"world_size={spec.world_size} needs as many actor options; got {len(actor_options)}")
        if spec.device == "cuda" and any(o.get("num_gpus", 0) < 1 for o in actor_options):
            raise ValueError(f"device=cuda needs num_gpus >= 1 in every rank actor's options (one GPU per rank, "
                             f"NCCL); got {[o.get('num_gpus', 0) for o in actor_options]}")
        self.world_size = spec.world_size
        self._spec = dataclasses.replace(spec, own_gpu_only=True)  # Ray sets each actor's CUDA_VISIBLE_DEVICES
        remote = ray.remote(FSDPRankActor)
        self.actors: list[Any] = [remote.options(**o).remote(rank) for rank, o in enumerate(actor_options)]
        self._finalizer = weakref.finalize(self, _kill, list(self.actors))

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        [(addr, port)] = self._gather({0: self.actors[0].address.remote()},
                                      "start (report its node's address for the process group)", timeout_s)
        spec = dataclasses.replace(self._spec, master_addr=addr, master_port=port)
        self._gather({r: a.build.remote(spec) for r, a in enumerate(self.actors)},
                     f"start (init the process group at {addr}:{port}, load and shard the model)",
                     max(deadline - time.monotonic(), 1.0))

    def call(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]], what: str, timeout_s: float) -> list[Any]:
        refs = {r: a.run.remote(method, args) for r, (a, args) in enumerate(zip(self.actors, per_rank_args, strict=True))}
        return self._gather(refs, what, timeout_s)

    def where(self, timeout_s: float) -> list[dict[str, Any]]:
        """Each rank's {"rank", "node_id", "pid"}."""
        nodes = self._gather({r: a.node_id.remote() for r, a in enumerate(self.actors)}, "report its node", timeout_s)
        pids = self._gather({r: a.pid.remote() for r, a in enumerate(self.actors)}, "report its pid", timeout_s)
        return [{"rank": r, "node_id": n, "pid": p} for r, (n, p) in enumerate(zip(nodes, pids, strict=True))]

    def stop(self) -> None:
        if self._finalizer.alive:
            with contextlib.suppress(Exception):
                self._gather({r: a.close.remote() for r, a in enumerate(self.actors)}, "shut down", STOP_TIMEOUT_S)
            self._finalizer()

    def _gather(self, refs: dict[int, Any], what: str, limit: float) -> list[Any]:
        """The replies of `refs` (rank -> ObjectRef) in rank order, waiting at most `limit` seconds; a dead,
        failing or silent rank kills every rank actor and raises with its rank and `what`."""
        import ray

        deadline = time.monotonic() + limit
        pending = {ref: rank for rank, ref in refs.items()}
        replies: dict[int, Any] = {}
        failed: RuntimeError | None = None
        grace_end = deadline
        try:
            while pending:
                now = time.monotonic()
                if failed is not None and now >= grace_end:
                    raise failed
                if now >= deadline:
                    raise failed or WaitTimeout(f"timed out after {limit:.0f} s waiting for FSDP worker rank(s) "
                                                f"{sorted(pending.values())} to {what}")
                ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=min(POLL_S, deadline - now))
                for ref in ready:
                    rank = pending.pop(ref)
                    try:
                        replies[rank] = _reply(ref, rank, what)
                    except RankDied:
                        raise
                    except RuntimeError as exc:  # a collective fails on every rank when one dies: wait a little
                        if failed is None:      # for a death to be reported, the cause to name
                            failed, grace_end = exc, time.monotonic() + DEATH_GRACE_S
            if failed is not None:
                raise failed
        except BaseException:
            self._finalizer()
            raise
        return [replies[r] for r in sorted(replies)]


class RankDied(RuntimeError):
    """A rank actor died while the engine waited for it."""


def _reply(ref: Any, rank: int, what: str) -> Any:
    """The value of a finished rank task, or the error naming the rank (its death, or its traceback)."""
    import ray

    try:
        return ray.get(ref, timeout=GET_TIMEOUT_S)
    except ray.exceptions.RayActorError as exc:
        raise RankDied(f"FSDP worker rank {rank} died ({why_died(exc)}) while the engine waited for it "
                       f"to {what}") from None
    except ray.exceptions.RayTaskError as exc:
        raise RuntimeError(f"FSDP worker rank {rank} failed to {what}:\n{exc}") from None


def _export_ref(rank: FSDPRank, master: bool) -> list[Any] | None:
    """Rank 0: the gathered weights put into Ray's object store (owned by rank 0's actor); others: None."""
    import ray

    state = rank.export(master)  # a collective: every rank takes part
    # (a list: the reference, not the value; SharedState: raw bytes, read in place by every actor)
    return None if state is None else [ray.put(SharedState(state)), state_bytes(state)]


class RayFSDPTrainEngine(FSDPTrainEngine):
    """An `FSDPTrainEngine` whose ranks are Ray actors (built by `start_ray_fsdp`)."""

    def export_weights_ref(self, master: bool = False) -> Any:
        """The full weights (as `export_weights` returns them) as an `ObjectRef` of rank 0's, not pulled into
        this process; returned once every rank has finished the gather. Rank 0's actor owns the object:
        it is lost when the engine closes, so read it before then."""
        return export_ref(self, master)

    def placement(self) -> list[dict[str, Any]]:
        """Each rank's {"rank", "node_id", "pid"} (for the run's summary)."""
        links = self.links
        if not isinstance(links, RayRankLinks) or not links.alive:
            raise RuntimeError("the FSDP train engine is closed (after close() or an earlier worker failure)")
        return links.where(self.timeout_s)


def start_ray_fsdp(model_dir: str | Path, *, actor_options: list[dict[str, Any]], **engine: Any) -> RayFSDPTrainEngine:
    """An FSDP engine over Ray rank actors, rank r started with `actor_options[r]` (Ray's `.options()`:
    num_cpus, num_gpus, name, scheduling_strategy...); `engine`: `FSDPTrainEngine`'s keywords
    (`world_size`, `lr`, `device`: "cuda" (NCCL; each rank's options must ask for a GPU) or "cpu"
    (gloo), ...). `model_dir` must be readable on every rank's node, and `save`'s folder writable where
    the driver and rank 0 run (the driver writes the model, rank 0 the optimizer state)."""
    options = [dict(o) for o in actor_options]
    return RayFSDPTrainEngine(model_dir, links=lambda spec: RayRankLinks(spec, options), **engine)


# ---------------------------------------------------------------------------------------------------
# the collective weight path on the ranks (`asyncflow.runtime.ray_weights`): rank 0 is the sender
# ---------------------------------------------------------------------------------------------------


def export_ref(engine: FSDPTrainEngine, master: bool = False) -> Any:
    """The full weights as an `ObjectRef` of rank 0's (for any FSDP engine over Ray links)."""
    ref, engine.last_export_bytes = engine.call_ranks(_export_ref, [(master,)] * engine.world_size, "gather the full weights")[0]
    return ref


def _port(rank: FSDPRank) -> WeightPort:
    port: WeightPort | None = getattr(rank, "weight_port", None)
    if port is None:
        raise RuntimeError(f"FSDP rank {rank.rank} holds no weight port (rank 0 joins the weight group)")
    return port


def rank_weights_address(rank: FSDPRank) -> tuple[str, int] | None:
    return WeightPort.address() if rank.rank == 0 else None


def rank_join_weights(rank: FSDPRank, host: str, port: int, size: int, epoch: int, backend: str,
                      bucket_bytes: int, timeout_s: float) -> None:
    """Rank 0 joins weight group `epoch` as its rank 0 (the others are not in it)."""
    if rank.rank == 0:
        if getattr(rank, "weight_port", None) is None:
            rank.weight_port = WeightPort(bucket_bytes, timeout_s)  # type: ignore[attr-defined]
        _port(rank).join(host, port, 0, size, epoch, backend)


def rank_send_weights(rank: FSDPRank, version: int) -> None:
    """Every rank takes part in the gather; rank 0 broadcasts the result to the weight group."""
    state = rank.export(False)
    if state is not None:
        _port(rank).send(state, version)


def rank_published(rank: FSDPRank, version: int) -> Any:
    """Rank 0: the state it last sent, put into the object store, if it is `version` (else None)."""
    import ray

    if rank.rank != 0:
        return None
    state = _port(rank).published(version)
    return None if state is None else [ray.put(SharedState(state))]


class FSDPTrainerActor(TrainerActor):
    """Actor: the trainer with `train.engine: fsdp` on Ray. It holds no weights itself: it splits each
    batch among the rank actors (one placement-group bundle each, `rank_options`) and combines their
    replies, as `FSDPTrainEngine` does for local ranks; weights go from rank 0 straight to the rollout
    actors (an object-store reference, or the collective broadcast)."""

    def __init__(self, cfg: Config, model_dir: str, threads: int, rank_options: list[dict[str, Any]]) -> None:
        from asyncflow.engines.factory import make_train_engine

        quiet_transformers()
        limit_malloc_arenas()  # (asyncflow.malloc_arena says why)
        self.cfg = cfg
        self.engine: FSDPTrainEngine = make_train_engine(  # type: ignore[assignment]
            cfg, Path(model_dir), threads=threads, links=lambda spec: RayRankLinks(spec, rank_options))
        self.port = weight_port(cfg)

    def export_weights(self) -> Any:  # type: ignore[override]
        """A reference to the weights rank 0 stored (never copied into this actor)."""
        return export_ref(self.engine)

    def weights_address(self) -> tuple[str, int]:
        return self._ranks(rank_weights_address, (), "open a port for the weight group")[0]  # type: ignore[no-any-return]

    def join_weights(self, host: str, port: int, rank: int, size: int, epoch: int, backend: str) -> None:
        args = (host, port, size, epoch, backend, self.port.bucket_bytes, self.port.timeout_s)
        self._ranks(rank_join_weights, args, f"join weight group {epoch}")

    def send_weights(self, version: int) -> None:
        self._ranks(rank_send_weights, (version,), f"send policy version {version}")

    def published(self, version: int) -> Any:
        reply = self._ranks(rank_published, (version,), f"hand out policy version {version}")[0]
        return None if reply is None else reply[0]

    def placement(self) -> list[dict[str, Any]]:
        links = self.engine.links
        ranks = links.where(self.engine.timeout_s) if isinstance(links, RayRankLinks) else []
        return [{"role": "trainer", "index": r["rank"], "node_id": r["node_id"], "pid": r["pid"]} for r in ranks]

    def _ranks(self, fn: Any, args: tuple[Any, ...], what: str) -> list[Any]:
        return self.engine.call_ranks(fn, [args] * self.engine.world_size, what)
