"""A Tinker service's engines as Ray actors (`runtime.kind: ray`), placed like a run's: sampling engines
take the rollout workers' bundles (`runtime.rollout_cpus` / `rollout_gpus` / `rollout_resource`), the
training models the trainer's (`train_*`); FSDP ranks are `ray_fsdp`'s rank actors.

The service keeps calling the same surfaces (`sampler_engines.SamplerEngine`, the `TrainingModels`
methods) on proxies here; each call is one actor call, waited for within a bound that names it.
Callbacks do not cross processes: a remote sampler cuts samples at their stops afterwards, and a
remote `forward_backward` is a forward call, `on_forward` here, then a backward call.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.engines.base import GenRequest, GenResult
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.runtime.ray_errors import dead_actor_error
from asyncflow.tinker.sampler_engines import Adapter, SamplerEngine
from asyncflow.tinker.training import Outputs, SavedState

CALL_TIMEOUT_S = 600.0  # one actor call (a training pass, a weight load)


@dataclass(frozen=True)
class SamplerSpec:
    """What a sampler actor builds: `build_sampler(spec, index)` in its own process."""

    kind: str  # hf or vllm
    model_dir: str
    eos_ids: tuple[int, ...]
    pad_id: int
    max_batch: int
    dtype: str
    seed: int
    device: str  # where an hf engine runs inside the actor (cpu, cuda)
    lora_rank: int  # vllm: the largest adapter rank it serves


def build_sampler(spec: SamplerSpec, index: int) -> SamplerEngine:
    """Engine number `index` of `spec`, in this process."""
    import torch

    from asyncflow.tinker.sampler_engines import HFSampler, LoopSampler

    if spec.kind == "vllm":
        from asyncflow.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(spec.model_dir, max_batch=spec.max_batch, dtype=spec.dtype, seed=spec.seed + index,
                            lora_rank=spec.lora_rank)
        return LoopSampler(engine, f"vllm sampler {index}", merges_adapters=False)
    from asyncflow.engines.hf import HFEngine

    return HFSampler(HFEngine(Path(spec.model_dir), eos_token_id=list(spec.eos_ids), pad_token_id=spec.pad_id,
                              max_batch=spec.max_batch, device=spec.device, dtype=getattr(torch, spec.dtype),
                              seed=spec.seed + index, name=f"sampler {index}"))


class SamplerActor:
    """One sampling engine in a Ray actor (threaded: concurrent calls batch in the engine)."""

    def __init__(self, spec: SamplerSpec, index: int) -> None:
        from asyncflow.engines.base import quiet_transformers

        quiet_transformers()
        self.engine = build_sampler(spec, index)

    def ready(self) -> bool:
        return True

    def load(self, adapter: Adapter, version: int) -> float:
        return self.engine.load(adapter, version).result(timeout=CALL_TIMEOUT_S)

    def generate(self, request: GenRequest) -> GenResult:
        return self.engine.generate(request).result(timeout=CALL_TIMEOUT_S)

    def score(self, prompt: list[int]) -> list[float]:
        return self.engine.score(prompt).result(timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        self.engine.shutdown()


class RaySampler(SamplerEngine):
    """A `SamplerActor` seen as a pool engine."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor, self.name = actor, name
        self._error: BaseException | None = None

    @classmethod
    def start(cls, spec: SamplerSpec, index: int, options: dict[str, Any], timeout_s: float) -> RaySampler:
        """Start actor `index` with Ray `options` and wait (bounded) until its engine has loaded."""
        import ray

        remote: Any = ray.remote(SamplerActor)
        actor = remote.options(**options).remote(spec, index)
        sampler = cls(actor, f"sampler {index} (Ray actor)")
        _get(actor.ready.remote(), timeout_s, f"sampler actor {index} loading the model")
        return sampler

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _call(self, ref: Any) -> cf.Future[Any]:
        """The call's result as a future; a dead actor is noted (`error`) before the future fails, so a
        caller that sees the failure sees the engine as dead too (the pool then stops using it)."""
        out: cf.Future[Any] = cf.Future()

        def settle(done: cf.Future[Any]) -> None:
            exc = done.exception()
            if exc is None:
                out.set_result(done.result())
                return
            if dead_actor_error(exc) is not None:
                self._error = exc
            out.set_exception(exc)

        ref.future().add_done_callback(settle)
        return out

    def load(self, adapter: Adapter, version: int) -> cf.Future[float]:
        return self._call(self.actor.load.remote(adapter, version))

    def generate(self, request: GenRequest) -> cf.Future[GenResult]:
        return self._call(self.actor.generate.remote(dataclasses.replace(request, on_token=None)))

    def score(self, prompt: list[int]) -> cf.Future[list[float]]:
        return self._call(self.actor.score.remote(prompt))

    def shutdown(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # (a dead or stuck actor is killed all the same)
            ray.get(self.actor.close.remote(), timeout=30.0)
        ray.kill(self.actor)


class TrainingActor:
    """`TrainingModels` in a Ray actor (the torch trainer; one call at a time)."""

    def __init__(self, model_dir: str, device: str) -> None:
        from asyncflow.engines.base import quiet_transformers
        from asyncflow.tinker.training import TrainingModels

        quiet_transformers()
        self.models = TrainingModels(Path(model_dir), device)

    def ready(self) -> bool:
        return True

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.models, method)(*args)


@dataclass
class ClientInfo:
    rank: int
    layers: tuple[bool, bool]


class RemoteTraining:
    """The `TrainingModels` surface the service uses, each method a call on a `TrainingActor`; calls run
    on one local thread in submission order (`submit`), as `TrainingModels` runs them."""

    def __init__(self, actor: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.actor, self.timeout_s = actor, timeout_s
        self.clients: dict[str, ClientInfo] = {}
        self._worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")

    @classmethod
    def start(cls, model_dir: Path, device: str, options: dict[str, Any], timeout_s: float) -> RemoteTraining:
        import ray

        remote: Any = ray.remote(TrainingActor)
        actor = remote.options(**options).remote(str(model_dir), device)
        _get(actor.ready.remote(), timeout_s, "the training actor loading the model")
        return cls(actor)

    def _call(self, method: str, *args: Any) -> Any:
        return _get(self.actor.call.remote(method, *args), self.timeout_s, f"the training actor's {method}")

    def submit(self, fn: Any, *args: Any) -> cf.Future[Any]:
        return self._worker.submit(fn, *args)

    def shutdown(self) -> None:
        import ray

        self._worker.shutdown(wait=False, cancel_futures=True)
        ray.kill(self.actor)

    def client(self, model_id: str) -> ClientInfo:
        if model_id not in self.clients:
            raise UserError(f"model_id {model_id!r}: no such training client")
        return self.clients[model_id]

    def create(self, model_id: str, rank: int, seed: int | None, layers: tuple[bool, bool] = (True, True)) -> None:
        self._call("create", model_id, rank, seed, layers)
        self.clients[model_id] = ClientInfo(rank, layers)

    def forward_backward(self, model_id: str, loss_name: str, config: dict[str, float], data: list[Any],
                         forward_only: bool, on_forward: Any = None) -> Outputs:
        outputs: Outputs = self._call("forward", model_id, loss_name, config, data, forward_only)
        if on_forward is not None:
            on_forward(outputs)
        self._call("backward")
        return outputs

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        return self._call("optim_step", model_id, adam)  # type: ignore[no-any-return]

    def adapter(self, model_id: str) -> dict[str, Any]:
        return self._call("adapter", model_id)  # type: ignore[no-any-return]

    def save(self, model_id: str) -> SavedState:
        return self._call("save", model_id)  # type: ignore[no-any-return]

    def load(self, model_id: str, saved: SavedState, with_optimizer: bool) -> None:
        self._call("load", model_id, saved, with_optimizer)


def _get(ref: Any, timeout_s: float, what: str) -> Any:
    """`ray.get` within `timeout_s`; a `UserError` raised in the actor comes back as itself."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise WaitTimeout(f"tinker-serve: {what} did not finish within {timeout_s:g} s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        if isinstance(cause, UserError):
            raise UserError(str(cause.args[0]) if cause.args else str(cause)) from None
        raise
