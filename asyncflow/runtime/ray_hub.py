"""`runtime.colocate`: rollout actor 0 as the run's hub. One process is the store controller,
the feeder, the reward workers and rollout worker 0, so that engine's per-sample traffic (take a
prompt, write a response and take the next in one call, score a group, admit prompts) is
in-process calls on the store, as in the local runtime. The driver's calls (a trainer batch,
weights, the gate) and the other rollout actors' store calls reach the same process through Ray.

The hub answers to every method the driver and the other actors call on the store controller
(it is one), on a rollout actor and on the feeder; where their names would clash, the feeder's
loop is `feed` and its gate's close `close_gate`, the engine's close `close_engine`, and the
reward loops `run_reward(j)`. Its death ends the run, as the store controller's does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config
from asyncflow.engines.base import GenRequest, GenResult
from asyncflow.runtime.ray_actors import FeederActor, RewardActor, RolloutActor, actor_parts, plugin_cwd
from asyncflow.runtime.ray_placement import Placement
from asyncflow.transfer_queue.ray_controller import GC_THRESHOLD, OWNER_CHECK_S, StoreController
from asyncflow.transfer_queue.ray_store import RayTransferQueue


class HubActor(StoreController):
    """Actor: the store controller with rollout worker 0, the feeder and the reward workers inside."""

    def __init__(self, store: tuple[int, float, float, int], cfg: Config, model_dir: str, rows: Any, out: str,
                 reward_fn_path: str | list[str], rewards: int, threads: int, version: int = 0,
                 session: str = "", cwd: str | None = None) -> None:
        super().__init__(*store)
        # the stages take the in-process store (`self.q`): the rollout stage then writes a response
        # and refills its slot in one call (`complete_and_take`); one context for all of them
        parts = actor_parts(cfg, Path(model_dir), rows, Path(out), self.q)
        self.feeder = FeederActor(cfg, model_dir, rows, out, self.q, cwd=cwd, parts=parts)
        self.rewards = [RewardActor(j, cfg, model_dir, rows, out, self.q, reward_fn_path, parts=parts)
                        for j in range(rewards)]
        # last: the feeder and reward workers set one torch thread; the engine's setting is `threads`
        self.rollout = RolloutActor(0, cfg, model_dir, rows, out, self.q, threads, version, session=session, cwd=cwd,
                                    parts=parts)
        self.parts = parts

    # ------------------------------------------------------------------ rollout worker 0
    async def ready(self) -> int:
        return await self.rollout.ready()

    def pid(self) -> int:
        return os.getpid()

    async def run(self) -> None:
        await self.rollout.run()

    async def generate(self, request: GenRequest) -> GenResult:
        return await self.rollout.generate(request)

    async def load_weights(self, state: dict[str, torch.Tensor] | None, version: int, mode: str) -> dict[str, float]:
        return await self.rollout.load_weights(state, version, mode)

    async def join_weights(self, host: str, port: int, rank: int, size: int, epoch: int, backend: str) -> None:
        await self.rollout.join_weights(host, port, rank, size, epoch, backend)

    async def receive_weights(self, version: int, mode: str) -> dict[str, float]:
        return await self.rollout.receive_weights(version, mode)

    def cancel_older_than(self, min_version: int) -> int:
        return self.rollout.cancel_older_than(min_version)

    def stats(self) -> dict[str, float]:
        return self.rollout.stats()

    def spans(self) -> list[tuple[str, str, float, float, dict[str, Any]]]:
        """The trace spans of every stage in this process (rollout worker 0's, the reward workers')."""
        return self.parts.ctx.tracer.raw()

    async def close_engine(self) -> None:
        await self.rollout.close_engine()

    # ------------------------------------------------------------------ feeder
    def rows(self) -> list[dict[str, Any]]:
        return self.feeder.rows()

    async def feed(self) -> None:
        await self.feeder.feed()

    def restore(self, next_group: int, version: int, admitted: int) -> None:
        self.feeder.restore(next_group, version, admitted)

    def publish(self, version: int) -> None:
        self.feeder.publish(version)

    def drop(self, groups: int) -> None:
        self.feeder.drop(groups)

    def close_gate(self) -> None:
        self.feeder.close_gate()

    # ------------------------------------------------------------------ reward workers
    async def run_reward(self, index: int) -> None:
        await self.rewards[index].run()

    def reward_stats(self) -> dict[str, float]:
        """The reward workers' call counts (they share this process's counters)."""
        c = self.parts.ctx.counters
        return {"reward_calls": float(c.reward_calls), "reward_call_failures": float(c.reward_call_failures)}


def start_hub(cfg: Config, place: Placement, n_reward: int, model_dir: str, rows: list[dict[str, Any]], out: str,
              reward_fn_path: str | list[str], threads: int, version: int) -> Any:
    """Create the hub (without waiting for it): in rollout 0's bundle, named as the store controller
    (the other actors find the store by that name), never restarted."""
    import ray

    from asyncflow.workflow.settings import store_capacity

    opts = {**place.options(0, "rollout-0"), "name": f"{place.prefix}-store", "max_concurrency": 10_000,
            "max_restarts": 0}
    if cfg.rollout.launch_servers is not None:  # the bundle's resources are its server's
        from asyncflow.runtime.ray_servers import rollout_options

        opts = rollout_options(opts)
    store = (store_capacity(cfg), cfg.workflow.lease_timeout_s, OWNER_CHECK_S, GC_THRESHOLD)
    return ray.remote(HubActor).options(**opts).remote(
        store, cfg, model_dir, ray.put(rows), out, reward_fn_path, n_reward, threads, version,
        session=place.prefix, cwd=plugin_cwd(cfg))


def hub_client(hub: Any) -> RayTransferQueue:
    """The driver's client of the hub's store."""
    return RayTransferQueue(hub)
