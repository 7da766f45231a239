"""The `local` runtime: every component in this process (asyncio + threads).

The engines and the trainer are built by the engine factory (server engines, `rollout.engine:
openai`, are then connected and given the trainer's weights); the pipeline runs every stage loop
itself and holds the store.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Awaitable
from typing import Any

from asyncflow.engines.factory import loads_initial_weights, make_inference_engine, make_train_engine
from asyncflow.runtime.base import RuntimeSetup


class LocalRuntime:
    """Engines and trainer in this process; the pipeline runs every stage (see `Runtime`)."""

    absolute_folder = False  # the run folder as the user gave it (no other process opens it)
    opens_folder_first = False  # the folder is written once the run is built
    trainer_here = True  # the trainer's device is this process's (the KL reference may share it)
    restarts_from_start: bool = False  # no actor is ever rebuilt from the folder the run started from
    collect_ahead = False  # the store answers in this process: the trainer asks for a batch once it published
    stages_elsewhere = False
    remote_stacks = None  # (no other process: the stall watchdog dumps this one's stacks)
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
            # one writer session for all engines: each weight version is written once (openai)
            session = secrets.token_hex(8)
            engines = [make_inference_engine(cfg, setup.policy_dir, setup.tok, i, setup.version, run_dir=setup.out,
                                             session=session, threads=setup.threads) for i in range(cfg.rollout.workers)]
            await asyncio.gather(*(e.connect() for e in engines))
            if loads_initial_weights(cfg):
                state = trainer.export_weights()
                await asyncio.gather(*(e.load_weights(state, setup.version, "drain") for e in engines))
        except BaseException:
            trainer.close()
            raise
        return cls(engines, trainer)

    def stages(self) -> dict[str, Awaitable[None]] | None:
        return None

    def restore_feeder(self, pipeline: Any, next_group: int, version: int, admitted: int) -> None:
        pipeline.feeder.restore(next_group, version, admitted)

    def row_fields(self) -> dict[str, float]:
        return {}

    def collect(self, tracer: Any, counters: Any) -> None:
        return None

    def summary(self) -> dict[str, Any]:
        """Everything ran in this process (fsdp ranks: its child processes)."""
        return {"restarts": {}, "actors": [{"role": "local", "index": 0, "node_id": None, "pid": os.getpid()}]}

    def shutdown(self) -> None:
        self.trainer.close()
