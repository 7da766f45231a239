"""The processes of `asyncflow bench weights`: a trainer and rollout engines as Ray actors.

They are the runtime's own actor classes (`TrainerActor`, `RolloutActor`) built around a model
made from a config in memory instead of a run's config and model folder, so every publication takes
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
    """The trainer: a `TorchTrainEngine` (float32 master weights, `dtype` exports) around a fresh model."""

    def __init__(self, shape: str, dtype: str, bucket_bytes: int, timeout_s: float, threads: int) -> None:
        from asyncflow.engines.torch_train import TorchTrainEngine

        torch.set_num_threads(threads)
        torch.manual_seed(0)
        model = build_model(shape, torch.float32, initialise=True)
        self.torch_engine = TorchTrainEngine(model, lr=1e-5, dtype=getattr(torch, dtype))
        self.engine = self.torch_engine
        self.engine.reuse_export_memory()  # (as `TrainerActor.__init__`: the runtime's trainer does)
        self.port = WeightPort(bucket_bytes, timeout_s)

    def params(self) -> tuple[int, int]:
        """(parameters, bytes of one export in the compute dtype), tied weights counted once."""
        seen: dict[int, int] = {}
        for p in self.torch_engine.model.parameters():
            seen[p.data_ptr()] = p.numel()
        n = sum(seen.values())
        return n, n * torch.empty((), dtype=self.torch_engine.dtype).element_size()

    def new_version(self, version: int) -> float:
        """Change the weights for `version`; the digest of what the engines must then hold."""
        mark(self.torch_engine.model, version)
        return digest(self.torch_engine.model.state_dict(), self.torch_engine.dtype)

    def write_folder(self, root: str, model_dir: str, version: int, session: str) -> str:
        """Export and write `version` as a server engine's weight folder (once per version)."""
        from asyncflow.engines.server_sync import WeightFolderWriter

        # (reuse_files: the engines read as `asyncflow serve` does, under `map_file`'s lock)
        writer = WeightFolderWriter(Path(root), Path(model_dir), in_place=False, session=session, reuse_files=True)
        return str(asyncio.run(writer.folder_for(self.engine.export_weights(), version)))


class BenchRollout(RolloutActor):
    """A rollout actor holding an `HFEngine` of the same shape (no rollout loop: it only loads)."""

    def __init__(self, index: int, shape: str, dtype: str, bucket_bytes: int, timeout_s: float, threads: int) -> None:
        from asyncflow.engines.hf import HFEngine

        sys.setswitchinterval(0.001)  # (as `RolloutActor`: the decode thread gets the GIL back sooner)
        torch.set_num_threads(threads)
        self.index = index
        self.hf = HFEngine(build_model(shape, getattr(torch, dtype), initialise=False), eos_token_id=0,
                           dtype=getattr(torch, dtype), name=f"rollout-{index}")
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
