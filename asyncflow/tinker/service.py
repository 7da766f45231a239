"""The routes of a Tinker-compatible service (`asyncflow tinker-serve`): what the official `tinker` SDK
sends under /api/v1, answered from the training clients (`training.TrainingBackend`), the samplers
(`sampling.SamplingPool`) and the futures (`futures.FutureStore`).

Long calls (create_model, forward_backward, optim_step, the saves and loads, asample) answer their POST
with a request id at once and run on the training thread or a sampling job; `retrieve_future` long-polls
them. A bad request is a 400 `{"detail": ...}` on the POST or, found while running, a failed future
`{"error": ..., "category": "user"}`; an unknown route is a 404 `{"detail": ...}` naming it.
Checkpoints (`save_weights`, named `save_weights_for_sampler`) are kept in this process's memory, or
with a state folder in files there (`checkpoints.py`), found again by path after a restart. The REST
API's routes (training runs, checkpoint listings and deletes, sessions) are `rest.py`'s.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError
from asyncflow.tinker.checkpoints import StoredState, make_stores
from asyncflow.tinker.futures import FutureStore
from asyncflow.tinker.rest import NotFound, RestApi, Session
from asyncflow.tinker.runs import RunStore, metadata
from asyncflow.tinker.sampling import SamplingPool, Snapshot
from asyncflow.tinker.stability import add_stability_inputs
from asyncflow.tinker.stream import StreamState
from asyncflow.tinker.training import TrainingBackend
from asyncflow.tinker.wire import FwdBwdRequest, forward_backward_output, parse_forward_backward

PREFIX = "/api/v1"
MAX_REMEMBERED = 10_000  # training submits remembered for deduplication (the most recent)
PROTO = "application/x-protobuf"
# what the SDK's client/config asks: no JWT exchange, a fwd/bwd call's chunks sent in seq order (this
# server runs a client's requests in arrival order), uncompressed bodies, one retrieve_future per sample
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "custom_loss_server_side": False,
                 "sample_join_sampling_session": False}


@dataclass
class Reply:
    status: int
    body: bytes
    content_type: str = "application/json"


def json_reply(status: int, value: Any) -> Reply:
    return Reply(status, json.dumps(value).encode())


class RouteNotFound(Exception):
    pass


class TinkerService:
    """The API's state: sessions, training clients, sampling sessions, checkpoints, futures."""

    def __init__(self, training: TrainingBackend, sampling: SamplingPool, *, api_key: str | None = None,
                 tokenizer_id: str | None = None, futures: FutureStore | None = None,
                 stream: StreamState | None = None, state_dir: Path | None = None, model_name: str = "") -> None:
        """`tokenizer_id`: what `get_info` tells the SDK to load the tokenizer from (`get_tokenizer()`):
        the model folder, where its path has no ':' (the SDK cuts the id there). `stream`: the
        streaming option's state (`stream.py`); none or a bound of 0 is the plain loop. `state_dir`:
        the folder checkpoints are written to and read from (None: memory). `model_name`: the model
        `get_server_capabilities` names."""
        self.training, self.sampling, self.api_key = training, sampling, api_key
        self.stream = stream or StreamState(0)
        self._waits = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tinker-wait")  # samplers waiting for training
        self.tokenizer_id = tokenizer_id if tokenizer_id and ":" not in tokenizer_id else None
        self.futures = futures or FutureStore()
        self._lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._ids = itertools.count()
        self.sessions: dict[str, Session] = {}
        self.base_models: dict[str, str] = {}  # model id -> the base model name it was created with
        # tinker://<model>/weights/<name> and tinker://<model>/sampler_weights/<name>
        self.checkpoints, self.sampler_weights = make_stores(state_dir)
        self.runs = RunStore(state_dir)
        self.rest = RestApi(self.runs, self.checkpoints, self.sampler_weights, self.sessions, model_name)
        # session (so model) ids unlike any an earlier process saved under, where saves outlive it
        self._run_tag = "" if state_dir is None else f"-{secrets.token_hex(4)}"
        self._submitted: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()  # (model, seq_id) -> answer
        self._closers: list[Callable[[], None]] = []

    def on_shutdown(self, fn: Callable[[], None]) -> None:
        """Call `fn` at `shutdown`, after the engines have stopped (what they ran on: Ray's placement...)."""
        self._closers.append(fn)

    def shutdown(self) -> None:
        self._waits.shutdown(wait=False, cancel_futures=True)
        self.sampling.shutdown()
        self.training.shutdown()
        for fn in self._closers:
            fn()

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Reply:
        """Answer one request; never raises."""
        route, _, query = path.partition("?")
        route = route.rstrip("/")
        try:
            if self.api_key is not None and headers.get("x-api-key") != self.api_key:
                return json_reply(401, {"detail": "a valid X-API-Key header is required"})
            return self._route(method, route, query, body)
        except RouteNotFound:
            return json_reply(404, {"detail": f"no route: {method} {route} (not supported by asyncflow tinker-serve)"})
        except NotFound as exc:
            return json_reply(404, {"detail": str(exc)})
        except UserError as exc:
            return json_reply(400, {"detail": str(exc)})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a body not of the shape this route reads
            return json_reply(400, {"detail": f"{route}: bad request body ({type(exc).__name__}: {exc})"})
        except Exception as exc:  # (the server's own failure: a 500, which the SDK retries; the server goes on)
            return json_reply(500, {"detail": f"{route}: {type(exc).__name__}: {exc}"})

    def _route(self, method: str, route: str, query: str, body: bytes) -> Reply:
        if not route.startswith(PREFIX):
            raise RouteNotFound
        name = route[len(PREFIX) + 1:]
        answer = self.rest.answer(method, name, query)
        if answer is not None:
            return json_reply(200, answer)
        if method == "GET":
            if name.startswith("samplers/"):
                return json_reply(200, self._get_sampler(name.removeprefix("samplers/")))
            if name == "healthz":
                return json_reply(200, {"status": "ok"})
            raise RouteNotFound
        if method != "POST":
            raise RouteNotFound
        if name in ("forward_backward", "forward"):
            return json_reply(200, self._forward_backward(body))
        if name.startswith("sessions/") and name.endswith("/finish"):
            return json_reply(200, self._finish(name.split("/")[1]))
        posts: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            "client/config": lambda _: CLIENT_CONFIG, "client/dynamic_config": lambda _: {},
            "create_session": self._create_session, "session_heartbeat": self._heartbeat,
            "telemetry": lambda _: {"status": "accepted"}, "create_model": self._create_model,
            "get_info": self._get_info, "optim_step": self._optim_step, "save_weights": self._save_weights,
            "load_weights": self._load_weights, "save_weights_for_sampler": self._save_for_sampler,
            "create_sampling_session": self._create_sampling_session, "asample": self._asample,
        }
        if name == "retrieve_future":
            return self._retrieve(json.loads(body or b"{}"))
        if name not in posts:
            raise RouteNotFound
        request = json.loads(body or b"{}")
        if not isinstance(request, dict):
            raise UserError(f"{route}: the body must be a JSON object")
        return json_reply(200, posts[name](request))

    # ---------------------------------------------------------------- sessions and futures

    def _new_id(self, prefix: str) -> str:
        with self._lock:
            return f"{prefix}-{next(self._ids)}"

    def _create_session(self, request: dict[str, Any]) -> dict[str, Any]:
        session_id = self._new_id(f"sess{self._run_tag}")
        name = request.get("display_name")
        self.sessions[session_id] = Session(metadata(request.get("user_metadata")), None if name is None else str(name))
        return {"session_id": session_id, "type": "create_session"}

    def _heartbeat(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"type": "session_heartbeat"}

    def _finish(self, session_id: str) -> dict[str, Any]:
        self.sessions.setdefault(session_id, Session()).finished = True
        return {}

    def _add_sampler(self, session_id: str, snapshot: Snapshot) -> str:
        """A new sampling session's id, listed under `session_id` (the SDK's session)."""
        sampler_id = self._new_id("sampler")
        self.sampling.add(sampler_id, snapshot)
        self.sessions.setdefault(session_id, Session()).sampler_ids.append(sampler_id)
        return sampler_id

    def _future(self, kind: str, future: cf.Future[Any], **extra: Any) -> dict[str, Any]:
        return {"request_id": self.futures.add(kind, future), **extra}

    def _once(self, model_id: str, seq_id: Any, submit: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """`submit()`'s answer, or the answer already given to this client's request `seq_id`: the SDK
        re-sends a submit whose answer it did not get (a timeout), and a training call must run once."""
        if seq_id is None:
            return submit()
        key = (model_id, int(seq_id))
        with self._submit_lock:  # (held while submitting: the re-sent copy waits for the first one's answer)
            if key not in self._submitted:
                self._submitted[key] = submit()
                while len(self._submitted) > MAX_REMEMBERED:
                    self._submitted.popitem(last=False)
            return self._submitted[key]

    def _retrieve(self, request: dict[str, Any]) -> Reply:
        request_id = str(request.get("request_id"))
        found = self.futures.poll(request_id)
        if found.state == "unknown":
            return json_reply(404, {"detail": f"request_id {request_id!r}: no such future (or its result expired)"})
        if found.state == "pending":
            return json_reply(200, {"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if found.state == "failed":
            exc = found.value
            category = "user" if isinstance(exc, UserError) else "server"
            message = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"
            return json_reply(200, {"error": message, "category": category})
        if found.kind == "proto":
            return Reply(200, found.value, PROTO)
        return json_reply(200, found.value)

    # ---------------------------------------------------------------- training clients

    def _create_model(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = f"{request['session_id']}:train:{int(request['model_seq_id'])}"
        lora = request.get("lora_config") or {}
        self.base_models[model_id] = str(request.get("base_model") or "")
        self.runs.add(model_id, self.base_models[model_id], int(lora.get("rank", 32)),
                      metadata(request.get("user_metadata")))

        def create() -> dict[str, Any]:
            layers = (bool(lora.get("train_attn", True)), bool(lora.get("train_mlp", True)))
            self.training.create(model_id, int(lora.get("rank", 32)), lora.get("seed"), layers)
            if self.stream.on:
                self.stream.reset(model_id, self.training.adapter(model_id))
            return {"model_id": model_id, "type": "create_model"}

        return self._future("json", self.training.submit(create), model_id=model_id)

    def _get_info(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = str(request["model_id"])
        if model_id not in self.base_models:
            raise UserError(f"get_info: model_id {model_id!r}: no such training client")
        name = self.base_models[model_id]
        rank = self.training.clients[model_id].rank if model_id in self.training.clients else None
        data = {"arch": "lora", "model_name": name, "tokenizer_id": self.tokenizer_id}
        return {"model_id": model_id, "model_data": data, "is_lora": True, "lora_rank": rank, "model_name": name,
                "type": "get_info"}

    def _forward_backward(self, body: bytes) -> dict[str, Any]:
        req = parse_forward_backward(body)
        self.training.client(req.model_id)  # (an unknown model fails the POST)
        if req.loss_fn == "stable_reinforce":  # (so does provenance naming no recorded sequence)
            add_stability_inputs(req.data, self.sampling.records)
        self.stream.check(req.model_id)
        if self.stream.on and not req.forward_only:
            return self._once(req.model_id, req.seq_id,
                              lambda: self._future("proto", self._answered_after_forward(req), model_id=req.model_id))

        def run() -> bytes:
            lps, metrics = self.training.forward_backward(req.model_id, req.loss_fn, req.config, req.data,
                                                          req.forward_only)
            return forward_backward_output(lps, metrics)

        return self._once(req.model_id, req.seq_id,
                          lambda: self._future("proto", self.training.submit(run), model_id=req.model_id))

    def _answered_after_forward(self, req: FwdBwdRequest) -> cf.Future[bytes]:
        """Streaming: a future that gets the outputs once the forward has run; the backward follows on
        the training thread, and a failure after the answer fails the client's later calls."""
        answer: cf.Future[bytes] = cf.Future()

        def run() -> None:
            try:
                self.training.forward_backward(req.model_id, req.loss_fn, req.config, req.data, False,
                                               on_forward=lambda out: answer.set_result(forward_backward_output(*out)))
            except Exception as exc:
                if answer.done():
                    self.stream.failed(req.model_id, exc)
                else:
                    answer.set_exception(exc)

        self.training.submit(run)
        return answer

    def _optim_step(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id = str(request["model_id"])
        adam = request.get("adam_params") or request.get("optim_params") or request.get("optimizer_params") or {}
        self.training.client(model_id)
        self.stream.check(model_id)
        if self.stream.on:
            return self._once(model_id, request.get("seq_id"), lambda: self._optim_step_answered_first(model_id, adam))
        return self._once(model_id, request.get("seq_id"), lambda: self._future(
            "json", self.training.submit(lambda: {"metrics": self.training.optim_step(model_id, adam)}), model_id=model_id))

    def _optim_step_answered_first(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        """Streaming: the step is queued on the training thread and answered at once, with how many of
        the client's steps are not applied yet and how far behind its newest sampler was."""
        self.stream.ask(model_id)

        def step() -> None:
            try:
                self.training.optim_step(model_id, adam)
                self.stream.applied(model_id, self.training.adapter(model_id))
            except Exception as exc:
                self.stream.failed(model_id, exc)

        self.training.submit(step)
        pending, lag = self.stream.behind(model_id)
        metrics = {"optim/lr": float(adam.get("learning_rate", 1e-4)), "stream/steps_pending": float(pending),
                   "stream/sampler_lag": float(lag)}
        return {"request_id": self.futures.done("json", {"metrics": metrics}), "model_id": model_id}

    def _save_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id, name = str(request["model_id"]), str(request.get("path") or self._new_id("state"))
        path = f"tinker://{model_id}/weights/{name}"
        self.stream.check(model_id)  # (a client whose answered step failed has no weights worth saving)

        def save() -> dict[str, Any]:
            self.checkpoints[path] = StoredState(self.training.save(model_id), self.base_models.get(model_id, ""))
            return {"path": path, "type": "save_weights"}

        return self._once(model_id, request.get("seq_id"),
                          lambda: self._future("json", self.training.submit(save), model_id=model_id))

    def _load_weights(self, request: dict[str, Any]) -> dict[str, Any]:
        path, with_optimizer = str(request["path"]), bool(request.get("optimizer", False))
        if path not in self.checkpoints:
            raise UserError(f"load_weights: {path!r}: no such checkpoint (save_state paths of this server only)")
        stored = self.checkpoints[path]
        saved = stored.saved
        if "model_id" in request:  # load_state on an existing client
            model_id = str(request["model_id"])
            create = None
        else:  # create_training_client_from_state: a new client, then the load
            model_id = f"{request['session_id']}:train:{int(request['model_seq_id'])}"
            source = path.removeprefix("tinker://").split("/")[0]
            self.base_models[model_id] = str(request.get("base_model") or self.base_models.get(source) or stored.base_model)
            source_run = self.runs.get(source)  # (its user_metadata kept where the request gives none)
            given = metadata(request.get("user_metadata"))
            self.runs.add(model_id, self.base_models[model_id], saved.rank,
                          given if given is not None or source_run is None else source_run.user_metadata)
            create = model_id

        def load() -> dict[str, Any]:
            if create is not None:
                self.training.create(create, saved.rank, None, saved.layers)
            self.training.load(model_id, saved, with_optimizer)
            if self.stream.on:
                self.stream.reset(model_id, self.training.adapter(model_id))
            return {"path": path, "model_id": model_id, "type": "load_weights"}

        return self._once(model_id, request.get("seq_id", 0 if create else None),
                          lambda: self._future("json", self.training.submit(load), model_id=model_id))

    # ---------------------------------------------------------------- sampling

    def _save_for_sampler(self, request: dict[str, Any]) -> dict[str, Any]:
        model_id, name = str(request["model_id"]), request.get("path")
        self.training.client(model_id)
        self.stream.check(model_id)
        if self.stream.on and not name:  # (a named one is a checkpoint: taken in order, after every step)
            return self._once(model_id, request.get("seq_id"), lambda: self._future(
                "json", self._waits.submit(self._newest_sampler, model_id), model_id=model_id))

        def save() -> dict[str, Any]:
            snapshot = Snapshot(self.base_models.get(model_id, ""), self.training.adapter(model_id))
            if name:
                snapshot.model_path = f"tinker://{model_id}/sampler_weights/{name}"
                self.sampler_weights[snapshot.model_path] = snapshot
                return {"path": snapshot.model_path, "type": "save_weights_for_sampler"}
            sampler_id = self._add_sampler(model_id.split(":train:")[0], snapshot)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self._once(model_id, request.get("seq_id"),
                          lambda: self._future("json", self.training.submit(save), model_id=model_id))

    def _newest_sampler(self, model_id: str) -> dict[str, Any]:
        version, asked, adapter = self.stream.newest(model_id)
        snapshot = Snapshot(self.base_models.get(model_id, ""), adapter, version=version, behind=asked - version)
        sampler_id = self._add_sampler(model_id.split(":train:")[0], snapshot)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

    def _create_sampling_session(self, request: dict[str, Any]) -> dict[str, Any]:
        path = request.get("model_path")
        if path:
            if path not in self.sampler_weights:
                raise UserError(f"create_sampling_session: {path!r}: no such sampler weights "
                                "(save_weights_for_sampler paths of this server only)")
            snapshot = self.sampler_weights[path]
        else:
            snapshot = Snapshot(str(request.get("base_model") or ""), None)
        sampler_id = self._add_sampler(str(request.get("session_id", "")), snapshot)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def _get_sampler(self, session_id: str) -> dict[str, Any]:
        snapshot = self.sampling.get(session_id)
        info: dict[str, Any] = {"sampler_id": session_id, "base_model": snapshot.base_model,
                                "model_path": snapshot.model_path}
        if snapshot.version is not None:  # (streaming: which weights its samples come from)
            info.update(weights_version=snapshot.version, versions_behind=snapshot.behind)
        return info

    def _asample(self, request: dict[str, Any]) -> dict[str, Any]:
        n = int(request.get("num_samples", 1))
        if n < 1:
            raise UserError(f"asample: num_samples must be at least 1, not {n}")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if request.get(key):
                raise UserError(f"asample: {key} is not supported by asyncflow tinker-serve (0 only)")
        kinds = {c.get("type", "encoded_text") for c in request["prompt"]["chunks"]} - {"encoded_text"}
        if kinds:
            raise UserError(f"asample: prompt chunks of type {sorted(kinds)} are not supported (encoded_text only)")
        if request.get("target_prompt_logprobs") is not None:
            raise UserError("asample: target_prompt_logprobs is not supported by asyncflow tinker-serve")
        sequence_ids = [self._new_id("seq") for _ in range(n)]
        return self._future("proto", self.sampling.submit(request, sequence_ids), sample_sequence_ids=sequence_ids)
