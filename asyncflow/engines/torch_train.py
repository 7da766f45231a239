"""Plain-PyTorch train engine: one process, one device, AdamW, gradient accumulation.

A train step is `mini_batches` optimizer steps over one batch. Each mini-batch is split into
micro-batches of `micro_batch_size` rows; every micro-batch's loss is already divided by the token
count of the whole mini-batch (see algorithms/losses.py), so gradients simply accumulate and the
result does not depend on the micro-batch size.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from asyncflow.algorithms.losses import kl_estimate
from asyncflow.engines import head_logprobs
from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.attention_choice import pick_attention
from asyncflow.engines.base import LossFn, TrainBatch, TrainEngine, state_bytes
from asyncflow.engines.lr_schedule import LrSchedule, mark_steps, restored_steps, set_lr
from asyncflow.engines.master_weights import MasterWeights
from asyncflow.engines.weight_sync import aliases
from asyncflow.errors import RunFailed, UserError


@contextlib.contextmanager
def keep_hyperparameters(optimizer: torch.optim.Optimizer, keys: tuple[str, ...] = ("lr", "weight_decay")) -> Iterator[None]:
    """Loading an optimizer state brings back the saved run's `lr` and `weight_decay` with it; keep
    this run's (the config's: a resume that changes `train.lr` means it)."""
    kept = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
    yield
    for group, values in zip(optimizer.param_groups, kept, strict=True):
        group.update(values)


def token_logprobs(model: PreTrainedModel, batch: TrainBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, L-1] of each trained next token (`response_mask`; 0 elsewhere) under logits /
    temperature, and their entropy: the output head runs on those positions only, a chunk at a time."""
    length = batch.input_ids.shape[1]
    pick_attention(model, batch.input_ids.device, length, length)
    return head_logprobs.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask, temperature)


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """`train.gradient_checkpointing` (transformers' activation checkpointing): each decoder layer's
    activations are recomputed in backward instead of kept (before FSDP's fully_shard, so the wrapped layers inherit it)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"train.gradient_checkpointing: {type(model).__name__} does not support gradient checkpointing")
    enable = getattr(model, "activation_checkpointing_enable", None)  # (its name from transformers 5.2x on)
    if enable is not None:
        enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def eval_mode(model: Any, checkpointing: bool) -> Any:
    """`model.eval()` (no dropout: RL trainers run so), with checkpointed layers flagged `training`:
    transformers recomputes a layer only while it is training; their submodules stay in eval mode."""
    model.eval()
    if checkpointing:
        for module in model.modules():
            if getattr(module, "gradient_checkpointing", False):
                module.training = True
    return model


def finish_optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: float, sums: dict[str, float]) -> bool:
    """Apply the step unless the gradient is not finite (a NaN/inf loss or gradient): then the weights
    stay as they are (published NaN weights would end the run's usefulness) and `skipped_nonfinite` is 1.
    Returns whether the norm of this process's weights is finite after it (a finite gradient times a
    huge `train.lr` can still overflow them; a norm past float range means weights of ~1e19 and more)."""
    sums["grad_norm"] = grad_norm
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        sums["skipped_nonfinite"] = 1.0
        return True
    optimizer.step()
    sums["skipped_nonfinite"] = 0.0
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # (FSDP: this rank's shards)
    norms = torch._foreach_norm([t for t in local if t.numel()])
    return bool(torch.stack(norms).isfinite().all()) if norms else True


def nonfinite_weights_error(grad_norm: float, lr: float) -> RunFailed:
    return RunFailed(f"train.lr: the policy's weights diverged in an optimizer step (their norm is NaN or inf; gradient norm "
                     f"{grad_norm:.3g}, lr {lr:g}); the run cannot go on: lower train.lr (or clip harder with a "
                     "lower train.max_grad_norm) and start again from the last checkpoint")


def micro_batches(batch: TrainBatch, size: int | None, device: torch.device) -> list[tuple[list[int], TrainBatch]]:
    """`batch` in parts of at most `size` rows (None: one part), each on `device` with the rows it
    holds. The rows are taken in order of length, so each part pads to a length near its own rows'
    and is trimmed to it (a part cut in batch order padded every row to the batch's longest); losses
    are normalised by the whole mini-batch, so the order changes no sum."""
    size = size or len(batch)
    lengths = batch.attention_mask.sum(-1).tolist()
    order = sorted(range(len(batch)), key=lambda i: -lengths[i]) if size < len(batch) else list(range(len(batch)))
    parts = [order[i : i + size] for i in range(0, len(order), size)]
    return [(rows, batch.select(rows).trimmed().to(device)) for rows in parts]


def gather_rows(parts: list[tuple[list[int], torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """Per-row results [rows, width] of micro-batches (each trimmed) put back into a [B, L-1] tensor
    shaped as `like`, at their rows, zero past each part's width."""
    out = torch.zeros(like.shape, dtype=torch.float32)
    for rows, values in parts:
        out[rows, : values.shape[1]] = values.float().cpu()
    return out


def mini_batch_rows(n: int, parts: int) -> list[list[int]]:
    """The rows of each of a batch's `train.mini_batches` parts (interleaved; empty parts left out)."""
    order = list(range(n))
    return [p for p in (order[i::parts] for i in range(parts)) if p]


def proximal_ahead(batch: TrainBatch, minis: list[list[int]], logprobs: Callable[[TrainBatch], torch.Tensor]) -> None:
    """Decoupled PPO's proximal log-probs of the rows after the first mini-batch, from `logprobs` (a
    no-grad pass) before any update; the first mini-batch's come from its own train passes."""
    rest = [i for rows in minis[1:] for i in rows]
    if not rest:
        return
    prox = torch.zeros_like(batch.behavior_logprobs)
    prox[rest] = logprobs(batch.select(rest)).to(prox.device)
    batch.proximal_logprobs = prox


def before_update(logp: torch.Tensor, mb: TrainBatch, proximal: bool) -> dict[str, float]:
    """What a pass on the weights before the step's first update also gives: decoupled PPO's proximal
    log-probs (set on `mb` with `proximal`), and the sums of the train/inference mismatch over
    `mb.mismatch_mask` (k3 of KL(behavior || trainer), clamped as the loss's KL term)."""
    current = logp.detach()
    if proximal:
        mb.proximal_logprobs = current
    same = mb.mismatch_mask
    if same is None:
        return {}
    kl = kl_estimate(mb.behavior_logprobs * same, current * same, "k3") * same
    return {"mismatch_kl_sum": float(kl.sum()), "mismatch_tokens": float(same.sum())}


class ReferenceModel:
    """The frozen reference policy of the KL term (`algorithm.kl_coef` > 0): the base model's weights
    on `device`, evaluated without gradients in micro-batches of `micro_batch_size` rows (as the
    trainer's passes are: a whole batch's logits at once would be batch x length x vocabulary floats).
    Its passes are the trainer's: its weights in `dtype` (the trainer computes with its weights in the
    same dtype), so the KL is 0 before the first update. Calling it with a CPU batch gives the [B, L-1]
    log-probs as a CPU tensor."""

    def __init__(self, model: str | Path | PreTrainedModel, *, temperature: float, micro_batch_size: int | None = None,
                 device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        # (loaded in float32, then cast: the trainer's weights are the same float32 values rounded once)
        self.model = model.to(device=device, dtype=dtype).eval()  # type: ignore[arg-type,call-arg]
        self.model.requires_grad_(False)
        self.device = torch.device(device)
        self.dtype = dtype
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    def __call__(self, batch: TrainBatch) -> torch.Tensor:
        with torch.no_grad():
            parts = [(rows, token_logprobs(self.model, mb, self.temperature)[0])
                     for rows, mb in micro_batches(batch, self.micro_batch_size, self.device)]
        return gather_rows(parts, batch.response_mask)


def combine_metrics(parts: list[dict[str, float]], *, mean: bool) -> dict[str, float]:
    """Combine metric dicts: keys ending in `_max` / `_min` by max / min; the rest summed (micro-batch
    shares of one mini-batch) or, with `mean`, averaged (one value per mini-batch)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / (len(values) if mean else 1)
    return out


def name_dtype(path: str, dtype: torch.dtype) -> None:
    """Make the folder's config.json name the dtype its weights are in (save_pretrained may write
    another: from_pretrained, or vLLM's dtype auto, then loads it at another size)."""
    config_file = os.path.join(path, "config.json")
    with open(config_file, encoding="utf-8") as fh:
        config = json.load(fh)
    for key in ("dtype", "torch_dtype"):  # (transformers 5 writes `dtype`; 4.x read `torch_dtype`)
        if key == "dtype" or key in config:
            config[key] = str(dtype).removeprefix("torch.")
    with open(config_file, "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, sort_keys=True)
        fh.write("\n")


class TorchTrainEngine(TrainEngine):
    """The policy on one device, trained with AdamW."""

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        lr: float,
        weight_decay: float = 0.0,
        mini_batches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float = 1.0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        schedule: LrSchedule | None = None,
        gradient_checkpointing: bool = False,
        lora: Any = None,
    ) -> None:
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        if gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.lora = lora  # the `model.lora` section (None: full fine-tuning)
        weights: Any = model.to(device=device, dtype=torch.float32)  # type: ignore[arg-type,call-arg]
        self.masters: MasterWeights | None = None
        if lora is None and dtype != torch.float32:  # (taken before the cast: float32 values, exactly)
            self.masters = MasterWeights([p for p in weights.parameters() if p.requires_grad])
        # the passes run on the weights in the compute dtype; a LoRA adapter is made after the cast and
        # stays float32 (PEFT keeps adapters of a bf16 model in float32), its base frozen in that dtype.
        # Eval mode: no dropout, as RL trainers run (the proximal log-probs would be noisy samples)
        policy: Any = weights.to(dtype=dtype)
        if lora is not None:
            policy = lora_adapter.wrap(policy, lora)
        self.model = eval_mode(policy, gradient_checkpointing)
        self.device = torch.device(device)
        self.dtype = dtype  # the compute dtype: passes, exported and final weights
        self.mini_batches = mini_batches
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # (LoRA: the adapter's)
        # the optimizer steps float32 values: the masters, or the parameters themselves where they are float32
        self.stepped = self.masters.masters if self.masters is not None else self.trainable
        self.optimizer = torch.optim.AdamW(self.stepped, lr=lr, weight_decay=weight_decay)
        # LoRA: the reference pass turns the adapter off for the whole model, so no other pass may run meanwhile
        self._passes: contextlib.AbstractContextManager[Any] = threading.RLock() if lora else contextlib.nullcontext()
        self.schedule = schedule or LrSchedule(lr, mini_batches=mini_batches)
        self.steps_done = 0  # train steps taken: the schedule's position (restored with the optimizer)
        self._export_memory: dict[str, torch.Tensor] | None = None  # (`reuse_export_memory`)

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        with self._passes, torch.no_grad():
            parts = [(rows, token_logprobs(self.model, mb, temperature)[0]) for rows, mb in self._micro(batch)]
        return gather_rows(parts, batch.response_mask)  # (on the CPU, where batches are built)

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """LoRA: the KL reference is the base model, i.e. this model with its adapter off."""
        if self.lora is None:
            raise ValueError("reference_logprobs: only a LoRA trainer holds its reference (the base model)")
        with self._passes, self.model.disable_adapter():
            return self.logprobs(batch, temperature)

    def _micro(self, batch: TrainBatch) -> list[tuple[list[int], TrainBatch]]:
        """The micro-batches, each on the model's device, with the rows of `batch` each holds."""
        return micro_batches(batch, self.micro_batch_size, self.device)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, *,
                   proximal: bool = False) -> dict[str, float]:
        minis = mini_batch_rows(len(batch), self.mini_batches)
        rates = self.schedule.rates(self.steps_done)
        with self._passes:
            if proximal:
                proximal_ahead(batch, minis, lambda part: self.logprobs(part, temperature))
            lora_adapter.set_dropout(self.model, True)
            try:
                steps = [self._optimizer_step(batch.select(rows), loss_fn, temperature, lr, first=k == 0, proximal=proximal)
                         for k, (rows, lr) in enumerate(zip(minis, rates, strict=False))]
            finally:
                lora_adapter.set_dropout(self.model, False)
        self.steps_done += 1
        mark_steps(self.optimizer, self.steps_done)
        return combine_metrics(steps, mean=True)

    def _optimizer_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, lr: float, *, first: bool = True,
                        proximal: bool = False) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        set_lr(self.optimizer, lr)
        norm = batch.norm()
        if norm.tokens == 0:  # every row masked (e.g. reward errors): AdamW's momentum would still move the weights
            return {"grad_norm": 0.0, "skipped_nonfinite": 0.0, "lr": lr}
        parts: list[dict[str, float]] = []
        for _, mb in self._micro(batch):
            logp, entropy = token_logprobs(self.model, mb, temperature)
            part = before_update(logp, mb, proximal) if first else {}
            loss, metrics = loss_fn(logp, mb, norm)
            loss.backward()
            part.update({k: float(v) for k, v in metrics.items()})
            part["loss"] = float(loss.detach())
            part["entropy"] = float((entropy.detach() * mb.response_mask).sum()) / max(norm.tokens, 1.0)
            parts.append(part)
        sums = combine_metrics(parts, mean=False)
        clip = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        if not finish_optimizer_step(self.optimizer, float(torch.nn.utils.clip_grad_norm_(self.stepped, clip)),
                                     sums):
            raise nonfinite_weights_error(sums["grad_norm"], lr)
        if self.masters is not None:
            self.masters.write_back()
        sums["lr"] = lr
        return sums

    def export_weights(self) -> dict[str, torch.Tensor]:
        if self.lora is not None:  # the adapter alone (engines merge or serve it: asyncflow.engines.lora)
            with self._passes:
                state = lora_adapter.adapter_state(self.model, self.dtype)
        else:  # CPU copies in the compute dtype: engines load them onto their own devices, and a Ray
            # actor without a GPU can unpickle them
            own = self.model.state_dict()
            same = aliases(own)  # a tied weight is exported once, under all its names
            state = {}
            for k, v in own.items():
                state[k] = state[same[k]] if k in same else self._export_copy(k, v.detach())
        self.last_export_bytes = state_bytes(state)
        return state

    def reuse_export_memory(self) -> None:
        self._export_memory = {}

    def _export_copy(self, name: str, v: torch.Tensor) -> torch.Tensor:
        """`v` on the CPU in the compute dtype: a new tensor, or the last export's, overwritten."""
        dtype = self.dtype if v.is_floating_point() else v.dtype
        if self._export_memory is None:
            return v.to("cpu", dtype=dtype, copy=True)
        out = self._export_memory.get(name)
        if out is None or out.shape != v.shape or out.dtype != dtype:
            out = self._export_memory[name] = torch.empty(v.shape, dtype=dtype)
        return out.copy_(v)

    def save(self, path: str, *, with_optimizer: bool) -> None:
        """A checkpoint (`with_optimizer`) keeps the float32 master weights, so a resume continues
        exactly; the final folder is in the compute dtype (`model.dtype`), as the passes ran."""
        os.makedirs(path, exist_ok=True)
        if self.lora is not None:  # the adapter in PEFT layout (+ final/merged on request)
            merged = self.dtype if self.lora.save_merged and not with_optimizer else None
            with self._passes:
                lora_adapter.save(self.model, path, merged_dtype=merged)
        elif with_optimizer and self.masters is not None:
            self.model.save_pretrained(path, state_dict=self._float32_state())
            name_dtype(path, torch.float32)
        else:
            self.model.save_pretrained(path)
            name_dtype(path, self.dtype)
        if with_optimizer:
            torch.save(self.optimizer.state_dict(), os.path.join(path, "optimizer.pt"))

    def _float32_state(self) -> dict[str, torch.Tensor]:
        """The model's state dict with each trained weight's float32 master in its place (tied names
        share one tensor, as in the model) and the rest in float32."""
        assert self.masters is not None
        master_of = {id(p): m for p, m in zip(self.masters.params, self.masters.masters, strict=True)}
        state = {k: v.float() if v.is_floating_point() else v for k, v in self.model.state_dict().items()}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in master_of:
                state[name] = master_of[id(param)].detach()
        return state

    def load_optimizer(self, path: str) -> None:
        """Restore the optimizer state written by `save(..., with_optimizer=True)`."""
        if self.lora is not None:  # a LoRA checkpoint holds the adapter; the base model is the run's
            lora_adapter.load_adapter_weights(self.model, path)
        # onto the CPU: load_state_dict moves each state tensor to its parameter's device itself, except
        # AdamW's `step` counters, which stay on the CPU (on a GPU they would cost a sync per step)
        with keep_hyperparameters(self.optimizer):
            self.optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=True,
                                                      map_location="cpu"))
        self.steps_done = restored_steps(self.optimizer, self.mini_batches)
