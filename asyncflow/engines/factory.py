"""The one place engines are built from the config: the trainer named by `train.engine` and the
rollout engines named by `rollout.engine` (hf, vllm, openai), for the local runtime and the Ray
rollout actors alike.

Where an engine runs is the caller's: it passes `device` (the local runtime picks one per engine
under `model.device`; a Ray actor the device Ray gave it). A server engine (`rollout.engine:
openai`) is built unconnected; the caller awaits its `connect` and, as `loads_initial_weights`
says, loads the trainer's weights into it before its first request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from asyncflow.config import Config
from asyncflow.engines.base import InferenceEngine, TrainEngine, pick_device
from asyncflow.engines.lr_schedule import LrSchedule


def make_train_engine(cfg: Config, model_dir: Path, *, threads: int, device: str | None = None,
                      links: Callable[[Any], Any] | None = None) -> TrainEngine:
    """The `TrainEngine` named by `train.engine`, holding the weights in `model_dir`. `device`: where
    the plain torch trainer runs (None: `model.device` on this process); fsdp starts its ranks as
    child processes of this one (NCCL with a GPU per rank when there are enough, else gloo on CPU,
    sharing `threads`), or through `links` (a `fsdp_train.RankLinks` factory: the Ray runtime's rank
    actors, `threads` each)."""
    t = cfg.train
    common: dict[str, Any] = dict(lr=t.lr, weight_decay=t.weight_decay, mini_batches=t.mini_batches,
                                  micro_batch_size=t.micro_batch_size, max_grad_norm=t.max_grad_norm,
                                  dtype=getattr(torch, cfg.model.dtype), schedule=lr_schedule(cfg),
                                  gradient_checkpointing=t.gradient_checkpointing, lora=cfg.model.lora)
    if t.engine == "fsdp":
        from asyncflow.engines.fsdp_train import FSDPTrainEngine

        if links is not None:  # ranks elsewhere (Ray actors): each has its GPU when Ray gave it one
            on_gpu = cfg.model.device != "cpu" and cfg.runtime.train_gpus >= 1
            return FSDPTrainEngine(model_dir, world_size=t.world_size, device="cuda" if on_gpu else "cpu",
                                   threads=threads, timeout_s=t.worker_timeout_s, seed=cfg.seed, links=links, **common)
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= t.world_size
        return FSDPTrainEngine(model_dir, world_size=t.world_size, device="cuda" if enough else "cpu",
                               threads=max(1, threads // t.world_size), timeout_s=t.worker_timeout_s,
                               seed=cfg.seed, **common)
    from asyncflow.engines.torch_train import TorchTrainEngine

    engine: TrainEngine = TorchTrainEngine(model_dir, device=device or pick_device(cfg.model.device), **common)
    if cfg.runtime.weight_sync_delta:
        from asyncflow.engines.delta_train import DeltaTrainEngine

        engine = DeltaTrainEngine(engine)
    return engine


def lr_schedule(cfg: Config) -> LrSchedule:
    """`train.lr` over the run's optimizer steps, as `train.lr_schedule` shapes it."""
    t = cfg.train
    return LrSchedule(t.lr, kind=t.lr_schedule, warmup_ratio=t.warmup_ratio, total_steps=t.max_steps * t.mini_batches,
                      min_lr_ratio=t.min_lr_ratio, mini_batches=t.mini_batches)


def make_inference_engine(cfg: Config, model_dir: Path, tok: Any, index: int, version: int = 0,
                          device: str | None = None, *, run_dir: Path | None = None,
                          session: str = "", threads: int | None = None) -> InferenceEngine:
    """Rollout engine number `index`, named by `rollout.engine`, holding the weights in `model_dir`
    as policy `version`. `tok`: the run's `asyncflow.tokenizer.Tokenizer` (its EOS and stop ids end
    a generation). `device`: where an hf engine runs (None: `model.device`, engines spread over this
    process's GPUs); vLLM always runs on a GPU of its own choosing. openai: the engine on
    `rollout.server_urls[index]`, writing weight folders under `rollout.sync_dir` (default
    `run_dir/weight_sync`) once per version for all engines given the same `session`. `threads`: an hf
    engine's torch threads (its decode thread's own; None: the process default)."""
    if cfg.rollout.engine == "openai":
        from asyncflow.engines.openai_engine import make_openai_engine

        if run_dir is None and cfg.rollout.sync_dir is None:
            raise ValueError("an openai rollout engine needs run_dir (or rollout.sync_dir) for its weight folders")
        return make_openai_engine(cfg.rollout, index, model_dir, run_dir or Path(), session=session, version=version)
    if cfg.rollout.engine == "vllm":
        from asyncflow.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(model_dir, max_batch=cfg.rollout.max_batch, dtype=cfg.model.dtype, seed=cfg.seed + index,
                            lora_rank=None if cfg.model.lora is None else cfg.model.lora.r)
        engine.version = version
        return engine
    from asyncflow.engines.hf import HFEngine

    return HFEngine(model_dir, eos_token_id=[tok.eos_token_id, *tok.stop_ids], pad_token_id=tok.pad_token_id,
                    max_batch=cfg.rollout.max_batch, device=device or pick_device(cfg.model.device, index),
                    dtype=getattr(torch, cfg.model.dtype), seed=cfg.seed + index, name=f"rollout-{index}",
                    version=version, threads=threads)


def loads_initial_weights(cfg: Config) -> bool:
    """Whether the rollout engines start from whatever their servers hold (`rollout.engine: openai`):
    the runtime then loads the trainer's weights into them as the start version before any request."""
    return cfg.rollout.engine == "openai"
