"""The service's streaming option (`tinker-serve --max-staleness N`, N >= 1): sampling for the next
batch starts on the newest weights already applied while training on the current batch goes on,
and never on weights more than N versions behind the ones asked for.

A training client's weights version counts its weight changes: its creation, each optim_step and
each load. "Asked" counts those the client has sent, "applied" those the training thread has done.
In streaming mode the service answers a forward_backward once its forward has run (the log-probs and
loss are known; its backward runs next) and an optim_step at once, so the client's loop moves on to
`save_weights_and_get_sampling_client` while training still runs. That sampler gets the newest
applied adapter, provided it is at most N versions behind the asked one, else it waits for training:

    client:   fwd_bwd(k) ─ optim(k) ─ sampler ─ sample batch k+1 ──────── fwd_bwd(k+1) ...
    service:  forward(k) ┴ backward(k), optim(k) ──────────────────────── forward(k+1) ...
                         └ sampler: version k-1 (<= N behind k) ─ sampling on another thread

Training itself is unchanged (the same calls, in the same order, on the same weights): only the
weights that samples come from may be older, which the off-policy losses correct for with the
sampling log-probs each datum carries.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from asyncflow.errors import UserError, WaitTimeout

WAIT_S = 600.0  # how long a sampler waits for training to come within the staleness bound


@dataclass
class Versions:
    asked: int = 0
    applied: int = 0
    adapter: dict[str, torch.Tensor] | None = None  # the adapter after the newest applied change
    lag: int = 0  # how far behind the asked version the newest sampler this client made was
    failed: BaseException | None = None  # a deferred step that failed: every later call says so


class StreamState:
    """Per training client: versions asked and applied, the newest applied adapter, and the bound."""

    def __init__(self, max_staleness: int, *, wait_s: float = WAIT_S) -> None:
        if max_staleness < 0:
            raise UserError(f"tinker-serve --max-staleness: must be 0 or more, not {max_staleness}")
        self.max_staleness, self.wait_s = max_staleness, wait_s
        self._cv = threading.Condition()
        self._clients: dict[str, Versions] = {}

    @property
    def on(self) -> bool:
        return self.max_staleness > 0

    def ask(self, model_id: str) -> int:
        """A weight change sent (creation, optim_step, load): the new asked version."""
        with self._cv:
            versions = self._clients.setdefault(model_id, Versions())
            versions.asked += 1
            return versions.asked

    def applied(self, model_id: str, adapter: dict[str, torch.Tensor]) -> None:
        """The training thread made the next weight change; `adapter` is the adapter after it."""
        with self._cv:
            versions = self._clients.setdefault(model_id, Versions())
            versions.applied += 1
            versions.adapter = adapter
            self._cv.notify_all()

    def reset(self, model_id: str, adapter: dict[str, torch.Tensor]) -> None:
        """The client was created or loaded (on the training thread): its adapter now, every step
        asked so far counted as applied, and no failure."""
        with self._cv:
            versions = self._clients.setdefault(model_id, Versions())
            versions.applied, versions.adapter, versions.failed = versions.asked, adapter, None
            self._cv.notify_all()

    def failed(self, model_id: str, exc: BaseException) -> None:
        """A step whose answer was already given failed (a backward or optim_step run after answering)."""
        with self._cv:
            self._clients.setdefault(model_id, Versions()).failed = exc
            self._cv.notify_all()

    def check(self, model_id: str) -> None:
        """Raise if one of the client's deferred steps failed: its weights are not what it asked for."""
        with self._cv:
            versions = self._clients.get(model_id)
            if versions is not None and versions.failed is not None:
                exc = versions.failed
                raise UserError(f"training client {model_id}: a step answered before it ran then failed "
                                f"({type(exc).__name__}: {exc}); load a saved state into it, or create a new client")

    def behind(self, model_id: str) -> tuple[int, int]:
        """(steps asked but not applied, the lag of the client's newest sampler)."""
        with self._cv:
            versions = self._clients.get(model_id, Versions())
            return versions.asked - versions.applied, versions.lag

    def newest(self, model_id: str) -> tuple[int, int, dict[str, torch.Tensor]]:
        """(version, asked version, adapter): the newest applied adapter, once it is at most
        `max_staleness` versions behind the asked one (waiting for training up to `wait_s`)."""
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while True:
                self.check(model_id)
                versions = self._clients.get(model_id, Versions())
                if versions.adapter is not None and versions.applied >= versions.asked - self.max_staleness:
                    versions.lag = versions.asked - versions.applied
                    return versions.applied, versions.asked, versions.adapter
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WaitTimeout(f"tinker-serve: a sampler for {model_id}: training stayed "
                                      f"{versions.asked - versions.applied} versions behind for {self.wait_s:g} s "
                                      f"(--max-staleness {self.max_staleness})")
                self._cv.wait(timeout=left)
