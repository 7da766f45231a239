"""Weight sync: how a new policy version travels from the trainer to the inference engines.

Two implementations behind one small sender/receiver interface:

- `LocalWeightSync`: in-process hand-off of the exported state dict (what `Trainer.publish` does
  today: `trainer.export_weights()` then `engine.load_weights(state, version, mode)`; the Ray runtime
  does the same with an object-store reference in place of the dict).
- `BroadcastWeightSender` / `BroadcastWeightReceiver`: a `torch.distributed` broadcast from the
  trainer's rank to every inference process in one process group — NCCL between GPUs (the point:
  weights never leave the devices), gloo on CPU (tests). Parameters are packed into flat byte buckets
  of `bucket_bytes` and broadcast bucket by bucket, so the transfer is a few large collectives rather
  than one per tensor and needs at most one bucket of extra memory on each side:

```
 sender (src rank)                                        receiver (every other rank)
 header: [version, len(meta)] ─────── broadcast ───────►  header
 meta: names, dtypes, shapes (pickled bytes) ─ bcast ──►  meta -> the same bucket plan, empty tensors
 bucket 0: bytes of t0 | t1 | first part of t2 ─ bcast ─► unpack into t0, t1, t2[:k]
 bucket 1: rest of t2 (a tensor larger than a bucket spans several) ─► t2[k:]
```

The plan is a pure function of the metadata, so both sides cut the byte stream identically; a tensor
is copied as raw bytes, so dtypes and values round-trip exactly. Every collective is issued
asynchronously and waited for with a timeout that names what was waited for.

Tensors of `direct_bytes` (1 MiB) and more are not packed: each goes by itself after the buckets,
straight from the sender's tensor into the receiver's. A tied weight (the same tensor under two
names) goes once; the metadata names its aliases. `receive_into` writes a version into an engine's
own tensors (no second state dict); `announced` takes the header first, so a receiver can wait for
a publication in one thread and stream its bytes in another (an engine's decode thread).
"""

from __future__ import annotations

import abc
import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from asyncflow.errors import WaitTimeout

DEFAULT_BUCKET_BYTES = 256 * 2**20
DEFAULT_DIRECT_BYTES = 2**20  # a tensor this large is broadcast by itself, straight from and into its memory


class WeightSender(abc.ABC):
    """The trainer's side: publish a full state dict as `version`."""

    @abc.abstractmethod
    def send(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Deliver `state` as `version` to every receiver (blocks until it is handed over)."""


class WeightReceiver(abc.ABC):
    """An inference engine's side: the next published state dict and its version."""

    @abc.abstractmethod
    def receive(self, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
        """Wait at most `timeout_s` for the next publication; returns (state, version)."""


# ---------------------------------------------------------------------------------------------------
# in process
# ---------------------------------------------------------------------------------------------------


class LocalWeightSync(WeightSender, WeightReceiver):
    """In-process publication: the sender leaves the newest (state, version); each receiver
    (`receiver()`, one per engine) takes a version newer than the one *it* took last (an older unread
    one is superseded, as in the engines). `receive` on the sync itself is one such receiver's."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._latest: tuple[dict[str, torch.Tensor], int] | None = None
        self._default = _LocalReceiver(self)

    def send(self, state: dict[str, torch.Tensor], version: int) -> None:
        with self._cv:
            self._latest = (state, version)
            self._cv.notify_all()

    def receiver(self) -> WeightReceiver:
        """A receiver of its own: every receiver gets every version (one receiver's take hid it from
        the others when they shared one "last taken")."""
        return _LocalReceiver(self)

    def receive(self, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
        return self._default.receive(timeout_s)


class _LocalReceiver(WeightReceiver):
    def __init__(self, sync: LocalWeightSync) -> None:
        self.sync, self.taken = sync, -1

    def receive(self, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
        sync = self.sync
        with sync._cv:
            ok = sync._cv.wait_for(lambda: sync._latest is not None and sync._latest[1] > self.taken, timeout_s)
            if not ok or sync._latest is None:
                raise WaitTimeout(f"timed out after {timeout_s:.1f} s waiting for weights newer than version {self.taken}")
            self.taken = sync._latest[1]
            return sync._latest


# ---------------------------------------------------------------------------------------------------
# bucketing (pure)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to allocate one tensor."""

    name: str
    dtype: str  # e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class Segment:
    """`nbytes` bytes of tensor `index`, from byte `tensor_offset`, at byte `bucket_offset` of a bucket."""

    index: int
    tensor_offset: int
    bucket_offset: int
    nbytes: int


def aliases(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Name -> the earlier name whose tensor it is (tied weights: the same memory, shape and dtype).
    A publication carries such a tensor once; a receiver gives it both names again."""
    first: dict[tuple[Any, ...], str] = {}
    out = {}
    for k, v in state.items():
        key = (v.device, v.data_ptr(), tuple(v.shape), tuple(v.stride()), v.dtype)
        if v.numel() and key in first:
            out[k] = first[key]
        else:
            first.setdefault(key, k)
    return out


def describe(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of a state dict, in its order."""
    return [TensorSpec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int, skip: frozenset[int] = frozenset()) -> list[list[Segment]]:
    """Cut the concatenated bytes of all tensors (but those `skip` names) into buckets of at most
    `bucket_bytes`."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Segment]] = [[]]
    used = 0
    for i, spec in enumerate(specs):
        if i in skip:
            continue
        offset, left = 0, spec.nbytes
        while left > 0:
            if used == bucket_bytes:
                buckets.append([])
                used = 0
            n = min(left, bucket_bytes - used)
            buckets[-1].append(Segment(i, offset, used, n))
            used += n
            offset += n
            left -= n
    return [b for b in buckets if b]


def plan_direct(specs: list[TensorSpec], direct_bytes: int) -> frozenset[int]:
    """The tensors broadcast whole from and into their own memory (no packing, no unpacking): those
    of at least `direct_bytes`, where one collective's fixed cost is small beside the bytes."""
    return frozenset(i for i, s in enumerate(specs) if s.nbytes >= direct_bytes)


def bucket_size(segments: list[Segment]) -> int:
    """Bytes a bucket holds (the last bucket is usually smaller than the limit)."""
    return max(s.bucket_offset + s.nbytes for s in segments)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a contiguous copy first if needed)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(tensors: list[torch.Tensor], segments: list[Segment], device: torch.device | str = "cpu",
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's bytes: each segment's slice of its tensor, at its offset (in the front of `out`
    when given, a reused buffer). Give it `as_bytes` views when packing many buckets: a
    non-contiguous tensor is otherwise copied whole once per bucket that holds a piece of it."""
    size = bucket_size(segments)
    buf = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out[:size]
    for s in segments:
        src = as_bytes(tensors[s.index])[s.tensor_offset : s.tensor_offset + s.nbytes]
        buf[s.bucket_offset : s.bucket_offset + s.nbytes].copy_(src)
    return buf


def unpack_bucket(buf: torch.Tensor, segments: list[Segment], out: list[torch.Tensor]) -> None:
    """Copy each segment of `buf` into its place in the (contiguous) output tensors."""
    for s in segments:
        dst = out[s.index].view(-1).view(torch.uint8)
        dst[s.tensor_offset : s.tensor_offset + s.nbytes].copy_(buf[s.bucket_offset : s.bucket_offset + s.nbytes])


def allocate(specs: list[TensorSpec], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Empty tensors for the specs (what a receiver fills)."""
    return [torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs]


# ---------------------------------------------------------------------------------------------------
# torch.distributed broadcast (NCCL on GPUs, gloo on CPU)
# ---------------------------------------------------------------------------------------------------


@dataclass
class WeightGroup:
    """A process group of its own for weight broadcasts (rank 0: the trainer's sender; 1..: engines),
    built from a TCP store rather than `init_process_group`: its members may already belong to
    another default group (FSDP's ranks) and it is rebuilt when an engine restarts."""

    pg: Any
    rank: int
    size: int
    device: torch.device


def open_weight_group(host: str, port: int, rank: int, size: int, *, backend: str, timeout_s: float,
                      tag: str = "weights") -> WeightGroup:
    """Join (rank 0: host) the group of `size` members at `host:port`; waits at most `timeout_s` for
    all of them. `backend`: "gloo" (CPU tensors) or "nccl" (this process's current GPU)."""
    import torch.distributed as dist

    limit = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, size, rank == 0, timeout=limit)
        prefixed = dist.PrefixStore(tag, store)
        if backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = limit  # (the options' name for the group's collective timeout)
            pg: Any = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, size, limit)
            device = torch.device("cpu")
    except RuntimeError as exc:  # (the store's and gloo's rendezvous raise on timeout)
        raise WaitTimeout(f"weight group {tag}: rank {rank} of {size} could not join at {host}:{port} within "
                          f"{timeout_s:.0f} s ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    return WeightGroup(pg, rank, size, device)


def _bcast(t: torch.Tensor, src: int, group: Any, timeout_s: float, what: str) -> None:
    import torch.distributed as dist

    if isinstance(group, WeightGroup):  # (not registered with torch.distributed: its own broadcast call)
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        work = group.pg.broadcast([t], opts)
    else:
        work = dist.broadcast(t, src=src, group=group, async_op=True)
    try:
        ok = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo and NCCL raise on timeout or a peer that went away
        raise WaitTimeout(f"weight broadcast: {what} did not complete within {timeout_s:.0f} s ({exc})") from exc
    if ok is False:
        raise WaitTimeout(f"weight broadcast: {what} did not complete within {timeout_s:.0f} s")


class _Collective:
    """A side of the broadcast. A collective that timed out stays posted in the process group, so the
    next one would be paired with it out of step (gloo then aborts the process from C++): after a
    timeout the side refuses every later call; the group must be rebuilt."""

    broken: str | None = None

    def _run(self, t: torch.Tensor, src: int, group: Any, timeout_s: float, what: str) -> None:
        if self.broken is not None:
            raise RuntimeError(f"weight broadcast: this {type(self).__name__} is out of step with its group since "
                               f"{self.broken}; rebuild the process group and the sender/receiver")
        try:
            _bcast(t, src, group, timeout_s, what)
        except WaitTimeout:
            self.broken = f"{what} timed out"
            raise


class BroadcastWeightSender(WeightSender, _Collective):
    """Broadcast state dicts from rank `src` of `group` (None: the default group), bucket by bucket."""

    def __init__(self, *, src: int = 0, group: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 device: torch.device | str = "cpu", timeout_s: float = 600.0,
                 direct_bytes: int = DEFAULT_DIRECT_BYTES) -> None:
        self.src, self.group, self.bucket_bytes = src, group, bucket_bytes
        self.device, self.timeout_s, self.direct_bytes = torch.device(device), timeout_s, direct_bytes

    def send(self, state: dict[str, torch.Tensor], version: int, extra: Any = None) -> None:
        """`extra`: any picklable value that travels with the metadata (a delta publication's
        skeleton: asyncflow.engines.weight_delta.split)."""
        same = aliases(state)  # (a tied tensor goes once; receivers give it its other names again)
        state = {k: v for k, v in state.items() if k not in same}
        specs = describe(state)
        plan = (specs, self.bucket_bytes, same, self.direct_bytes, extra)
        meta = torch.frombuffer(bytearray(pickle.dumps(plan)), dtype=torch.uint8)
        header = torch.tensor([version, meta.numel()], dtype=torch.int64, device=self.device)
        self._run(header, self.src, self.group, self.timeout_s, f"the header of version {version}")
        self._run(meta.to(self.device), self.src, self.group, self.timeout_s, f"the metadata of version {version}")
        # flat byte views made once: a non-contiguous tensor is copied once, not once per bucket
        tensors = [as_bytes(v.to(self.device)) for v in state.values()]
        direct = plan_direct(specs, self.direct_bytes)
        buckets = plan_buckets(specs, self.bucket_bytes, skip=direct)
        # one buffer for every bucket: its pages are faulted in once, not once per bucket
        buf = torch.empty(max((bucket_size(b) for b in buckets), default=0), dtype=torch.uint8, device=self.device)
        for i, segments in enumerate(buckets):
            view = pack_bucket(tensors, segments, self.device, out=buf)
            self._run(view, self.src, self.group, self.timeout_s, f"bucket {i + 1}/{len(buckets)} of version {version}")
        for i in sorted(direct):
            self._run(tensors[i], self.src, self.group, self.timeout_s, f"tensor {specs[i].name} of version {version}")


Incoming = tuple[int, list[TensorSpec], int, dict[str, str], int, Any]  # a version's header and metadata


class WeightsRefused(ValueError):
    """A receive into an engine's parameters stopped before it wrote any byte into them (another
    version, a state that does not fit, no group): the engine still holds its previous weights whole."""


def fit_problem(specs: list[TensorSpec], same: dict[str, str], params: dict[str, torch.Tensor]) -> str | None:
    """Why the broadcast tensors `specs` (and their `aliases`) cannot be written in place into
    `params`, or None."""
    missing = [k for k in params if k not in {s.name for s in specs} and same.get(k) not in params]
    bad = [s.name for s in specs if s.name not in params or tuple(params[s.name].shape) != s.shape
           or str(params[s.name].dtype).removeprefix("torch.") != s.dtype or not params[s.name].is_contiguous()]
    parts = [f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
             for what, names in (("missing", missing), ("unexpected or other shape/dtype", bad)) if names]
    return "; ".join(parts) or None


class BroadcastWeightReceiver(WeightReceiver, _Collective):
    """Receive state dicts broadcast by `BroadcastWeightSender`: into new tensors on `device`
    (`receive`), or straight into an engine's own parameters (`receive_into`: no second copy of the
    state, one bucket of extra memory)."""

    def __init__(self, *, src: int = 0, group: Any = None, device: torch.device | str = "cpu") -> None:
        self.src, self.group, self.device = src, group, torch.device(device)

    def receive(self, timeout_s: float, incoming: Incoming | None = None) -> tuple[dict[str, torch.Tensor], int]:
        """The next broadcast (or the one `incoming` announced) in new tensors; its version (its
        `extra`: `incoming[5]`, from `announced`)."""
        version, specs, bucket_bytes, same, direct_bytes, _ = incoming or self.announced(timeout_s)
        out = allocate(specs, self.device)
        self._stream(specs, bucket_bytes, direct_bytes, out, version, timeout_s)
        state = {s.name: t for s, t in zip(specs, out, strict=True)}
        return {**state, **{k: state[v] for k, v in same.items()}}, version

    def receive_into(self, params: dict[str, torch.Tensor], timeout_s: float, expect: int | None = None,
                     incoming: Incoming | None = None) -> int:
        """Write the next broadcast into `params` (name -> the engine's tensor, same shape and dtype,
        contiguous) in place; its version. Another version than `expect`, or a state that does not
        fit, is still received (into a scratch bucket: the group stays in step) and refused.
        `incoming`: its header, already taken by `announced` (the wait for a publication then
        happens there, and only the bytes here)."""
        version, specs, bucket_bytes, same, direct_bytes, _ = incoming or self.announced(timeout_s)
        problem = fit_problem(specs, same, params)
        if problem is None and expect is not None and version != expect:
            problem = f"version {version} arrived where {expect} was announced"
        out = None if problem is not None else [params[s.name] for s in specs]
        self._stream(specs, bucket_bytes, direct_bytes, out, version, timeout_s)
        if problem is not None:
            raise WeightsRefused(f"weight broadcast: version {version} not loaded: {problem}")
        for name, target in same.items():  # (an engine whose copy of a tied weight is a tensor of its own)
            if name in params and params[name].data_ptr() != params[target].data_ptr():
                params[name].copy_(params[target])
        return version

    def announced(self, timeout_s: float) -> Incoming:
        """The header and metadata of the next version: (version, specs, bucket bytes, aliases,
        the size from which a tensor goes by itself, the sender's `extra`)."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._run(header, self.src, self.group, timeout_s, "the header of the next version")
        version, meta_len = int(header[0]), int(header[1])
        meta = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
        self._run(meta, self.src, self.group, timeout_s, f"the metadata of version {version}")
        specs, bucket_bytes, same, direct_bytes, extra = pickle.loads(meta.cpu().numpy().tobytes())
        return version, specs, bucket_bytes, same, direct_bytes, extra

    def _stream(self, specs: list[TensorSpec], bucket_bytes: int, direct_bytes: int,
                out: list[torch.Tensor] | None, version: int, timeout_s: float) -> None:
        """Receive every bucket into one reused buffer and unpack it into `out`, then each tensor sent
        by itself straight into its place in `out` (None: received and dropped)."""
        direct = plan_direct(specs, direct_bytes)
        buckets = plan_buckets(specs, bucket_bytes, skip=direct)
        buf = torch.empty(max((bucket_size(b) for b in buckets), default=0), dtype=torch.uint8, device=self.device)
        for i, segments in enumerate(buckets):
            view = buf[: bucket_size(segments)]
            self._run(view, self.src, self.group, timeout_s, f"bucket {i + 1}/{len(buckets)} of version {version}")
            if out is not None:
                unpack_bucket(view, segments, out)
        for i in sorted(direct):
            into = out[i].view(-1).view(torch.uint8) if out is not None else torch.empty(
                specs[i].nbytes, dtype=torch.uint8, device=self.device)
            self._run(into, self.src, self.group, timeout_s, f"tensor {specs[i].name} of version {version}")
