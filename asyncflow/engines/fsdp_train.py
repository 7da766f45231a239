"""FSDP2 train engine: the policy sharded across worker processes (gloo on CPU, NCCL on GPU).

```
 driver process (the pipeline calls one object)          worker processes, one per rank
 FSDPTrainEngine ──── pipe ──► rank 0: fully_shard(model), AdamW over its shards ─┐
   logprobs / train_step: the batch's rows split   ──► rank 1: ...               ├ process group:
   by rank (contiguous shares), same number of     ──► rank N-1                  ┘ all-gather params,
   forward/backward passes on every rank                                           reduce-scatter grads
   ◄── per-rank metric sums (combined: sum / max / min), log-prob shares, full weights from rank 0
```

The loss of a micro-batch is already divided by a normaliser of the *whole* mini-batch
(`asyncflow.engines.base.Norm`); each rank all-reduces its share's token and sequence counts, so the
contributions of all micro-batches on all ranks add up to the mini-batch's loss. FSDP's gradient
reduction therefore sums (divide factor 1) instead of averaging, and the result does not depend on
the world size or `micro_batch_size`. Ranks whose share is shorter run zero-weight passes on a dummy
row, so every rank issues the same collectives (a missing pass would hang the others).

The engine reaches its ranks through a transport (`RankLinks`): local processes from a forkserver
(`PipeLinks`, the default) or Ray actors (`asyncflow.runtime.ray_fsdp`); the shares, metrics and saves
above are the engine's, the same over either. Every wait on a rank has a timeout; a rank that dies or
raises is an error naming it, and the transport then stops all ranks (their collectives cannot
continue without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import cloudpickle
import torch
import torch.multiprocessing  # noqa: F401  (registers shared-memory pickling of tensors for the pipes)
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from asyncflow.engines import fsdp_lora
from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.base import LossFn, Norm, TrainBatch, TrainEngine, quiet_transformers, state_bytes
from asyncflow.engines.fsdp_parts import Share, decoder_layers, make_shares
from asyncflow.engines.lr_schedule import LrSchedule, expect_keys_of, mark_steps, restored_steps, set_lr
from asyncflow.engines.torch_train import (
    before_update,
    combine_metrics,
    enable_gradient_checkpointing,
    eval_mode,
    finish_optimizer_step,
    keep_hyperparameters,
    mini_batch_rows,
    nonfinite_weights_error,
    proximal_ahead,
    token_logprobs,
)
from asyncflow.errors import WaitTimeout
from asyncflow.malloc_arena import limit_malloc_arenas

POLL_S = 0.2  # how often a wait on a worker checks that every worker is still alive


@dataclass(frozen=True)
class WorkerSpec:
    """What every rank needs to build its shard of the policy."""

    model_dir: str
    world_size: int
    master_port: int  # 0: the transport picks the rendezvous (`RankLinks` implementations set it)
    lr: float
    weight_decay: float
    max_grad_norm: float
    device: str  # "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r unless `own_gpu_only`)
    dtype: str
    threads: int
    timeout_s: float
    seed: int
    master_addr: str = "127.0.0.1"  # the rendezvous host: rank 0's node
    own_gpu_only: bool = False  # the process sees exactly its own GPU (a Ray actor's CUDA_VISIBLE_DEVICES): cuda:0
    gradient_checkpointing: bool = False
    lora: Any = None  # the `model.lora` section (None: full fine-tuning; asyncflow.engines.fsdp_lora)
    # what each rank builds, `rank_class(rank, spec)` with a `run(method, args)` (picklable by reference;
    # None: `FSDPRank`); another kind of rank serves the same transport (asyncflow.tinker.fsdp_training)
    rank_class: Any = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------
# worker side (runs in the rank's process)
# ---------------------------------------------------------------------------------------------------


RankMethod = str | Callable[..., Any]  # an `FSDPRank` method's name, or `f(rank, *args)` (picklable)


def join_process_group(rank: int, spec: WorkerSpec) -> torch.device:
    """Set this process up as rank `rank` (threads, seed, device) and join the process group at
    `spec`'s rendezvous; returns the rank's device."""
    import torch.distributed as dist

    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    if spec.device == "cuda":
        device = torch.device("cuda", 0 if spec.own_gpu_only else rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if spec.device == "cuda" else "gloo",
        init_method=f"tcp://{spec.master_addr}:{spec.master_port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    return device


def shard(model: torch.nn.Module, dtype: torch.dtype) -> Any:
    """`fully_shard` each decoder layer, then the root (computing in `dtype`, reducing gradients in
    float32); gradients are summed over the ranks, not averaged."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    sharded: Any = fully_shard(model, mp_policy=policy)
    # losses are normalised by the whole mini-batch: rank contributions add up, so sum gradients
    # (gloo has no pre-multiplied sum: force a plain SUM reduction); the setting is per FSDP module
    for module in sharded.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return sharded


class FSDPRank:
    """One rank's shard of the policy and of the optimizer state (built in the rank's own process)."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        self.rank, self.spec = rank, spec
        self.device = join_process_group(rank, spec)
        # float32 master weights and AdamW states; a lower model.dtype is FSDP's compute dtype (its
        # mixed-precision policy casts the gathered parameters; gradients are reduced in float32)
        model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
        self.dtype = getattr(torch, spec.dtype)
        # the plain model's state-dict keys, and tied aliases (e.g. lm_head.weight -> embed_tokens.weight),
        # so the exported dict loads strictly into an unsharded model
        self.keys = list(model.state_dict().keys())
        first: dict[int, str] = {}
        self.aliases: dict[str, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                self.aliases[name] = first[id(param)]
            else:
                first[id(param)] = name
        model.to(self.device)  # type: ignore[arg-type]
        if spec.gradient_checkpointing:  # before fully_shard: the FSDP layer classes wrap checkpointed forwards
            enable_gradient_checkpointing(model)
        if spec.lora is not None:  # before fully_shard, so FSDP shards the PEFT model (fsdp_lora)
            model = lora_adapter.wrap(model, spec.lora)
        sharded = shard(model, self.dtype)
        self.model: Any = eval_mode(sharded, spec.gradient_checkpointing)  # no dropout (as the plain engine)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # (LoRA: the adapter's)
        self.optimizer = torch.optim.AdamW(self.trainable, lr=spec.lr, weight_decay=spec.weight_decay)

    def run(self, method: RankMethod, args: tuple[Any, ...]) -> Any:
        """One command: this rank's method `method`, or the function `method(self, *args)`."""
        return getattr(self, method)(*args) if isinstance(method, str) else method(self, *args)

    def _passes(self, share: Share, dummy: TrainBatch) -> list[tuple[TrainBatch, bool]]:
        """(micro-batch, real?) for each of the share's passes; padding passes reuse the dummy row."""
        out: list[tuple[TrainBatch, bool]] = []
        rows = share.rows
        n = 0 if rows is None else len(rows)
        for i in range(share.passes):
            idx = list(range(i * share.micro_batch_size, min((i + 1) * share.micro_batch_size, n)))
            if rows is not None and idx:
                out.append((rows.select(idx).to(self.device), True))
            else:
                out.append((dummy.to(self.device), False))
        return out

    def logprobs(self, share: Share, dummy: TrainBatch, temperature: float) -> torch.Tensor | None:
        parts = []
        with torch.no_grad():
            for mb, real in self._passes(share, dummy):
                logp = token_logprobs(self.model, mb, temperature)[0]
                if real:
                    parts.append(logp.cpu())
        return torch.cat(parts) if parts else None

    def train_step(self, shares: list[Share], dummy: TrainBatch, loss_bytes: bytes, temperature: float,
                   rates: list[float], steps_done: int, proximal: bool = False) -> list[tuple[dict[str, float], float]]:
        """`rates`: each optimizer step's lr, the same on every rank (the driver's schedule)."""
        loss_fn: LossFn = pickle.loads(loss_bytes)
        out = []
        lora_adapter.set_dropout(self.model, True)  # (no LoRA: no such modules)
        try:
            for k, (share, lr) in enumerate(zip(shares, rates, strict=True)):
                set_lr(self.optimizer, lr)
                out.append(self._optimizer_step(share, dummy, loss_fn, temperature, first=k == 0, proximal=proximal))
        finally:
            lora_adapter.set_dropout(self.model, False)
        mark_steps(self.optimizer, steps_done)  # (saved with the optimizer state: a resume continues from it)
        return out

    def _optimizer_step(
        self, share: Share, dummy: TrainBatch, loss_fn: LossFn, temperature: float, *, first: bool, proximal: bool
    ) -> tuple[dict[str, float], float]:
        import torch.distributed as dist

        self.optimizer.zero_grad(set_to_none=True)
        local = share.rows.norm() if share.rows is not None else Norm(0.0, 0.0)
        counts = torch.tensor([local.tokens, local.seqs], dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)  # the whole mini-batch's normaliser, over all ranks
        norm = Norm(tokens=float(counts[0]), seqs=float(counts[1]))
        if norm.tokens == 0:  # no rank has a trained token: every rank skips the step together
            return {}, 0.0
        parts: list[dict[str, float]] = []
        passes = self._passes(share, dummy)
        for i, (mb, real) in enumerate(passes):
            self.model.set_requires_gradient_sync(i == len(passes) - 1)  # reduce once, after the last pass
            logp, entropy = token_logprobs(self.model, mb, temperature)
            if not real:
                (logp.sum() * 0.0).backward()  # same collectives as the other ranks, no contribution
                continue
            part = before_update(logp, mb, proximal) if first else {}
            loss, metrics = loss_fn(logp, mb, norm)
            loss.backward()
            part.update({k: float(v) for k, v in metrics.items()})
            part["loss"] = float(loss.detach())
            part["entropy"] = float((entropy.detach() * mb.response_mask).sum()) / max(norm.tokens, 1.0)
            parts.append(part)
        clip = self.spec.max_grad_norm if self.spec.max_grad_norm > 0 else float("inf")
        total = torch.nn.utils.clip_grad_norm_(self.trainable, clip)
        full = total.full_tensor() if hasattr(total, "full_tensor") else total
        sums = combine_metrics(parts, mean=False)
        finite = finish_optimizer_step(self.optimizer, float(full), sums)  # the norm is global: ranks decide alike
        del sums["grad_norm"], sums["skipped_nonfinite"]  # the driver sets both once, from the norm
        if not finite:  # this rank's shards overflowed: the driver ends the run with one line
            sums["nonfinite_weights"] = 1.0
        return sums, float(full)

    def export(self, master: bool = False) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0: in the compute dtype (for the rollout engines and the final
        folder), or with `master` the float32 master weights (a checkpoint, so a resume is exact)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.spec.lora is not None:  # the adapter alone (a collective as well)
            return fsdp_lora.gather_adapter(self, torch.float32 if master else self.dtype)
        state: dict[str, Any] = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return None
        dtype = torch.float32 if master else self.dtype
        full = {k: state[k] if k in state else state[self.aliases[k]] for k in self.keys}
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}  # (.to: no copy if same)

    def save_optimizer(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            torch.save(state, os.path.join(path, "optimizer.pt"))

    def load_optimizer(self, path: str, mini_batches: int) -> int:
        """Returns the schedule's position the state records (`restored_steps`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
        expect_keys_of(self.optimizer, state)
        with keep_hyperparameters(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, state, options=StateDictOptions(full_state_dict=True))
        return restored_steps(self.optimizer, mini_batches)


def build_rank(rank: int, spec: WorkerSpec) -> Any:
    """This process's rank: `spec.rank_class`'s, by default an `FSDPRank`."""
    return (spec.rank_class or FSDPRank)(rank, spec)


def _worker_main(rank: int, spec: WorkerSpec, conn: Any) -> None:
    """A rank's command loop: ("method", args) in, ("ok", result) or ("error", traceback) out."""
    try:
        quiet_transformers()
        limit_malloc_arenas()  # (asyncflow.malloc_arena says why)
        worker = build_rank(rank, spec)
        conn.send(("ok", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the driver is gone
            return
        if method == "close":
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.destroy_process_group()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", worker.run(method, args)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


# ---------------------------------------------------------------------------------------------------
# driver side: the transport to the ranks (`RankLinks`), and the engine over any transport
# ---------------------------------------------------------------------------------------------------


class RankLinks(Protocol):
    """How the driver reaches its ranks. Every wait is bounded; a rank that dies, raises or stays
    silent is an error naming it, and every rank is stopped by then (the others may be stuck in a
    collective without it)."""

    world_size: int

    @property
    def alive(self) -> bool:
        """False once stopped (by `stop`, or by a failure)."""
        ...

    def start(self, timeout_s: float) -> None:
        """Wait until every rank has built its `FSDPRank` (process group joined, model sharded)."""
        ...

    def call(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]], what: str, timeout_s: float) -> list[Any]:
        """`FSDPRank.run(method, args)` on every rank with its own args; the replies in rank order.
        `what` names the request in errors ("compute log-probs")."""
        ...

    def stop(self) -> None:
        """Shut the ranks down (politely, then by force); nothing once stopped."""
        ...


def _stop(procs: list[Any], conns: list[Any]) -> None:
    """Kill worker processes that are still running (used on errors and at garbage collection)."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)
    for c in conns:
        with contextlib.suppress(OSError):
            c.close()


class PipeLinks:
    """The ranks as processes of this machine, one pipe each: ("method", args) in, ("ok", result) or
    ("error", traceback) out; rank r on cuda:r on GPU. They start from a forkserver that has imported
    torch and transformers once, so a second engine in the same process starts in about a second."""

    def __init__(self, spec: WorkerSpec) -> None:
        if spec.device == "cuda" and torch.cuda.device_count() < spec.world_size:
            raise ValueError(f"world_size={spec.world_size} needs that many GPUs; {torch.cuda.device_count()} visible")
        spec = dataclasses.replace(spec, master_port=spec.master_port or _free_port())
        self.world_size = spec.world_size
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])  # torch + transformers imported once, then forked per rank
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(spec.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, spec, theirs), name=f"fsdp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)

    @property
    def alive(self) -> bool:
        return self._finalizer.alive

    def start(self, timeout_s: float) -> None:
        self._collect("start (init the process group, load and shard the model)", timeout_s)

    def call(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]], what: str, timeout_s: float) -> list[Any]:
        self._send(method, per_rank_args, what)
        return self._collect(what, timeout_s)

    def stop(self) -> None:
        if self._finalizer.alive:
            with contextlib.suppress(Exception):
                self._send("close", [()] * self.world_size, "shut down")
                self._collect("shut down", 30.0)
            self._finalizer()

    def _send(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]], what: str) -> None:
        for rank, (conn, args) in enumerate(zip(self.conns, per_rank_args, strict=True)):
            try:
                conn.send((method, args))
            except OSError as exc:  # a broken pipe: the worker is gone
                self.procs[rank].join(timeout=5)
                self._finalizer()
                raise RuntimeError(f"FSDP worker rank {rank} died (exit code {self.procs[rank].exitcode}) before it "
                                   f"could be asked to {what} ({exc})") from None

    def _collect(self, what: str, limit: float) -> list[Any]:
        """Every rank's reply, waiting at most `limit` seconds; a dead, failing or silent worker stops
        all of them and raises with its rank and what was waited for."""
        deadline = time.monotonic() + limit
        replies: dict[int, Any] = {}
        try:
            while len(replies) < self.world_size:
                for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True)):
                    if rank in replies:
                        continue
                    if conn.poll(POLL_S / self.world_size):
                        try:
                            status, value = conn.recv()
                        except EOFError:  # (a pipe polls readable at its end: the worker died mid-call)
                            proc.join(timeout=5)
                            raise RuntimeError(f"FSDP worker rank {rank} died (exit code {proc.exitcode}) while the "
                                               f"engine waited for it to {what}") from None
                        if status == "error":
                            raise RuntimeError(f"FSDP worker rank {rank} failed to {what}:\n{value}")
                        replies[rank] = value
                    elif not proc.is_alive():
                        raise RuntimeError(
                            f"FSDP worker rank {rank} died (exit code {proc.exitcode}) while the engine waited for it to {what}"
                        )
                if time.monotonic() > deadline and len(replies) < self.world_size:
                    missing = sorted(set(range(self.world_size)) - set(replies))
                    raise WaitTimeout(f"timed out after {limit:.0f} s waiting for FSDP worker rank(s) {missing} to {what}")
        except BaseException:
            self._finalizer()  # the other ranks may be stuck in a collective: stop them all
            raise
        return [replies[r] for r in range(self.world_size)]


class FSDPTrainEngine(TrainEngine):
    """The policy sharded with FSDP2 over `world_size` ranks, trained with AdamW. `links` builds the
    transport to the ranks from their `WorkerSpec`: local processes (`PipeLinks`) by default, Ray
    actors with `asyncflow.runtime.ray_fsdp.start_ray_fsdp`."""

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        world_size: int,
        lr: float,
        weight_decay: float = 0.0,
        mini_batches: int = 1,
        micro_batch_size: int | None = None,
        max_grad_norm: float = 1.0,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        threads: int = 1,
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        seed: int = 0,
        links: Callable[[WorkerSpec], RankLinks] = PipeLinks,
        schedule: LrSchedule | None = None,
        gradient_checkpointing: bool = False,
        lora: Any = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._tmp: str | None = None
        if isinstance(model, PreTrainedModel):
            self._tmp = tempfile.mkdtemp(prefix="asyncflow-fsdp-")
            model.save_pretrained(self._tmp)
            model = self._tmp
        self.model_dir = str(model)
        # read now, not at each save: the folder may be a checkpoint that pruning removes later
        self._config = AutoConfig.from_pretrained(self.model_dir)
        gen = Path(self.model_dir) / "generation_config.json"
        self._generation_config = gen.read_bytes() if gen.is_file() else None
        self.world_size = world_size
        self.mini_batches = mini_batches
        self.micro_batch_size = micro_batch_size
        self.dtype = dtype
        self.schedule = schedule or LrSchedule(lr, mini_batches=mini_batches)
        self.steps_done = 0  # train steps taken: the schedule's position (restored with the optimizer)
        self.timeout_s = timeout_s
        self._loss_cache: tuple[LossFn, bytes] | None = None
        self.lora = lora
        self._rpc = threading.Lock()  # one command at a time on the ranks (LoRA: reference passes run beside steps)
        spec = WorkerSpec(
            model_dir=self.model_dir, world_size=world_size, master_port=0, lr=lr,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm, device=device,
            dtype=str(dtype).removeprefix("torch."), threads=threads, timeout_s=timeout_s, seed=seed,
            gradient_checkpointing=gradient_checkpointing, lora=lora,
        )
        self._links: RankLinks | None = None
        try:
            self._links = links(spec)
            self._links.start(start_timeout_s)
        except BaseException:  # the ranks stopped now and the temporary model folder removed (close() is
            self.close()       # never reached for an engine that failed to start)
            raise

    @property
    def links(self) -> RankLinks | None:
        """The transport to the ranks (None: it failed to start)."""
        return self._links

    @property
    def _procs(self) -> list[Any]:
        """The rank processes of the local transport (none on another)."""
        return list(getattr(self._links, "procs", []))

    # ------------------------------------------------------------------ RPC

    def _call(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]], what: str) -> list[Any]:
        if self._links is None or not self._links.alive:
            raise RuntimeError("the FSDP train engine is closed (after close() or an earlier worker failure)")
        with self._rpc:
            return self._links.call(method, per_rank_args, what, self.timeout_s)

    def call_ranks(self, method: RankMethod, per_rank_args: list[tuple[Any, ...]] | None = None,
                   what: str = "run a command") -> list[Any]:
        """Run `method` (an `FSDPRank` method's name, or a picklable `f(rank: FSDPRank, *args)`) on every
        rank at once (it may run collectives), waiting at most the engine's `timeout_s`; the replies
        in rank order."""
        return self._call(method, per_rank_args or [()] * self.world_size, what)

    # ------------------------------------------------------------------ TrainEngine

    def logprobs(self, batch: TrainBatch, temperature: float, method: RankMethod = "logprobs") -> torch.Tensor:
        shares = make_shares(batch, self.world_size, self.micro_batch_size)
        dummy = batch.select([0])
        parts = self._call(method, [(s, dummy, temperature) for s in shares], "compute log-probs")
        out = torch.cat([p for p in parts if p is not None])
        order = torch.tensor([i for s in shares for i in s.index], dtype=torch.long)
        return out[torch.argsort(order)]  # back into the batch's row order

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """LoRA: the base model's log-probs (the ranks' adapter off for the passes)."""
        if self.lora is None:
            raise ValueError("reference_logprobs: only a LoRA trainer holds its reference (the base model)")
        return self.logprobs(batch, temperature, method=fsdp_lora.reference_logprobs)

    def _loss_bytes(self, loss_fn: LossFn) -> bytes:
        """The loss function pickled by value (closures included), once per distinct function."""
        if self._loss_cache is None or self._loss_cache[0] is not loss_fn:
            self._loss_cache = (loss_fn, cloudpickle.dumps(loss_fn))
        return self._loss_cache[1]

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, *,
                   proximal: bool = False) -> dict[str, float]:
        rows = mini_batch_rows(len(batch), self.mini_batches)
        if proximal:
            proximal_ahead(batch, rows, lambda part: self.logprobs(part, temperature))
        minis = [batch.select(p) for p in rows]
        per_rank: list[list[Share]] = [[] for _ in range(self.world_size)]
        for mini in minis:
            for rank, share in enumerate(make_shares(mini, self.world_size, self.micro_batch_size)):
                per_rank[rank].append(share)
        dummy = batch.select([0])
        loss_bytes = self._loss_bytes(loss_fn)
        rates = self.schedule.rates(self.steps_done)[: len(minis)]
        args = [(s, dummy, loss_bytes, temperature, rates, self.steps_done + 1, proximal) for s in per_rank]
        replies = self._call("train_step", args, "train a step")
        self.steps_done += 1
        steps = []
        for i in range(len(minis)):
            sums = combine_metrics([replies[r][i][0] for r in range(self.world_size)], mean=False)
            if sums.pop("nonfinite_weights", 0.0):
                raise nonfinite_weights_error(replies[0][i][1], rates[i])
            sums["grad_norm"] = replies[0][i][1]  # the norm of the whole gradient: equal on every rank
            sums["skipped_nonfinite"] = 0.0 if math.isfinite(sums["grad_norm"]) else 1.0
            sums["lr"] = rates[i]
            steps.append(sums)
        return combine_metrics(steps, mean=True)

    def export_weights(self, master: bool = False) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = self._call("export", [(master,)] * self.world_size, "gather the full weights")[0]
        self.last_export_bytes = state_bytes(state)
        return state

    def save(self, path: str, *, with_optimizer: bool) -> None:
        """An HF folder built from the gathered weights (and the optimizer state, gathered on rank 0).

        The optimizer file holds the full FSDP optimizer state keyed by parameter name; it is read back
        by `FSDPTrainEngine.load_optimizer` (not by the plain engine, whose file is keyed by index)."""
        if self.lora is not None:
            return fsdp_lora.save(self, path, with_optimizer=with_optimizer, config=self._config)
        state = self.export_weights(master=with_optimizer)  # a checkpoint keeps the float32 master weights
        model = AutoModelForCausalLM.from_config(self._config, dtype=torch.float32 if with_optimizer else self.dtype)
        model.load_state_dict(state, strict=True)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        if self._generation_config is not None:  # the model's own (its EOS ids...), not the defaults that
            (Path(path) / "generation_config.json").write_bytes(self._generation_config)  # save_pretrained wrote
        if with_optimizer:
            self._call("save_optimizer", [(path,)] * self.world_size, "save the optimizer state")

    def load_optimizer(self, path: str) -> None:
        """Restore the optimizer state written by `save(..., with_optimizer=True)` (every rank reads it)."""
        if self.lora is not None:  # a LoRA checkpoint holds the adapter; the base model is the run's
            self._call(fsdp_lora.load_adapter, [(path,)] * self.world_size, "load the adapter")
        positions = self._call("load_optimizer", [(path, self.mini_batches)] * self.world_size, "load the optimizer state")
        self.steps_done = positions[0]

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and remove the temporary model folder."""
        if self._links is not None:
            self._links.stop()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
