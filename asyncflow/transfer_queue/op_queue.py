"""The Ray store client's updates that need no answer (write, complete, ack, release, remove, renew,
lose_blobs), queued and sent together: a Ray call costs ~1 ms of CPU whatever it carries.

An update goes in one `apply` call with those near it, or rides on the client's next take or
metrics read (`carried`). How long one waits for company: on an event loop `ride_along_s` (20 ms),
or `coalesce_s` (2 ms) while a take of the client waits in the controller (`taking`); from a plain
thread, acks and renews `coalesce_s` (a `CoalesceTimer`), the others not at all. Acks and renews
never change what a take can see (acked samples are the client's lease, never offered again), so a
take need not wait for them; the other updates are *unsettled* until the controller answered them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from asyncflow.transfer_queue.coalesce import CoalesceTimer

Op = tuple[str, tuple[Any, ...]]  # (controller update name, its arguments)
SETTLED = ("ack", "renew")  # the updates a take need not wait for


class OpQueue:
    """Updates queued by one store client; `send_fn(ops)` makes one controller call of them and
    returns its ref (may run on the timer's thread)."""

    def __init__(self, send_fn: Callable[[list[Op]], Any], *, coalesce_s: float = 0.002,
                 ride_along_s: float = 0.02) -> None:
        self._send_fn = send_fn
        self.coalesce_s = coalesce_s
        # with no take of this client waiting in the controller, updates on an event loop wait this
        # long for the next take to carry them: a rollout actor's refill comes every few responses
        self.ride_along_s = ride_along_s
        self._lock = threading.Lock()  # `_buf` and `_sent`: the timer's thread sends too
        self._buf: list[Op] = []  # updates not sent yet
        self._buf_unsettled = False  # one of them is not an ack or renew
        # refs of calls sent without waiting: the controller (an async actor) may run calls out of
        # order, so the client's later reads wait for these first (`drain`)
        self._sent: list[Any] = []
        self._unsettled = False  # a sent update other than ack/renew is unanswered: takes must wait for it
        self._flush_at: asyncio.TimerHandle | None = None  # sends an event loop's updates
        self._timer = CoalesceTimer(self.send)  # sends a plain thread's acks and renews
        self._taking = 0  # takes of this client on its event loop waiting for the controller's answer

    @property
    def unsettled(self) -> bool:
        """A sent update other than ack/renew may be unanswered: a take must wait for it first."""
        return self._unsettled

    @property
    def unanswered(self) -> int:
        """Calls sent since the last `drain` (those seen answered at the last pruning left out)."""
        return len(self._sent)

    def add(self, name: str, args: tuple[Any, ...]) -> None:
        """Queue update `name(*args)`; it goes out as the module docstring says."""
        with self._lock:
            self._buf.append((name, args))
            self._buf_unsettled |= name not in SETTLED
            many = len(self._buf) >= 256
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if many or (loop is None and self._buf_unsettled):
            self.send()
        elif loop is not None:
            if self._flush_at is None:
                self._flush_at = loop.call_later(self.coalesce_s if self._taking else self.ride_along_s, self.send)
        else:
            self._timer.arm(self.coalesce_s)

    def send(self) -> None:
        """Send the queued updates now, in one call (none: nothing)."""
        with self._lock:
            self._send_locked()

    def carried(self, blocked: bool = False) -> tuple[list[Op], list[Op]]:
        """(first, after): the queued updates, taken for the next controller call to carry. All acks
        and renews go `after` (applied once a take is answered: acked samples are never offered
        again); else all go `first`, in order. None ride while `blocked` (the caller's earlier calls,
        e.g. puts, are unanswered) or sent updates are `unsettled`: the take waits for those first."""
        with self._lock:
            if blocked or self._unsettled:
                return [], []
            ops, unsettled = self._take_buf()
            return (ops, []) if unsettled else ([], ops)

    def drain(self) -> list[Any]:
        """Send the queued updates and hand over the refs of every call sent since the last drain:
        the caller waits for them (`flush`), so takes need not any more."""
        with self._lock:
            self._send_locked()
            sent, self._sent, self._unsettled = self._sent, [], False
        return sent

    @contextlib.contextmanager
    def taking(self) -> Iterator[None]:
        """Around a take's wait for the controller: meanwhile updates go out after `coalesce_s`."""
        self._taking += 1
        try:
            yield
        finally:
            self._taking -= 1

    def _send_locked(self) -> None:
        ops, unsettled = self._take_buf()
        if not ops:
            return
        self._unsettled |= unsettled
        self._sent.append(self._send_fn(ops))
        if len(self._sent) >= 256:  # (keeps the list short: answered calls need no wait)
            import ray

            _, self._sent = ray.wait(self._sent, num_returns=len(self._sent), timeout=0)

    def _take_buf(self) -> tuple[list[Op], bool]:
        """The queued updates, taken, and whether any is unsettled (lock held); no timer left to send them."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        self._timer.cancel()
        out = (self._buf, self._buf_unsettled)
        self._buf, self._buf_unsettled = [], False
        return out
