"""The recording OpenAI-compatible endpoint that black-box agent episodes (`rollout.agent`) talk to.

```
 agent episode (any OpenAI client, plain HTTP)            rollout worker's event loop
   base_url = http://127.0.0.1:PORT/episodes/<key>/v1 ──► AgentProxy (asyncio server, one per worker)
                                                             │ routes by <key> to the episode's
                                                             ▼
                                    EpisodeRecorder ──GenRequest(token ids)──► InferenceEngine
                                      records per call: prompt ids sent, response ids, behavior
                                      log-probs and token versions that came back
```

Every call goes to the run's own `InferenceEngine` (HF in-process, or an `openai` engine to a real
server) as token ids, so the recorded ids are exactly the ids generated. Text never round-trips:
- `/v1/chat/completions`: messages are rendered with the tokenizer's chat template once. When a call
  continues the previous one (its messages are the previous messages, then the assistant reply this
  proxy returned, then new messages), the prompt is the previous prompt ids + the generated ids +
  the template's tokens after them; the template is only ever rendered with the assistant contents
  left empty for that splice (`_blank`), so generated text is never re-tokenized. Anything else
  (the agent edited history, a template that renders differently) is rendered afresh, and the
  stitcher's prefix check (`workflow/agent.py`) sees that it does not extend the previous call.
- `/v1/completions`: a token-id prompt is used as is; a text prompt that starts with the previous
  call's prompt text + reply text becomes previous ids + generated ids + the rest tokenized.

Sampling settings are the run's (`rollout.temperature`, `top_p`, `top_k`: the trainer divides by the
same temperature); a request asking for others is refused, and `max_tokens` is capped at
`rollout.max_new_tokens`. Reusing `serve.py`'s request parsing and reply fields keeps the two
endpoints' wire format identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from asyncflow.clock import Clock
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine
from asyncflow.http_limits import HeaderLimitError
from asyncflow.openai_prompts import chat_ids, chat_messages, fits, longest_token_chars, prompt_list
from asyncflow.openai_stream import DONE, StreamState, sse
from asyncflow.openai_text import TokenFeed, finish_choice
from asyncflow.openai_wire import (
    READ_TIMEOUT_S,
    RequestError,
    completion_tokens_key,
    is_token_ids,
    openai_logprobs,
    parse_body,
    rl_fields,
    sampling_params,
    usage,
)
from asyncflow.openai_wire import UNSUPPORTED as SERVE_UNSUPPORTED
from asyncflow.tool_calls import ToolParser, tool_parser
from asyncflow.workflow.agent_http import (
    MAX_CONNECTIONS,
    MAX_WAITING,
    ConnectionGate,
    body_length,
    drain_small_body,
    error_reply,
    read_head,
    write_events,
    write_json,
)
from asyncflow.workflow.episode import end_ids

# (`tools` are rendered by the chat template and the calls parsed back: `tool_calls`)
UNSUPPORTED: dict[str, Any] = {**{k: v for k, v in SERVE_UNSUPPORTED.items() if k != "tools"}, "suffix": None,
                               "echo": False}
Reply = dict[str, Any] | AsyncIterator[bytes]


@dataclass
class Call:
    """One recorded model call of an episode."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


@dataclass
class RecorderSettings:
    max_new_tokens: int
    temperature: float  # what requests are sampled at (0 for greedy evaluation)
    train_temperature: float  # what a request may ask for (the run's rollout.temperature)
    request_timeout_s: float
    max_calls: int
    top_p: float = 1.0
    top_k: int = 0
    max_context: int | None = None  # the model's positions: a call gets at most what its prompt leaves


@dataclass
class _Last:
    """The previous call, for splicing the next one onto its exact ids."""

    call: Call
    reply: str  # the text (chat: the content) returned: stop strings and tool calls left out
    generated: str = ""  # the text of all response ids (a completion continued from it is spliced)
    messages: list[dict[str, Any]] | None = None  # chat
    skeleton: list[int] = field(default_factory=list)  # chat: template render with assistant contents blank
    prompt_text: str | None = None  # text completion


class EpisodeRecorder:
    """Answers one episode's OpenAI calls from the engine and records each call's exact tokens."""

    def __init__(self, engine: InferenceEngine, tok: Any, uid: int, settings: RecorderSettings, clock: Clock,
                 floor: Callable[[], float] | None = None) -> None:
        """`tok`: the workflow's `Tokenizer` (`.hf`, `.encode`, `.decode`, `.eos_token_id`). `floor()`:
        the oldest policy version a sample may still be trained with; a call made once the episode's
        oldest generated token is older is refused (409) and the episode is `stale` (calls that generated
        nothing do not count)."""
        self.engine, self.tok, self.uid, self.settings, self.clock = engine, tok, uid, settings, clock
        self.floor = floor
        self.stale = False
        self.calls: list[Call] = []
        self.failure: BaseException | None = None  # a generation failure: the run's, not the agent's
        self.tasks: set[asyncio.Task[Any]] = set()
        self._last: _Last | None = None
        self._started = 0
        self._generated: set[int] = set()
        self._oldest: float = math.inf  # the oldest policy version among the tokens generated so far

    async def completions(self, req: dict[str, Any]) -> Reply:
        params = self._params(req, chat=False)
        ids, text = self._prompt_ids(req.get("prompt"))
        request = self._request(ids, params, req)
        rid = f"cmpl-{uuid.uuid4().hex}"

        def remember(call: Call, reply: str) -> None:
            self._last = _Last(call, reply, self.tok.decode(call.response_ids), prompt_text=text)

        if params["stream"]:
            return self._stream(request, params, rid, None, remember)
        call, reply, cut = await self._sample(request, params)
        remember(call, reply)
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": "asyncflow-policy", "choices": [{"index": 0, "text": reply, **self._fields(call, cut, params)}],
                "usage": usage([ids], 1, [(0, _result(call))])}

    async def chat(self, req: dict[str, Any]) -> Reply:
        req = completion_tokens_key(req)
        params = self._params(req, chat=True)
        # content parts as one text, as `asyncflow serve` reads them (their repr went into the prompt);
        # the flattened messages are what the next call's history is compared with
        messages = chat_messages(req.get("messages"), self._room())
        if getattr(self.tok.hf, "chat_template", None) is None:
            raise RequestError("the policy's tokenizer has no chat template; use /v1/completions", param="messages")
        tools, parser = self._tools(req)
        ids, skeleton = self._chat_ids(messages, tools)
        request = self._request(ids, params, req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"

        def remember(call: Call, reply: str) -> None:
            content = parser(reply)[0] if parser is not None else reply
            self._last = _Last(call, content or "", messages=[dict(m) for m in messages], skeleton=skeleton)

        if params["stream"]:
            return self._stream(request, params, rid, parser, remember, chat=True)
        call, reply, cut = await self._sample(request, params)
        remember(call, reply)
        message: dict[str, Any] = {"role": "assistant", "content": reply}
        fields = self._fields(call, cut, params, chat=True)
        if parser is not None:
            message["content"], calls = parser(reply)
            if calls:
                message["tool_calls"], fields["finish_reason"] = calls, "tool_calls"
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": "asyncflow-policy",
                "choices": [{"index": 0, "message": message, **fields}], "usage": usage([ids], 1, [(0, _result(call))])}

    def _tools(self, req: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolParser | None]:
        """The request's `tools` (rendered by the chat template) and the parser of the calls in the
        reply (none when `tool_choice` is "none")."""
        tools, choice = req.get("tools"), req.get("tool_choice")
        if tools is None or tools == []:
            return None, None
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError("tools: expected a list of tool objects", param="tools")
        template = str(self.tok.hf.chat_template)
        parser = tool_parser(template)
        if parser is None and "tools" not in template:
            raise RequestError("tools: the policy's chat template does not render tools", param="tools")
        return tools, None if choice == "none" else parser

    def _fields(self, call: Call, cut: GenResult, params: dict[str, Any], chat: bool = False) -> dict[str, Any]:
        fields = {**rl_fields(_result(call)), "prompt_token_ids": call.prompt_ids}
        if params["logprobs"]:
            fields["logprobs"].update(openai_logprobs(cut, self._piece, chat, params["top_logprobs"]))
        return fields

    def _piece(self, token: int) -> str:
        return str(self.tok.hf.decode([token]))

    # ------------------------------------------------------------------ prompt ids

    def _room(self) -> int | None:
        """The most prompt tokens a call may have (one position left to generate); None: unknown."""
        return None if self.settings.max_context is None else self.settings.max_context - 1

    def _prompt_ids(self, prompt: Any) -> tuple[list[int], str | None]:
        """(ids, the text they came from) of a completion's one prompt; one too long for the model's
        positions is refused by its length, before it is converted."""
        prompts = prompt_list(prompt)
        prompt, room = prompts[0], self._room()
        if len(prompts) != 1 or not prompt:
            raise RequestError("prompt: expected one text or one list of token ids (n=1, one prompt per call)",
                               param="prompt")
        per = longest_token_chars(self.tok.hf)
        if room is not None and not fits(prompt, room, per):
            size, per_token = (f"{len(prompt)} characters", f" (a token here is at most {per} characters)") \
                if isinstance(prompt, str) else (f"{len(prompt)} tokens", "")
            raise RequestError(f"prompt: {size} fill the model's {room + 1} positions{per_token}; no room to generate "
                               "(end the episode)", param="prompt", kind="context_length_exceeded")
        if isinstance(prompt, str):
            return self._text_ids(prompt), prompt
        if not is_token_ids(prompt):
            raise RequestError("prompt: expected one text or one list of token ids (n=1, one prompt per call)",
                               param="prompt")
        ids = [int(t) for t in prompt]
        vocab = len(self.tok.hf)  # or an id the engine generated (a model's vocabulary may be padded past it)
        if any(not 0 <= t < vocab and t not in self._generated for t in ids):
            raise RequestError(f"prompt: a token id is outside the vocabulary (0..{vocab - 1})", param="prompt")
        return ids, None

    def _text_ids(self, text: str) -> list[int]:
        last = self._last
        # (from the text of all generated ids: after a stop string, the agent's text goes on with it)
        if last is not None and last.prompt_text is not None and text.startswith(last.prompt_text + last.generated):
            rest = text[len(last.prompt_text) + len(last.generated):]
            return [*last.call.prompt_ids, *last.call.response_ids, *self.tok.encode(rest)]
        return [int(t) for t in self.tok.hf(text)["input_ids"]]

    def _chat_ids(self, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None = None) -> tuple[list[int], list[int]]:
        """(prompt ids, skeleton): spliced onto the previous call's exact ids when it continues it."""
        last = self._last
        if last is not None and last.messages is not None:
            k = len(last.messages)
            if (len(messages) > k and messages[:k] == last.messages and messages[k].get("role") == "assistant"
                    and (messages[k].get("content") or "") == last.reply):
                try:
                    hist = self._render(_blank(messages[: k + 1]), generation_prompt=False, tools=tools)
                    full = self._render(_blank(messages), generation_prompt=True, tools=tools)
                except RequestError:
                    hist = full = []
                n = len(last.skeleton)
                if hist and hist[:n] == last.skeleton and full[: len(hist)] == hist:
                    closing = hist[n:]  # the template's tokens after an assistant turn (end of turn, ...)
                    resp = last.call.response_ids
                    if resp and closing and resp[-1] == closing[0] and resp[-1] in end_ids(self.tok):
                        # generation already ended on it: the EOS, or a stop id the template closes a
                        # turn with (Gemma's <end_of_turn>, Phi-3's <|end|>), which was spliced twice
                        closing = closing[1:]
                    return [*last.call.prompt_ids, *resp, *closing, *full[len(hist):]], full
        ids = self._render(messages, generation_prompt=True, tools=tools)
        try:
            skeleton = self._render(_blank(messages), generation_prompt=True, tools=tools)
        except RequestError:
            skeleton = ids
        return ids, skeleton

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
        return chat_ids(self.tok.hf, messages, generation_prompt=generation_prompt, tools=tools, room=self._room(),
                        chars_per_token=longest_token_chars(self.tok.hf))

    # ------------------------------------------------------------------ generation

    def _params(self, req: dict[str, Any], chat: bool) -> dict[str, Any]:
        """The call's sampling parameters, or its refusal: checked before its prompt is converted."""
        s = self.settings
        params = sampling_params(req, UNSUPPORTED, "the agent endpoint (each call is recorded as one turn)", chat=chat)
        if params["n"] != 1:
            raise RequestError("n: one completion per call (each call is one turn of this episode)", param="n")
        for key, value in (("temperature", s.train_temperature), ("top_p", s.top_p), ("top_k", s.top_k)):
            if req.get(key) is not None and float(params[key]) != float(value):
                raise RequestError(f"{key}: this run samples at rollout.{key}={value:g} (the trainer assumes it); "
                                   f"leave {key} out or send that value", param=key)
        if self._started >= s.max_calls:
            raise RequestError(f"this episode has made its rollout.max_turns={s.max_calls} model calls",
                               status=429, kind="max_turns_reached")
        if self.floor is not None and self._oldest < self.floor():
            # (`_oldest`: the first token of every call that generated any; within a call versions never go back)
            self.stale = True
            raise RequestError("this episode's oldest generated token is older than workflow.max_staleness allows: "
                               "the episode is cancelled (its sample will not be trained)", status=409,
                               kind="episode_cancelled")
        return params

    def _request(self, prompt_ids: list[int], params: dict[str, Any], req: dict[str, Any]) -> GenRequest:
        """The call's engine request, or its refusal (before any reply is begun)."""
        s = self.settings
        if not prompt_ids:
            raise RequestError("prompt: empty after tokenization", param="prompt")
        max_tokens = min(params["max_tokens"], s.max_new_tokens) if req.get("max_tokens") is not None \
            else s.max_new_tokens
        if s.max_context is not None:  # (a call past the model's positions failed the engine, ending the run)
            if len(prompt_ids) >= s.max_context:
                raise RequestError(f"prompt: {len(prompt_ids)} tokens fill the model's {s.max_context} positions; "
                                   "no room to generate (end the episode)", param="prompt", kind="context_length_exceeded")
            max_tokens = min(max_tokens, s.max_context - len(prompt_ids))
        self._started += 1
        # a stop string ends generation in the engine at the token completing it (`_sample` cuts the
        # same way after the fact for an engine without token callbacks)
        feed = TokenFeed(0, self.tok.decode, params["stop"]) if params["stop"] else None
        return GenRequest(self.uid, prompt_ids, max_tokens, s.temperature, s.top_p, s.top_k, seed=params["seed"],
                          top_logprobs=params["top_logprobs"], on_token=feed)

    async def _sample(self, request: GenRequest, params: dict[str, Any]) -> tuple[Call, str, GenResult]:
        """Generate and record the call: (the call, its text, the result), cut at its first stop
        string, so that the recorded ids and log-probs are exactly what the reply's text came from."""
        try:
            res = await self.clock.wait_for(self.engine.generate(request), self.settings.request_timeout_s,
                                            f"generation of agent sample {self.uid}, call {self._started}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's failure ends the run (as in `run_episode`), not just this call
            self.failure = self.failure or exc
            raise
        cut, text = finish_choice(res, self.tok.decode, params["stop"])
        call = Call(list(request.prompt_ids), list(cut.response_ids), list(cut.behavior_logprobs),
                    list(cut.token_versions), cut.finish_reason)
        self.calls.append(call)
        if call.versions:
            self._oldest = min(self._oldest, call.versions[0])
        self._generated.update(call.response_ids)
        return call, text, cut

    async def _stream(self, request: GenRequest, params: dict[str, Any], rid: str, parser: ToolParser | None,
                      remember: Callable[[Call, str], None], chat: bool = False) -> AsyncIterator[bytes]:
        """The call as server-sent events: a chunk per token as the engine samples it (an engine
        without token callbacks: one chunk at the end); recorded as the call is without `stream`."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        request.on_token = TokenFeed(0, self.tok.decode, params["stop"],
                                     lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        state = StreamState(chat=chat, model="asyncflow-policy", rid=rid, decode=self.tok.decode, piece=self._piece,
                            params=params, tool_parser=parser)
        me = asyncio.current_task()
        if me is not None:
            self.tasks.add(me)  # (cancelled with the episode, as a call without `stream` is)
        task = asyncio.ensure_future(self._sample(request, params))
        try:
            while not task.done():  # (bounded: `_sample` times out at rollout.request_timeout_s)
                getter = asyncio.ensure_future(events.get())
                await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    continue
                for chunk in state.token(getter.result()):
                    yield sse(chunk)
            while not events.empty():  # (the engine queued every token before it resolved the request)
                for chunk in state.token(events.get_nowait()):
                    yield sse(chunk)
            try:
                call, text, cut = task.result()
            except Exception as exc:
                kind = exc.kind if isinstance(exc, RequestError) else "server_error"
                yield sse({"error": {"message": str(exc), "type": kind, "param": None, "code": None}})
                return
            remember(call, text)
            for chunk in state.finish(0, cut)[0]:
                yield sse(chunk)
            if params["include_usage"]:
                yield sse(state.usage_chunk(usage([call.prompt_ids], 1, [(0, _result(call))])))
            yield DONE
        finally:
            task.cancel()
            if me is not None:
                self.tasks.discard(me)


def _blank(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns emptied, their tool calls too: the generated ids stand for both in a splice."""
    return [{**{k: v for k, v in m.items() if k != "tool_calls"}, "content": ""} if m.get("role") == "assistant"
            else m for m in messages]


def _result(call: Call) -> GenResult:
    return GenResult(0, call.response_ids, call.logprobs, call.versions, call.finish_reason)  # type: ignore[arg-type]


class AgentProxy:
    """A loopback asyncio HTTP server in the rollout worker's loop: `/episodes/<key>/v1/...` routes to
    the `EpisodeRecorder` registered under `key` (a fresh random key per episode, so a late call from
    a finished episode can never land in another). Its transport and bounds are `agent_http`'s: a
    request for an unknown key is answered 404 from its headers, before its body is read; connections
    past `max_connections` wait their turn (`wait_s`: the run's rollout.request_timeout_s, as long as
    a call they wait behind may take), and past `max_waiting` are refused 503."""

    def __init__(self, host: str = "127.0.0.1", *, max_connections: int = MAX_CONNECTIONS,
                 max_waiting: int = MAX_WAITING, wait_s: float = 600.0) -> None:
        self.host = host
        self.port = 0
        self.gate = ConnectionGate(max_connections, max_waiting, wait_s)
        self._server: asyncio.Server | None = None
        self._episodes: dict[str, EpisodeRecorder] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._connection, self.host, 0, backlog=1024)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for rec in list(self._episodes.values()):
            for t in list(rec.tasks):
                t.cancel()
        self._episodes.clear()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    def register(self, rec: EpisodeRecorder) -> str:
        """Route a new episode; returns its base URL."""
        key = f"{rec.uid}-{secrets.token_hex(6)}"
        self._episodes[key] = rec
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    def unregister(self, base_url: str) -> None:
        """Stop routing an episode and abandon its calls still in flight."""
        rec = self._episodes.pop(base_url.rstrip("/").split("/")[-2], None)
        if rec is not None:
            for t in list(rec.tasks):
                t.cancel()

    def route(self, method: str, path: str) -> tuple[EpisodeRecorder, str]:
        """(the episode's recorder, the route under its /v1) from the request line alone; an unknown
        route or episode key is a 404."""
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 3 or parts[0] != "episodes" or parts[2] != "v1":
            raise RequestError(f"no route {method} {path[:200]}", status=404, kind="not_found_error")
        rec = self._episodes.get(parts[1])
        if rec is None:
            raise RequestError(f"episode {parts[1][:100]!r} is not running (it ended, or never existed)", status=404,
                               kind="not_found_error")
        return rec, "/" + "/".join(parts[3:])

    async def answer(self, rec: EpisodeRecorder, method: str, route: str, body: bytes) -> tuple[int, Reply]:
        """Answer one request of `rec`'s episode: (status, JSON object or, streamed, server-sent events)."""
        try:
            if method == "GET" and route == "/models":
                return 200, {"object": "list", "data": [{"id": "asyncflow-policy", "object": "model",
                                                         "owned_by": "asyncflow"}]}
            if method == "POST" and route in ("/completions", "/chat/completions"):
                task = asyncio.current_task()
                if task is not None:
                    rec.tasks.add(task)
                try:
                    req = parse_body(body)
                    return 200, await (rec.completions(req) if route == "/completions" else rec.chat(req))
                finally:
                    if task is not None:
                        rec.tasks.discard(task)
            raise RequestError(f"no route {method} {route}", status=404, kind="not_found_error")
        except RequestError as exc:
            return exc.status, error_reply(exc)
        except Exception as exc:  # a generation failure (kept on the recorder and raised by the episode)
            return 500, {"error": {"message": f"internal error: {exc!r}", "type": "server_error", "param": None,
                                   "code": None}}

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            refused = await self.gate.enter(writer.transport)
            if refused is not None:
                await write_json(writer, 503, error_reply(RequestError(refused, status=503, kind="server_busy")))
                return
            try:
                await self._exchange(reader, writer)
            finally:
                self.gate.leave()
        finally:
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read one request (its episode key checked before its body is read), answer it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READ_TIMEOUT_S
        headers: dict[str, str] = {}
        try:
            method, path, headers = await asyncio.wait_for(read_head(reader), READ_TIMEOUT_S)
            rec, route = self.route(method, path)
            length = body_length(headers)
            body = await asyncio.wait_for(reader.readexactly(length), max(0.0, deadline - loop.time())) \
                if length else b""
        except RequestError as exc:
            await drain_small_body(reader, headers)
            await write_json(writer, exc.status, error_reply(exc))
            return
        except HeaderLimitError as exc:
            await write_json(writer, 431, error_reply(RequestError(f"request {exc}", status=431)))
            return
        except (asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            await write_json(writer, 400, error_reply(RequestError(f"bad request: {exc!r}")))
            return
        status, reply = await self.answer(rec, method, route, body)
        if isinstance(reply, dict):
            await write_json(writer, status, reply)
        else:
            await write_events(writer, reply)
