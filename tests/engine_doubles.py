"""A scripted inference engine for episode, agent and environment tests (a test double for the
policy, not an engine): imported by the test modules that play episodes against it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine


class ScriptedEngine(InferenceEngine):
    """Answers call i with the ids `turns[i]`: token k's log-prob `logprob(k)`, its version the
    engine's (`version`), or with `versions_by_call` i + 1. Records each call's prompt; `before(i)`
    runs first."""

    def __init__(self, turns: list[list[int]], *, logprob: Callable[[int], float] = lambda k: -0.5,
                 before: Callable[[int], None] | None = None, version: int = 0, versions_by_call: bool = False,
                 capacity: int = 4) -> None:
        self.turns, self.logprob, self.before, self.versions_by_call = turns, logprob, before, versions_by_call
        self.prompts: list[list[int]] = []
        self.version = version
        self._capacity = capacity

    @property
    def calls(self) -> int:
        return len(self.prompts)

    async def generate(self, request: GenRequest) -> GenResult:
        if self.before is not None:
            self.before(self.calls)
        self.prompts.append(list(request.prompt_ids))
        ids = self.turns[self.calls - 1]
        version = self.calls if self.versions_by_call else self.version
        return GenResult(request.uid, ids, [self.logprob(k) for k in range(len(ids))], [version] * len(ids), "stop")

    async def load_weights(self, state: Any, version: int, mode: Any) -> float:
        return 0.0

    def cancel_older_than(self, min_version: int) -> int:
        return 0

    def load(self) -> int:
        return 0

    @property
    def capacity(self) -> int:
        return self._capacity
