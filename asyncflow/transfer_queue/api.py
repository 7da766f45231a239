"""The store's public types, shared by both placements (`TransferQueue` in process, `RayTransferQueue`
across processes): what a producer puts (`NewSample`), what a consumer gets (`Lease` of `SampleView`s),
what a closed store raises (`QueueClosed`), and the `StoreClient` protocol the workflow codes against."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class QueueClosed(Exception):
    """The store was closed: `take` and `put` are refused and every waiter is woken with this."""


@dataclass
class NewSample:
    """A sample to admit with `put`. One object may be listed several times in a put (a group's
    identical samples): each entry is admitted as its own sample with its own uid and its own copy
    of `fields`."""

    group_id: int
    """The prompt this sample answers."""
    group_size: int
    """Number of samples in the group (`rollout.n`), >= 1."""
    fields: dict[str, Any]
    """Initial fields (e.g. `prompt_ids` tensor, prompt text, answer)."""
    priority: float | None = None
    """Lower is served first; default is the admission sequence number (the uid)."""
    uid: int | None = None
    """Normally assigned by the store; a client may pass one it got from `reserve_uids`."""


@dataclass(slots=True)
class SampleView:
    """What a consumer gets: one sample with the fields its stage asked for."""

    uid: int
    group_id: int
    version: int | None
    """Oldest policy version that produced any of its tokens; None until written."""
    fields: dict[str, Any]
    """The stage's registered fields plus any written `fields_extra` (a shallow copy)."""


@dataclass(slots=True)
class Lease:
    """Samples taken by one stage until `ack`, `release` or `deadline`."""

    id: int
    stage: str
    samples: list[SampleView]
    """Ready and within the version floor, lowest priority first."""
    expired: list[SampleView]
    """Taken because their version is below `min_version`; still need an ack (usually with remove)."""
    deadline: float


class StoreClient(Protocol):
    """What the workflow uses of a store: `TransferQueue` (in process) and `RayTransferQueue`
    (a controller actor shared by processes) both provide it."""

    # whether a call is answered in the caller's process (no round trip for a caller to hide)
    in_process: bool

    def register_stage(self, stage: str, fields: Sequence[str], *, groups: bool = False) -> None: ...

    async def put(self, samples: list[NewSample], timeout: float | None = None) -> list[int]: ...

    async def take(
        self,
        stage: str,
        max_samples: int,
        *,
        min_samples: int = 1,
        timeout: float | None = None,
        lease_s: float | None = None,
        min_version: int | None = None,
        fields_extra: Sequence[str] = (),
    ) -> Lease: ...

    async def take_each(
        self,
        stage: str,
        max_samples: int,
        *,
        timeout: float | None = None,
        lease_s: float | None = None,
        min_version: int | None = None,
        fields_extra: Sequence[str] = (),
        room: Callable[[], int] | None = None,
    ) -> list[Lease]: ...

    def write(self, uid: int, fields: dict[str, Any], *, version: int | None = None) -> None: ...

    def complete(
        self, lease: Lease, writes: dict[int, dict[str, Any]], *, versions: dict[int, int] | None = None,
        remove: bool = False,
    ) -> bool: ...

    def complete_and_take(self, lease: Lease, fields: dict[str, Any], *, version: int | None, stage: str,
                          fields_extra: Sequence[str] = ()) -> tuple[bool, Lease | None]: ...

    def ack(self, lease: Lease, *, remove: bool = False) -> bool: ...

    def release(self, lease: Lease) -> bool: ...

    def renew(self, leases: Iterable[Lease], lease_s: float | None = None) -> None: ...

    def remove(self, uids: Iterable[int]) -> None: ...

    def close(self) -> None: ...

    def size(self) -> int: ...

    def metrics(self) -> dict[str, float]: ...

    def metrics_async(self) -> Awaitable[dict[str, float]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
