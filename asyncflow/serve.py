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

The HTTP transport and its bounds against hostile clients are in `serve_http`; this module holds
the routes, which bound the work a request may cause: choices per request (counted, with each
prompt's length, before any prompt is tokenized: `openai_prompts`) and in flight (429 past
`max_queued_choices`), a pause that expires, weight loads one at a time and only from `weights_root`.
"""

from __future__ import annotations

import concurrent.futures as cf
import hmac
import queue
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.engines.weight_delta import ResyncNeeded
from asyncflow.openai_prompts import chat_ids, chat_messages, fits, longest_token_chars, prompt_list
from asyncflow.openai_text import TokenFeed, finish_choice
from asyncflow.openai_wire import (
    MAX_BODY_BYTES,
    UNSUPPORTED,
    RequestError,
    completion_tokens_key,
    is_token_ids,
    openai_logprobs,
    parse_body,
    rl_fields,
    sampling_params,
    usage,
)
from asyncflow.serve_http import (
    error_body,
    is_loopback,
)
from asyncflow.weight_folder import read_weights, weights_folder

if TYPE_CHECKING:  # torch stays unimported until a server starts: the CLI validates arguments first
    from asyncflow.engines.base import GenResult

Reply = dict[str, Any] | Iterator[bytes]  # a JSON object, or a stream's server-sent events

MAX_CHOICES = 4096  # prompts x n of one request: each queued choice holds memory until it runs
MAX_QUEUED_CHOICES = 8192  # choices of all requests admitted and not finished (over it: 429)
MAX_PAUSE_S = 600.0  # a pause nobody resumes ends by itself after this (a crashed trainer cannot stall the server)
ADMIN_MAX_BODY_BYTES = 64 * 1024  # admin bodies are a few small fields
_GONE_POLL_S = 0.25  # while generating, how often a request checks that its client is still connected


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
                 request_timeout_s: float = 600.0, max_context: int | None = None, admin_token: str | None = None,
                 max_queued_choices: int = MAX_QUEUED_CHOICES, max_pause_s: float = MAX_PAUSE_S,
                 weights_root: Path | None = None, load_anywhere: bool = True) -> None:
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.token = token
        self.admin_token = admin_token  # (when set, /admin/* takes only it; it is accepted on every route)
        self.max_queued_choices = max_queued_choices
        self.max_pause_s = max_pause_s
        self.weights_root = weights_root.resolve() if weights_root is not None else None
        self.load_anywhere = load_anywhere  # without a weights root: any folder (loopback) or none (exposed)
        self._queued = 0  # choices admitted by `_run` and not finished (under `_gate`)
        self._paused_until: float | None = None  # monotonic end of the pause (None: not paused)
        self.request_timeout_s = request_timeout_s
        self.max_context = max_context
        self.chars_per_token = longest_token_chars(tokenizer)  # (texts longer than the context takes: refused unread)
        self.vocab_size = int(engine.model.get_input_embeddings().weight.shape[0])
        self._gate = threading.Condition()
        self._uid = 0
        self.created = int(time.time())
        self._local = threading.local()  # per HTTP thread: `gone`, whether its client has left
        self._loading = threading.Lock()  # one weight load at a time, each answered after it is in use

    # ------------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes,
               gone: Callable[[], bool] | None = None) -> tuple[int, Reply]:
        """Answer one HTTP request: (status, JSON object or event stream). Never raises. `gone()`: whether the client
        has disconnected (checked while generating: its requests are then cancelled)."""
        self._local.gone = gone
        try:
            route = path.split("?", 1)[0].rstrip("/") or "/"
            self._check_auth(headers, route)
            self._check_origin(headers)
            if method == "GET":
                getters: dict[str, Callable[[], dict[str, Any]]] = {
                    "/v1/models": self._models, "/admin/version": self._version, "/admin/stats": self._stats,
                    "/health": self._health,
                }
                if route in getters:
                    return 200, getters[route]()
            elif method == "POST":
                posts: dict[str, Callable[[dict[str, Any]], Reply]] = {
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
            return 500, error_body(f"internal error: {exc!r}", "server_error")

    def precheck(self, method: str, path: str, headers: Mapping[str, str], length: int) -> tuple[int, dict[str, Any]] | None:
        """The refusal a request gets from its headers alone (token, origin, body size for its
        route), or None: checked before its body is read, so a refused client cannot make the server
        wait for (or take in) a large body."""
        route = path.split("?", 1)[0].rstrip("/") or "/"
        limit = ADMIN_MAX_BODY_BYTES if route.startswith("/admin/") else MAX_BODY_BYTES
        try:
            self._check_auth(headers, route)
            self._check_origin(headers)
            if length > limit:
                raise RequestError(f"the body ({length} bytes) is larger than {limit} bytes allowed on {route}",
                                   status=413)
        except RequestError as exc:
            return exc.status, error_body(str(exc), exc.kind)
        return None

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

    def _check_auth(self, headers: Mapping[str, str], route: str) -> None:
        """The route's token: the admin token on /admin/* when one is set (it also opens every other
        route), else the token; compared in constant time."""
        admin = route.startswith("/admin/") and self.admin_token is not None
        accepted = [self.admin_token] if admin else [t for t in (self.token, self.admin_token) if t is not None]
        if not accepted or (self.token is None and not admin):
            return
        scheme, _, given = headers.get("authorization", "").strip().partition(" ")
        ok = [hmac.compare_digest(given.strip().encode(), t.encode()) for t in accepted if t is not None]
        if scheme.lower() != "bearer" or not any(ok):
            which = "the admin token" if admin else "the token"
            raise RequestError(f"missing or wrong token: send 'Authorization: Bearer TOKEN' with {which}",
                               status=401, kind="authentication_error")

    # ------------------------------------------------------------------ OpenAI routes

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "asyncflow"}]}

    def _completions(self, req: dict[str, Any]) -> Reply:
        prompts = prompt_list(req.get("prompt"))
        params = sampling_params(req, {**UNSUPPORTED, "suffix": None})
        echo = req.get("echo", False)
        if not isinstance(echo, bool) or (echo and params["stream"]):
            raise RequestError("echo: expected true or false, and not with stream", param="echo")
        self._check_size(prompts, params)
        ids = self._prompts(prompts)
        reply = self._answer(ids, params, chat=False)
        if echo:  # (after generating: the prompts' pass then runs on the weights the choices ended on)
            self._echo(reply, ids, params["logprobs"])
        return reply

    def _echo(self, reply: Any, prompts: list[list[int]], logprobs: bool) -> None:
        """`echo`: each choice's text, ids and log-probs preceded by its prompt's, as OpenAI's legacy
        completions give them (the first prompt token has log-prob None: nothing conditions it). The
        prompt's log-probs are the model's at temperature 1, one scoring pass for all the prompts."""
        assert isinstance(reply, dict)
        scored = [p for p in prompts if len(p) > 1]
        lps = iter(self._score(scored) if logprobs and scored else [])
        per_prompt = [[None, *next(lps)] if logprobs and len(p) > 1 else [None] * len(p) for p in prompts]
        for choice in reply["choices"]:
            ids = prompts[choice["prompt_index"]]
            choice["text"] = self._text(ids) + choice["text"]
            choice["prompt_token_ids"] = list(ids)
            lp = choice["logprobs"]
            lp["token_logprobs"] = per_prompt[choice["prompt_index"]] + lp["token_logprobs"]
            if "tokens" in lp:
                lp["tokens"] = [self._piece(t) for t in ids] + lp["tokens"]
            if lp.get("top_logprobs") is not None:
                lp["top_logprobs"] = [None] * len(ids) + lp["top_logprobs"]

    def _score(self, prompts: list[list[int]]) -> list[list[float]]:
        score = getattr(self.engine, "submit_score", None)
        if score is None:
            raise RequestError("echo with logprobs: this engine cannot score prompts", param="echo")
        try:
            return score(prompts).result(timeout=self.request_timeout_s)  # type: ignore[no-any-return]
        except cf.TimeoutError:
            raise RequestError(f"echo: the prompts' log-probs took over {self.request_timeout_s:g} s", status=504,
                               kind="timeout") from None

    def _check_size(self, prompts: list[Any], params: dict[str, Any]) -> None:
        """Refuse a request by its counts before any prompt is converted (the body limit admits
        millions of prompts, each costing a tokenizer call and its ids' memory): its choices, and each
        prompt's length against the context it may use."""
        self._check_choices(len(prompts), params["n"])
        if self.max_context is None:
            return
        room = self.max_context - params["max_tokens"]
        for p in prompts:
            if isinstance(p, (str, list)) and not fits(p, room, self.chars_per_token):
                what = f"{len(p)} characters" if isinstance(p, str) else f"{len(p)} tokens"
                per = f" (a token here is at most {self.chars_per_token} characters)" if isinstance(p, str) else ""
                raise RequestError(f"prompt ({what}) + max_tokens ({params['max_tokens']}) exceeds the model's context "
                                   f"of {self.max_context} tokens{per}", param="max_tokens")

    def _check_choices(self, prompts: int, n: int) -> None:
        limit = min(MAX_CHOICES, self.max_queued_choices)
        if prompts * n > limit:
            raise RequestError(f"{prompts} prompts x n={n} is more than {limit} choices in one request; split it",
                               param="prompt")

    def _chat(self, req: dict[str, Any]) -> Reply:
        req = completion_tokens_key(req)
        params = sampling_params(req, UNSUPPORTED, chat=True)  # (checked, and its choices counted, before rendering)
        self._check_choices(1, params["n"])
        room = None if self.max_context is None else \
            self.max_context - (params["max_tokens"] if req.get("max_tokens") is not None else 1)
        if room is not None and room < 1:
            raise RequestError(f"max_tokens ({params['max_tokens']}) leaves no room for the messages in the model's "
                               f"context of {self.max_context} tokens", param="max_tokens")
        messages = chat_messages(req.get("messages"), room)
        if getattr(self.tok, "chat_template", None) is None:
            raise RequestError(f"model {self.model_name!r} has no chat template (its tokenizer defines none); "
                               "use /v1/completions with a text or token-id prompt", param="messages")
        prompt = chat_ids(self.tok, messages, generation_prompt=True, room=room, chars_per_token=self.chars_per_token)
        if not prompt:
            raise RequestError("messages: empty after the chat template", param="messages")
        if req.get("max_tokens") is None and self.max_context is not None:  # (as OpenAI and vLLM: the rest of
            req = {**req, "max_tokens": max(1, self.max_context - len(prompt))}  # the context, not 16)
        return self._answer([prompt], sampling_params(req, UNSUPPORTED, chat=True), chat=True)

    def _answer(self, prompts: list[list[int]], params: dict[str, Any], chat: bool) -> Reply:
        """The reply: one JSON object, or (`stream`) server-sent events. Each choice is cut at its
        first stop string (`openai_text`): its ids and log-probs are the tokens up to the one
        completing it, its text stops before it."""
        if params["stream"]:
            return self._stream(prompts, params, chat)
        results = self._run(prompts, params)
        choices = []
        for i, (prompt_index, res) in enumerate(results):
            cut, text = finish_choice(res, self._text, params["stop"])
            results[i] = (prompt_index, cut)
            fields = rl_fields(cut)
            if params["logprobs"]:
                fields["logprobs"].update(openai_logprobs(cut, self._piece, chat, params["top_logprobs"]))
            body = {"message": {"role": "assistant", "content": text}} if chat else {"text": text,
                                                                                       "prompt_index": prompt_index}
            choices.append({"index": i, **body, **fields})
        rid, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        return {"id": f"{rid}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage(prompts, params["n"], results)}

    def _prompts(self, prompt: list[Any]) -> list[list[int]]:
        """Token ids of each prompt (`prompt_list`'s): text (tokenized as it is) or a token-id list."""
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

    def _admit(self, prompts: list[list[int]], params: dict[str, Any]) -> int:
        """Admit the request's choices (within `max_queued_choices`); the count, for `_release`."""
        choices = len(prompts) * params["n"]
        self._check_choices(len(prompts), params["n"])
        for ids in prompts:
            if self.max_context is not None and len(ids) + params["max_tokens"] > self.max_context:
                raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params['max_tokens']}) exceeds the "
                                   f"model's context of {self.max_context} tokens", param="max_tokens")
        self._check_engine()
        with self._gate:  # each admitted choice holds memory (and its request a thread) until it ends
            if self._queued + choices > self.max_queued_choices:
                raise RequestError(f"{self._queued} choices are queued or running; {choices} more would pass "
                                   f"--max-queued-choices {self.max_queued_choices}: retry later", status=429,
                                   kind="rate_limit_error")
            self._queued += choices
        return choices

    def _release(self, choices: int) -> None:
        with self._gate:
            self._queued -= choices

    def _run(self, prompts: list[list[int]], params: dict[str, Any]) -> list[tuple[int, GenResult]]:
        """Admit the request's choices, wait until not paused, generate."""
        choices = self._admit(prompts, params)
        try:
            deadline = time.monotonic() + self.request_timeout_s
            self._wait_unpaused(deadline)
            return self._generate(prompts, params, deadline)
        finally:
            self._release(choices)

    def _check_engine(self) -> None:
        error = getattr(self.engine, "error", None)
        if error is not None:
            raise RequestError(f"the engine stopped after an error ({error!r}); the server is exiting for its "
                               "supervisor to restart it", status=503, kind="server_error")

    def _submit(self, prompts: list[list[int]], params: dict[str, Any], futures: list[tuple[int, Any]],
                emit: Callable[[tuple[Any, ...]], None] | None = None) -> None:
        """Submit n requests per prompt into `futures` (the caller cancels them on any failure); a
        token callback where stop strings or a stream (`emit`) need one; choice k seeded seed + k."""
        from asyncflow.engines.base import GenRequest

        for index, ids in enumerate(prompts):
            for _ in range(params["n"]):
                with self._gate:
                    self._uid += 1
                    uid = self._uid
                k = len(futures)
                feed = TokenFeed(k, self._text, params["stop"], emit) if params["stop"] or emit else None
                seed = None if params["seed"] is None else (params["seed"] + k) % (1 << 64)
                req = GenRequest(uid, ids, params["max_tokens"], params["temperature"], params["top_p"],
                                 params["top_k"], seed=seed, top_logprobs=params["top_logprobs"], on_token=feed)
                futures.append((index, self.engine.submit(req)))

    def _generate(self, prompts: list[list[int]], params: dict[str, Any],
                  deadline: float) -> list[tuple[int, GenResult]]:
        """Submit n requests per prompt and wait for all of them (to `deadline`; cancelled when the
        client leaves). Out of memory for their batch is a 503 for this request alone."""
        futures: list[tuple[int, Any]] = []
        results = []
        try:
            self._submit(prompts, params, futures)
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
        except Exception as exc:
            raise self._failure(exc) from None
        finally:  # a request that failed or timed out (or could not submit them all): its other choices are abandoned
            for _, fut in futures:
                fut.cancel()
        return results

    def _failure(self, exc: Exception) -> Exception:
        """What a generation failure is answered with: a timeout 504, out of memory 503 (for this
        request alone), a stopped engine 503 (as /health says); anything else as it is (a 500)."""
        from asyncflow.engines.base import EngineOutOfMemory

        if isinstance(exc, RequestError):
            return exc
        if isinstance(exc, (TimeoutError, cf.TimeoutError)):
            return RequestError(f"generation timed out after {self.request_timeout_s:g} s", status=504, kind="timeout")
        if isinstance(exc, EngineOutOfMemory):
            return RequestError(f"{exc}; retry with fewer choices or shorter prompts", status=503, kind="server_error")
        try:
            self._check_engine()
        except RequestError as stopped:
            return stopped
        return exc

    # ------------------------------------------------------------------ streaming

    def _stream(self, prompts: list[list[int]], params: dict[str, Any], chat: bool) -> Iterator[bytes]:
        stream = self._stream_events(prompts, params, chat)
        next(stream)  # admission, the pause and submission: their refusals are answered before the 200
        return stream

    def _stream_events(self, prompts: list[list[int]], params: dict[str, Any], chat: bool) -> Iterator[bytes]:
        """Server-sent events: one chunk per generated token, each choice's last chunk, the usage
        when asked, `[DONE]`. A failure after the 200 is an `error` event (the SDK raises it)."""
        from asyncflow.openai_stream import DONE, StreamState, pump, sse

        choices = self._admit(prompts, params)
        futures: list[tuple[int, Any]] = []
        try:
            self._wait_unpaused(time.monotonic() + self.request_timeout_s)
            deadline = time.monotonic() + self.request_timeout_s
            events: queue.Queue[tuple[Any, ...]] = queue.Queue()
            self._submit(prompts, params, futures, emit=events.put)
            state = StreamState(chat=chat, model=self.model_name, rid=f"{'chatcmpl' if chat else 'cmpl'}-"
                                f"{uuid.uuid4().hex}", decode=self._text, piece=self._piece, params=params)
            yield b""
            try:
                results = yield from pump(futures, events, state, deadline, getattr(self._local, "gone", None))
            except Exception as exc:
                err = self._failure(exc)
                if not isinstance(err, RequestError):
                    traceback.print_exc(file=sys.stderr)
                kind = err.kind if isinstance(err, RequestError) else "server_error"
                yield sse(error_body(str(err), kind))
                return
            if params["include_usage"]:
                yield sse(state.usage_chunk(usage(prompts, params["n"], results)))
            yield DONE
        finally:
            for _, fut in futures:
                fut.cancel()
            self._release(choices)

    def _paused_now(self) -> bool:
        """Paused, and the pause has not expired (call under `_gate`)."""
        return self._paused_until is not None and time.monotonic() < self._paused_until

    def _wait_unpaused(self, deadline: float) -> None:
        gone = getattr(self._local, "gone", None)
        with self._gate:
            while self._paused_now():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RequestError(f"server paused for longer than {self.request_timeout_s:g} s", status=503,
                                       kind="server_paused")
                if gone is not None and gone():  # (it held its thread to the timeout, then was generated anyway)
                    raise RequestError("the client disconnected", status=499, kind="client_closed")
                assert self._paused_until is not None
                pause_left = self._paused_until - time.monotonic()
                self._gate.wait(timeout=max(0.0, min(left, pause_left, _GONE_POLL_S if gone is not None else left)))

    def _text(self, ids: list[int]) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=True))

    def _piece(self, token: int) -> str:
        """One token's text in log-prob lists (special tokens by name)."""
        return str(self.tok.decode([token]))

    # ------------------------------------------------------------------ admin routes

    def _load_weights(self, req: dict[str, Any]) -> dict[str, Any]:
        path, version, mode = req.get("path"), req.get("version"), req.get("mode", "swap")
        if not isinstance(path, str) or not path:
            raise RequestError("path: expected the folder holding the new *.safetensors weights", param="path")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise RequestError("version: expected an integer >= 0", param="version")
        if mode not in ("drain", "swap", "abort"):
            raise RequestError(f"mode: {mode!r} is not one of drain, swap, abort", param="mode")
        folder = weights_folder(path, self.weights_root, self.load_anywhere)
        deadline = time.monotonic() + self.request_timeout_s
        # one at a time, taken before the weights are read: two loads never hold a full state dict each,
        # and a load that another overtook was answered 200 with weights never loaded
        if not self._loading.acquire(timeout=self.request_timeout_s):
            raise RequestError(f"another weight load held the engine for {self.request_timeout_s:g} s", status=504,
                               kind="timeout")
        try:
            state = read_weights(folder, self.engine.model, self.weights_root)
            try:
                seconds = self._wait_loaded(self.engine.request_weights(state, version, mode), deadline)
            except ResyncNeeded as exc:  # (a delta that does not apply here: the client sends the full weights)
                raise RequestError(f"path: {exc}", status=409, kind="resync_needed", param="path") from None
            del state  # (the engine holds it until loaded; not this thread past that)
        finally:
            self._loading.release()
        return {"version": self.engine.version, "seconds": seconds}

    def _wait_loaded(self, done: cf.Future[float], deadline: float) -> float:
        try:
            return done.result(timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, cf.TimeoutError):
            if self.engine.withdraw_weights(done):  # (it took effect later, after this 504)
                raise RequestError(f"the weight load did not start within {self.request_timeout_s:g} s; it is "
                                   f"withdrawn and version {self.engine.version} stays", status=504,
                                   kind="timeout") from None
        try:  # begun: it is being copied in
            return done.result(timeout=self.request_timeout_s)
        except (TimeoutError, cf.TimeoutError):  # (it was a 500 "internal error")
            raise RequestError(f"the weight load began but did not finish within {self.request_timeout_s:g} "
                               f"s more; version {self.engine.version} is loaded now", status=504,
                               kind="timeout") from None

    def _pause(self, req: dict[str, Any]) -> dict[str, Any]:
        """Pause for `timeout_s` (default and most: `max_pause_s`); it then ends by itself, so a
        client that paused and died does not stall the server for good."""
        seconds = req.get("timeout_s", self.max_pause_s)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= self.max_pause_s:
            raise RequestError(f"timeout_s: expected seconds in (0, {self.max_pause_s:g}] (--max-pause-s)",
                               param="timeout_s")
        with self._gate:
            self._paused_until = time.monotonic() + float(seconds)
        return {"paused": True}

    def _resume(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._gate:
            self._paused_until = None
            self._gate.notify_all()
        return {"paused": False}

    def _version(self) -> dict[str, Any]:
        with self._gate:
            paused = self._paused_now()
        return {"version": self.engine.version, "model": self.model_name, "paused": paused}

    def _stats(self) -> dict[str, Any]:
        with self._gate:
            queued = self._queued
        return {"version": self.engine.version, "in_flight": self.engine.load(), "queued_choices": queued,
                **self.engine.stats()}
