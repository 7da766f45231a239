"""In-process vLLM inference engine (GPU): `InferenceEngine` over vLLM's `AsyncLLM`.

vLLM is imported only when an engine is built, so this module imports without it. Requests are token
ids in (`TokensPrompt`), token ids and per-token log-probs out (`SamplingParams(logprobs=0)`, streamed
as deltas). The engine is created with `logprobs_mode="processed_logprobs"` so the reported log-probs
are those of the temperature-scaled distribution actually sampled from, as asyncflow's behavior
log-probs must be (vLLM's default reports the raw model's log-probs); this needs vLLM >= 0.10.2.
Prefix caching is off: a cached prefix computed with old weights would silently serve new requests.

Weights are loaded through vLLM's documented extension point: `worker_extension_cls` adds
`asyncflow_load_weights(path)` to every GPU worker, which reads a safetensors file and calls
`model_runner.model.load_weights`; the engine writes the state dict to that file (in /dev/shm when it
exists) and calls it with `AsyncLLM.collective_rpc`. (An NCCL broadcast receiver from
`asyncflow.engines.weight_sync` can replace the file on a multi-GPU deployment; not wired here.)

Modes (`workflow.weight_update`): `drain` holds new requests, waits for running ones, then loads;
`swap` loads while requests run (vLLM runs the RPC between two engine steps and keeps the KV cache);
`abort` aborts running requests, loads, and resubmits each with its prompt plus the tokens so far.
Per-token versions are conservative in `swap`: a token is tagged with the new version only if it
arrived after the load returned, so a token can be labelled older than it is, never newer (staleness
is over-, never under-counted).

LoRA (`model.lora`): vLLM runs with `enable_lora`; a published adapter is written as a PEFT folder
and new requests carry a `LoRARequest` naming it (one id per version; vLLM's LRU cache of adapters
evicts the old ones). A request keeps the adapter it was submitted with, so its tokens carry that
adapter's version (an abort-mode resubmission takes the new one).

Never run here: this machine has no GPU and no vLLM (docs/engines.md); the LoRA path is untested.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, WeightUpdateMode
from asyncflow.engines.weight_delta import Publication
from asyncflow.errors import WaitTimeout

EXTENSION = "asyncflow.engines.vllm_engine.WeightLoaderExtension"


class WeightLoaderExtension:
    """Mixed into vLLM's GPU worker (`worker_extension_cls`): load weights from a safetensors file."""

    model_runner: Any  # provided by the vLLM worker this class extends

    def asyncflow_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path)
        self.model_runner.model.load_weights(weights=list(state.items()))
        return len(state)


@dataclass
class _Running:
    """One request in flight."""

    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    request_id: str = ""
    evaluation: bool = False  # uid < 0: never cancelled (InferenceEngine.cancel_older_than)
    cancelled: bool = False
    restart: bool = False  # aborted for a weight load (mode abort): resubmit with the tokens so far
    streaming: bool = False  # a vLLM request of this row is running


class VLLMEngine(InferenceEngine):
    """vLLM's AsyncLLM in this process (its engine core runs in a child process, as vLLM does)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch: int = 256,
        dtype: str = "bfloat16",
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        timeout_s: float = 600.0,
        lora_rank: int | None = None,
    ) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        lora: dict[str, Any] = {} if lora_rank is None else {"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 2}
        args = AsyncEngineArgs(
            model=str(model_dir), dtype=dtype, seed=seed, max_num_seqs=max_batch,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enable_prefix_caching=False, logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION, **lora,
        )
        self._setup(AsyncLLM.from_engine_args(args), max_batch, timeout_s)

    def _setup(self, llm: Any, max_batch: int, timeout_s: float) -> None:
        """The engine's state around an `AsyncLLM` (tests build one around a fake)."""
        self.llm: Any = llm
        self.version = 0
        self._capacity = max_batch
        self._timeout = timeout_s
        self._running: dict[int, _Running] = {}
        self._admit = asyncio.Event()
        self._admit.set()
        self._ids = itertools.count()
        self._busy = 0.0
        self._busy_since: float | None = None
        self._lora: tuple[Any, int] | None = None  # (LoRARequest, its version) once an adapter is published
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._dir = tempfile.mkdtemp(prefix="asyncflow-vllm-", dir=shm)

    @property
    def capacity(self) -> int:
        return self._capacity

    def load(self) -> int:
        return len(self._running)

    def busy_seconds(self) -> float:
        """Wall seconds with at least one request in flight."""
        extra = time.monotonic() - self._busy_since if self._busy_since is not None else 0.0
        return self._busy + extra

    def _track(self, uid: int, row: _Running | None) -> None:
        if row is not None:
            if not self._running:
                self._busy_since = time.monotonic()
            self._running[uid] = row
            return
        self._running.pop(uid, None)
        if not self._running and self._busy_since is not None:
            self._busy += time.monotonic() - self._busy_since
            self._busy_since = None

    async def generate(self, request: GenRequest) -> GenResult:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        await self._admitted()
        row = _Running(evaluation=request.uid < 0)
        logprobs: list[float] = []
        finish = "length"
        key = next(self._ids)  # (not the uid: an agent's concurrent calls share their sample's)
        self._track(key, row)
        try:
            while not row.cancelled:
                row.restart = False
                row.request_id = f"{request.uid}-{next(self._ids)}"
                left = request.max_new_tokens - len(row.tokens)
                if left <= 0:
                    break
                params = SamplingParams(
                    n=1, temperature=request.temperature, top_p=request.top_p,
                    top_k=request.top_k if request.top_k > 0 else -1, max_tokens=left, logprobs=0,
                    output_kind=RequestOutputKind.DELTA, detokenize=False,
                )
                prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids) + row.tokens)
                reason = None
                row.streaming = True
                adapter, adapter_version = self._lora or (None, None)
                extra = {} if adapter is None else {"lora_request": adapter}
                try:
                    async for out in self.llm.generate(prompt, params, row.request_id, **extra):
                        done = out.outputs[0]
                        for j, tok in enumerate(done.token_ids):
                            row.tokens.append(int(tok))
                            logprobs.append(float(done.logprobs[j][tok].logprob))
                            row.versions.append(self.version if adapter_version is None else adapter_version)
                        if out.finished:
                            reason = done.finish_reason
                finally:
                    row.streaming = False
                finish = "stop" if reason == "stop" else "length"
                if row.restart and not row.cancelled and reason not in ("stop", "length"):
                    # parked until the new weights are in; the publication's `cancel_older_than` may
                    # cancel it meanwhile (the loop's check): it was resubmitted and decoded to its
                    # max_new_tokens for nobody
                    await self._admitted()
                    continue
                break
        finally:
            self._track(key, None)
        if row.cancelled:
            finish = "cancelled"
        return GenResult(request.uid, row.tokens, logprobs, row.versions, finish)  # type: ignore[arg-type]

    async def score_prompt(self, prompt_ids: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 (vLLM's prompt log-probs, one token drawn), under the
        served adapter if one is loaded. Untested (no GPU here)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        await self._admitted()
        params = SamplingParams(n=1, temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        adapter = self._lora[0] if self._lora is not None else None
        extra = {} if adapter is None else {"lora_request": adapter}
        last = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                           f"score-{next(self._ids)}", **extra):
            last = out
        rows = (last.prompt_logprobs or [])[1:] if last is not None else []
        return [float(row[tok].logprob) for row, tok in zip(rows, prompt_ids[1:], strict=True)]

    def use_base(self, version: int) -> None:
        """Generate with the base model again (no LoRA request) from now on, as weights `version`."""
        self._lora = None
        self.version = version

    async def _admitted(self) -> None:
        """Wait until no abort-mode weight load holds new requests back (bounded by the request timeout)."""
        try:
            await asyncio.wait_for(self._admit.wait(), self._timeout)
        except asyncio.TimeoutError:
            raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for vLLM to finish a weight load "
                              "(rollout.request_timeout_s)") from None

    def cancel_older_than(self, min_version: int) -> int:
        rows = [r for r in self._running.values()
                if r.versions and r.versions[0] < min_version and not r.cancelled and not r.evaluation]
        for r in rows:
            r.cancelled = True
            asyncio.ensure_future(self.llm.abort(r.request_id))
        return len(rows)

    async def load_weights(self, state: dict[str, torch.Tensor] | Publication, version: int,  # type: ignore[override]
                           mode: WeightUpdateMode) -> float:
        """A delta publication loads as its full weights (vLLM's loader takes whole tensors)."""
        from safetensors.torch import save_file

        if isinstance(state, Publication):
            state = state.full_state()
        if lora_adapter.is_adapter(state):
            return await self._load_adapter(state, version, mode)
        start = time.monotonic()
        # (a unique name: a cancelled load of the same version may still be writing its file)
        path = os.path.join(self._dir, f"v{version}-{next(self._ids)}.safetensors")
        # tied weights share storage, which safetensors refuses: each tensor gets its own copy
        save = asyncio.ensure_future(
            asyncio.to_thread(save_file, {k: v.detach().contiguous().clone() for k, v in state.items()}, path))
        try:
            await asyncio.shield(save)  # (a load cancelled meanwhile still learns when the file is complete)
            if mode == "swap":
                await self._rpc_load(path, version)
                return time.monotonic() - start
            self._admit.clear()
            try:
                if mode == "abort":
                    for r in list(self._running.values()):  # (a request may end during an abort's await)
                        r.restart = True
                        await self.llm.abort(r.request_id)
                await self._wait_idle(version)
                await self._rpc_load(path, version)
            finally:
                self._admit.set()
            return time.monotonic() - start
        finally:
            if save.done():
                _remove(path)
            else:  # cancelled while the file is written: remove it once it is (it is hundreds of MB in /dev/shm)
                save.add_done_callback(lambda _: _remove(path))

    async def _load_adapter(self, state: dict[str, torch.Tensor], version: int, mode: WeightUpdateMode) -> float:
        """A LoRA publication: new requests name it (`LoRARequest`); drain and abort first stop the
        running ones as for full weights. Untested (no GPU here)."""
        from vllm.lora.request import LoRARequest

        start = time.monotonic()
        folder = os.path.join(self._dir, f"a{version}")
        await asyncio.to_thread(lora_adapter.write_folder, state, folder)
        request = LoRARequest(lora_name=f"asyncflow-v{version}", lora_int_id=version + 1, lora_path=folder)
        if mode == "swap":
            self._lora = (request, version)
        else:
            self._admit.clear()
            try:
                if mode == "abort":
                    for r in list(self._running.values()):
                        r.restart = True
                        await self.llm.abort(r.request_id)
                await self._wait_idle(version)
                self._lora = (request, version)
            finally:
                self._admit.set()
        self.version = version
        for old in Path(self._dir).glob("a*"):  # (two newest kept: requests may still load the previous one)
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)
        return time.monotonic() - start

    async def _rpc_load(self, path: str, version: int) -> None:
        try:
            await asyncio.wait_for(self.llm.collective_rpc("asyncflow_load_weights", args=(path,)), self._timeout)
        except asyncio.TimeoutError:
            raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for vLLM to load version {version}") from None
        self.version = version

    async def _wait_idle(self, version: int) -> None:
        """Wait until no vLLM request runs (drain: they finish; abort: they stop and wait to resume)."""
        deadline = time.monotonic() + self._timeout
        while any(r.streaming for r in self._running.values()):
            if time.monotonic() > deadline:
                raise WaitTimeout(f"timed out after {self._timeout:.0f} s waiting for running requests to stop "
                                  f"before loading version {version}")
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.llm.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
