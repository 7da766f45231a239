"""The engines a Tinker service samples with, behind the one surface its sampling pool uses: take a
snapshot's weights (an adapter, or the base model), draw one sample, score a prompt.

- `HFSampler`: asyncflow's `HFEngine` in this process, the adapter merged into its weights; it stops
  a sample at a stop token or string as it is decoded (`GenRequest.on_token`).
- `LoopSampler`: any asynchronous `InferenceEngine` with `score_prompt` (`rollout.engine: vllm`, vLLM
  in this process with the adapter as a LoRA request; `rollout.engine: openai`, a running
  OpenAI-compatible server, `asyncflow serve`, vLLM or SGLang, fed the adapter through its LoRA route
  or, for `asyncflow serve`, merged) on an event loop thread of its own. These do not call back per
  token: the pool cuts each sample at its first stop afterwards (`stops_early` False).

Weight sync is adapter-only on every engine: a snapshot is its adapter's tensors (`lora.adapter_state`),
never the base model's weights, which every engine loads once from the model folder.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

import torch

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine
from asyncflow.engines.hf import HFEngine

T = TypeVar("T")
Adapter = dict[str, torch.Tensor] | None  # a published adapter; None: the base model


class SamplerEngine(abc.ABC):
    """One engine of the pool. Calls may come from any thread; each returns a future."""

    name: str
    stops_early = False  # honours `GenRequest.on_token` (else the pool cuts samples at their stops)

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """Why the engine stopped for good (None while it serves)."""

    @abc.abstractmethod
    def load(self, adapter: Adapter, version: int) -> cf.Future[float]:
        """Serve `adapter` (None: the base model) as weights `version` from the next request on; never
        called while a request runs on the engine."""

    @abc.abstractmethod
    def generate(self, request: GenRequest) -> cf.Future[GenResult]:
        """One sample."""

    @abc.abstractmethod
    def score(self, prompt: list[int]) -> cf.Future[list[float]]:
        """log p(prompt[i] | prompt[:i]) for i >= 1, at temperature 1."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (requests still running fail)."""


class HFSampler(SamplerEngine):
    stops_early = True

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.name = engine, engine.name

    @property
    def error(self) -> BaseException | None:
        return self.engine.error

    def load(self, adapter: Adapter, version: int) -> cf.Future[float]:
        return self.engine.request_weights(adapter if adapter is not None else lora_adapter.no_adapter(), version, "swap")

    def generate(self, request: GenRequest) -> cf.Future[GenResult]:
        return self.engine.submit(request)

    def score(self, prompt: list[int]) -> cf.Future[list[float]]:
        rows = self.engine.submit_score([prompt])
        out: cf.Future[list[float]] = cf.Future()

        def first(done: cf.Future[list[list[float]]]) -> None:
            if done.exception() is not None:
                out.set_exception(done.exception())  # type: ignore[arg-type]
            else:
                out.set_result(done.result()[0])

        rows.add_done_callback(first)
        return out

    def shutdown(self) -> None:
        self.engine.shutdown()


class LoopSampler(SamplerEngine):
    """An asynchronous engine driven from other threads through its own event loop thread."""

    def __init__(self, engine: InferenceEngine, name: str, *, merges_adapters: bool) -> None:
        """`merges_adapters`: the engine takes the base model back as an adapter that changes nothing
        (`asyncflow serve` merges adapters); else it stops naming an adapter (the engine's `use_base`)."""
        self.engine, self.name, self.merges_adapters = engine, name, merges_adapters
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"tinker-{name}", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        return None  # (a failing server or vLLM fails its requests; the engine stays in the pool)

    def _run(self, coro: Awaitable[T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]

    def connect(self, timeout_s: float) -> None:
        """Wait (bounded) for the engine to answer (`InferenceEngine.connect`); its error is raised."""
        self._run(self.engine.connect()).result(timeout=timeout_s)

    def load(self, adapter: Adapter, version: int) -> cf.Future[float]:
        if adapter is None and not self.merges_adapters:
            return self._run(self._use_base(version))
        return self._run(self.engine.load_weights(adapter if adapter is not None else lora_adapter.no_adapter(),
                                                  version, "drain"))

    async def _use_base(self, version: int) -> float:
        self.engine.use_base(version)  # type: ignore[attr-defined]  # (on the loop, as every engine call)
        return 0.0

    def generate(self, request: GenRequest) -> cf.Future[GenResult]:
        return self._run(self.engine.generate(request))

    def score(self, prompt: list[int]) -> cf.Future[list[float]]:
        return self._run(self.engine.score_prompt(prompt))  # type: ignore[attr-defined]

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # (a failed close still stops the loop)
            self._run(self.engine.close()).result(timeout=30.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)


def ends_at_stop(tokens: list[int], stop_ids: Any, stop_texts: list[str], tokenizer: Any) -> bool:
    """Whether `tokens` end with a stop: their last token is a stop token, or their text ends with a
    stop string (`tokens` may be only the tail of a sample, enough tokens to spell one)."""
    if tokens[-1] in stop_ids:
        return True
    if stop_texts:
        text = tokenizer.decode(tokens)
        return any(text.endswith(s) for s in stop_texts)
    return False


def cut_at_stop(result: GenResult, stop_ids: Any, stop_texts: list[str], tokenizer: Any) -> GenResult:
    """`result` ended at its first stop token (kept) or at the token completing a stop string, as an
    engine that stops while decoding would have ended it (finish "stop"); unchanged without one."""
    reach = max((len(s) for s in stop_texts), default=0) + 2  # (tokens enough to spell the longest stop string)
    for n in range(1, len(result.response_ids) + 1):
        if ends_at_stop(result.response_ids[max(0, n - reach): n], stop_ids, stop_texts, tokenizer):
            return GenResult(result.uid, result.response_ids[:n], result.behavior_logprobs[:n],
                             result.token_versions[:n], "stop", result.extra)
    return result
