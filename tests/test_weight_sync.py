"""Weight sync: bucket packing round-trips exactly; the gloo broadcast delivers identical tensors and versions."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from asyncflow.engines.weight_sync import (
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    LocalWeightSync,
    allocate,
    bucket_size,
    describe,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
)
from asyncflow.errors import WaitTimeout

BUCKET = 1024  # bytes: the 4,000-byte tensor below spans four buckets


def _state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "w": torch.randn(3, 5, generator=g),
        "big": torch.randn(1000, generator=g),  # 4,000 bytes > one bucket
        "half": torch.randn(7, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-5, 5, (2, 2), generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "scalar": torch.tensor(float(version), dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_buckets_respect_the_size_and_round_trip_exactly() -> None:
    state = _state(1)
    specs = describe(state)
    buckets = plan_buckets(specs, BUCKET)
    assert all(bucket_size(b) <= BUCKET for b in buckets)
    assert sum(bucket_size(b) for b in buckets) == sum(s.nbytes for s in specs)
    assert sum(1 for b in buckets for s in b if specs[s.index].name == "big") >= 4
    tensors = list(state.values())
    out = allocate(specs)
    for segments in buckets:
        unpack_bucket(pack_bucket(tensors, segments), segments, out)
    _same(state, {s.name: t for s, t in zip(specs, out, strict=True)})


def test_local_sync_carries_the_newest_version_and_times_out() -> None:
    sync = LocalWeightSync()
    with pytest.raises(WaitTimeout, match="newer than version -1"):
        sync.receive(0.01)
    sync.send(_state(1), 1)
    sync.send(_state(2), 2)  # supersedes version 1
    state, version = sync.receive(1.0)
    assert version == 2
    _same(state, _state(2))
    with pytest.raises(WaitTimeout, match="newer than version 2"):
        sync.receive(0.01)
    threading.Timer(0.05, sync.send, args=(_state(3), 3)).start()
    assert sync.receive(5.0)[1] == 3
    # every receiver gets every version (one engine's take hid it from the others)
    engines = [sync.receiver(), sync.receiver()]
    assert [r.receive(1.0)[1] for r in engines] == [3, 3]
    sync.send(_state(4), 4)
    assert [r.receive(1.0)[1] for r in engines] == [4, 4]
    with pytest.raises(WaitTimeout, match="newer than version 4"):
        engines[1].receive(0.01)


def test_a_broadcast_side_that_timed_out_refuses_later_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed-out collective stays posted in the group: a retry was paired with it out of step and
    gloo aborted the process (and the sender's) from C++."""
    import asyncflow.engines.weight_sync as ws

    calls: list[str] = []

    def stuck(t: torch.Tensor, src: int, group: object, timeout_s: float, what: str) -> None:
        calls.append(what)
        raise WaitTimeout(f"weight broadcast: {what} did not complete within {timeout_s:.0f} s")

    monkeypatch.setattr(ws, "_bcast", stuck)
    receiver = BroadcastWeightReceiver()
    with pytest.raises(WaitTimeout, match="the header of the next version did not complete"):
        receiver.receive(0.01)
    with pytest.raises(RuntimeError, match="out of step with its group since the header of the next version timed "
                                           "out; rebuild the process group"):
        receiver.receive(0.01)
    sender = BroadcastWeightSender(timeout_s=0.01)
    with pytest.raises(WaitTimeout):
        sender.send(_state(1), 1)
    with pytest.raises(RuntimeError, match="BroadcastWeightSender is out of step"):
        sender.send(_state(2), 2)
    assert calls == ["the header of the next version", "the header of version 1"]  # (no collective after)


def _broadcast_rank(rank: int, port: int, results: object) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        if rank == 0:
            sender = BroadcastWeightSender(src=0, bucket_bytes=BUCKET, timeout_s=60)
            for version in (7, 8):
                sender.send(_state(version), version)
            results.put((0, "sent"))  # type: ignore[attr-defined]
        else:
            receiver = BroadcastWeightReceiver(src=0)
            report = []
            for want in (7, 8):
                state, version = receiver.receive(60)
                try:
                    _same(state, _state(want))
                    report.append((version, "equal"))
                except AssertionError as exc:
                    report.append((version, f"differs: {exc}"))
            results.put((1, report))  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def test_gloo_broadcast_delivers_identical_tensors_and_versions() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[0] == "sent"
    assert got[1] == [(7, "equal"), (8, "equal")]
    assert all(p.exitcode == 0 for p in procs)


def test_a_strided_tensor_is_made_contiguous_once_not_once_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A non-contiguous tensor over several buckets is copied once by the broadcast sender (it was
    copied whole for each bucket holding a piece of it: a 1 GB transposed weight over 4 buckets is
    4 GB of copies), and its bytes still arrive intact."""
    import asyncflow.engines.weight_sync as ws

    strided = torch.randn(40, 25).t()  # 4,000 bytes over four 1,024-byte buckets, not contiguous
    state = {"strided": strided, "w": torch.randn(3)}
    copies: list[int] = []
    real = ws.as_bytes

    def counting(t: torch.Tensor) -> torch.Tensor:
        if not t.is_contiguous():
            copies.append(t.numel())
        return real(t)

    sent: list[torch.Tensor] = []
    monkeypatch.setattr(ws, "as_bytes", counting)
    monkeypatch.setattr(ws, "_bcast", lambda t, *a: sent.append(t.clone()))
    BroadcastWeightSender(bucket_bytes=BUCKET).send(state, 3)
    assert copies == [strided.numel()]
    specs = describe(state)
    out = allocate(specs)
    for buf, segments in zip(sent[2:], plan_buckets(specs, BUCKET), strict=True):
        unpack_bucket(buf, segments, out)
    assert torch.equal(out[0], strided) and torch.equal(out[1], state["w"])
