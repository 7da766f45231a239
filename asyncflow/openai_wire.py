"""The OpenAI HTTP API's wire format, as `asyncflow serve` and the agent proxy speak it: request
parsing and validation, sampling fields, the RL fields of a choice, usage, and the error a refused
request gets. A leaf: both servers import it; it imports nothing of theirs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (torch stays unimported until a server starts)
    from asyncflow.engines.base import GenResult

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_N = 128
READ_TIMEOUT_S = 60.0  # longest a client may take to send one request (then its connection is closed)


class RequestError(Exception):
    """A request the server refuses: answered with `status` and an OpenAI-style error object."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param


def completion_tokens_key(req: dict[str, Any]) -> dict[str, Any]:
    """A chat request's `max_completion_tokens` (OpenAI's newer name) as `max_tokens` when that is
    absent or null (clients that send unset fields as null: it was ignored, and generation ran to
    the end of the context)."""
    if req.get("max_tokens") is None and req.get("max_completion_tokens") is not None:
        return {**req, "max_tokens": req["max_completion_tokens"]}
    return req


def flatten_content(message: dict[str, Any], i: int) -> dict[str, Any]:
    """A message whose `content` is a list of parts (OpenAI's `[{"type": "text", "text": ...}]`) as one
    text, which is what a text model's chat template renders (it printed the list's repr); a part of
    another type (an image) is refused."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"messages[{i}].content: only text parts are supported, got {kind!r}", param="messages")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        req = json.loads(body) if body else {}
    except (ValueError, RecursionError):  # (nesting deeper than the parser's stack: a 500 and a traceback)
        raise RequestError("the request body is not valid JSON") from None
    if not isinstance(req, dict):
        raise RequestError("the request body must be a JSON object")
    return req


def is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def number_field(req: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = req.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise RequestError(f"{key}: expected a number in [{lo:g}, {hi:g}], got {value!r}", param=key)
    return float(value)


def integer_field(req: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    value = req.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"{key}: expected an integer in [{lo}, {hi}], got {value!r}", param=key)
    return value


MAX_TOP_LOGPROBS = 20  # alternatives per token (vLLM's default cap; OpenAI's is 20 for chat)
MAX_STOPS, MAX_STOP_CHARS = 16, 1000

# refused when set to anything but their neutral value (vLLM's extra sampling keys too: a client that
# sends `ignore_eos` or `min_tokens` must not get EOS-stopped text it did not ask for)
UNSUPPORTED: dict[str, Any] = {"best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
                                "tools": None, "response_format": None, "ignore_eos": False, "min_tokens": 0,
                                "stop_token_ids": None, "repetition_penalty": 1, "min_p": 0}


def stop_field(req: dict[str, Any]) -> list[str]:
    stop = req.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise RequestError(f"stop: expected a string or a list of at most {MAX_STOPS} non-empty strings "
                           f"(each at most {MAX_STOP_CHARS} characters)", param="stop")
    return list(stops)


def logprob_fields(req: dict[str, Any], chat: bool) -> tuple[bool, int]:
    """(whether OpenAI-format log-probs are asked, alternatives per token): completions
    `logprobs: N`; chat `logprobs: true` and `top_logprobs: N`."""
    if chat:
        asked = req.get("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise RequestError("logprobs: expected a boolean (alternatives: top_logprobs)", param="logprobs")
        top = integer_field(req, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top and not asked:
            raise RequestError("top_logprobs: needs logprobs: true", param="top_logprobs")
        return bool(asked), top
    if req.get("top_logprobs") not in (None, 0):
        raise RequestError("top_logprobs: a chat field; completions take logprobs: N", param="top_logprobs")
    if isinstance(req.get("logprobs"), bool):  # (accepted before: true is one alternative)
        return bool(req["logprobs"]), int(req["logprobs"])
    top = integer_field(req, "logprobs", -1, 0, MAX_TOP_LOGPROBS)
    return top >= 0, max(top, 0)


def stream_fields(req: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include usage in a last chunk)."""
    stream, options = req.get("stream"), req.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream: expected a boolean", param="stream")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise RequestError("stream_options: expected an object, with stream: true", param="stream_options")
    usage_asked = (options or {}).get("include_usage", False)
    if not isinstance(usage_asked, bool):
        raise RequestError("stream_options.include_usage: expected a boolean", param="stream_options")
    return bool(stream), usage_asked


def sampling_params(req: dict[str, Any], unsupported: dict[str, Any], server: str = "asyncflow serve",
                    chat: bool = False) -> dict[str, Any]:
    """Sampling parameters of a request; options this server cannot honour are refused, not ignored
    (`unsupported` maps each refused key to its neutral value, which is accepted)."""
    for key, neutral in unsupported.items():
        value = req.get(key)
        if value is not None and value != neutral and value not in ([], {}, ""):
            raise RequestError(f"{key}: is not supported by {server}", param=key)
    top_k = integer_field(req, "top_k", 0, -1, 1 << 30)
    logprobs, top = logprob_fields(req, chat)
    stream, include_usage = stream_fields(req)
    seed = integer_field(req, "seed", -1, -(1 << 63), (1 << 64) - 1) if req.get("seed") is not None else None
    return {
        "max_tokens": integer_field(req, "max_tokens", 16, 1, 1 << 20),
        "temperature": number_field(req, "temperature", 1.0, 0.0, 100.0),
        "top_p": number_field(req, "top_p", 1.0, 1e-9, 1.0),
        "top_k": max(top_k, 0),
        "n": integer_field(req, "n", 1, 1, MAX_N),
        "stop": stop_field(req), "seed": seed, "logprobs": logprobs, "top_logprobs": top,
        "stream": stream, "include_usage": include_usage,
    }


def openai_logprobs(res: GenResult, piece: Callable[[int], str], chat: bool, top: int) -> dict[str, Any]:
    """OpenAI's log-prob fields of a choice (chat: `content`; completions: `tokens`, `top_logprobs`)
    besides asyncflow's `token_logprobs`. Alternatives are over the distribution sampled from: logits
    / temperature (1 when greedy), after top-p/top-k truncation (tokens outside it are left out)."""
    ids, lps = list(res.response_ids), list(res.behavior_logprobs)
    alts = list(res.extra.get("top_logprobs", [])) if top > 0 else []
    alts += [[]] * (len(ids) - len(alts))  # (an engine that returns no alternatives)
    if chat:
        content = [{"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
                    "top_logprobs": [{"token": piece(a), "logprob": v, "bytes": list(piece(a).encode())}
                                     for a, v in alt[:top]]} for t, lp, alt in zip(ids, lps, alts, strict=True)]
        return {"content": content}
    return {"tokens": [piece(t) for t in ids],
            "top_logprobs": [{piece(a): v for a, v in alt[:top]} for alt in alts] if top > 0 else None}


def rl_fields(res: GenResult) -> dict[str, Any]:
    reason = {"stop": "stop", "length": "length"}.get(res.finish_reason, "abort")
    return {"token_ids": list(res.response_ids), "logprobs": {"token_logprobs": list(res.behavior_logprobs)},
            "token_versions": list(res.token_versions), "finish_reason": reason}


def usage(prompts: list[list[int]], n: int, results: list[tuple[int, GenResult]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n (as OpenAI and vLLM count)
    completion = sum(len(r.response_ids) for _, r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
