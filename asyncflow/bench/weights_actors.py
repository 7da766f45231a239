"""The processes of `asyncflow bench weights`: a trainer and rollout engines as Ray actors.

They are the runtime's own actor classes (`TrainerActor`, `RolloutActor`) built around a model
made from a config in memory (or a model folder: `model=DIR`, whose new versions come from train
steps) instead of a run's config, so every publication takes
the runtime's code path: `export_weights` / `send_weights` on the trainer, `load_weights` /
`receive_weights` on a rollout actor, `WeightPort` for the broadcast group. The folder path for
server engines writes with `WeightFolderWriter` (what an `openai` engine does) and loads the way
`asyncflow serve`'s `/admin/load_weights` route does (`read_weights`, then `request_weights`).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from asyncflow.runtime.ray_actors import RolloutActor, TrainerActor
from asyncflow.runtime.ray_weights import WeightPort

SHAPES: dict[str, dict[str, Any]] = {  # Qwen2.5's published configs (tie_word_embeddings as they ship)
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True},
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 512, "tie_word_embeddings": True},
}


def build_model(shape: str, dtype: torch.dtype, *, initialise: bool) -> Any:
    """A Qwen2 causal LM of `shape` in `dtype`: randomly initialised (`initialise`), else left as
    allocated (a receiver's weights are overwritten by the first publication; initialising 1 GB on
    two cores costs seconds per engine)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)
    skip: Any = contextlib.nullcontext()
    if not initialise:
        from transformers.initialization import no_init_weights

        skip = no_init_weights()
    with skip:
        model = Qwen2ForCausalLM(config)
    model.tie_weights()  # (skipping the initialisation skips the tying too)
    return model.to(dtype).eval()  # type: ignore[arg-type]


def mark(model: Any, version: int) -> None:
    """Make `version`'s weights differ from the last version's (the first element of every tensor),
    so a receiver that kept old weights is caught by `digest`."""
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[0] = float(version % 7 + 1) / 8


def digest(state: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> float:
    """A cheap fingerprint of a state dict: a strided sample of every tensor (each tensor's first
    element among it), cast to `dtype` first when given (the sender's float32 as published)."""
    total = 0.0
    for k, v in sorted(state.items()):
        sample = v.detach().reshape(-1)[::9973]
        if dtype is not None and v.is_floating_point():
            sample = sample.to(dtype)
        total += float(sample.double().sum()) * (1 + len(k) % 5)
    return total


class BenchTrainer(TrainerActor):
    """The trainer: a `TorchTrainEngine` (float32 master weights, `dtype` exports) around a fresh model
    of `shape`, or the model in `model_dir`; publishing full weights, or deltas (`sync`)."""

    def __init__(self, shape: str, dtype: str, bucket_bytes: int, timeout_s: float, threads: int,
                 model_dir: str | None = None, lr: float = 1e-5) -> None:
        from asyncflow.engines.torch_train import TorchTrainEngine

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model: Any = model_dir if model_dir is not None else build_model(shape, torch.float32, initialise=True)
        self.torch_engine = TorchTrainEngine(model, lr=lr, dtype=getattr(torch, dtype))
        self.engine: Any = self.torch_engine
        self.engine.reuse_export_memory()  # (as `TrainerActor.__init__`: the runtime's trainer does)
        self.port = WeightPort(bucket_bytes, timeout_s)
        self.train = model_dir is not None  # new versions by train steps (else `mark`)
        self.vocab = int(self.torch_engine.model.config.vocab_size)

    def sync(self, kind: str) -> None:
        """Publish full weights from now on, or deltas (a new encoder: its first publication is full)."""
        from asyncflow.engines.delta_train import DeltaTrainEngine

        self.engine = DeltaTrainEngine(self.torch_engine) if kind == "delta" else self.torch_engine

    def last_publication(self) -> tuple[int | None, float | None]:
        """(bytes, share of the elements that changed) of the last delta publication; (None, None) for
        a full one."""
        last = getattr(self.engine, "last", None)
        if last is None or not last.is_delta:
            return None, None
        return last.nbytes, last.changed_elements / max(last.total_elements, 1)

    def params(self) -> tuple[int, int]:
        """(parameters, bytes of one export in the compute dtype), tied weights counted once."""
        seen: dict[int, int] = {}
        for p in self.torch_engine.model.parameters():
            seen[p.data_ptr()] = p.numel()
        n = sum(seen.values())
        return n, n * torch.empty((), dtype=self.torch_engine.dtype).element_size()

    def new_version(self, version: int) -> float:
        """Change the weights for `version` (a train step of the real model, else `mark`); the digest
        of what the engines must then hold."""
        if self.train:
            self.torch_engine.train_step(pg_batch(self.vocab, version), pg_loss, 1.0)
        else:
            mark(self.torch_engine.model, version)
        return digest(self.torch_engine.model.state_dict(), self.torch_engine.dtype)

    def write_folder(self, root: str, model_dir: str, version: int, session: str) -> str:
        """Export and write `version` as a server engine's weight folder (once per version)."""
        from asyncflow.engines.server_sync import WeightFolderWriter

        # (reuse_files: the engines read as `asyncflow serve` does, under `map_file`'s lock)
        writer = WeightFolderWriter(Path(root), Path(model_dir), in_place=False, session=session, reuse_files=True)
        return str(asyncio.run(writer.folder_for(self.engine.export_weights(), version)))


def pg_batch(vocab: int, seed: int, rows: int = 4, length: int = 48) -> Any:
    """A policy-gradient batch of random token sequences (the last 3/4 of each trained, advantages
    +1 and -1): a train step moves the weights as an RL step of that size does."""
    from asyncflow.engines.base import TrainBatch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    mask = torch.zeros(rows, length - 1)
    mask[:, length // 4 :] = 1.0
    adv = torch.tensor([1.0, -1.0] * (rows // 2))
    return TrainBatch(ids, torch.ones_like(ids), mask, adv, torch.zeros(rows, length - 1))


def pg_loss(logp: torch.Tensor, mb: Any, norm: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -(logp * mb.response_mask * mb.advantages[:, None]).sum() / norm.tokens, {}


class BenchRollout(RolloutActor):
    """A rollout actor holding an `HFEngine` of the same shape (no rollout loop: it only loads)."""

    def __init__(self, index: int, shape: str, dtype: str, bucket_bytes: int, timeout_s: float, threads: int,
                 model_dir: str | None = None, lr: float = 0.0) -> None:
        from asyncflow.engines.hf import HFEngine

        sys.setswitchinterval(0.001)  # (as `RolloutActor`: the decode thread gets the GIL back sooner)
        torch.set_num_threads(threads)
        self.index = index
        model: Any = model_dir if model_dir is not None else build_model(shape, getattr(torch, dtype), initialise=False)
        self.hf = HFEngine(model, eos_token_id=0, dtype=getattr(torch, dtype), name=f"rollout-{index}")
        self.engine = self.hf
        self.connected = None
        self.port = WeightPort(bucket_bytes, timeout_s)
        self.timeout_s = timeout_s

    def digest(self) -> float:
        return digest(self.hf.model.state_dict())

    def storages(self) -> list[int]:
        """The data pointers of the engine's parameters (unchanged by a load in place)."""
        return [p.data_ptr() for p in self.hf.model.parameters()]

    async def load_folder(self, folder: str, version: int, mode: str) -> dict[str, float]:
        """What `asyncflow serve`'s `/admin/load_weights` does with a folder: read it, then load."""
        from asyncflow.weight_folder import read_weights

        def load() -> float:
            state = read_weights(Path(folder), self.hf.model)
            return self.hf.request_weights(state, version, mode).result(timeout=self.timeout_s)  # type: ignore[arg-type]

        return {"seconds": await asyncio.to_thread(load)}
