"""How a Ray run's new weights reach the rollout actors (`runtime.weight_sync`).

- `object_store`: the trainer exports the weights once as an object; each rollout actor fetches it
  (`StoredWeights`).
- `collective`: a bucketed broadcast (`asyncflow.engines.weight_sync`) from the trainer's rank 0 to
  every rollout actor over a process group of their own, NCCL when they all hold GPUs, gloo
  otherwise (`WeightChannel` builds it, `Broadcast` is one version's delivery). The weights never
  pass through the object store or the driver.

```
 driver: WeightChannel.publish(v) ── group changed? (an actor died or came back) ─► rebuild:
            trainer.weights_address() -> host:port; every member joins (rank 0: the trainer)
         trainer.send_weights(v) ──► broadcast ──► rollout i: receive_weights(v, mode) -> engine.load_weights
```

A member that misses a broadcast (it failed, or the actor restarted since the group was built)
takes the same version from the object store instead: the trainer keeps the state it last sent
(`WeightPort.last`) for exactly that, and hands it out only for that version, so a version number
always names the weights it came with.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import torch

from asyncflow.engines.weight_delta import HeldParams, HeldWeights, Publication, ResyncNeeded, join, split
from asyncflow.engines.weight_sync import (
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    Incoming,
    WeightGroup,
    WeightsRefused,
    open_weight_group,
)
from asyncflow.errors import WaitTimeout
from asyncflow.runtime.ray_errors import dead_actor_error

MISSED = object()  # a broadcast that did not reach its member (it then loads from the object store)
STATUS_TIMEOUT_S = 10.0  # reading the result of a call `ray.wait` already reported as finished

# ---------------------------------------------------------------------------------------------------
# actor side: the trainer's rank 0 and each rollout actor hold one
# ---------------------------------------------------------------------------------------------------


class WeightPort:
    """One actor's end of the collective path: join the current group, send or receive a version."""

    def __init__(self, bucket_bytes: int, timeout_s: float) -> None:
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self.group: WeightGroup | None = None
        self.last: tuple[dict[str, torch.Tensor] | Publication, int] | None = None  # the sender's last sent (state, version)

    @staticmethod
    def address() -> tuple[str, int]:
        """This node's address and a free port on it, for the group's store (rank 0 hosts it)."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, int(s.getsockname()[1])

    def join(self, host: str, port: int, rank: int, size: int, epoch: int, backend: str) -> None:
        """Leave the previous group (if any) and join group `epoch` as `rank` of `size`."""
        self.group = None
        self.group = open_weight_group(host, port, rank, size, backend=backend, timeout_s=self.timeout_s,
                                       tag=f"weights-{epoch}")

    def _current(self, what: str) -> WeightGroup:
        if self.group is None:
            raise RuntimeError(f"weight broadcast: cannot {what}: this actor is in no weight group (or its last "
                               "broadcast failed); the driver rebuilds the group at the next publication")
        return self.group

    def send(self, state: dict[str, torch.Tensor] | Publication, version: int) -> None:
        """Broadcast `state` as `version` to the group; keep it for members that miss it (a delta
        publication's tensors go as a flat state, its skeleton with the metadata; a member that
        misses it takes the version's full weights)."""
        group = self._current(f"send version {version}")
        extra = None
        if isinstance(state, Publication):
            self.last = (state.as_full(), version)
            flat, extra = split(state)
            state = flat if state.is_delta else state.tensors  # (whole: the sender sends a tied weight once)
        else:
            self.last = (state, version)
        sender = BroadcastWeightSender(src=0, group=group, bucket_bytes=self.bucket_bytes, device=group.device,
                                       timeout_s=self.timeout_s)
        try:
            sender.send(state, version, extra)
        except BaseException:
            self.group = None  # out of step with the others: rebuilt before the next send
            raise

    def published(self, version: int) -> dict[str, torch.Tensor] | Publication | None:
        """The state last sent, if it is `version` (None: a newer one has been sent since)."""
        return self.last[0] if self.last is not None and self.last[1] == version else None

    def announced(self, version: int) -> Incoming:
        """Wait for the header of the broadcast of `version` (off the engine's decode thread: a send
        that never comes must not hold the engine); its bytes follow through `receive_into`."""
        group = self._current(f"receive version {version}")
        try:
            return BroadcastWeightReceiver(src=0, group=group, device=group.device).announced(self.timeout_s)
        except BaseException:
            self.group = None
            raise

    def receive_into(self, params: dict[str, torch.Tensor], version: int, incoming: Incoming) -> None:
        """The announced broadcast of `version` written straight into an engine's tensors
        (`HFEngine.request_fill`)."""
        if self.group is None:
            raise WeightsRefused(f"weight broadcast: cannot receive version {version}: this actor is in no weight "
                                 "group (or its last broadcast failed); the driver rebuilds it at the next publication")
        receiver = BroadcastWeightReceiver(src=0, group=self.group, device=self.group.device)
        held = params.held if isinstance(params, HeldParams) else None
        skeleton = incoming[5]
        try:
            if isinstance(skeleton, Publication) and skeleton.is_delta:
                flat, got = receiver.receive(self.timeout_s, incoming)
                apply_received(join(skeleton, flat), params, held, version, got)
                return
            receiver.receive_into(params, self.timeout_s, expect=version, incoming=incoming)
        except BaseException:
            self.group = None  # (a refused version or state was still received whole, but the driver rebuilds)
            raise
        if held is not None:
            if not isinstance(skeleton, Publication):
                held.forget()  # (a plain state: no checksum to hold)
            elif not held.verify_full(skeleton, params):
                raise RuntimeError(f"weight broadcast: version {version}: the checksum of the weights received "
                                   "differs from the trainer's")

    def receive(self, version: int) -> Any:
        """The broadcast of `version` (anything else is an error: versions are exact): a state dict, or
        a `Publication` where the trainer publishes deltas."""
        group = self._current(f"receive version {version}")
        receiver = BroadcastWeightReceiver(src=0, group=group, device=group.device)
        try:
            incoming = receiver.announced(self.timeout_s)
            state, got = receiver.receive(self.timeout_s, incoming)
        except BaseException:
            self.group = None
            raise
        if got != version:
            self.group = None
            raise RuntimeError(f"weight broadcast: received policy version {got} where {version} was announced")
        skeleton = incoming[5]
        return join(skeleton, state) if isinstance(skeleton, Publication) else state


def apply_received(pub: Publication, params: dict[str, torch.Tensor], held: HeldWeights | None, version: int,
                   got: int) -> None:
    """A delta received by broadcast, written into an engine's tensors where it applies to the
    publication they hold: `WeightsRefused` before any write where not (the member then loads the
    version's full weights from the object store), an error after the write where the checksum differs."""
    if got != version:
        raise WeightsRefused(f"weight broadcast: version {got} arrived where {version} was announced")
    if held is None or held.mirror is not None or not held.applies(pub):
        raise ResyncNeeded(f"weight broadcast: the delta of version {version} does not apply to the weights held",
                           pub.seq)
    if not held.write_delta(pub, params):
        held.forget()
        raise RuntimeError(f"weight broadcast: version {version}: the checksum after the delta differs from the "
                           "trainer's")


# ---------------------------------------------------------------------------------------------------
# driver side
# ---------------------------------------------------------------------------------------------------


class StoredWeights:
    """One version in the object store: every rollout actor fetches it itself. Where the trainer
    publishes deltas (`runtime.weight_sync_delta`), `resync(seq)` is a reference to the full weights
    of publication `seq` (None: the last), which an actor the delta does not apply to loads instead."""

    def __init__(self, ref: Any, resync: Callable[[int | None], Any] | None = None) -> None:
        self.ref, self.resync = ref, resync

    async def deliver(self, engine: Any, version: int, mode: str) -> Any:
        """Load into one `RemoteEngine`'s actor; its reply, or None if the actor died meanwhile."""
        import ray

        try:
            return await engine.unless_down(engine.handle.load_weights.remote(self.ref, version, mode),
                                            f"load policy version {version}")
        except ray.exceptions.RayTaskError as exc:
            if self.resync is None or not isinstance(exc.cause, ResyncNeeded):
                raise
            full = self.resync(exc.cause.seq)
        return await engine.unless_down(engine.handle.load_weights.remote(full, version, mode),
                                        f"load the full weights of policy version {version}")

    def catch_up(self) -> Any:
        """The reference a restarted actor loads this version from (the full weights: it holds none
        of the versions a delta applies to)."""
        return self.ref if self.resync is None else self.resync(None)


class Broadcast:
    """One version sent over the weight group: members receive it by broadcast; any other engine
    (restarted since the group was built), and a member whose receive failed, loads it from the
    object store (`catch_up`, from the trainer's copy of what it last sent)."""

    def __init__(self, channel: WeightChannel, version: int, ranks: dict[str, int], send: Any) -> None:
        self.channel, self.version, self.ranks, self.send = channel, version, ranks, send
        self._stored: Any = None

    async def deliver(self, engine: Any, version: int, mode: str) -> Any:
        """Load this version into one `RemoteEngine`'s actor; its reply, or None if the actor died."""
        if engine.actor_id in self.ranks:
            reply = await self._receive(engine, version, mode)
            if reply is not MISSED:
                self.channel.delivered += reply is not None
                return reply
        self.channel.fallbacks += 1
        return await engine.unless_down(engine.handle.load_weights.remote(self.catch_up(), version, mode),
                                        f"load policy version {version}")

    async def _receive(self, engine: Any, version: int, mode: str) -> Any:
        """The broadcast's reply, or MISSED when the receive failed or the trainer's send did first (a
        receive left waiting for a send that failed would wait out its whole timeout)."""
        import ray

        ref = engine.handle.receive_weights.remote(version, mode)
        recv = asyncio.ensure_future(engine.unless_down(ref, f"receive policy version {version} by broadcast"))
        sent = asyncio.ensure_future(self._sent())
        try:
            done, _ = await asyncio.wait({recv, sent}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done and sent.exception() is not None:
                ray.cancel(ref)
                why = type(sent.exception()).__name__
            else:
                try:
                    return await recv
                except ray.exceptions.RayTaskError as exc:
                    if dead_actor_error(exc) is not None:
                        raise
                    why = type(exc.cause).__name__
        finally:
            for task in (recv, sent):
                if not task.done():
                    task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.channel.failed(f"{engine.name} missed the broadcast of version {version} ({why}); it loads it "
                            "from the object store")
        return MISSED

    async def _sent(self) -> None:
        await self.send

    def catch_up(self) -> Any:
        if self._stored is None:
            self._stored = self.channel.published(self.version)
        return self._stored


class WeightChannel:
    """The driver's side of `runtime.weight_sync: collective`: who is in the group, and each
    publication. `sender` is the trainer (`weights_address`, `join_weights`, `send_weights`,
    `published`, `export_ref`); `engines` the `RemoteEngine`s of the rollout actors."""

    def __init__(self, sender: Any, engines: list[Any], backend: str, timeout_s: float,
                 log: Callable[[str], None]) -> None:
        self.sender, self.engines, self.backend, self.timeout_s, self.log = sender, engines, backend, timeout_s, log
        # the group's members as (engine index, incarnation): a restarted actor is a new process that
        # must join again even where the index list is the same
        self.members: list[tuple[int, int]] | None = None
        self.last_send: Any = None  # the previous publication's send (a failed one leaves the sender groupless)
        self.epoch = 0  # groups built so far
        self.delivered = 0  # loads by broadcast, and from the object store (misses, restarts, no group)
        self.fallbacks = 0

    def failed(self, why: str) -> None:
        """A broadcast went wrong: the group is rebuilt before the next one."""
        self.members = None
        self.log(f"[asyncflow] ray: weight broadcast: {why}")

    def published(self, version: int) -> Any:
        return self.sender.published(version)

    def publish(self, version: int) -> StoredWeights | Broadcast:
        """Start sending `version`: by broadcast to the live rollout actors, or (none live, or the
        group could not be rebuilt) through the object store."""
        live = [i for i, e in enumerate(self.engines) if not e.down and e.gone is None]
        if not live:
            return self.sender.stored_weights()
        if self._send_failed():
            self.failed("the trainer's last broadcast failed; the group is built again")
        members = [(i, self.engines[i].incarnation) for i in live]
        if members != self.members:
            try:
                self._rebuild(live)
            except (WaitTimeout, RuntimeError) as exc:
                self.failed(f"could not rebuild the group ({exc}); version {version} goes through the object store")
                return self.sender.stored_weights()
            self.members = members
        ranks = {self.engines[i].actor_id: k + 1 for k, i in enumerate(live)}
        self.last_send = self.sender.send_weights(version)
        return Broadcast(self, version, ranks, self.last_send)

    def _send_failed(self) -> bool:
        """Whether the previous publication's send ended in an error (not waiting for one still running)."""
        import ray

        if self.last_send is None or not ray.wait([self.last_send], timeout=0)[0]:
            return False
        try:
            ray.get(self.last_send, timeout=STATUS_TIMEOUT_S)
        except ray.exceptions.RayError:
            return True
        return False

    def _rebuild(self, live: list[int]) -> None:
        import ray

        self.epoch += 1
        size = len(live) + 1
        host, port = self.sender.weights_address()
        refs = [self.sender.join_weights(host, port, size, self.epoch, self.backend)]
        refs += [self.engines[i].handle.join_weights.remote(host, port, k + 1, size, self.epoch, self.backend)
                 for k, i in enumerate(live)]
        try:
            ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WaitTimeout(f"timed out after {self.timeout_s:.0f} s waiting for the trainer and rollout "
                              f"actors {live} to join weight group {self.epoch}") from None
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"joining weight group {self.epoch} failed: {type(exc).__name__}") from exc
