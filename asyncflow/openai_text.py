"""Response text as the OpenAI servers return it: incremental detokenization and `stop` strings.

The rule for a stop string (`asyncflow serve` and the agent proxy): generation ends at the first
token whose text completes a stop string; the token ids, log-probs and versions kept are exactly the
generated tokens up to and including that one (what the loss trains on), and the returned text is
their text cut before the stop string. The engine checks after each token (`TokenFeed`) and the
reply replays the same scan over the ids it got (`finish_choice`), so both find the same token, and
an engine without a token callback (a remote one) is cut the same way after the fact. A leaf module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncflow.engines.base import GenResult

Decode = Callable[[list[int]], str]


class IncrementalText:
    """The text of a growing list of token ids, appended a token at a time (the prefix/read offsets
    of vLLM's detokenizer: a token's text is decoded with a few tokens before it, and held back
    while it ends in a partial UTF-8 character). `stop_at`: where the first stop string begins."""

    def __init__(self, decode: Decode, stops: list[str] | tuple[str, ...] = ()) -> None:
        self.decode, self.stops = decode, tuple(stops)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.stop_at: int | None = None
        self._prefix = self._read = 0

    def add(self, token: int) -> bool:
        """Append `token`; True once the text holds a stop string."""
        self.ids.append(token)
        before = self.decode(self.ids[self._prefix:self._read])
        now = self.decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            start = len(self.text)
            self.text += now[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            if self.stop_at is None and self.stops:
                self._find_stop(max(0, start - self.longest + 1))
        return self.stop_at is not None

    def _find_stop(self, since: int) -> None:
        hits = [i for i in (self.text.find(s, since) for s in self.stops) if i >= 0]
        if hits:
            self.stop_at = min(hits)

    def final(self) -> str:
        """The whole text: cut before the stop string, or with any held-back partial character."""
        if self.stop_at is not None:
            return self.text[:self.stop_at]
        now = self.decode(self.ids[self._prefix:])
        return self.text + now[len(self.decode(self.ids[self._prefix:self._read])):]


class TokenFeed:
    """A choice's per-token callback (`GenRequest.on_token`), called in the engine's thread: scans
    for stop strings (True ends the request) and hands each token, with the text so far, to `emit`
    (a stream's queue) when streaming."""

    def __init__(self, index: int, decode: Decode, stops: list[str] | tuple[str, ...],
                 emit: Callable[[tuple[Any, ...]], object] | None = None) -> None:
        self.index, self.emit = index, emit
        self.scan = IncrementalText(decode, stops)

    def __call__(self, token: int, logprob: float, version: int, top: list[tuple[int, float]] | None) -> bool:
        stopped = self.scan.add(token)
        if self.emit is not None:  # (the text is an immutable snapshot: the consumer is another thread)
            self.emit((self.index, token, logprob, version, top, self.scan.text, self.scan.stop_at))
        return stopped


def finish_choice(res: GenResult, decode: Decode, stops: list[str] | tuple[str, ...]) -> tuple[GenResult, str]:
    """(result cut at the first stop string, its text): ids, log-probs, versions and alternatives up
    to the token completing it, finish "stop"; without stops (or none hit) the result as it is."""
    if not stops:
        return res, decode(list(res.response_ids))
    scan = IncrementalText(decode, stops)
    for k, token in enumerate(res.response_ids):
        if scan.add(token):
            keep = k + 1
            extra = dict(res.extra)
            if "top_logprobs" in extra:
                extra["top_logprobs"] = list(extra["top_logprobs"])[:keep]
            cut = replace(res, response_ids=list(res.response_ids[:keep]),
                          behavior_logprobs=list(res.behavior_logprobs[:keep]),
                          token_versions=list(res.token_versions[:keep]), finish_reason="stop", extra=extra)
            return cut, scan.final()
    return res, scan.final()
