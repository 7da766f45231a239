"""`asyncflow serve`: an OpenAI-compatible HTTP server over the continuous-batching `HFEngine`.

    HTTP threads (one per connection)                     decode thread (HFEngine)
    auth ─► validate ─► pause gate ─► engine.submit() ──► waiting ─► running batch ─► futures
                            ▲                                 ▲                         │
    /admin/pause, /resume ──┘    /admin/load_weights ─────────┘ (request_weights)       ▼
                                                                          JSON reply per request

Every HTTP request is its own thread that submits its `n` generation requests to the one engine and
waits for their futures, so concurrent HTTP requests share decode steps (continuous batching):
requests join and leave the running batch between steps. Replies carry what RL needs besides the
text: `token_ids` (EOS included when generation ended on it), `logprobs.token_logprobs` (the behavior
log-probs the engine sampled with) and `token_versions` (the weight version of each token).

Why the standard library's threading server and not an ASGI stack: nothing beyond the core
dependencies is needed, and the work per request is waiting on a future while the decode thread
computes, which threads do well.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import hmac
import http.server
import ipaddress
import json
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.errors import UserError
from asyncflow.openai_wire import (
    MAX_BODY_BYTES,
    READ_TIMEOUT_S,
    UNSUPPORTED,
    RequestError,
    completion_tokens_key,
    flatten_content,
    is_token_ids,
    parse_body,
    rl_fields,
    sampling_params,
    usage,
)
from asyncflow.weight_folder import read_weights

if TYPE_CHECKING:  # torch stays unimported until a server starts: the CLI validates arguments first
    from asyncflow.engines.base import GenResult

MAX_CHOICES = 4096  # prompts x n of one request: each queued choice holds memory until it runs
_GONE_POLL_S = 0.25  # while generating, how often a request checks that its client is still connected


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _local_host_name(host: str) -> bool:
    """Whether a `Host` header (name or address, optional port) names this machine's loopback."""
    name = host.strip().lower()
    if name.startswith("["):  # [IPv6]:port
        name = name[1:].partition("]")[0]
    elif name.count(":") == 1:
        name = name.partition(":")[0]
    return is_loopback(name.rstrip(".")) or name.rstrip(".").endswith(".localhost")


class OpenAIServer:
    """The routes of `asyncflow serve`, independent of the HTTP transport (so tests can call
    `handle` directly and the transport stays a thin shell)."""

    def __init__(self, engine: Any, tokenizer: Any, model_name: str, *, token: str | None = None,
                 request_timeout_s: float = 600.0, max_context: int | None = None) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.token = token
        self.request_timeout_s = request_timeout_s
        self.max_context = max_context
        self.vocab_size = int(engine.model.get_input_embeddings().weight.shape[0])
        self._gate = threading.Condition()
        self._paused = False
        self._uid = 0
        self.created = int(time.time())
        self._local = threading.local()  # per HTTP thread: `gone`, whether its client has left
        self._loading = threading.Lock()  # one weight load at a time, each answered after it is in use

    # ------------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
               gone: Callable[[], bool] | None = None) -> tuple[int, dict[str, Any]]:
        """Answer one HTTP request: (status, JSON object). Never raises. `gone()`: whether the client
        has disconnected (checked while generating: its requests are then cancelled)."""
        self._local.gone = gone
        try:
            self._check_auth(headers)
            self._check_origin(headers)
            route = path.split("?", 1)[0].rstrip("/") or "/"
            if method == "GET":
                getters: dict[str, Callable[[], dict[str, Any]]] = {
                    "/v1/models": self._models, "/admin/version": self._version, "/admin/stats": self._stats,
                    "/health": self._health,
                }
                if route in getters:
                    return 200, getters[route]()
            elif method == "POST":
                posts: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
                    "/v1/completions": self._completions, "/v1/chat/completions": self._chat,
                    "/admin/load_weights": self._load_weights, "/admin/pause": self._pause,
                    "/admin/resume": self._resume,
                }
                if route in posts:
                    return 200, posts[route](parse_body(body))
            if method not in ("GET", "POST"):
                raise RequestError(f"method {method} is not allowed (GET or POST)", status=405,
                                   kind="invalid_request_error")
            raise RequestError(f"no route {method} {route}", status=404, kind="not_found_error")
        except RequestError as exc:
            return exc.status, {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": None}}
        except Exception as exc:  # a bug or a dead engine: logged here, one line to the client
            traceback.print_exc(file=sys.stderr)
            return 500, {"error": {"message": f"internal error: {exc!r}", "type": "server_error", "param": None,
                                   "code": None}}

    def _health(self) -> dict[str, Any]:
        """200 while the engine can answer; 503 once it stopped after an error (a load balancer or
        supervisor then sees it: every request would fail)."""
        error = getattr(self.engine, "error", None)
        if error is not None:
            raise RequestError(f"the engine stopped after an error: {error!r}", status=503, kind="server_error")
        return {"status": "ok"}

    def _check_origin(self, headers: Mapping[str, str]) -> None:
        """Without a token (loopback), only local clients that are not web pages: a request a browser
        sends for a page (it carries `Origin`), or one for another host name (DNS rebinding: a page's
        own name resolved to 127.0.0.1), is refused. Any site the user had open could otherwise
        pause the server, load weights from any folder, or generate."""
        if self.token is not None:
            return  # (a browser cannot add the Authorization header to a cross-site request unasked)
        if "origin" in headers:
            raise RequestError("requests from web pages (an Origin header) need the server started with --token",
                               status=403, kind="permission_error")
        host = headers.get("host")
        if host is not None and not _local_host_name(host):
            raise RequestError(f"host {host!r} is not this server's loopback name: start the server with --token to "
                               "serve other names", status=403, kind="permission_error")

    def _check_auth(self, headers: Mapping[str, str]) -> None:
        if self.token is None:
            return
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise RequestError("missing or wrong token: send 'Authorization: Bearer TOKEN'", status=401,
                               kind="authentication_error")

    # ------------------------------------------------------------------ OpenAI routes

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "asyncflow"}]}

    def _completions(self, req: dict[str, Any]) -> dict[str, Any]:
        prompts = self._prompts(req.get("prompt"))
        params = sampling_params(req, {**UNSUPPORTED, "suffix": None, "echo": False})
        results = self._run(prompts, params)
        choices = []
        for i, (prompt_index, res) in enumerate(results):
            choices.append({"index": i, "text": self._text(res.response_ids), **rl_fields(res),
                            "prompt_index": prompt_index})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage(prompts, params["n"], results)}

    def _chat(self, req: dict[str, Any]) -> dict[str, Any]:
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise RequestError("messages: expected a non-empty list of {role, content} objects", param="messages")
        if getattr(self.tok, "chat_template", None) is None:
            raise RequestError(f"model {self.model_name!r} has no chat template (its tokenizer defines none); "
                               "use /v1/completions with a text or token-id prompt", param="messages")
        messages = [flatten_content(m, i) for i, m in enumerate(messages)]
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:
            raise RequestError(f"messages: the chat template failed: {exc}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        prompt = [int(t) for t in ids]
        if not prompt:
            raise RequestError("messages: empty after the chat template", param="messages")
        req = completion_tokens_key(req)
        if req.get("max_tokens") is None and self.max_context is not None:  # (as OpenAI and vLLM: the rest of
            req = {**req, "max_tokens": max(1, self.max_context - len(prompt))}  # the context, not 16)
        params = sampling_params(req, UNSUPPORTED)
        results = self._run([prompt], params)
        choices = [{"index": i, "message": {"role": "assistant", "content": self._text(res.response_ids)},
                    **rl_fields(res)} for i, (_, res) in enumerate(results)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage([prompt], params["n"], results)}

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """Token ids of each prompt: text (tokenized as it is), a token-id list, or a list of either."""
        if isinstance(prompt, str) or is_token_ids(prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise RequestError("prompt: expected text, a list of token ids, or a non-empty list of those",
                               param="prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                ids = [int(t) for t in self.tok(p)["input_ids"]]
            elif is_token_ids(p):
                ids = [int(t) for t in p]
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                                       param="prompt")
            else:
                raise RequestError("prompt: expected text, a list of token ids, or a list of those", param="prompt")
            if not ids:
                raise RequestError("prompt: empty after tokenization", param="prompt")
            out.append(ids)
        return out

    def _run(self, prompts: list[list[int]], params: dict[str, Any]) -> list[tuple[int, GenResult]]:
        """Submit n requests per prompt (once not paused) and wait for all of them."""
        from asyncflow.engines.base import GenRequest

        deadline = time.monotonic() + self.request_timeout_s
        if len(prompts) * params["n"] > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts x n={params['n']} is more than {MAX_CHOICES} choices in one "
                               "request; split it", param="prompt")
        for ids in prompts:
            if self.max_context is not None and len(ids) + params["max_tokens"] > self.max_context:
                raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params['max_tokens']}) exceeds the "
                                   f"model's context of {self.max_context} tokens", param="max_tokens")
        self._wait_unpaused(deadline)
        futures = []
        results = []
        try:
            for index, ids in enumerate(prompts):
                for _ in range(params["n"]):
                    with self._gate:
                        self._uid += 1
                        uid = self._uid
                    req = GenRequest(uid, ids, params["max_tokens"], params["temperature"], params["top_p"],
                                     params["top_k"])
                    futures.append((index, self.engine.submit(req)))
            gone = getattr(self._local, "gone", None)
            for index, fut in futures:
                while True:
                    left = deadline - time.monotonic()
                    wait = left if gone is None else min(left, _GONE_POLL_S)
                    try:
                        results.append((index, fut.result(timeout=max(0.0, wait))))
                        break
                    except (TimeoutError, cf.TimeoutError):  # (distinct classes before Python 3.11)
                        if time.monotonic() >= deadline:
                            raise
                        if gone is not None and gone():
                            raise RequestError("the client disconnected", status=499, kind="client_closed") from None
        except (TimeoutError, cf.TimeoutError):
            raise RequestError(f"generation timed out after {self.request_timeout_s:g} s", status=504,
                               kind="timeout") from None
        finally:  # a request that failed or timed out (or could not submit them all): its other choices are abandoned
            for _, fut in futures:
                fut.cancel()
        return results

    def _wait_unpaused(self, deadline: float) -> None:
        gone = getattr(self._local, "gone", None)
        with self._gate:
            while self._paused:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestError(f"server paused for longer than {self.request_timeout_s:g} s", status=503,
                                       kind="server_paused")
                if gone is not None and gone():  # (it held its thread to the timeout, then was generated anyway)
                    raise RequestError("the client disconnected", status=499, kind="client_closed")
                self._gate.wait(timeout=left if gone is None else min(left, _GONE_POLL_S))

    def _text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    # ------------------------------------------------------------------ admin routes

    def _load_weights(self, req: dict[str, Any]) -> dict[str, Any]:
        path, version, mode = req.get("path"), req.get("version"), req.get("mode", "swap")
        if not isinstance(path, str) or not path:
            raise RequestError("path: expected the folder holding the new *.safetensors weights", param="path")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("version: expected an integer >= 0", param="version")
        if mode not in ("drain", "swap", "abort"):
            raise RequestError(f"mode: {mode!r} is not one of drain, swap, abort", param="mode")
        state = read_weights(Path(path), self.engine.model)
        deadline = time.monotonic() + self.request_timeout_s
        # one at a time: a load that another overtook was answered 200 with weights never loaded
        if not self._loading.acquire(timeout=self.request_timeout_s):
            raise RequestError(f"another weight load held the engine for {self.request_timeout_s:g} s", status=504,
                               kind="timeout")
        try:
            done = self.engine.request_weights(state, version, mode)
            try:
                seconds = done.result(timeout=max(0.0, deadline - time.monotonic()))
            except (TimeoutError, cf.TimeoutError):
                if self.engine.withdraw_weights(done):  # (it took effect later, after this 504)
                    raise RequestError(f"the weight load did not start within {self.request_timeout_s:g} s; it is "
                                       f"withdrawn and version {self.engine.version} stays", status=504,
                                       kind="timeout") from None
                try:  # begun: it is being copied in
                    seconds = done.result(timeout=self.request_timeout_s)
                except (TimeoutError, cf.TimeoutError):  # (it was a 500 "internal error")
                    raise RequestError(f"the weight load began but did not finish within {self.request_timeout_s:g} "
                                       f"s more; version {self.engine.version} is loaded now", status=504,
                                       kind="timeout") from None
        finally:
            self._loading.release()
        return {"version": self.engine.version, "seconds": seconds}

    def _pause(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._gate:
            self._paused = True
        return {"paused": True}

    def _resume(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._gate:
            self._paused = False
            self._gate.notify_all()
        return {"paused": False}

    def _version(self) -> dict[str, Any]:
        return {"version": self.engine.version, "model": self.model_name, "paused": self._paused}

    def _stats(self) -> dict[str, Any]:
        return {"version": self.engine.version, "in_flight": self.engine.load(), **self.engine.stats()}


# ---------------------------------------------------------------------- HTTP transport


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # a client that stops sending mid-request: its thread is freed, not held forever

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_PUT(self) -> None:  # (other methods: an OpenAI-style JSON error, not the standard library's HTML page)
        self._answer("PUT")

    def do_DELETE(self) -> None:
        self._answer("DELETE")

    def do_PATCH(self) -> None:
        self._answer("PATCH")

    def do_HEAD(self) -> None:
        self._answer("HEAD")

    def do_OPTIONS(self) -> None:
        self._answer("OPTIONS")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line, an over-long header, an
        unknown method) as the OpenAI-style JSON object every other error is, not its HTML page."""
        if self.request_version == "HTTP/0.9":  # (a request line it could not parse: no status line was written)
            self.request_version = "HTTP/1.0"
        phrase = message or http.server.BaseHTTPRequestHandler.responses.get(code, ("error",))[0]
        data = json.dumps({"error": {"message": phrase, "type": "invalid_request_error", "param": None,
                                     "code": None}}).encode()
        self.close_connection = True
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    def _answer(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        headers = {k.lower(): v for k, v in self.headers.items()}
        if "chunked" in headers.get("transfer-encoding", "").lower():  # (its body was read as empty)
            self._skip_chunked_body()  # (answered and closed mid-body, the client's send broke: no 411 seen)
            status, reply = 411, {"error": {"message": "send the body with a Content-Length (chunked transfer "
                                                       "encoding is not supported)", "type": "invalid_request_error",
                                            "param": None, "code": None}}
        elif not 0 <= length <= MAX_BODY_BYTES:
            status, reply = 400, {"error": {"message": "bad or too large Content-Length", "type": "invalid_request_error",
                                            "param": None, "code": None}}
        else:
            body = self.rfile.read(length) if length else b""
            status, reply = self.server.app.handle(method, self.path, headers, body, gone=self._client_gone)
        data = json.dumps(reply).encode()
        self.close_connection = True
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client left before its answer
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if method != "HEAD":  # (a HEAD reply has headers only)
                self.wfile.write(data)

    def _skip_chunked_body(self) -> None:
        """Read a chunked body to its end, discarding it (at most `MAX_BODY_BYTES`; the socket's
        `timeout` bounds each read), so the client has sent it all before it is answered."""
        left = MAX_BODY_BYTES
        with contextlib.suppress(OSError, ValueError):
            while left > 0:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline(1024)  # (the blank line after the last chunk; trailers are not read)
                    return
                if not 0 < size <= left:
                    return  # (too large: answered without reading it all)
                left -= size
                self.rfile.read(size + 2)  # the chunk and its line end

    def _client_gone(self) -> bool:
        """The client closed its connection: its socket reads end-of-file (its request was read whole)."""
        try:
            if hasattr(select, "poll"):  # (select.select fails on descriptors past 1024: a busy server has those)
                poller = select.poll()
                poller.register(self.connection, select.POLLIN)
                if not poller.poll(0):
                    return False
            elif not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""  # readable: data, or end-of-file
        except OSError:
            return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would drown the useful output


class _HTTPServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once; the default backlog of 5 would drop them
    app: OpenAIServer  # set before serving starts (`run_server` binds before the model loads)

    def __init__(self, address: tuple[Any, ...], app: OpenAIServer | None = None,  # (IPv6: a 4-tuple)
                 family: socket.AddressFamily = socket.AF_INET) -> None:
        if app is not None:
            self.app = app
        self.address_family = family
        super().__init__(address, _Handler)


def listen(host: str, port: int) -> _HTTPServer:
    """Resolve `host` and bind `host:port` (not serving yet). Done before the model loads (seconds), so
    an unknown host or a busy port ends at once with one line naming `--host` or `--port`, not with a
    traceback after the load. IPv4 is preferred where the host has both (as the standard server does)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)  # "": all
    except (OSError, UnicodeError, ValueError) as exc:  # socket.gaierror is an OSError
        raise UserError(f"serve: --host {host}: cannot be resolved ({getattr(exc, 'strerror', None) or exc})") from None
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    try:
        return _HTTPServer(address, family=family)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"serve: --port {port}: address already in use on {host}") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"serve: --host {host}: not an address of this machine ({why})") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"serve: --port {port}: permission denied on {host} ({why})") from None
        raise UserError(f"serve: cannot listen on --host {host} --port {port} ({why})") from None


def _serve_in_thread(server: _HTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="asyncflow-serve-http", daemon=True)
    thread.start()
    return thread


def start_http(app: OpenAIServer, host: str, port: int) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    """Bind `host:port` (0: a free port; read it from `server.server_address`) and serve in a thread."""
    server = listen(host, port)
    server.app = app
    return server, _serve_in_thread(server)


MODEL_DIR_KEY = "serve MODEL_DIR"


def load_tokenizer(model_dir: Path) -> Any:
    """The folder's tokenizer; one that does not load, is empty or has no EOS token is a `UserError`
    naming the folder (`asyncflow.tokenizer.load_tokenizer`, under this command's key)."""
    from asyncflow.tokenizer import load_tokenizer as load

    return load(model_dir, key=MODEL_DIR_KEY)


def make_app(model_dir: Path, *, model_name: str, token: str | None, max_batch: int,
             seed: int = 0) -> OpenAIServer:
    """Load the model folder's tokenizer and weights into an `HFEngine` behind the routes; a folder
    that does not load is a `UserError` naming it."""
    tok = load_tokenizer(model_dir)

    import torch

    from asyncflow.data import generation_stop_ids
    from asyncflow.engines.hf import HFEngine
    from asyncflow.model_folder import check_weights_match_config

    check_weights_match_config(model_dir, key=MODEL_DIR_KEY)
    torch.manual_seed(seed)
    try:
        eos = int(tok.eos_token_id)  # (and generation_config.json's stop ids, as transformers and vLLM stop)
        engine = HFEngine(model_dir, eos_token_id=[eos, *generation_stop_ids(model_dir, eos)],
                          pad_token_id=int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
                          max_batch=max_batch, seed=seed, name="serve")
    except (OSError, ValueError, KeyError) as exc:  # the folder's config or weights (json errors are ValueErrors)
        raise UserError(f"{MODEL_DIR_KEY}: cannot load the model in {model_dir}: {type(exc).__name__}: {exc}") from None
    ctx = getattr(engine.model.config, "max_position_embeddings", None)
    return OpenAIServer(engine, tok, model_name, token=token, max_context=ctx)


def run_server(model_dir: Path, *, host: str, port: int, model_name: str, token: str | None, max_batch: int,
               log: Callable[[str], None] = print) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); prints one line with the address once listening.

    The cheap checks run first, in the order that costs least: the folder's files (plain Python), then
    the address (bound now, served once the model is in), then the tokenizer and the model."""
    from asyncflow.model_folder import check_model_dir

    check_model_dir(model_dir, key=MODEL_DIR_KEY)
    server = listen(host, port)
    try:
        app = make_app(model_dir, model_name=model_name, token=token, max_batch=max_batch)
    except BaseException:
        server.server_close()
        raise
    server.app = app
    thread = _serve_in_thread(server)
    bound_port = int(server.server_address[1])
    log(f"asyncflow serve: model {model_name!r} from {model_dir} listening on http://{host}:{bound_port}"
        + (" (token required)" if token else ""))

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while thread.is_alive():
            thread.join(timeout=1.0)
    finally:
        server.shutdown()
        server.server_close()
        app.engine.shutdown()
