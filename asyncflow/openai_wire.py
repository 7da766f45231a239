"""The OpenAI HTTP API's wire format, as `asyncflow serve` and the agent proxy speak it: request
parsing and validation, sampling fields, the RL fields of a choice, usage, and the error a refused
request gets. A leaf: both servers import it; it imports nothing of theirs.
"""

from __future__ import annotations

import json
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


# refused when set to anything but their neutral value (vLLM's extra sampling keys too: a client that
# sends `ignore_eos` or `min_tokens` must not get EOS-stopped text it did not ask for)
UNSUPPORTED: dict[str, Any] = {"stream": False, "stop": None, "seed": None, "best_of": 1, "presence_penalty": 0,
                                "frequency_penalty": 0, "logit_bias": None, "tools": None, "response_format": None,
                                "ignore_eos": False, "min_tokens": 0, "stop_token_ids": None,
                                "repetition_penalty": 1, "min_p": 0, "top_logprobs": 0}


def sampling_params(req: dict[str, Any], unsupported: dict[str, Any], server: str = "asyncflow serve") -> dict[str, Any]:
    """Sampling parameters of a request; options this server cannot honour are refused, not ignored
    (`unsupported` maps each refused key to its neutral value, which is accepted)."""
    for key, neutral in unsupported.items():
        value = req.get(key)
        if value is not None and value != neutral and value not in ([], {}, ""):
            why = "per-request seeds are not supported (one seeded generator samples every request)" if key == "seed" \
                else f"is not supported by {server}"
            raise RequestError(f"{key}: {why}", param=key)
    logprobs = req.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, (bool, int)) or not 0 <= logprobs <= 1):
        raise RequestError("logprobs: expected 0, 1 or a boolean: each choice's token_logprobs (the sampled "
                           "tokens') are always returned; top alternatives are not", param="logprobs")
    top_k = integer_field(req, "top_k", 0, -1, 1 << 30)
    return {
        "max_tokens": integer_field(req, "max_tokens", 16, 1, 1 << 20),
        "temperature": number_field(req, "temperature", 1.0, 0.0, 100.0),
        "top_p": number_field(req, "top_p", 1.0, 1e-9, 1.0),
        "top_k": max(top_k, 0),
        "n": integer_field(req, "n", 1, 1, MAX_N),
    }


def rl_fields(res: GenResult) -> dict[str, Any]:
    reason = {"stop": "stop", "length": "length"}.get(res.finish_reason, "abort")
    return {"token_ids": list(res.response_ids), "logprobs": {"token_logprobs": list(res.behavior_logprobs)},
            "token_versions": list(res.token_versions), "finish_reason": reason}


def usage(prompts: list[list[int]], n: int, results: list[tuple[int, GenResult]]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)  # each prompt once, whatever n (as OpenAI and vLLM count)
    completion = sum(len(r.response_ids) for _, r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
