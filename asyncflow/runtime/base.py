"""The runtime seam: what the runner asks of wherever the workflow's components run.

`local` (`asyncflow.runtime.local.LocalRuntime`): one process; the engines and the trainer are
objects here and the pipeline runs every stage loop itself. `ray` (`asyncflow.runtime.ray_runtime.
RayWorkers`): the feeder, rollout, reward and trainer are actors; the store is a controller actor.
The runner builds a `RuntimeSetup`, starts the class `runtime_class(cfg.runtime.kind)` names, and
from then on talks only to this interface: it never branches on the runtime's kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from asyncflow.config import Config

RUNTIMES = {"local": "asyncflow.runtime.local:LocalRuntime", "ray": "asyncflow.runtime.ray_runtime:RayWorkers"}


@dataclass
class RuntimeSetup:
    """What a runtime is started from."""

    cfg: Config
    policy_dir: Path  # the policy's weights: the base model, or a resumed run's checkpoint
    model_dir: Path  # the base model (its tokenizer and server settings)
    rows: list[dict[str, Any]]  # the training prompts
    out: Path  # the run folder
    reward_fn_path: str | list[str]  # `reward.fn`: one function or several
    tok: Any  # the run's `asyncflow.tokenizer.Tokenizer`
    threads: int  # torch threads of the trainer and each engine's process
    version: int  # the policy version the weights in `policy_dir` are
    log: Callable[[str], None]
    steps: int = 0  # train steps already taken (a resumed run's)


class Runtime(Protocol):
    """A started runtime: its engines, trainer and (remote) stages, and how to end them."""

    engines: list[Any]  # `InferenceEngine`s: the rollout workers' (engine 0 also serves evaluation)
    trainer: Any  # the `TrainEngine`
    store: Any  # the store the stages share (None: the pipeline holds its own, in this process)
    gate: Any  # the staleness gate (None: the pipeline's own)
    restarts: dict[str, int]  # actor restarts by stage ("rollout/0"), for the summary
    collect_ahead: bool  # the trainer collects its next batch during a train step (`Trainer`)
    stages_elsewhere: bool  # the feeder, rollout and reward stages run in actors (`build_pipeline`)
    # every other process's stack dump by name, for the stall watchdog (None: there is none)
    remote_stacks: Callable[[], Awaitable[dict[str, str]]] | None

    def stages(self) -> dict[str, Awaitable[None]] | None:
        """The stage loops that run elsewhere, by name, for `Pipeline.run(remote=...)`; None: all here."""

    def restore_feeder(self, pipeline: Any, next_group: int, version: int, admitted: int) -> None:
        """Resume the feeder at draw `next_group` with the gate at `version` (`Feeder.restore`)."""

    def row_fields(self) -> dict[str, float]:
        """What each train row adds about the runtime (Ray: actor restarts so far)."""

    def collect(self, tracer: Any, counters: Any) -> None:
        """Merge what ran elsewhere (trace spans, counters) into the driver's, once the run ends."""

    def summary(self) -> dict[str, Any]:
        """What `summary.json` says of the runtime, once the stages stopped: `restarts` by stage, `actors`
        (where each component runs: [{role, index, node_id, pid}]), and what else it counted."""

    def shutdown(self) -> None:
        """Stop the engines, the trainer and the actors (not Ray itself)."""


def runtime_class(kind: str) -> Any:
    """The runtime class of `runtime.kind` (imported on demand: Ray loads only for `ray`)."""
    module, name = RUNTIMES[kind].split(":")
    return getattr(importlib.import_module(module), name)
