"""Where a Ray run's actors go: one resource bundle per worker actor in a placement group (refused
at once where a Ray of fixed size can never place them), and each actor's Ray options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncflow.config import Config
from asyncflow.errors import UserError


@dataclass
class Placement:
    """The worker actors' bundles: actor `i` (rollout 0..w-1, the trainer, then reward 0..) has the
    role, CPUs and GPUs `roles[i]`; one that asks for resources holds bundle `placed.index(i)` of
    `group` (None: no actor asks for any). Actors are numbered rollout 0..w-1, then the trainer's
    ranks, then reward 0.."""

    roles: list[tuple[str, float, float]]
    placed: list[int]
    group: Any
    prefix: str  # every actor's Ray name starts with it: asyncflow-<8 hex>
    max_restarts: int

    def options(self, i: int, name: str) -> dict[str, Any]:
        """Ray's options for worker actor `i`, named `<prefix>-<name>`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role, c, g = self.roles[i]
        o: dict[str, Any] = {"num_cpus": c, "num_gpus": g, "max_concurrency": 1000 if role != "train" else 1,
                             "name": f"{self.prefix}-{name}"}
        if role in ("rollout", "reward"):  # restarted by Ray, then brought back into the run by `_supervise`
            o.update(max_restarts=self.max_restarts, max_task_retries=0)
        if self.group is not None and i in self.placed:
            o["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=self.placed.index(i))
        return o

    def remove(self) -> None:
        """Free the placement group (if any)."""
        from ray.util.placement_group import remove_placement_group

        if self.group is not None:
            remove_placement_group(self.group)


LABEL_AMOUNT = 0.001  # of a custom resource (`runtime.train_resource`...) per bundle: a node label, not a count


def train_ranks(cfg: Config) -> int:
    """The trainer's actors: one per FSDP rank, else one."""
    return cfg.train.world_size if cfg.train.engine == "fsdp" else 1


def reserve(cfg: Config, n_reward: int, prefix: str) -> Placement:
    """Reserve a placement group for the worker actors that ask for resources (waiting at most
    `runtime.placement_timeout_s`)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    rt = cfg.runtime
    roles = [("rollout", rt.rollout_cpus, rt.rollout_gpus)] * cfg.rollout.workers
    roles += [("train", rt.train_cpus, rt.train_gpus)] * train_ranks(cfg)
    roles += [("reward", rt.reward_cpus, 0.0)] * n_reward
    labels = {"rollout": rt.rollout_resource, "train": rt.train_resource}
    bundles = [{k: v for k, v in (("CPU", c), ("GPU", g), (labels.get(role), LABEL_AMOUNT)) if k and v > 0}
               for role, c, g in roles]
    placed = [i for i, b in enumerate(bundles) if b]
    pg = None
    if placed:
        if rt.address is None:  # a local Ray holds all it ever will: what it cannot hold is refused now
            check_placeable([bundles[i] for i in placed], rt.placement_strategy, ray.cluster_resources(),
                            sum(1 for node in ray.nodes() if node.get("Alive")))
        pg = placement_group([bundles[i] for i in placed], strategy=rt.placement_strategy)
        if not pg.wait(timeout_seconds=rt.placement_timeout_s):
            remove_placement_group(pg)
            raise UserError(
                f"runtime: Ray cannot place the worker bundles {[bundles[i] for i in placed]} within "
                f"runtime.placement_timeout_s ({rt.placement_timeout_s:g} s; cluster resources: "
                f"{ray.cluster_resources()}); lower runtime.*_cpus / *_gpus, add nodes or raise the timeout"
            )
    return Placement(roles, placed, pg, prefix, rt.max_restarts)


def check_placeable(bundles: list[dict[str, float]], strategy: str, total: dict[str, float], nodes: int) -> None:
    """Refuse, in one line, worker bundles a Ray of fixed size can never place (more GPUs or CPUs than it
    has, or STRICT_SPREAD over more bundles than nodes): the placement group waited
    `runtime.placement_timeout_s` (2 minutes by default) before saying so."""
    for res, keys in (("GPU", "runtime.rollout_gpus / runtime.train_gpus"),
                      ("CPU", "runtime.rollout_cpus / runtime.train_cpus / runtime.reward_cpus")):
        want = sum(b.get(res, 0.0) for b in bundles)
        if want > total.get(res, 0.0) + 1e-9:
            raise UserError(f"{keys}: the workers need {want:g} {res}(s) in all; this Ray has {total.get(res, 0.0):g} "
                            f"(runtime.address: null starts a local Ray of this machine's)")
    for label in sorted({k for b in bundles for k in b} - {"CPU", "GPU"}):
        if total.get(label, 0.0) <= 0:
            raise UserError(f"runtime.train_resource / runtime.rollout_resource: no node of this Ray offers the "
                            f"resource {label!r} (ray start --resources='{{\"{label}\": 1}}' labels a node)")
    if strategy == "STRICT_SPREAD" and len(bundles) > nodes:
        raise UserError(f"runtime.placement_strategy: STRICT_SPREAD puts each of the {len(bundles)} worker bundles "
                        f"on its own node; this Ray has {nodes} node(s)")



def driver_node() -> Any:
    """Scheduling on the driver's node: the store controller and the feeder live with the driver, so
    losing a worker node never takes the run's state with it. (Hard: Ray 2.60 placed soft-affine
    zero-CPU actors on other nodes.)"""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
