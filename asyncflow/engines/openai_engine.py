"""`rollout.engine: openai`: generation on an OpenAI-compatible server (asyncflow serve, vLLM, SGLang).

Each request is one `POST /v1/completions` whose prompt is the sample's token ids, so the server
never re-tokenizes text and the ids the trainer sees are exactly the ids that were sampled. The reply
must carry the generated ids (`choices[0].token_ids`, or vLLM's `token_id:N` tokens) and their
log-probs (`logprobs.token_logprobs`). Continuous batching is the server's job: this engine keeps up
to `capacity` requests in flight at once, on pooled keep-alive connections (`http_client`), with a
deadline on every call.

Versions: `asyncflow serve` reports the weight version of every token (`token_versions`); other
servers do not, so every token gets the version the server held when the request was sent — the
oldest it can be, which is what staleness counts. Weights go out through `weight_sync.py`.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, WeightUpdateMode
from asyncflow.engines.http_client import HTTPError, close_pool, request_json
from asyncflow.engines.server_sync import WeightFolderWriter, WeightSync, make_weight_sync, sync_root
from asyncflow.engines.weight_delta import Publication
from asyncflow.errors import UserError, WaitTimeout


class OpenAIEngine(InferenceEngine):
    """One OpenAI-compatible server as an `InferenceEngine`."""

    def __init__(self, base_url: str, *, sync: WeightSync, writer: WeightFolderWriter, server_type: str,
                 model: str | None = None, token: str | None = None, max_batch: int = 256,
                 request_timeout_s: float = 600.0, sync_timeout_s: float = 600.0, version: int = 0) -> None:
        self.base_url = base_url.rstrip("/")
        self.sync = sync
        self.writer = writer
        self.server_type = server_type
        self.model = model
        self.adapter: str | None = None  # the LoRA adapter's name on the server, once one is loaded
        self.token = token
        self.max_batch = max_batch
        self.request_timeout_s = request_timeout_s
        self.sync_timeout_s = sync_timeout_s
        self.version = version
        self._in_flight: dict[object, int | None] = {}  # per request in flight: server version when sent (None: eval)
        self._cancel_floor = 0  # replies whose oldest token is older than this end as cancelled
        # a server the run started and restarts (`runtime.ray_servers.ServerLink`; None: the user's server):
        # `await server.recover()` waits, bounded, until a dead server answers again or raises why it cannot;
        # `server.loaded(folder, version)` records the weights a restarted server must load first;
        # `await server.token()` is its bearer token, which then replaces `token`
        self.server: Any = None
        self._recovery: Any = None  # the one recovery all requests that met the dead server wait for
        self._server_token = False  # `token` is the started server's (asked of `server`)

    @property
    def capacity(self) -> int:
        return self.max_batch

    async def connect(self, initial_state: dict[str, torch.Tensor] | None = None) -> None:
        """Check the server answers (and learn its model name when none is configured); with
        `initial_state`, load it as version 0 so the server starts from the trainer's weights."""
        token = await self._token()
        try:
            models = await request_json("GET", f"{self.base_url}/v1/models", token=token,
                                        timeout=self.sync_timeout_s)
        except (HTTPError, OSError, WaitTimeout) as exc:
            raise UserError(f"rollout.server_urls: {self.base_url} is not an OpenAI-compatible server "
                               f"that answers: {exc}") from None
        if self.model is None:
            data = models.get("data") if isinstance(models, dict) else None
            if not data or not isinstance(data, list):
                raise UserError(f"rollout.server_urls: {self.base_url}/v1/models lists no model")
            first = data[0]
            if not isinstance(first, dict) or not isinstance(first.get("id"), str) or not first["id"]:
                raise UserError(f"rollout.server_urls: {self.base_url}/v1/models does not name its model as "
                                f"data[0].id (it sent {str(first)[:80]!r}); set rollout.server_model")
            self.model = first["id"]
        if initial_state is not None:
            await self.load_weights(initial_state, 0, "drain")

    async def generate(self, request: GenRequest) -> GenResult:
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(request.prompt_ids), "max_tokens": request.max_new_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "n": 1, "logprobs": 0,
        }
        if request.top_k > 0:
            body["top_k"] = request.top_k
        self._name_adapter(body)
        if self.server_type == "vllm":  # vLLM's documented extras: generated ids in the reply
            body.update(return_token_ids=True, return_tokens_as_token_ids=True)
        sent_version = self.version
        key = object()  # (not the uid: an agent's concurrent calls share their sample's, and the first to end
        # took the other out of load() and cancel_older_than's count); an evaluation's (uid < 0) is never
        # cancelled: None here, and its reply is kept below
        self._in_flight[key] = sent_version if request.uid >= 0 else None
        try:
            reply = await self._call("POST", "/v1/completions", body, self.request_timeout_s, retry_safe=True)
        finally:
            del self._in_flight[key]
        ids, logprobs, versions, reason = parse_choice(reply, sent_version, self.base_url)
        if versions and versions[0] < self._cancel_floor and request.uid >= 0:
            reason = "cancelled"
        return GenResult(request.uid, ids, logprobs, versions, reason)  # type: ignore[arg-type]

    def _name_adapter(self, body: dict[str, Any]) -> None:
        """A served LoRA adapter in a completion request: vLLM takes its name as the model, SGLang as
        lora_path (none loaded, or merged by the server: nothing)."""
        if self.adapter is not None:
            body["model" if self.server_type == "vllm" else "lora_path"] = self.adapter

    def use_base(self, version: int) -> None:
        """Requests name the base model again (a server that serves adapters by name), as weights `version`."""
        self.adapter = None
        self.version = version

    async def score_prompt(self, prompt_ids: list[int]) -> list[float]:
        """log p(prompt[i] | prompt[:i]) for i >= 1 at temperature 1, under the weights the server
        holds: the legacy completions' `echo` with log-probs (asyncflow serve, vLLM), one token drawn."""
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": 1, "temperature": 1.0,
                                "echo": True, "logprobs": 0}
        self._name_adapter(body)
        reply = await self._call("POST", "/v1/completions", body, self.request_timeout_s, retry_safe=True)
        try:
            values = reply["choices"][0]["logprobs"]["token_logprobs"][1: len(prompt_ids)]
            scores = [float(x) for x in values]
        except (KeyError, IndexError, TypeError, ValueError):
            raise HTTPError(200, f"{self.base_url}/v1/completions: echo with logprobs sent no prompt log-probs "
                                 "(choices[0].logprobs.token_logprobs)") from None
        if len(scores) != len(prompt_ids) - 1:
            raise HTTPError(200, f"{self.base_url}/v1/completions: echo gave {len(scores)} prompt log-probs for "
                                 f"{len(prompt_ids)} prompt tokens")
        return scores

    async def load_weights(self, state: dict[str, torch.Tensor] | Publication, version: int,  # type: ignore[override]
                           mode: WeightUpdateMode) -> float:
        """A delta publication goes to `asyncflow serve` as a delta folder; where the server answers
        409 (it missed a version, or its checksum differs) the version's full weights follow
        (`ResyncNeeded` where they are not in this process). Other servers load the full weights."""
        start = time.monotonic()
        if isinstance(state, Publication) and (self.server_type != "asyncflow" or self.writer.in_place):
            state = state.full_state()
        delta = isinstance(state, Publication) and state.is_delta
        try:
            folder = await self._load_folder(state, version, mode)
        except HTTPError as exc:
            if not (delta and exc.status == 409) or not isinstance(state, Publication):
                raise
            delta = False
            folder = await self._load_folder(state.as_full(), version, mode)
        self.version = version
        if self.server is not None and not delta:  # (a restarted server loads a full folder: it holds no base)
            self.server.loaded(folder, version)
        return time.monotonic() - start

    async def _load_folder(self, state: dict[str, torch.Tensor] | Publication, version: int,
                           mode: WeightUpdateMode) -> Path:
        folder = await self.writer.folder_for(state, version)
        token = await self._token()
        for attempt in range(2):
            try:
                if lora_adapter.is_adapter(state):  # a LoRA publication: the server's LoRA route (server_sync)
                    self.adapter = await self.sync.load_adapter(self.base_url, folder, version, mode, token=token,
                                                                timeout=self.sync_timeout_s)
                else:
                    await self.sync.load(self.base_url, folder, version, mode, token=token, timeout=self.sync_timeout_s)
                break
            except HTTPError as exc:
                if attempt or not self._recoverable(exc):
                    raise
                await self._recover()
        return folder

    async def _call(self, method: str, path: str, body: Any, timeout: float, retry_safe: bool = False) -> Any:
        """One request; when it meets a dead server the run restarts (`server`), once more after it is back.
        `retry_safe`: a completion may be sent again when a kept connection turns out closed (its first
        reply never arrived, so the sample is drawn once as far as the run sees)."""
        if self._recovery is not None:  # (a restart under way: not to the fresh process before its weights)
            await self._recover()
        token = await self._token()
        try:
            return await request_json(method, f"{self.base_url}{path}", body, token=token, timeout=timeout,
                                      retry_safe=retry_safe)
        except HTTPError as exc:
            if not self._recoverable(exc):
                raise
        await self._recover()
        return await request_json(method, f"{self.base_url}{path}", body, token=token, timeout=timeout,
                                  retry_safe=retry_safe)

    async def _token(self) -> str | None:
        """The bearer token to send: a started server's own (asked of its link once, before the first
        request, which may be a weight load into a restarted rollout actor), else `token`."""
        if self.server is not None and not self._server_token:
            self.token = await self.server.token()
            self._server_token = True
        return self.token

    async def close(self) -> None:
        """Close this event loop's kept connections (shared by the loop's engines: a later call reopens)."""
        await close_pool()

    def _recoverable(self, exc: HTTPError) -> bool:
        return self.server is not None and exc.status == 0  # (0: no connection, or lost mid-reply)

    async def _recover(self) -> None:
        """Wait with every other caller for one recovery of the server (`server.recover`, bounded)."""
        if self._recovery is None:
            self._recovery = asyncio.ensure_future(self.server.recover())
            self._recovery.add_done_callback(self._recovered)
        await asyncio.shield(self._recovery)

    def _recovered(self, task: Any) -> None:
        if self._recovery is task:
            self._recovery = None
        if not task.cancelled():
            task.exception()  # (retrieved: every waiter gets it raised)

    def cancel_older_than(self, min_version: int) -> int:
        """A request cannot be stopped mid-flight over plain HTTP: replies whose oldest token is older
        than `min_version` are returned as cancelled when they arrive (what the workflow needs to
        drop them); the server still finishes them."""
        self._cancel_floor = max(self._cancel_floor, min_version)
        return sum(1 for v in self._in_flight.values() if v is not None and v < min_version)

    def load(self) -> int:
        return len(self._in_flight)


def parse_choice(reply: Any, sent_version: int, where: str) -> tuple[list[int], list[float], list[int], str]:
    """(token ids, behavior log-probs, per-token versions, finish reason) of a completion reply."""
    try:
        choice = reply["choices"][0]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError):
        raise HTTPError(200, f"{where}/v1/completions: no choices[0].logprobs.token_logprobs in the reply") from None
    ids = choice.get("token_ids")
    if ids is None:  # vLLM with return_tokens_as_token_ids: tokens are 'token_id:N'
        tokens = choice["logprobs"].get("tokens") or []
        if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
    if not isinstance(ids, list) or len(ids) != len(logprobs):
        raise HTTPError(200, f"{where}/v1/completions: the reply has no generated token ids matching its "
                             "log-probs (asyncflow needs exact ids; see docs/engines.md for each server's flags)")
    versions = choice.get("token_versions") or [sent_version] * len(ids)
    # what the trainer indexes with must be exact: a float id was truncated, a null version or a
    # string id was a traceback, a short version list or a negative id failed later inside the trainer
    if not _whole_numbers(ids) or min(ids, default=0) < 0:
        raise HTTPError(200, f"{where}/v1/completions: the reply's token ids are not all non-negative integers "
                             f"(e.g. {next((t for t in ids if not isinstance(t, int) or t < 0), ids[:1])!r})")
    if not _whole_numbers(versions) or len(versions) != len(ids):
        raise HTTPError(200, f"{where}/v1/completions: the reply's token_versions are not one integer per "
                             f"generated token ({len(versions)} for {len(ids)} tokens)")
    if not all(math.isfinite(x) for x in logprobs):
        raise HTTPError(200, f"{where}/v1/completions: the reply's token_logprobs are not all finite")
    finish = choice.get("finish_reason")
    reason = finish if finish in ("stop", "length") else "cancelled"
    return list(ids), logprobs, list(versions), reason


def _whole_numbers(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def make_openai_engine(rollout: Any, index: int, model_dir: Path, run_dir: Path, *, session: str,
                       version: int = 0) -> OpenAIEngine:
    """The engine on `rollout.server_urls[index]` (not connected yet: `connect`). Its weight-folder
    writer writes each version once for all the run's engines that share `session`, in this
    process or another (`WeightFolderWriter`); `model_dir` gives the served folder's config files."""
    sync = make_weight_sync(rollout.server_type)
    writer = WeightFolderWriter(sync_root(rollout, run_dir), model_dir, in_place=sync.in_place, session=session,
                                lock_timeout_s=rollout.sync_timeout_s, reuse_files=sync.locks_reads)
    token = os.environ.get(rollout.server_token_env) or None
    return OpenAIEngine(rollout.server_urls[index], sync=sync, writer=writer, server_type=rollout.server_type,
                        model=rollout.server_model, token=token, max_batch=rollout.max_batch,
                        request_timeout_s=rollout.request_timeout_s, sync_timeout_s=rollout.sync_timeout_s,
                        version=version)
