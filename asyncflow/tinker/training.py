"""The training clients of a Tinker service: one base model, one LoRA adapter and one AdamW per client.

Every client is a named adapter on one PEFT model (PEFT's multi-adapter support), not a PEFT model
each: wrapping injects LoRA layers into the base model's modules in place, so one set of frozen base
weights can carry many adapters only through one wrapper. A call activates its client's adapter
(`set_adapter`), so its forward and backward reach that adapter's parameters alone: gradients
accumulate per client across forward_backward calls and are applied and cleared by that client's
optim_step, whatever the other clients did in between.

All calls run on one worker thread, in the order they were submitted (the SDK submits a client's
requests in seq_id order and waits for each POST's answer before the next), so clients never see a
half-applied call of another.
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.head_logprobs import right_pad, token_logprobs
from asyncflow.errors import UserError
from asyncflow.tinker.losses import LossFn, loss_fn
from asyncflow.tinker.wire import Datum

LORA_ALPHA = 32  # the adapters' alpha (their update is scaled by alpha / rank)
T = TypeVar("T")
Outputs = tuple[list[np.ndarray], dict[str, float]]  # each datum's target log-probs, and the metrics


@dataclass
class Client:
    adapter: str  # its PEFT adapter name
    rank: int
    layers: tuple[bool, bool]  # (attention, MLP): which linear layers its adapter covers
    optimizer: torch.optim.AdamW
    params: list[torch.nn.Parameter]


@dataclass
class SavedState:
    """A client's adapter tensors and optimizer state (`save_weights`), kept in memory."""

    rank: int
    layers: tuple[bool, bool]
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


class ClientInfo(Protocol):
    """What the service reads of a training client."""

    @property
    def rank(self) -> int: ...

    @property
    def layers(self) -> tuple[bool, bool]: ...


class TrainingBackend(Protocol):
    """What a Tinker service needs of its training clients: `TrainingModels` (one process) or
    `asyncflow.tinker.fsdp_training.FSDPTrainingModels` (FSDP2 ranks). Every call but `submit`,
    `shutdown`, `clients` and `client` runs on the training thread (`submit`)."""

    @property
    def clients(self) -> Mapping[str, ClientInfo]: ...

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]: ...

    def shutdown(self) -> None: ...

    def client(self, model_id: str) -> ClientInfo: ...

    def create(self, model_id: str, rank: int, seed: int | None, layers: tuple[bool, bool] = (True, True)) -> None: ...

    def forward_backward(self, model_id: str, loss_name: str, config: dict[str, float], data: list[Datum],
                         forward_only: bool, on_forward: Callable[[Outputs], None] | None = None) -> Outputs: ...

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]: ...

    def adapter(self, model_id: str) -> dict[str, torch.Tensor]: ...

    def save(self, model_id: str) -> SavedState: ...

    def load(self, model_id: str, saved: SavedState, with_optimizer: bool) -> None: ...


def target_tokens(data: list[Datum]) -> list[list[int]]:
    """Each datum's `target_tokens`; a `UserError` unless each is as long as its (non-empty) input."""
    if any("target_tokens" not in d.inputs for d in data):
        raise UserError("forward_backward: every datum needs loss_fn_inputs['target_tokens']")
    targets = [np.asarray(d.inputs["target_tokens"]).reshape(-1).astype(np.int64).tolist() for d in data]
    for d, t in zip(data, targets, strict=True):
        if len(t) != len(d.tokens) or not d.tokens:
            raise UserError(f"forward_backward: target_tokens has {len(t)} tokens, model_input {len(d.tokens)} "
                            "(they must be as long, and not empty)")
    return targets


def target_logprobs(model: Any, data: list[Datum]) -> list[torch.Tensor]:
    """Per datum, log p(target_tokens[i] | tokens[: i + 1]) for every position i ([N], differentiable).
    Where the targets are the input shifted by one (the usual case) the output head is applied to the
    target positions only (`head_logprobs.token_logprobs`); otherwise through full logits."""
    targets = target_tokens(data)
    device = next(model.parameters()).device
    if all(t[:-1] == d.tokens[1:] for d, t in zip(data, targets, strict=True)):
        ids, mask = (x.to(device) for x in right_pad([d.tokens + t[-1:] for d, t in zip(data, targets, strict=True)]))
        lp, _ = token_logprobs(model, ids, mask, mask[:, 1:].float(), 1.0)
        return [lp[i, : len(d.tokens)] for i, d in enumerate(data)]
    ids, mask = (x.to(device) for x in right_pad([d.tokens for d in data]))
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    out = []
    for i, t in enumerate(targets):
        z = torch.log_softmax(logits[i, : len(t)], dim=-1)
        out.append(z.gather(-1, torch.tensor(t, device=device)[:, None]).squeeze(-1))
    return out


def linear_layers(model: torch.nn.Module) -> dict[str, bool]:
    """The body's linear layers (the output head left out) by name: whether each sits in attention."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    return {n: any(k in n.lower() for k in ("attn", "attention")) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head}


def target_modules(linear: dict[str, bool], layers: tuple[bool, bool]) -> str:
    """PEFT's `target_modules` (a regex over module names) for the attention and/or MLP layers."""
    names = [n for n, in_attn in linear.items() if layers[0 if in_attn else 1]]
    if not names:
        raise UserError("create_model: lora_config trains no layer (train_attn and train_mlp are both false, "
                        "or the model has none of the kind asked for)")
    return "|".join(re.escape(n) for n in names)


def summed_loss(fn: LossFn, lps: list[torch.Tensor], data: list[Datum], config: dict[str, float]) -> torch.Tensor:
    """The loss of a batch: its datums' losses summed (Tinker never normalizes)."""
    return sum((fn(lp, d.inputs, config) for lp, d in zip(lps, data, strict=True)), torch.zeros((), device=lps[0].device))


def add_adapter(model: Any, base: torch.nn.Module, name: str, rank: int, targets: str,
                seed: int | None) -> tuple[Any, list[torch.nn.Parameter]]:
    """Adapter `name` (rank `rank` on the modules `targets` matches, B = 0) on the PEFT model `model`,
    or on `base` wrapped now when `model` is None; the PEFT model and the adapter's parameters
    (trainable, in PEFT's parameter order: the optimizer state is laid out by it)."""
    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=targets,
                             task_type="CAUSAL_LM")
    if seed is not None:
        torch.manual_seed(seed)
    with warnings.catch_warnings():  # (peft reads transformers' deprecated `is_gradient_checkpointing`)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if model is None:
            model = peft.get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    params = [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]
    for p in params:
        p.requires_grad_(True)
    return model, params


def adam_step(optimizer: torch.optim.AdamW, params: list[torch.nn.Parameter], adam: dict[str, Any]) -> dict[str, float]:
    """Apply the accumulated gradients of `params` with AdamW set from `adam` (Tinker's AdamParams:
    learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm), then clear them; the metrics."""
    lr = float(adam.get("learning_rate", 1e-4))
    for group in optimizer.param_groups:
        group.update(lr=lr, betas=(float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95))),
                     eps=float(adam.get("eps", 1e-12)), weight_decay=float(adam.get("weight_decay", 0.0)))
    clip = float(adam.get("grad_clip_norm", 0.0))
    grads = [p.grad for p in params if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(params, clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"optim/grad_norm": norm, "optim/lr": lr}


class TrainingModels:
    """The base model (float32, on `device`) with one LoRA adapter per training client."""

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.base.to(torch.device(device))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.linear = linear_layers(self.base)  # (read before PEFT wraps them)
        self.peft: Any = None
        self.clients: dict[str, Client] = {}
        self._loss: torch.Tensor | None = None  # a forward pass's loss awaiting `backward`
        self._worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """Run `fn(*args)` on the training thread, after every call submitted before it."""
        return self._worker.submit(fn, *args)

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    def client(self, model_id: str) -> Client:
        if model_id not in self.clients:
            raise UserError(f"model_id {model_id!r}: no such training client")
        return self.clients[model_id]

    def targets(self, layers: tuple[bool, bool]) -> str:
        return target_modules(self.linear, layers)

    def create(self, model_id: str, rank: int, seed: int | None, layers: tuple[bool, bool] = (True, True)) -> None:
        """A fresh adapter (B = 0: the client starts as the base model) on the attention and/or MLP
        layers (`layers`), and its optimizer."""
        if rank < 1:
            raise UserError(f"create_model: lora_config.rank must be at least 1, not {rank}")
        name = f"client{len(self.clients)}"
        self.peft, params = add_adapter(self.peft, self.base, name, rank, self.targets(layers), seed)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        self.clients[model_id] = Client(name, rank, layers, optimizer, params)

    def forward_backward(self, model_id: str, loss_name: str, config: dict[str, float], data: list[Datum],
                         forward_only: bool, on_forward: Callable[[Outputs], None] | None = None) -> Outputs:
        """Each datum's target log-probs and the summed loss (`loss:sum`); unless `forward_only`, the
        loss's gradient is added to the client's accumulated gradients. `on_forward` gets the outputs
        as soon as they are known, before the backward pass."""
        outputs = self.forward(model_id, loss_name, config, data, forward_only)
        if on_forward is not None:
            on_forward(outputs)
        self.backward()
        return outputs

    def forward(self, model_id: str, loss_name: str, config: dict[str, float], data: list[Datum],
                forward_only: bool) -> Outputs:
        """`forward_backward`'s forward pass; unless `forward_only`, its loss waits for `backward`, the
        next call on the training thread (what a remote caller sends in two calls)."""
        client = self.client(model_id)
        fn = loss_fn(loss_name)
        self._loss = None
        if not data:
            return [], {"loss:sum": 0.0}
        self.peft.set_adapter(client.adapter)
        with torch.set_grad_enabled(not forward_only):
            lps = target_logprobs(self.peft, data)
            loss = summed_loss(fn, lps, data, config)
        if not forward_only:
            self._loss = loss
        return [lp.detach().cpu().numpy().copy() for lp in lps], {"loss:sum": float(loss.detach())}

    def backward(self) -> None:
        """Add the last `forward`'s loss gradient to its client's accumulated gradients (none: nothing)."""
        loss, self._loss = self._loss, None
        if loss is not None:
            loss.backward()

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW set from this call's AdamParams, then clear them."""
        client = self.client(model_id)
        return adam_step(client.optimizer, client.params, adam)

    def adapter(self, model_id: str) -> dict[str, torch.Tensor]:
        """The client's adapter as a published adapter (`lora.adapter_state`): what a sampler merges."""
        return lora_adapter.adapter_state(self.peft, torch.float32, adapter=self.client(model_id).adapter)

    def save(self, model_id: str) -> SavedState:
        import peft

        client = self.client(model_id)
        tensors = peft.get_peft_model_state_dict(self.peft, adapter_name=client.adapter)
        return SavedState(client.rank, client.layers, {k: v.detach().clone() for k, v in tensors.items()},
                          copy.deepcopy(client.optimizer.state_dict()))

    def load(self, model_id: str, saved: SavedState, with_optimizer: bool) -> None:
        """Put a saved adapter (and, `with_optimizer`, its AdamW state) into the client's adapter."""
        import peft

        client = self.client(model_id)
        if (saved.rank, saved.layers) != (client.rank, client.layers):
            raise UserError(f"load_weights: the checkpoint's LoRA (rank {saved.rank}, attention/MLP {saved.layers}) "
                            f"is not the client's (rank {client.rank}, {client.layers})")
        peft.set_peft_model_state_dict(self.peft, saved.tensors, adapter_name=client.adapter)
        client.optimizer.zero_grad(set_to_none=True)
        if with_optimizer:
            client.optimizer.load_state_dict(copy.deepcopy(saved.optimizer))
