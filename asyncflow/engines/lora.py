"""LoRA (`model.lora`): the trainer wraps its model in a PEFT LoRA adapter, and what it publishes is
the adapter alone, so a weight sync moves the adapter's bytes, not the model's.

A published adapter is a plain name -> tensor dict (every transport that carries weights carries it:
in-process, Ray's object store, the collective broadcast, a weight folder) holding PEFT's own
state-dict keys (`base_model.model.<module>.lora_A.weight`, as adapter_model.safetensors spells them)
plus one marker entry, `ADAPTER_KEY`: the adapter's PEFT config as JSON bytes. Engines that cannot
serve an adapter merge it: W = W_base + (alpha / r) B A, always onto the kept base weights, so each
version replaces the previous one instead of adding to it.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch

ADAPTER_KEY = "asyncflow.lora_adapter"  # the marker entry: uint8 JSON of the adapter's PEFT config
_PREFIX = "base_model.model."  # PEFT's prefix of the wrapped model's module names
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def wrap(model: Any, settings: Any) -> Any:
    """`model` as a PEFT model with a fresh LoRA adapter (`settings`: the `model.lora` section); only
    the adapter's parameters require grad."""
    import peft

    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.target_modules, task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # (peft reads transformers' deprecated `is_gradient_checkpointing`)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, config)


def set_dropout(model: Any, on: bool) -> None:
    """LoRA dropout on (train step) or off: the trainer runs in eval mode otherwise (see eval_mode)."""
    for name, module in model.named_modules():
        if name.endswith("lora_dropout.default"):
            module.training = on


def adapter_state(model: Any, dtype: torch.dtype, state_dict: dict[str, torch.Tensor] | None = None,
                  adapter: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors (CPU copies in `dtype`) and the marker entry: what a publication sends.
    `state_dict`: the model's parameters as gathered elsewhere (FSDP), else the model's own; `adapter`:
    which of the PEFT model's named adapters (its keys then carry no adapter name, as PEFT saves them)."""
    import peft

    tensors = peft.get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=adapter)
    state = {k: v.detach().to("cpu", dtype=dtype, copy=True) for k, v in tensors.items()}
    state[ADAPTER_KEY] = _encode(model.peft_config[adapter].to_dict())
    return state


def _encode(config: dict[str, Any]) -> torch.Tensor:
    text = json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v))
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def is_adapter(state: Any) -> bool:
    return isinstance(state, dict) and ADAPTER_KEY in state


def adapter_config(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The PEFT config (adapter_config.json's content) a published adapter carries."""
    return json.loads(bytes(state[ADAPTER_KEY].tolist()).decode())  # type: ignore[no-any-return]


def deltas(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Base-model weight name -> (alpha / r) B A for every adapted module (float32)."""
    config = adapter_config(state)
    rank = float(config["r"])
    scale = float(config["lora_alpha"]) / (rank**0.5 if config.get("use_rslora") else rank)
    out: dict[str, torch.Tensor] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        delta = scale * (state[f"{module}.lora_B.weight"].float() @ a.float())
        # (GPT-2's Conv1D stores its weight as [in, out]: PEFT marks such adapters fan_in_fan_out)
        out[f"{module.removeprefix(_PREFIX)}.weight"] = delta.T if config.get("fan_in_fan_out") else delta
    return out


def adapter_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state`'s adapter cannot merge into `model` (a module it adapts is missing or of another
    shape), or None."""
    odd = [k for k in state if k != ADAPTER_KEY and not k.endswith((".lora_A.weight", ".lora_B.weight"))]
    if odd or adapter_config(state).get("use_dora"):  # (embedding adapters, DoRA magnitudes: not mergeable here)
        return f"the adapter holds {odd[0] if odd else 'DoRA magnitudes'}, which this engine cannot merge"
    params = dict(model.named_parameters())
    for name, delta in deltas(state).items():
        if name not in params:
            return f"the adapter targets {name}, which the model does not have"
        if tuple(params[name].shape) != tuple(delta.shape):
            return f"{name}: the adapter's update is {tuple(delta.shape)}, the weight {tuple(params[name].shape)}"
    return None


@torch.no_grad()
def merge_into(model: torch.nn.Module, state: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    """Set each adapted weight of `model` to its base weight plus the adapter's update, and every weight
    an earlier adapter changed but this one does not back to its base. `base` keeps the base weights
    (filled on first use): every version merges onto the base, not onto the last merge."""
    params = dict(model.named_parameters())
    updates = deltas(state)
    for name in base.keys() - updates.keys():
        params[name].copy_(base[name])
    for name, delta in updates.items():
        param = params[name]
        if name not in base:
            base[name] = param.detach().clone()
        param.copy_((base[name].float() + delta.to(param.device)).to(param.dtype))


def no_adapter() -> dict[str, torch.Tensor]:
    """An adapter that changes no weight: merged, it puts back the base model's weights."""
    return {ADAPTER_KEY: _encode({"r": 1, "lora_alpha": 1})}


def write_folder(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """A published adapter as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in state.items() if k != ADAPTER_KEY}
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as fh:
        json.dump(adapter_config(state), fh, indent=2, sort_keys=True)


def is_adapter_folder(path: str | Path) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE)) and os.path.isfile(os.path.join(path, WEIGHTS_FILE))


def read_folder(path: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT adapter folder as a published adapter (the inverse of `write_folder`)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, CONFIG_FILE), encoding="utf-8") as fh:
        config = json.load(fh)
    state = load_file(os.path.join(path, WEIGHTS_FILE))
    state[ADAPTER_KEY] = _encode(config)
    return state


def load_adapter_weights(model: Any, path: str | Path) -> None:
    """Put the adapter saved in `path` (a checkpoint) into the PEFT `model`'s adapter."""
    import peft
    from safetensors.torch import load_file

    result = peft.set_peft_model_state_dict(model, load_file(os.path.join(path, WEIGHTS_FILE)))
    missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k]
    if missing:
        raise ValueError(f"{path}: the saved adapter lacks {missing[0]} (another model.lora shape?)")


def save(model: Any, path: str, *, merged_dtype: torch.dtype | None) -> None:
    """The adapter in PEFT layout into `path`; with `merged_dtype`, also the merged model (in that
    dtype) into `path/merged`."""
    model.save_pretrained(path)
    if merged_dtype is not None:
        import copy

        merged = copy.deepcopy(model).merge_and_unload()
        merged.to(dtype=merged_dtype).save_pretrained(os.path.join(path, "merged"))
