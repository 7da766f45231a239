"""What `asyncflow tinker-serve` builds, from its options or from an asyncflow run config (`--config`).

A run config gives the service the same model, engines, devices and Ray placement a training run of
that config would use:

    model.path / task, model.device, model.dtype    the base model, where it runs, its compute dtype
    rollout.engine (hf, vllm, openai), rollout.workers, rollout.max_batch, rollout.server_*   sampling
    train.engine (torch, fsdp), train.world_size, train.worker_timeout_s                       training
    runtime.kind: ray, runtime.address, runtime.*_cpus / *_gpus / *_resource, placement_*     placement
    workflow.max_staleness                          streaming (`--max-staleness`); unset: the plain loop
    seed

The rest of a run config (dataset, reward, algorithm, eval, train.lr, ...) belongs to the client's loop;
keys of it that the config sets are named in one line and not used.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.config import Config

MAX_ENGINES = 4  # sampling engines built on demand when nothing sets rollout.workers
MAX_BATCH = 64  # sequences one sampling engine decodes at once when nothing sets rollout.max_batch
LORA_RANK = 64  # vllm: the largest adapter rank its samplers serve when model.lora sets none
USED = ("model.", "rollout.engine", "rollout.workers", "rollout.max_batch", "rollout.server_", "rollout.sync_",
        "rollout.launch_servers",
        "rollout.request_timeout_s", "train.engine", "train.world_size", "train.worker_timeout_s", "runtime.",
        "workflow.max_staleness", "seed", "task")


@dataclass
class ServeSettings:
    model_dir: Path
    device: str = "auto"  # cpu, cuda, auto (model.device)
    dtype: str = "float32"  # the sampling engines' compute dtype (training keeps float32)
    sampler: str = "hf"  # hf, vllm, openai (rollout.engine)
    max_engines: int = MAX_ENGINES
    max_batch: int = MAX_BATCH
    trainer: str = "torch"  # torch, fsdp (train.engine)
    world_size: int = 1
    worker_timeout_s: float = 600.0
    ray: bool = False
    max_staleness: int = 0
    seed: int = 0
    lora_rank: int = LORA_RANK
    cfg: Config | None = None  # the run config (servers, Ray placement), if one was given

    @property
    def key(self) -> str:
        """What names the model folder in messages."""
        return "model.path" if self.cfg is not None else "tinker-serve MODEL_DIR"


def from_config(cfg: Config, explicit: set[str], log: Callable[[str], None]) -> ServeSettings:
    """The settings a run config gives (`explicit`: the keys it set); the model folder resolved as a
    run resolves it (a Hub id, a .gguf file, a task pack's model)."""
    from asyncflow.inputs import resolve_model_dir

    leaves = {k for k in explicit if not any(other.startswith(f"{k}.") for other in explicit)}
    unused = sorted(k for k in leaves if not k.startswith(USED))
    if unused:
        log(f"tinker-serve: the client's loop decides these, so they are not used: {', '.join(unused)}")
    r = cfg.rollout
    if "rollout.workers" in explicit:
        engines = r.workers
    else:
        servers = r.workers if r.launch_servers is not None else len(r.server_urls or [])
        engines = servers if r.engine == "openai" else 1 if r.engine == "vllm" else MAX_ENGINES
    return ServeSettings(
        model_dir=resolve_model_dir(cfg, log), device=cfg.model.device, dtype=cfg.model.dtype, sampler=r.engine,
        max_engines=max(1, engines), max_batch=r.max_batch if "rollout.max_batch" in explicit else MAX_BATCH,
        trainer=cfg.train.engine, world_size=cfg.train.world_size, worker_timeout_s=cfg.train.worker_timeout_s,
        ray=cfg.runtime.kind == "ray", max_staleness=cfg.workflow.max_staleness or 0, seed=cfg.seed,
        lora_rank=cfg.model.lora.r if cfg.model.lora is not None else LORA_RANK, cfg=cfg)


def with_options(settings: ServeSettings, args: Any) -> ServeSettings:
    """Command-line options given beside a config win over it."""
    if args.device is not None:
        settings.device = args.device
    if args.max_staleness is not None:
        settings.max_staleness = args.max_staleness
    return settings
