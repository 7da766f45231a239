"""LoRA on the FSDP engine (`model.lora` with train.engine=fsdp): each rank wraps its model in the
PEFT adapter before `fully_shard` (FSDP2 shards frozen base weights and trainable adapter weights
alike; only the adapter's get gradients and optimizer state). Publications gather only the adapter's
parameters (one all-gather each); the KL reference is the same sharded model with the adapter off.

Rank-side functions take the `FSDPRank` (`f(rank, *args)`, the engine's `call_ranks` form); the
engine-side ones take the `FSDPTrainEngine`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from asyncflow.engines import lora as lora_adapter

_ADAPTER = "default"  # PEFT's adapter name inside the module names (`lora_A.default.weight`)


def gather_adapter(rank: Any, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The adapter as a publication (`lora.adapter_state`'s form) on rank 0, None on the others. A
    collective: every rank gathers each trainable parameter in the same order."""
    full = {}
    for name, param in rank.model.named_parameters():
        if param.requires_grad:
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            full[name] = value.detach().to("cpu", dtype=dtype)
    if rank.rank != 0:
        return None
    return lora_adapter.adapter_state(rank.model, dtype, state_dict=full)


def reference_logprobs(rank: Any, share: Any, dummy: Any, temperature: float) -> torch.Tensor | None:
    """The base model's log-probs of this rank's share: the adapter off for the passes."""
    with rank.model.disable_adapter():
        return rank.logprobs(share, dummy, temperature)  # type: ignore[no-any-return]


def gather_merged(rank: Any, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """The merged model's full state dict (plain transformers names) on rank 0, None on the others."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state: dict[str, Any] = get_model_state_dict(rank.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    adapter = gather_adapter(rank, torch.float32)
    if rank.rank != 0 or adapter is None:
        return None
    plain = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
             for k, v in state.items() if "lora_" not in k}
    for name, delta in lora_adapter.deltas(adapter).items():
        plain[name] = plain[name].float() + delta
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in plain.items()}


def load_adapter(rank: Any, path: str) -> None:
    """Put a checkpoint's adapter (PEFT layout) into the sharded model (every rank reads the file)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    saved = load_file(os.path.join(path, lora_adapter.WEIGHTS_FILE))
    # PEFT's file names drop the adapter name the module names carry: lora_A.weight -> lora_A.default.weight
    state: dict[str, Any] = {k.replace(".lora_A.", f".lora_A.{_ADAPTER}.").replace(".lora_B.", f".lora_B.{_ADAPTER}."): v
             for k, v in saved.items()}
    result = set_model_state_dict(rank.model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise ValueError(f"{path}: the saved adapter lacks {missing[0]} (another model.lora shape?)")


def save(engine: Any, path: str, *, with_optimizer: bool, config: Any) -> None:
    """The adapter in PEFT layout into `path` (a checkpoint's in float32, with the optimizer state);
    with `model.lora.save_merged`, the final folder also gets the merged model (`config`: the base
    model's transformers config) in `path/merged`."""
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if with_optimizer else engine.dtype
    state = engine.call_ranks(gather_adapter, [(dtype,)] * engine.world_size, "gather the adapter")[0]
    lora_adapter.write_folder(state, path)
    if engine.lora.save_merged and not with_optimizer:
        merged = engine.call_ranks(gather_merged, [(engine.dtype,)] * engine.world_size, "gather the merged weights")[0]
        model = AutoModelForCausalLM.from_config(config, dtype=engine.dtype)
        model.load_state_dict(merged, strict=True)
        model.save_pretrained(os.path.join(path, "merged"))
    if with_optimizer:
        engine.call_ranks("save_optimizer", [(path,)] * engine.world_size, "save the optimizer state")
