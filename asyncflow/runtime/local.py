"""The `local` runtime: every component in this process (asyncio + threads).

The engines and the trainer are built by the engine factory (or, for `rollout.engine: openai`,
connected to their servers); the pipeline runs every stage loop itself and holds the store.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any

from asyncflow.engines.factory import make_inference_engine, make_train_engine
from asyncflow.runtime.base import RuntimeSetup


class LocalRuntime:
    """Engines and trainer in this process; the pipeline runs every stage (see `Runtime`)."""

    absolute_folder = False  # the run folder as the user gave it (no other process opens it)
    opens_folder_first = False  # the folder is written once the run is built
    trainer_here = True  # the trainer's device is this process's (the KL reference may share it)
    restarts_from_start: bool = False  # no actor is ever rebuilt from the folder the run started from
    store = None
    gate = None

    def __init__(self, engines: list[Any], trainer: Any) -> None:
        self.engines = engines
        self.trainer = trainer
        self.restarts: dict[str, int] = {}

    @classmethod
    async def launch(cls, setup: RuntimeSetup) -> LocalRuntime:
        cfg = setup.cfg
        trainer = make_train_engine(cfg, setup.policy_dir, threads=setup.threads)
        try:
            if cfg.rollout.engine == "openai":
                from asyncflow.engines.openai_engine import connect_all, make_openai_engines

                remote = make_openai_engines(cfg.rollout, setup.model_dir, setup.out)
                await connect_all(remote, trainer.export_weights())
                if setup.version:
                    await asyncio.gather(*(e.load_weights(trainer.export_weights(), setup.version, "drain")
                                           for e in remote))
                engines: list[Any] = list(remote)
            else:
                engines = [make_inference_engine(cfg, setup.policy_dir, setup.tok, i, setup.version)
                           for i in range(cfg.rollout.workers)]
        except BaseException:
            trainer.close()
            raise
        return cls(engines, trainer)

    def stages(self) -> dict[str, Awaitable[None]] | None:
        return None

    def restore_feeder(self, pipeline: Any, next_group: int, version: int, admitted: int) -> None:
        pipeline.restore_feeder(next_group, version, admitted)

    def row_fields(self) -> dict[str, float]:
        return {}

    def collect(self, tracer: Any, counters: Any) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """Everything ran in this process (fsdp ranks: its child processes)."""
        return {"restarts": {}, "actors": [{"role": "local", "index": 0, "node_id": None, "pid": os.getpid()}]}

    def shutdown(self) -> None:
        self.trainer.close()
