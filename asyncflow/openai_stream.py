"""Server-sent-event streaming of OpenAI replies, shared by `asyncflow serve` (threads) and the agent
proxy (asyncio): the chunks of each choice built from the engine's per-token events.

    engine thread: TokenFeed ──(index, token, log-prob, version, alternatives, text so far, stop)──► queue
    server: StreamState.token(event) ──► chunk   ...   StreamState.finish(index, result) ──► last chunks

A content chunk carries the text that became final (text that may still turn out to begin a stop
string is held back), and the tokens that arrived with it: `token_ids`, `token_versions` and
`logprobs` (asyncflow's `token_logprobs`, plus OpenAI's fields when asked). The chunk that ends a
choice carries any tokens not streamed yet (all of them, from an engine without a token callback),
so a choice's tokens over all its chunks are exactly those of the non-streamed reply.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asyncflow.engines.base import GenResult
from asyncflow.openai_text import Decode, finish_choice
from asyncflow.openai_wire import RequestError, openai_logprobs

if TYPE_CHECKING:
    from asyncflow.tool_calls import ToolParser

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@dataclass
class _Choice:
    emitted: int = 0  # characters of text sent
    streamed: int = 0  # tokens sent
    started: bool = False  # chat: the role delta was sent
    done: bool = False


class StreamState:
    """The chunks of one streamed request (chat or completions), choice by choice."""

    def __init__(self, *, chat: bool, model: str, rid: str, decode: Decode, piece: Callable[[int], str],
                 params: dict[str, Any], tool_parser: ToolParser | None = None) -> None:
        self.chat, self.model, self.rid, self.decode, self.piece = chat, model, rid, decode, piece
        self.stops: list[str] = params["stop"]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # characters that may begin a stop string
        self.logprobs, self.top = params["logprobs"], params["top_logprobs"]
        self.tool_parser = tool_parser  # (tool calls are parsed from the whole text: it is not streamed then)
        self.created = int(time.time())
        self.choices: dict[int, _Choice] = {}

    def _chunk(self, index: int, text: str, *, finish: str | None = None,
               tokens: GenResult | None = None, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta if delta is not None else ({"content": text} if text else {})
        else:
            choice["text"] = text
        if tokens is not None and tokens.response_ids:
            choice["token_ids"], choice["token_versions"] = list(tokens.response_ids), list(tokens.token_versions)
            choice["logprobs"] = {"token_logprobs": list(tokens.behavior_logprobs)}
            if self.logprobs:
                choice["logprobs"].update(openai_logprobs(tokens, self.piece, self.chat, self.top))
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def _start(self, index: int) -> list[dict[str, Any]]:
        c = self.choices.setdefault(index, _Choice())
        if c.started or not self.chat:
            return []
        c.started = True
        return [self._chunk(index, "", delta={"role": "assistant", "content": ""})]

    def token(self, event: tuple[Any, ...]) -> list[dict[str, Any]]:
        """The chunks for one token event of `TokenFeed`."""
        index, token, logprob, version, top, text, stop_at = event
        out = self._start(index)
        c = self.choices[index]
        if c.done:
            return out
        if self.tool_parser is not None:
            visible = c.emitted
        elif stop_at is not None:
            visible = stop_at
        else:
            visible = max(c.emitted, len(text) - self.hold)
        one = GenResult(0, [token], [logprob], [version], "stop", {"top_logprobs": [top or []]})
        c.streamed += 1
        out.append(self._chunk(index, text[c.emitted:visible], tokens=one))
        c.emitted = max(c.emitted, visible)
        return out

    def finish(self, index: int, res: GenResult) -> tuple[list[dict[str, Any]], GenResult, str]:
        """The last chunks of a choice whose result came: what was not streamed yet and its finish
        reason; also the result cut at its stop string and its text."""
        out = self._start(index)
        c = self.choices[index]
        cut, text = finish_choice(res, self.decode, self.stops)
        rest = GenResult(0, cut.response_ids[c.streamed:], cut.behavior_logprobs[c.streamed:],
                         cut.token_versions[c.streamed:], "stop",
                         {"top_logprobs": list(cut.extra.get("top_logprobs", []))[c.streamed:]})
        reason = {"stop": "stop", "length": "length"}.get(cut.finish_reason, "abort")
        delta: dict[str, Any] | None = None
        if self.tool_parser is not None:
            content, calls = self.tool_parser(text)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                reason = "tool_calls"
        if rest.response_ids or text[c.emitted:] or delta:
            out.append(self._chunk(index, text[c.emitted:], tokens=rest, delta=delta))
        out.append(self._chunk(index, "", finish=reason))
        c.done = True
        return out, cut, text

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": usage}


def pump(futures: list[tuple[int, Any]], events: queue.Queue[tuple[Any, ...]], state: StreamState, deadline: float,
         gone: Callable[[], bool] | None, poll_s: float = 0.25) -> Generator[bytes, None, list[tuple[int, GenResult]]]:
    """The events of a streamed request served from threads (`asyncflow serve`): chunks of the token
    events as they come, each choice's last ones once its future is done (after its events: the
    engine emits them before it resolves the future); returns the (prompt index, cut result) list.
    Raises `TimeoutError` at `deadline`, and a 499 once `gone()` says the client left."""
    results: dict[int, tuple[int, GenResult]] = {}
    while len(results) < len(futures):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if gone is not None and gone():
            raise RequestError("the client disconnected", status=499, kind="client_closed")
        with contextlib.suppress(queue.Empty):
            for chunk in state.token(events.get(timeout=min(left, poll_s))):
                yield sse(chunk)
        for k, (index, fut) in enumerate(futures):
            if k in results or not fut.done():
                continue
            while not events.empty():
                for chunk in state.token(events.get_nowait()):
                    yield sse(chunk)
            chunks, cut, _ = state.finish(k, fut.result())
            results[k] = (index, cut)
            for chunk in chunks:
                yield sse(chunk)
    return [results[k] for k in range(len(futures))]
