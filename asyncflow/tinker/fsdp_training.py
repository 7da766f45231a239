"""The training clients of a Tinker service over FSDP2 ranks: the base model sharded across `world_size`
processes, each client's LoRA adapter and AdamW replicated on every rank.

```
 driver (the service's training thread)               rank processes (asyncflow.engines.fsdp_train transport)
 FSDPTrainingModels ── create ─────────────────────► TinkerRank r: frozen base, fully_shard per decoder
   forward_backward: datums split by rank   ───────►   layer + root; PEFT adapters added after sharding,
   (contiguous shares), log-probs gathered  ◄─────── │  one per client, replicated; one AdamW per client
   in datum order, on_forward, then backward ──────► │  backward: local adapter gradients accumulate
   optim_step ──────────────────────────────────────►│  all-reduce (sum) the client's gradients, AdamW
   save / adapter ◄── rank 0's replica               ┘  (identical on every rank: replicas stay equal)
```

Why adapters are added after sharding, and replicated: clients come and go while the ranks run, and
`fully_shard` takes a module's parameters once; re-sharding for every new client would rebuild every
FSDP group. So FSDP2 shards only the frozen base (no optimizer state, no gradient reduction of its
own), and PEFT injects each client's LoRA layers into the sharded model afterwards: PEFT reads a
Linear's `in_features`/`out_features` (not its DTensor shard) and keeps the original Linear as
`base_layer`, which is the module FSDP swaps unsharded weights into around each layer's forward and
backward. The adapter's own parameters are plain tensors, the same on every rank (created from the
same seed and then broadcast from rank 0); they are a few MB where the base is GBs. Gradients flow
back through the frozen sharded layers (FSDP unshards them again for backward) to earlier adapters.
Each rank's adapter gradients are those of its share's loss; the loss is a sum over datums, so summing
the gradients over ranks (one all-reduce at `optim_step`) gives the whole call's, and every rank then
takes the same AdamW step on the same values.

Every rank runs one pass per call whatever its share: a rank without datums runs a zero-weight pass on
a dummy datum, so all ranks issue the same FSDP collectives. A failing rank stops all ranks (they may
be stuck in a collective), so bad input is refused on the driver first (`check_request`).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.fsdp_train import (
    PipeLinks,
    RankLinks,
    RankMethod,
    WorkerSpec,
    join_process_group,
    shard,
)
from asyncflow.errors import UserError
from asyncflow.tinker.losses import LossFn, loss_fn
from asyncflow.tinker.training import (
    Outputs,
    SavedState,
    adam_step,
    add_adapter,
    linear_layers,
    summed_loss,
    target_logprobs,
    target_modules,
    target_tokens,
)
from asyncflow.tinker.wire import Datum

T = TypeVar("T")
ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


# ---------------------------------------------------------------------------------------------------
# rank side (runs in each rank's process)
# ---------------------------------------------------------------------------------------------------


@dataclass
class RankAdapter:
    """One client's adapter replica on a rank: its parameters (PEFT order) and its AdamW."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.AdamW


class TinkerRank:
    """One rank: its shard of the frozen base model and a replica of every client's adapter."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        from transformers import AutoModelForCausalLM

        self.rank = rank
        self.device = join_process_group(rank, spec)
        model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        model.to(self.device)  # type: ignore[arg-type]
        self.base = shard(model, torch.float32)
        self.peft: Any = None  # the PEFT model around `base`, from the first client on
        self.adapters: dict[str, RankAdapter] = {}
        self.pending: torch.Tensor | None = None  # the last forward's loss, until its backward

    def run(self, method: RankMethod, args: tuple[Any, ...]) -> Any:
        return getattr(self, method)(*args) if isinstance(method, str) else method(self, *args)

    def create(self, name: str, rank: int, targets: str, seed: int | None) -> dict[str, tuple[int, ...]]:
        """Add the adapter; the shapes of its tensors by their saved (PEFT state-dict) names."""
        import peft
        import torch.distributed as dist

        self.peft, params = add_adapter(self.peft, self.base, name, rank, targets, seed)
        for p in params:  # (equal replicas whatever each rank's random state)
            dist.broadcast(p.data, src=0)
        self.adapters[name] = RankAdapter(params, torch.optim.AdamW(params, lr=1e-4))
        saved = peft.get_peft_model_state_dict(self.peft, state_dict=self.lora_params(), adapter_name=name)
        return {k: tuple(v.shape) for k, v in saved.items()}

    def forward(self, name: str, loss_name: str, config: dict[str, float], share: list[Datum], dummy: Datum,
                grad: bool) -> tuple[list[np.ndarray], float]:
        """The share's target log-probs and summed loss; with `grad`, the loss is kept for `backward`.
        An empty share runs the dummy datum with zero weight."""
        self.pending = None
        self.peft.set_adapter(name)
        with torch.set_grad_enabled(grad):
            if share:
                lps = target_logprobs(self.peft, share)
                loss = summed_loss(loss_fn(loss_name), lps, share, config)
            else:
                lps, loss = [], target_logprobs(self.peft, [dummy])[0].sum() * 0.0
        if grad:
            self.pending = loss
        return [lp.detach().cpu().numpy().copy() for lp in lps], float(loss.detach())

    def backward(self) -> None:
        loss, self.pending = self.pending, None
        if loss is None:
            raise RuntimeError("backward: no forward pass is waiting for its backward")
        loss.backward()

    def drop(self) -> None:
        """Forget the forward pass waiting for its backward."""
        self.pending = None

    def optim_step(self, name: str, adam: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist

        adapter = self.adapters[name]
        grads = [p.grad for p in adapter.params if p.grad is not None]  # (the same ones on every rank)
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)  # SUM: the rank shares' losses add up to the call's
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
        return adam_step(adapter.optimizer, adapter.params, adam)

    def lora_params(self) -> dict[str, torch.Tensor]:
        """The adapters' parameters by name (what PEFT's state-dict functions pick an adapter from)."""
        return {n: p for n, p in self.peft.named_parameters() if "lora_" in n}

    def publish(self, name: str) -> dict[str, torch.Tensor] | None:
        if self.rank != 0:
            return None
        return lora_adapter.adapter_state(self.peft, torch.float32, state_dict=self.lora_params(), adapter=name)

    def save(self, name: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        import peft

        if self.rank != 0:
            return None
        tensors = peft.get_peft_model_state_dict(self.peft, state_dict=self.lora_params(), adapter_name=name)
        # CPU copies (what the driver keeps must not be a GPU rank's memory)
        optimizer = self.adapters[name].optimizer.state_dict()
        state = {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                 for i, s in optimizer["state"].items()}
        return ({k: v.detach().to("cpu", copy=True) for k, v in tensors.items()},
                {"state": state, "param_groups": copy.deepcopy(optimizer["param_groups"])})

    def load(self, name: str, tensors: dict[str, torch.Tensor], optimizer: dict[str, Any] | None) -> None:
        import peft

        adapter = self.adapters[name]
        peft.set_peft_model_state_dict(self.peft, {k: v.to(self.device) for k, v in tensors.items()},
                                       adapter_name=name)
        adapter.optimizer.zero_grad(set_to_none=True)
        if optimizer is not None:
            adapter.optimizer.load_state_dict(copy.deepcopy(optimizer))


# ---------------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------------


@dataclass
class RemoteClient:
    """A training client as the driver knows it: its adapter lives on the ranks."""

    adapter: str  # its PEFT adapter name (the same on every rank)
    rank: int
    layers: tuple[bool, bool]  # (attention, MLP): which linear layers its adapter covers
    shapes: dict[str, tuple[int, ...]]  # its saved tensors' shapes by name (what a load must match)


def split(data: list[Datum], world_size: int) -> list[list[Datum]]:
    """Contiguous shares in datum order, their lengths differing by at most one."""
    size, extra = divmod(len(data), world_size)
    out, start = [], 0
    for r in range(world_size):
        end = start + size + (1 if r < extra else 0)
        out.append(data[start:end])
        start = end
    return out


def check_request(fn: LossFn, data: list[Datum], config: dict[str, float], vocab: int) -> None:
    """Raise here, as a UserError, what the ranks would raise on bad input (a failure on a rank stops
    every rank): the targets' lengths, token ids outside the vocabulary, and the loss's inputs (the
    loss is run once per datum on zero log-probs)."""
    targets = target_tokens(data)
    for d, t in zip(data, targets, strict=True):
        if min(d.tokens + t) < 0 or max(d.tokens + t) >= vocab:
            raise UserError(f"forward_backward: a token id of model_input or target_tokens is outside the "
                            f"model's vocabulary (0..{vocab - 1})")
        fn(torch.zeros(len(d.tokens)), d.inputs, config)


class FSDPTrainingModels:
    """`TrainingModels`' surface over FSDP2 ranks (the module docstring says how). `links` builds the
    transport to the ranks from their `WorkerSpec` (default `PipeLinks`: local processes)."""

    def __init__(self, model_dir: Path | str, *, world_size: int, device: str = "cpu", threads: int = 1,
                 timeout_s: float = 600.0, start_timeout_s: float = 300.0,
                 links: Callable[[WorkerSpec], RankLinks] | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        with torch.device("meta"):  # (module names and sizes only: no weights on the driver)
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
        self.linear = linear_layers(skeleton)
        self.vocab = int(skeleton.get_input_embeddings().num_embeddings)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.clients: dict[str, RemoteClient] = {}
        self._rpc = threading.Lock()  # one command at a time on the ranks
        self._worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        spec = WorkerSpec(model_dir=str(model_dir), world_size=world_size, master_port=0, lr=0.0, weight_decay=0.0,
                          max_grad_norm=0.0, device=device, dtype="float32", threads=threads, timeout_s=timeout_s,
                          seed=0, rank_class=TinkerRank)
        self._links: RankLinks | None = None
        try:
            self._links = (links or PipeLinks)(spec)
            self._links.start(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @property
    def links(self) -> RankLinks | None:
        """The transport to the ranks (None: it failed to start)."""
        return self._links

    def _call(self, method: RankMethod, args: tuple[Any, ...] | list[tuple[Any, ...]], what: str) -> list[Any]:
        """`method` on every rank (with `args`, or rank r with `args[r]`), waiting at most `timeout_s`;
        the replies by rank. A dead, failing or silent rank is an error naming it (all ranks stop)."""
        if self._links is None or not self._links.alive:
            raise RuntimeError("the FSDP training ranks are stopped (after shutdown() or an earlier rank failure)")
        per_rank = args if isinstance(args, list) else [args] * self.world_size
        with self._rpc:
            return self._links.call(method, per_rank, what, self.timeout_s)

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """Run `fn(*args)` on the training thread, after every call submitted before it."""
        return self._worker.submit(fn, *args)

    def shutdown(self) -> None:
        """Cancel queued calls, wait for the one in progress (at most `timeout_s`), stop the ranks."""
        self._worker.shutdown(wait=True, cancel_futures=True)
        if self._links is not None:
            self._links.stop()

    def client(self, model_id: str) -> RemoteClient:
        if model_id not in self.clients:
            raise UserError(f"model_id {model_id!r}: no such training client")
        return self.clients[model_id]

    def create(self, model_id: str, rank: int, seed: int | None, layers: tuple[bool, bool] = (True, True)) -> None:
        """A fresh adapter (B = 0) on the attention and/or MLP layers, and its optimizer, on every rank."""
        if rank < 1:
            raise UserError(f"create_model: lora_config.rank must be at least 1, not {rank}")
        name = f"client{len(self.clients)}"
        shapes = self._call("create", (name, rank, target_modules(self.linear, layers), seed), "add a client's adapter")[0]
        self.clients[model_id] = RemoteClient(name, rank, layers, shapes)

    def forward_backward(self, model_id: str, loss_name: str, config: dict[str, float], data: list[Datum],
                         forward_only: bool, on_forward: Callable[[Outputs], None] | None = None) -> Outputs:
        """As `TrainingModels.forward_backward`: the forward runs on every rank's share, `on_forward`
        gets the gathered outputs, then (unless `forward_only`) a second command runs the backward."""
        client = self.client(model_id)
        fn = loss_fn(loss_name)
        if not data:
            outputs: Outputs = ([], {"loss:sum": 0.0})
            if on_forward is not None:
                on_forward(outputs)
            return outputs
        check_request(fn, data, config, self.vocab)
        args = [(client.adapter, loss_name, config, share, data[0], not forward_only)
                for share in split(data, self.world_size)]
        replies = self._call("forward", args, "run a forward pass")
        outputs = ([lp for lps, _ in replies for lp in lps], {"loss:sum": float(sum(loss for _, loss in replies))})
        if on_forward is not None:
            try:
                on_forward(outputs)
            except BaseException:
                if not forward_only:
                    self._call("drop", (), "drop a forward pass")
                raise
        if not forward_only:
            self._call("backward", (), "run the backward pass")
        return outputs

    def _forward(self, adapter: str, loss_name: str, config: dict[str, float], data: list[Datum],
                 forward_only: bool) -> list[tuple[list[np.ndarray], float]]:
        if self._links is None or not self._links.alive:
            raise RuntimeError("the FSDP training ranks are stopped (after shutdown() or an earlier rank failure)")
        args = [(adapter, loss_name, config, share, data[0], not forward_only) for share in split(data, self.world_size)]
        with self._rpc:
            return self._links.call("forward", args, "run a forward pass", self.timeout_s)

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        """All-reduce the client's accumulated gradients, then AdamW as `TrainingModels.optim_step`."""
        client = self.client(model_id)
        try:
            values = {k: float(adam[k]) for k in ADAM_KEYS if k in adam}
        except (TypeError, ValueError) as exc:
            raise UserError(f"optim_step: adam_params: {exc}") from None
        metrics: dict[str, float] = self._call("optim_step", (client.adapter, values), "take an optimizer step")[0]
        return metrics

    def adapter(self, model_id: str) -> dict[str, torch.Tensor]:
        """The client's adapter as a published adapter (`lora.adapter_state`), from rank 0's replica."""
        state: dict[str, torch.Tensor] = self._call("publish", (self.client(model_id).adapter,), "publish an adapter")[0]
        return state

    def save(self, model_id: str) -> SavedState:
        client = self.client(model_id)
        tensors, optimizer = self._call("save", (client.adapter,), "save a client's state")[0]
        return SavedState(client.rank, client.layers, tensors, optimizer)

    def load(self, model_id: str, saved: SavedState, with_optimizer: bool) -> None:
        """Put a saved adapter (and, `with_optimizer`, its AdamW state) into every rank's replica."""
        client = self.client(model_id)
        if (saved.rank, saved.layers) != (client.rank, client.layers):
            raise UserError(f"load_weights: the checkpoint's LoRA (rank {saved.rank}, attention/MLP {saved.layers}) "
                            f"is not the client's (rank {client.rank}, {client.layers})")
        if {k: tuple(v.shape) for k, v in saved.tensors.items()} != client.shapes:  # (a rank would fail: all stop)
            raise UserError("load_weights: the checkpoint's adapter tensors do not fit this base model's layers")
        self._call("load", (client.adapter, saved.tensors, saved.optimizer if with_optimizer else None),
                   "load a client's state")
