"""Engine interfaces: the only thing the workflow knows about inference and training back-ends.

AsyncFlow's point is that the core is engine-agnostic: the workflow talks to an `InferenceEngine`
(one request in, token ids + behavior log-probs + per-token versions out, weights loaded in one of
three modes) and to a `TrainEngine` (log-probs of a batch, optimizer steps with a given loss, weight
export). Adapters for transformers, vLLM, HTTP servers or simulators implement these.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from asyncflow.engines.weight_sync import aliases

WeightUpdateMode = Literal["drain", "swap", "abort"]
# called by an engine that streams, once per sampled token, in its decode thread: (token id, its
# log-prob, its weight version, the top alternatives [(id, log-prob)] or None) -> True to end the
# request there (finish "stop": a stop string completed). Must be cheap and must not block.
TokenCallback = Callable[[int, float, int, list[tuple[int, float]] | None], bool]


def quiet_transformers() -> None:
    """Turn off transformers' own progress bars ("Loading weights", "Writing model shards") in this
    process: noise beside the run's progress line, and a late one-line error became three lines. Each
    process that loads a model calls it (the driver, FSDP ranks, Ray actors: the setting is per
    process, and spawned ranks and Ray workers do not inherit it)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@dataclass
class GenRequest:
    """One generation request: one sample (prompt replication makes n of these per prompt)."""

    uid: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling (1: off)
    top_k: int = 0  # top-k sampling (0: off)
    seed: int | None = None  # this request's own generator (reproducible sampling); None: the engine's
    top_logprobs: int = 0  # alternatives per token to return in `GenResult.extra["top_logprobs"]`
    on_token: TokenCallback | None = None  # per-token callback (engines without one finish whole requests)


class EngineOutOfMemory(RuntimeError):
    """The engine ran out of memory for one batch: its requests fail with this, and the engine goes
    on serving the others (any other error in its loop stops it for good)."""


@dataclass
class GenResult:
    """What the engine generated for one request."""

    uid: int
    response_ids: list[int]
    behavior_logprobs: list[float]  # log p(token) under the temperature-scaled distribution sampled from
    token_versions: list[int]  # policy version that produced each token
    finish_reason: Literal["stop", "length", "cancelled"]
    extra: dict[str, Any] = field(default_factory=dict)


class InferenceEngine(abc.ABC):
    """Asynchronous generation with continuous batching and versioned weight loading."""

    version: int

    @abc.abstractmethod
    async def generate(self, request: GenRequest) -> GenResult:
        """Generate one response; requests join and leave the running batch between decode steps."""

    async def connect(self) -> None:
        """Get ready for requests where that needs waiting (a server engine checks its server and
        learns its model name); an in-process engine is ready once built."""
        await asyncio.sleep(0)

    def start_generate(self, request: GenRequest) -> asyncio.Future[GenResult]:
        """Start `generate(request)` and return its future (cancel it to abandon the request).

        The rollout worker submits single-turn requests this way and completes each in a callback on
        the future, without an asyncio task per request. Default: `generate` wrapped in a task; an
        engine that already resolves a future per request returns that future directly."""
        return asyncio.ensure_future(self.generate(request))

    @abc.abstractmethod
    async def load_weights(self, state: dict[str, torch.Tensor], version: int, mode: WeightUpdateMode) -> float:
        """Load new weights as `version`. Returns seconds until they were in use."""

    @abc.abstractmethod
    def cancel_older_than(self, min_version: int) -> int:
        """Cancel in-flight requests whose oldest token version is below `min_version`; returns the count.
        Evaluation requests (uid < 0) are never cancelled: the floor is the staleness bound of training
        samples, and an evaluation running beside training while weights are published scored the
        cut-short responses as if they were its answers."""

    @abc.abstractmethod
    def load(self) -> int:
        """Requests admitted and not yet finished (running + waiting)."""

    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Most requests worth keeping in flight (continuous-batching slots)."""

    def busy_seconds(self) -> float:
        """Cumulative seconds spent computing (for busy fractions)."""
        return 0.0

    def stats(self) -> dict[str, float]:
        """Cumulative batching counters (`decode_steps`, `decode_rows`, `prefills`, `prefill_rows`)."""
        return {}

    async def close(self) -> None:
        """Stop background work."""
        await asyncio.sleep(0)


@dataclass
class TrainBatch:
    """A padded batch of sequences for the trainer (right-padded; response tokens marked by mask)."""

    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L] 1 on real tokens
    response_mask: torch.Tensor  # [B, L-1] float, 1 where target token t+1 is a trained response token
    advantages: torch.Tensor  # [B]
    behavior_logprobs: torch.Tensor  # [B, L-1] aligned with response_mask (0 elsewhere)
    ref_logprobs: torch.Tensor | None = None  # [B, L-1] frozen reference policy (KL)
    proximal_logprobs: torch.Tensor | None = None  # [B, L-1] trainer before this step's first update
    # [B, L-1] 1 on the trained tokens of responses the trainer's current weights generated wholly: the
    # train/inference mismatch (`mismatch_kl`) is measured there, in the train pass before the first update
    mismatch_mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, idx: list[int]) -> TrainBatch:
        """Rows `idx` as a new batch."""
        ix = torch.tensor(idx, dtype=torch.long)
        return TrainBatch(
            input_ids=self.input_ids[ix],
            attention_mask=self.attention_mask[ix],
            response_mask=self.response_mask[ix],
            advantages=self.advantages[ix],
            behavior_logprobs=self.behavior_logprobs[ix],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[ix],
            proximal_logprobs=None if self.proximal_logprobs is None else self.proximal_logprobs[ix],
            mismatch_mask=None if self.mismatch_mask is None else self.mismatch_mask[ix],
        )

    def trimmed(self) -> TrainBatch:
        """The batch without the padding columns that every row has (rows are right-padded)."""
        width = int(self.attention_mask.sum(-1).max()) if len(self) else 0
        if width >= self.input_ids.shape[1]:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        cut = {k: v[:, : width if v.shape[1] == self.input_ids.shape[1] else width - 1]
               for k, v in values.items() if isinstance(v, torch.Tensor) and v.dim() == 2}
        return replace(self, **cut)

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch on `device` (itself when it is there already: on the CPU, where batches are built)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in values.items() if isinstance(v, torch.Tensor)})

    def norm(self) -> Norm:
        """This batch's loss normaliser: trained tokens and sequences with at least one."""
        per_seq = self.response_mask.sum(-1)
        return Norm(tokens=float(per_seq.sum()), seqs=float((per_seq > 0).sum()))


@dataclass(frozen=True)
class Norm:
    """What a loss divides by: counts over the whole mini-batch (all micro-batches and ranks), so
    per-micro-batch contributions add up to the mini-batch's aggregate."""

    tokens: float
    seqs: float


# loss_fn(logprobs, micro_batch, norm) -> (scalar loss contribution, metric sums); metric keys
# ending in `_max` / `_min` are combined across micro-batches by max / min, the rest by sum
LossFn = Callable[[torch.Tensor, TrainBatch, Norm], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainEngine(abc.ABC):
    """Log-probs, optimizer steps and weight export for the policy."""

    last_export_bytes: int | None = None  # tensor bytes of the last export (None: not known here)
    # `export_weights` copies or gathers the weights, so the workflow runs it in a worker thread;
    # False where it only hands out a reference (the thread hop cost ~0.7 ms a step on Ray)
    export_blocks: bool = True

    @abc.abstractmethod
    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """Per-token log-probs [B, L-1] of the batch's target tokens (logits / temperature), no grad."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, *,
                   proximal: bool = False) -> dict[str, float]:
        """`mini_batches` optimizer steps over the batch; returns averaged metrics. The first
        mini-batch's passes run on the weights before any update, so they serve as its proximal
        log-probs (`proximal`: the loss needs them; later mini-batches' rows get theirs from a
        no-grad pass first) and measure `batch.mismatch_mask`'s tokens (`mismatch_kl_sum`,
        `mismatch_tokens`): no separate forward pass over the batch."""

    @abc.abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights to publish to inference engines."""

    @abc.abstractmethod
    def save(self, path: str, *, with_optimizer: bool) -> None:
        """Write a Hugging Face folder (and the optimizer state if asked)."""

    def reuse_export_memory(self) -> None:
        """Let each `export_weights` overwrite the previous export's tensors instead of allocating
        new ones (a fresh gigabyte is page-faulted in on every export: ~5x the cast itself). Only for
        a caller that copies or sends each export before asking for the next and keeps only the last
        (the Ray trainer actor). Engines without their own export memory ignore it."""
        return None  # (engines without export memory of their own: nothing to reuse)

    def export_bytes(self) -> int | None:
        """Bytes the last `export_weights` published (`weight_sync_bytes`), where the state itself is
        not at hand (a Ray reference); None when unknown."""
        return self.last_export_bytes

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        """Log-probs of the KL reference, where the trainer holds it: a LoRA trainer's base model
        (its adapter off), so the reference costs no second copy of the weights."""
        raise NotImplementedError(f"{type(self).__name__} holds no reference model")

    def load_optimizer(self, path: str) -> None:
        """Restore the optimizer state that `save(path, with_optimizer=True)` wrote (resume)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restore an optimizer state")

    def close(self) -> None:
        """Release processes or devices the engine holds (nothing for an in-process engine)."""
        return None


def state_bytes(state: Any) -> int | None:
    """Bytes a weight publication moves (its tensors' payload), or None where the state is not at hand
    (a Ray object-store reference or a collective broadcast). A delta publication moves its changes."""
    from asyncflow.engines.weight_delta import Publication

    if isinstance(state, Publication):
        return state.nbytes
    if not isinstance(state, dict):
        return None
    tensors = {k: t for k, t in state.items() if isinstance(t, torch.Tensor)}
    same = aliases(tensors)  # (a tied weight travels once)
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k not in same)


def changed_share(state: Any) -> float | None:
    """The share of the published elements a delta publication carries as changed (1.0 for the full
    publication that starts the stream), or None where the state is no publication at hand (full
    weights, a Ray reference)."""
    from asyncflow.engines.weight_delta import Publication

    if not isinstance(state, Publication) or not state.total_elements:
        return None
    return state.changed_elements / state.total_elements


def requester(engine: InferenceEngine) -> Callable[[GenRequest], Awaitable[GenResult]]:
    """The cheapest way to await one request on `engine`, for a caller that awaits each request in
    place (a multi-turn episode): `start_generate` where the engine resolves a future per request
    of its own (no coroutine frame per turn), else `generate` (no task per turn, as the default
    `start_generate` would make)."""
    start = getattr(type(engine), "start_generate", None)
    if start is not None and start is not InferenceEngine.start_generate:
        return engine.start_generate
    return engine.generate


def pick_device(setting: str, index: int = 0) -> str:
    """The torch device of engine number `index` under `model.device`: "cpu", or "cuda:i" with the
    engines spread over the GPUs this process sees (in a Ray actor: the ones Ray gave it, as
    CUDA_VISIBLE_DEVICES). `auto` takes a GPU when there is one; `cuda` without one is bad input."""
    if setting == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        if setting == "cuda":
            from asyncflow.errors import UserError

            raise UserError("model.device: cuda, but this process sees no GPU (torch.cuda.is_available() is False)")
        return "cpu"
    return f"cuda:{index % gpus}"
