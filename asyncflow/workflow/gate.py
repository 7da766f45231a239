"""The staleness gate: admission control that keeps every trained sample within `max_staleness`.

One invariant (as in torchtitan's RL loop): at most `(max_staleness + 1) x groups_per_step` groups
are live beyond what has already been trained. A group admitted while the engines run version `v`
is, with oldest-first training, trained by a step that starts from a version <= v + max_staleness,
so its staleness is within the bound. A dropped group (stale, cancelled, all rewards failed) frees
its slot so a replacement is admitted. `max_staleness: 0` is synchronous training: the next step's
prompts are admitted only once the current step's weights are loaded.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from asyncflow.clock import Clock
from asyncflow.errors import WaitTimeout


class GateControl(Protocol):
    """The trainer's side of the gate: the `StalenessGate` itself in process, a `RemoteGate` to the
    feeder actor's under Ray."""

    def drop(self, groups: int = 1) -> None: ...

    def publish(self, version: int) -> None: ...

    def min_version(self, trainer_version: int) -> int: ...

    def close(self) -> None: ...


class StalenessGate:
    """Counts admitted groups against the credit that the published version allows."""

    def __init__(self, groups_per_step: int, max_staleness: int, max_steps: int, clock: Clock, extra: int = 0) -> None:
        """`extra`: groups admitted beyond the invariant (redundant rollouts; the trainer keeps the
        first to finish and the staleness floor ends the rest)."""
        self.clock = clock
        self.extra = extra
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_steps = max_steps
        self.version = 0  # version loaded by every rollout engine
        self.admitted = 0  # groups admitted and not dropped
        self._changed = asyncio.Event()
        self.closed = False

    def credit(self) -> int:
        """Groups that may be admitted now."""
        steps = min(self.version + self.max_staleness + 1, self.max_steps)
        return steps * self.groups_per_step + self.extra - self.admitted

    def admit(self, groups: int = 1) -> None:
        self.admitted += groups

    def drop(self, groups: int = 1) -> None:
        """`groups` admitted groups will never be trained: their slots are free again."""
        self.admitted -= groups
        self._notify()

    def publish(self, version: int) -> None:
        """All engines now run `version` (never goes back, so publications may arrive out of order)."""
        self.version = max(self.version, version)
        self._notify()

    def restore(self, version: int, admitted: int) -> None:
        """Resume from a checkpoint: engines at `version`, `admitted` groups trained or live."""
        self.version = version
        self.admitted = admitted
        self._notify()

    def min_version(self, trainer_version: int) -> int:
        """Oldest behavior version a sample trained from `trainer_version` may have."""
        return trainer_version - self.max_staleness

    def close(self) -> None:
        """No more admissions: waiters return False at once."""
        self.closed = True
        self._notify()

    def _notify(self) -> None:
        self._changed.set()

    async def wait_for_credit(self, timeout: float) -> bool:
        """Wait until credit() > 0; False if `timeout` passed first or the gate was closed."""
        while self.credit() <= 0:
            if self.closed:
                return False
            self._changed.clear()
            try:
                await self.clock.wait_for(self._changed.wait(), timeout, "admission credit")
            except WaitTimeout:
                return False
        return not self.closed
