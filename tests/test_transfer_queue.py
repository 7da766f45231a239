"""TransferQueue: readiness, groups, leases, backpressure, concurrency, checkpoint; samplers."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from asyncflow.clock import RealClock
from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import (
    Lease,
    NewSample,
    QueueClosed,
    TransferQueue,
    balance_by_length,
    split_sequential,
)
from asyncflow.transfer_queue.store import check_state

T = TypeVar("T")


class FakeClock:
    """A clock whose now() the test sets; waits use real asyncio."""

    def __init__(self) -> None:
        self.t = 1000.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None, what: str) -> T:
        return await RealClock().wait_for(aw, timeout, what)


def prompts(n: int, group_size: int = 1, first_group: int = 0) -> list[NewSample]:
    return [
        NewSample(group_id=first_group + i // group_size, group_size=group_size, fields={"prompt": i})
        for i in range(n)
    ]


def uids_of(lease: Lease | None) -> list[int]:
    assert lease is not None
    return [s.uid for s in lease.samples]


def test_sample_not_delivered_until_all_registered_fields_written() -> None:
    q = TransferQueue()
    q.register_stage("reward", ["response", "logprobs"])
    (uid,) = q.put_blocking(prompts(1))
    assert q.take_nowait("reward", 4) is None
    q.write(uid, {"response": "r"})
    assert q.take_nowait("reward", 4) is None
    q.write(uid, {"logprobs": [0.1]}, version=3)
    lease = q.take_nowait("reward", 4, fields_extra=["prompt"])
    assert lease is not None and uids_of(lease) == [uid]
    assert lease.samples[0].fields == {"response": "r", "logprobs": [0.1], "prompt": 0}
    assert lease.samples[0].version == 3


def test_each_stage_gets_a_sample_once() -> None:
    q = TransferQueue()
    q.register_stage("a", ["prompt"])
    q.register_stage("b", ["prompt"])
    uids = q.put_blocking(prompts(3))
    for stage in ("a", "b"):
        lease = q.take_nowait(stage, 10)
        assert uids_of(lease) == uids
        assert lease is not None and q.ack(lease)
        assert q.take_nowait(stage, 10) is None
    assert q.size() == 3


def test_stage_registered_late_indexes_existing_samples() -> None:
    q = TransferQueue()
    uids = q.put_blocking(prompts(2))
    q.write(uids[1], {"x": 1})
    q.register_stage("late", ["x"])
    assert uids_of(q.take_nowait("late", 5)) == [uids[1]]


def test_a_stage_registered_after_puts_also_gets_later_puts_of_the_same_fields() -> None:
    """Which stages a put's field names make ready is kept across puts; registering a stage must
    renew it, or samples put later with the same names would never reach the new stage."""
    q = TransferQueue()
    q.register_stage("a", ["prompt_ids"])
    first = q.put_blocking([NewSample(0, 1, {"prompt_ids": [1], "row": 0})])
    q.register_stage("b", ["prompt_ids", "row"], groups=True)
    q.register_stage("c", ["row"])
    later = q.put_blocking([NewSample(1, 1, {"prompt_ids": [2], "row": 1})])
    assert uids_of(q.take_nowait("a", 5)) == first + later
    assert uids_of(q.take_nowait("b", 5)) == first + later
    assert uids_of(q.take_nowait("c", 5)) == first + later


def test_write_to_unknown_uid_raises_key_error() -> None:
    q = TransferQueue()
    with pytest.raises(KeyError, match="42"):
        q.write(42, {"x": 1})
    (uid,) = q.put_blocking(prompts(1))
    q.remove([uid])
    with pytest.raises(KeyError):
        q.write(uid, {"x": 1})


def test_write_version_keeps_the_oldest() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    (uid,) = q.put_blocking(prompts(1))
    q.write(uid, {}, version=5)
    q.write(uid, {}, version=3)
    q.write(uid, {}, version=4)
    lease = q.take_nowait("s", 1)
    assert lease is not None and lease.samples[0].version == 3


def test_group_mode_delivers_whole_groups_only() -> None:
    q = TransferQueue()
    q.register_stage("reward", ["response"], groups=True)
    uids = q.put_blocking(prompts(8, group_size=4))  # groups 0 and 1
    for uid in uids[:3] + uids[4:]:
        q.write(uid, {"response": 1})
    lease = q.take_nowait("reward", 8)
    assert uids_of(lease) == uids[4:]  # group 0 lacks one response
    assert q.ready_count("reward") == 0
    q.write(uids[3], {"response": 1})
    assert q.ready_count("reward") == 4
    assert uids_of(q.take_nowait("reward", 8)) == uids[:4]


def test_group_mode_never_splits_a_group_and_counts_samples() -> None:
    q = TransferQueue()
    q.register_stage("train", ["prompt"], groups=True)
    uids = q.put_blocking(prompts(8, group_size=4))
    assert q.take_nowait("train", 12, min_samples=12) is None  # min_samples counts samples
    uids += q.put_blocking(prompts(4, group_size=4, first_group=2))
    assert uids_of(q.take_nowait("train", 10)) == uids[:8]  # a third group would not fit
    with pytest.raises(ValueError, match="group_size"):
        q.take_nowait("train", 3)


def test_group_with_removed_member_still_completes() -> None:
    q = TransferQueue()
    q.register_stage("reward", ["response"], groups=True)
    uids = q.put_blocking(prompts(4, group_size=4))
    for uid in uids[:3]:
        q.write(uid, {"response": 1})
    assert q.take_nowait("reward", 4) is None
    q.remove([uids[3]])
    assert uids_of(q.take_nowait("reward", 4)) == uids[:3]


def test_one_new_sample_listed_n_times_is_admitted_as_n_samples() -> None:
    q = TransferQueue()
    q.register_stage("rollout", ["prompt"])
    q.register_stage("reward", ["response"], groups=True)
    ns = NewSample(0, 3, {"prompt": "p"}, priority=0.0)
    uids = q.put_blocking([ns] * 3)
    assert uids == [0, 1, 2] and ns.uid is None
    q.write(0, {"prompt": "changed"})  # each sample has its own copy of the fields
    assert [q._samples[u].fields["prompt"] for u in uids] == ["changed", "p", "p"]
    for u in uids:
        q.write(u, {"response": u})
    lease = q.take_nowait("reward", 3)
    assert lease is not None and sorted(s.uid for s in lease.samples) == uids  # one complete group of 3


def test_group_members_put_separately_complete_the_group() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"], groups=True)
    first = q.put_blocking([NewSample(7, 2, {"prompt": 0})])
    assert q.take_nowait("s", 2) is None
    second = q.put_blocking([NewSample(7, 2, {"prompt": 1})])
    assert uids_of(q.take_nowait("s", 2)) == first + second
    with pytest.raises(ValueError, match="group_size"):
        q.put_blocking([NewSample(7, 2, {"prompt": 2})])


def test_lowest_priority_is_served_first() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    uids = q.put_blocking([NewSample(i, 1, {"prompt": i}, priority=p) for i, p in enumerate([5.0, 1.0, 3.0])])
    assert uids_of(q.take_nowait("s", 3)) == [uids[1], uids[2], uids[0]]


def test_release_keeps_priority_and_serves_before_newer() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    old = q.put_blocking(prompts(2))
    lease = q.take_nowait("s", 2)
    assert lease is not None
    new = q.put_blocking(prompts(2, first_group=10))
    assert q.release(lease)
    assert uids_of(q.take_nowait("s", 4)) == old + new
    assert not q.release(lease)  # already ended


def test_release_of_group_lease_returns_the_group() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"], groups=True)
    uids = q.put_blocking(prompts(4, group_size=2))
    lease = q.take_nowait("s", 2)
    assert uids_of(lease) == uids[:2]
    assert lease is not None and q.release(lease)
    assert uids_of(q.take_nowait("s", 4)) == uids


def test_ack_remove_deletes_and_plain_ack_keeps_for_other_stages() -> None:
    q = TransferQueue()
    q.register_stage("a", ["prompt"])
    q.register_stage("b", ["prompt"])
    uids = q.put_blocking(prompts(2))
    lease = q.take_nowait("a", 2)
    assert lease is not None and q.in_flight("a") == 2
    q.ack(lease)
    assert q.in_flight("a") == 0 and q.size() == 2 and q.ready_count("b") == 2
    lease_b = q.take_nowait("b", 2)
    assert lease_b is not None and q.ack(lease_b, remove=True)
    assert q.size() == 0 and uids_of(lease_b) == uids


def test_lease_expiry_returns_samples_to_queue() -> None:
    clock = FakeClock()
    q = TransferQueue(lease_timeout_s=10.0, clock=clock)
    q.register_stage("s", ["prompt"])
    uids = q.put_blocking(prompts(2))
    first = q.take_nowait("s", 2)
    assert first is not None and first.deadline == clock.t + 10.0
    clock.t += 9.0
    assert q.take_nowait("s", 2) is None
    clock.t += 1.0
    second = q.take_nowait("s", 2, lease_s=100.0)
    assert uids_of(second) == uids
    assert q.metrics()["expired_leases"] == 1.0
    assert not q.ack(first, remove=True)  # expired: must not touch samples now leased by `second`
    assert q.size() == 2 and q.in_flight("s") == 2
    assert second is not None and q.ack(second)


def test_a_renewed_lease_outlives_its_first_deadline_and_expires_later() -> None:
    clock = FakeClock()
    q = TransferQueue(lease_timeout_s=10.0, clock=clock)
    q.register_stage("s", ["prompt"])
    uids = q.put_blocking(prompts(3))
    kept = q.take_nowait("s", 2)
    other = q.take_nowait("s", 1)
    assert kept is not None and other is not None
    clock.t += 8.0
    q.renew([kept])  # deadline: now + 10
    clock.t += 4.0  # past the first deadline: only the lease not renewed has ended
    assert q.take_nowait("s", 3) is not None and q.metrics()["expired_leases"] == 1.0
    assert not q.ack(other)
    clock.t += 1.0
    q.renew([kept], lease_s=1.0)  # a deadline never moves earlier
    clock.t += 1.5
    assert q.ack(kept, remove=True) and q.size() == 1
    clock.t += 20.0
    q.renew([kept])  # an ended lease is skipped
    assert q.size() == 1 and q.metrics()["expired_leases"] == 2.0
    assert uids_of(q.take_nowait("s", 3)) == [u for u in uids if u not in uids_of(kept)]


def test_renewing_held_leases_keeps_the_expiry_queue_bounded() -> None:
    """Each renewal queues a new deadline; superseded ones are dropped by the queue's clean-up (it kept
    every entry of a live lease, so 2,000 long-held leases made each renewal rebuild a growing queue)."""
    clock = FakeClock()
    q = TransferQueue(capacity=10_000, lease_timeout_s=600.0, clock=clock)
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(2000))
    held = q.take_each_nowait("s", 2000)
    for _ in range(20):
        clock.t += 150.0
        q.renew(held)
        assert len(q._expiry) <= 2 * 2000 + 1024 + 2000
    assert q.metrics()["expired_leases"] == 0.0 and all(q.ack(lease) for lease in held)


def test_lease_ids_are_unique() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(50))
    ids = set()
    for _ in range(50):
        lease = q.take_nowait("s", 1)
        assert lease is not None
        ids.add(lease.id)
        q.release(lease)
    assert len(ids) == 50


def test_waiting_take_wakes_when_a_real_short_lease_expires() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    (uid,) = q.put_blocking(prompts(1))
    assert uids_of(q.take_nowait("s", 1, lease_s=0.05)) == [uid]
    start = time.monotonic()
    assert uids_of(q.take_blocking("s", 1, timeout=5.0)) == [uid]
    assert time.monotonic() - start < 2.0


def test_async_take_wakes_when_a_real_short_lease_expires() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    (uid,) = q.put_blocking(prompts(1))

    async def run() -> Lease:
        assert uids_of(await q.take("s", 1, lease_s=0.05)) == [uid]
        return await q.take("s", 1, timeout=5.0)

    assert uids_of(asyncio.run(run())) == [uid]
    assert q.metrics()["wait_s/s"] > 0.0


def test_producer_blocks_when_full_and_unblocks_on_ack_remove() -> None:
    q = TransferQueue(capacity=4)
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(4))
    done = threading.Event()

    def produce() -> None:
        q.put_blocking(prompts(2, first_group=100), timeout=5.0)
        done.set()

    t = threading.Thread(target=produce)
    t.start()
    assert not done.wait(0.1)
    lease = q.take_nowait("s", 1)
    assert lease is not None
    q.ack(lease, remove=True)
    assert not done.wait(0.05)  # room for 1, needs 2
    lease = q.take_nowait("s", 1)
    assert lease is not None
    q.ack(lease, remove=True)
    assert done.wait(5.0)
    t.join()
    assert q.size() == 4


def test_async_put_blocks_until_remove() -> None:
    q = TransferQueue(capacity=2)
    uids = q.put_blocking(prompts(2))

    async def run() -> list[int]:
        task = asyncio.ensure_future(q.put(prompts(1, first_group=9), timeout=5.0))
        await asyncio.sleep(0.05)
        assert not task.done()
        q.remove(uids[:1])
        return await task

    assert asyncio.run(run()) == [2]


def test_put_timeout_raises_wait_timeout() -> None:
    q = TransferQueue(capacity=1)
    q.put_blocking(prompts(1))
    with pytest.raises(WaitTimeout, match="room"):
        q.put_blocking(prompts(1, first_group=1), timeout=0.05)
    with pytest.raises(WaitTimeout):
        asyncio.run(q.put(prompts(1, first_group=1), timeout=0.05))
    with pytest.raises(ValueError, match="capacity"):
        q.put_blocking(prompts(2))


def test_take_timeout_names_the_stage() -> None:
    q = TransferQueue()
    q.register_stage("reward", ["response"])
    with pytest.raises(WaitTimeout, match="reward"):
        q.take_blocking("reward", 1, timeout=0.05)
    with pytest.raises(WaitTimeout, match="reward"):
        asyncio.run(q.take("reward", 1, timeout=0.05))


def test_close_wakes_waiters_with_queue_closed() -> None:
    q = TransferQueue(capacity=1)
    q.register_stage("s", ["missing"])
    q.put_blocking(prompts(1))
    errors: list[BaseException] = []

    def wait_take() -> None:
        try:
            q.take_blocking("s", 1, timeout=10.0)
        except QueueClosed as exc:
            errors.append(exc)

    def wait_put() -> None:
        try:
            q.put_blocking(prompts(1, first_group=1), timeout=10.0)
        except QueueClosed as exc:
            errors.append(exc)

    async def async_take() -> None:
        with pytest.raises(QueueClosed):
            await q.take("s", 1, timeout=10.0)

    threads = [threading.Thread(target=wait_take), threading.Thread(target=wait_put)]
    for t in threads:
        t.start()

    async def run() -> None:
        task = asyncio.ensure_future(async_take())
        await asyncio.sleep(0.1)
        q.close()
        await asyncio.wait_for(task, 5.0)

    asyncio.run(run())
    for t in threads:
        t.join(5.0)
    assert len(errors) == 2
    with pytest.raises(QueueClosed):
        q.take_nowait("s", 1)


def test_min_version_routes_old_samples_to_expired() -> None:
    q = TransferQueue()
    q.register_stage("train", ["response"])
    uids = q.put_blocking(prompts(3))
    for uid, v in zip(uids, [1, 4, 2], strict=True):
        q.write(uid, {"response": 1}, version=v)
    lease = q.take_nowait("train", 3, min_version=2)
    assert lease is not None
    assert [s.uid for s in lease.samples] == [uids[1], uids[2]]
    assert [s.uid for s in lease.expired] == [uids[0]]
    assert q.in_flight("train") == 3


def test_min_version_uses_the_groups_oldest_version() -> None:
    q = TransferQueue()
    q.register_stage("train", ["response"], groups=True)
    uids = q.put_blocking(prompts(4, group_size=2))
    for uid, v in zip(uids, [5, 1, 5, 5], strict=True):
        q.write(uid, {"response": 1}, version=v)
    lease = q.take_nowait("train", 4, min_version=3)
    assert lease is not None
    assert [s.uid for s in lease.expired] == uids[:2]
    assert [s.uid for s in lease.samples] == uids[2:]


def test_metrics_report_depth_leases_and_bytes() -> None:
    q = TransferQueue()
    q.register_stage("s", ["x"])
    (uid,) = q.put_blocking([NewSample(0, 1, {"x": torch.zeros(4, dtype=torch.float32), "t": "abc"})])
    q.write(uid, {"y": np.zeros(2, dtype=np.int64)})
    m = q.metrics()
    assert m["bytes_put"] == 16 + 16 and m["depth/s"] == 1 and m["samples"] == 1
    q.take_nowait("s", 1)
    m = q.metrics()
    assert m["depth/s"] == 0 and m["leased/s"] == 1 and m["expired_leases"] == 0


def test_state_dict_round_trip_redelivers_unacked_leases() -> None:
    q = TransferQueue()
    q.register_stage("reward", ["prompt"])
    q.register_stage("train", ["prompt"], groups=True)
    uids = q.put_blocking(prompts(6, group_size=2))
    q.write(uids[0], {"r": 1}, version=2)
    acked = q.take_nowait("reward", 2)
    assert acked is not None and q.ack(acked)
    leased = q.take_nowait("reward", 2)  # never acked
    train = q.take_nowait("train", 2)
    assert train is not None and q.ack(train)
    q._stages["reward"].wait_s, q._stages["train"].wait_s, q._expired_leases = 1.5, 2.5, 3
    totals = {k: v for k, v in q.metrics().items() if k.startswith(("wait_s/", "bytes_put", "expired_leases"))}
    state = q.state_dict()

    r = TransferQueue()
    r.register_stage("reward", ["prompt"])
    r.load_state_dict(state)
    r.register_stage("train", ["prompt"], groups=True)  # registering after the restore also works
    assert r.size() == 6
    # the running totals metrics report go on from the saved ones (they restarted at 0 after a resume)
    assert {k: v for k, v in r.metrics().items() if k in totals} == totals and totals["wait_s/train"] == 2.5
    assert uids_of(r.take_nowait("reward", 10)) == uids_of(leased) + uids[4:]
    assert uids_of(r.take_nowait("train", 10)) == uids[2:]
    r.remove(uids[:1])
    (new,) = r.put_blocking(prompts(1, first_group=50))
    assert new == 6
    with pytest.raises(ValueError, match="empty"):
        r.load_state_dict(state)


def test_a_state_that_is_not_the_store_s_is_refused_before_anything_changes() -> None:
    """`check_state` (run by `load_state_dict`, and by a resume before the logs are cut): what
    `state_dict` writes passes; a damaged entry is a ValueError naming it and the store stays empty
    (a bad `totals` failed after `next_uid` had been set, with an int() or dict() error)."""
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(2))
    good = q.state_dict()
    check_state(good)
    check_state({**good, "samples": [], "groups": []})  # an empty store
    old = {k: v for k, v in good.items() if k not in ("totals", "next_group_id")}  # before 2026-11-24
    check_state(old)
    for bad, needle in (
        ([1, 2], r"\(a dict\), got list"),
        ({**good, "format": 99}, "unknown transfer queue state format 99"),
        ({**good, "next_uid": -1}, "next_uid must be an int >= 0"),
        ({**good, "samples": None}, "groups and samples must be lists"),
        ({**good, "groups": [{"group_id": 0, "size": 0, "put": 1, "removed": 0}]}, "a group entry"),
        ({**good, "samples": [{**good["samples"][0], "group_id": [0]}]}, "a sample entry"),
        ({**good, "samples": [{**good["samples"][0], "consumed": [1]}]}, "a sample entry"),
        ({**good, "samples": [good["samples"][0]] * 2}, "listed twice"),
        ({**good, "totals": {**good["totals"], "bytes_put": "x"}}, "totals is not"),
        ({**good, "totals": {**good["totals"], "wait_s": 5}}, "totals is not"),
    ):
        r = TransferQueue()
        r.register_stage("s", ["prompt"])
        with pytest.raises(ValueError, match=needle):
            r.load_state_dict(bad)  # type: ignore[arg-type]
        assert r.size() == 0 and r.state_dict()["next_uid"] == 0


def test_remove_drops_samples_lazily_from_ready_queues() -> None:
    q = TransferQueue()
    q.register_stage("s", ["prompt"])
    uids = q.put_blocking(prompts(300))
    q.remove(uids[:250])
    assert q.ready_count("s") == 50
    assert uids_of(q.take_nowait("s", 100)) == uids[250:]
    q.remove([12345])  # unknown uids are ignored


# ----------------------------------------------------------------------------- concurrency
N_SAMPLES = 6144  # 8 producers x 48 batches of 16


def check_consumption(acked: list[int], n: int) -> None:
    assert sorted(acked) == list(range(n)), "every uid acked exactly once"


def test_threads_many_producers_consumers_every_uid_acked_once() -> None:
    q = TransferQueue(capacity=512, lease_timeout_s=600.0)
    q.register_stage("s", ["prompt"])
    per_producer = N_SAMPLES // 8
    acked: list[int] = []
    holding: set[int] = set()
    guard = threading.Lock()
    failures: list[str] = []

    def produce(p: int) -> None:
        for i in range(0, per_producer, 16):
            q.put_blocking(prompts(16, first_group=p * per_producer + i), timeout=30.0)

    def consume(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            roll = rng.random()
            expire = roll < 0.05  # take with a short lease and let it run out
            try:
                lease = q.take_blocking(
                    "s", rng.randint(1, 32), timeout=30.0, lease_s=0.01 if expire else 30.0
                )
            except QueueClosed:
                return
            mine = {s.uid for s in lease.samples}
            if expire:
                time.sleep(0.03)
                assert not q.ack(lease, remove=True)
                continue
            with guard:
                if mine & holding:
                    failures.append(f"delivered twice concurrently: {mine & holding}")
                holding.update(mine)
            if roll < 0.15:
                with guard:
                    holding.difference_update(mine)
                q.release(lease)
                continue
            with guard:
                holding.difference_update(mine)
                if q.ack(lease, remove=True):
                    acked.extend(mine)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(8)]
    consumers = [threading.Thread(target=consume, args=(c,)) for c in range(8)]
    for t in producers + consumers:
        t.start()
    for t in producers:
        t.join(60)
    deadline = time.monotonic() + 60
    while q.size() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    q.close()
    for t in consumers:
        t.join(60)
    assert not failures
    check_consumption(acked, N_SAMPLES)
    assert q.metrics()["expired_leases"] > 0


def test_asyncio_many_producers_consumers_every_uid_acked_once() -> None:
    async def run() -> list[int]:
        q = TransferQueue(capacity=256)
        q.register_stage("s", ["response"])
        acked: list[int] = []
        holding: set[int] = set()

        async def produce(p: int) -> None:
            for i in range(0, N_SAMPLES // 8, 8):
                uids = await q.put(prompts(8, first_group=p * 10**6 + i), timeout=30.0)
                await asyncio.sleep(0)
                for uid in uids:
                    q.write(uid, {"response": uid}, version=0)

        async def consume(seed: int) -> None:
            rng = random.Random(seed)
            while True:
                roll = rng.random()
                expire = roll < 0.03  # take with a short lease and let it run out
                try:
                    lease = await q.take(
                        "s", rng.randint(1, 16), timeout=30.0, lease_s=0.01 if expire else 30.0
                    )
                except QueueClosed:
                    return
                mine = {s.uid for s in lease.samples}
                if expire:
                    await asyncio.sleep(0.03)
                    assert not q.ack(lease, remove=True)
                    continue
                assert not mine & holding, "delivered twice concurrently"
                holding.update(mine)
                await asyncio.sleep(0)
                holding.difference_update(mine)
                if roll < 0.13:
                    q.release(lease)
                elif q.ack(lease, remove=True):
                    acked.extend(mine)

        consumers = [asyncio.ensure_future(consume(c)) for c in range(16)]
        await asyncio.gather(*(produce(p) for p in range(8)))
        while q.size() > 0:
            await asyncio.sleep(0.01)
        q.close()
        await asyncio.wait_for(asyncio.gather(*consumers), 30)
        return acked

    check_consumption(asyncio.run(run()), N_SAMPLES)


def test_thread_producers_feed_asyncio_consumers() -> None:
    q = TransferQueue(capacity=128)
    q.register_stage("s", ["response"])

    def produce(p: int) -> None:
        for i in range(0, N_SAMPLES // 8, 8):
            uids = q.put_blocking(prompts(8, first_group=p * 10**6 + i), timeout=30.0)
            for uid in uids:
                q.write(uid, {"response": uid})

    async def run() -> list[int]:
        acked: list[int] = []

        async def consume() -> None:
            while True:
                try:
                    lease = await q.take("s", 16, timeout=30.0)
                except QueueClosed:
                    return
                assert q.ack(lease, remove=True)
                acked.extend(s.uid for s in lease.samples)

        consumers = [asyncio.ensure_future(consume()) for _ in range(8)]
        producers = [threading.Thread(target=produce, args=(p,)) for p in range(8)]
        for t in producers:
            t.start()
        await asyncio.to_thread(lambda: [t.join(60) for t in producers])
        while q.size() > 0:
            await asyncio.sleep(0.01)
        q.close()
        await asyncio.wait_for(asyncio.gather(*consumers), 30)
        return acked

    check_consumption(asyncio.run(run()), N_SAMPLES)


# ----------------------------------------------------------------------------- samplers
def test_balance_by_length_balances_sums_and_fills_every_bin() -> None:
    lengths = [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    bins = balance_by_length(lengths, 3)
    assert sorted(i for b in bins for i in b) == list(range(10))
    sums = [sum(lengths[i] for i in b) for b in bins]
    assert max(sums) - min(sums) <= 1
    assert all(balance_by_length([0, 0, 0, 5], 4))
    assert balance_by_length([3, 1], 3) == [[0], [1], []]


def test_split_sequential_keeps_order_and_sizes_within_one() -> None:
    assert split_sequential(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_sequential(2, 3) == [[0], [1], []]


def test_take_each_gives_one_lease_per_sample_in_one_call() -> None:
    q = TransferQueue()
    q.register_stage("rollout", ["prompt"])
    q.put_blocking(prompts(5))

    async def scenario() -> list[Lease]:
        return await q.take_each("rollout", 3, timeout=5)

    leases = asyncio.run(scenario())
    assert [uids_of(lease) for lease in leases] == [[0], [1], [2]]
    # each lease ends on its own: completing one leaves the others leased
    assert q.complete(leases[1], {1: {"response": "x"}})
    assert q.in_flight("rollout") == 2 and q.ready_count("rollout") == 2
    q.release(leases[0])
    assert q.ready_count("rollout") == 3

    async def rest() -> list[Lease]:
        return await q.take_each("rollout", 10, timeout=5)

    assert [uids_of(lease) for lease in asyncio.run(rest())] == [[0], [3], [4]]  # priority order


def test_take_each_nowait_takes_what_is_ready_without_waiting() -> None:
    q = TransferQueue()
    q.register_stage("rollout", ["prompt"])
    assert q.take_each_nowait("rollout", 4) == []  # nothing ready: no lease, no wait
    q.put_blocking(prompts(3))
    leases = q.take_each_nowait("rollout", 2, fields_extra=["answer"])
    assert [uids_of(lease) for lease in leases] == [[0], [1]]
    assert q.in_flight("rollout") == 2 and q.ready_count("rollout") == 1
    assert [uids_of(lease) for lease in q.take_each_nowait("rollout", 5)] == [[2]]
    assert q.take_each_nowait("rollout", 5) == []
    q.release(leases[1])
    assert [uids_of(lease) for lease in q.take_each_nowait("rollout", 5)] == [[1]]  # released: served again
    q.close()
    with pytest.raises(QueueClosed):
        q.take_each_nowait("rollout", 1)


def test_complete_and_take_writes_one_sample_and_leases_the_next() -> None:
    q = TransferQueue()
    q.register_stage("rollout", ["prompt"])
    q.register_stage("reward", ["response"], groups=True)
    q.put_blocking(prompts(3))
    first, second = q.take_each_nowait("rollout", 2)
    written, nxt = q.complete_and_take(first, {"response": "a"}, version=3, stage="rollout", fields_extra=["answer"])
    assert written and nxt is not None and uids_of(nxt) == [2]
    assert q.in_flight("rollout") == 2 and q.ready_count("rollout") == 0
    s0 = q._samples[0]
    assert s0.fields["response"] == "a" and s0.version == 3 and s0.consumed & q._stages["rollout"].bit
    # an ended lease writes nothing (its sample may be someone else's), but the slot still refills
    q.release(second)
    written, nxt = q.complete_and_take(second, {"response": "late"}, version=0, stage="rollout")
    assert not written and nxt is not None and uids_of(nxt) == [1]
    assert "response" not in q._samples[1].fields
    written, none = q.complete_and_take(nxt, {"response": "b"}, version=None, stage="rollout")
    assert written and none is None and q._samples[1].version is None  # nothing ready: no lease
    q.close()  # closed: the write lands, no next lease
    s2 = q._samples[2]
    assert q.complete_and_take(first_lease_of(q, 2), {"response": "c"}, version=None, stage="rollout") == (True, None)
    assert s2.fields["response"] == "c"


def first_lease_of(q: TransferQueue, uid: int) -> Lease:
    """A stand-in `Lease` for the live lease the store holds on `uid` (same id)."""
    lid = q._samples[uid].taken["rollout"]
    return Lease(lid, "rollout", [], [], 0.0)


def test_complete_and_take_refuses_misuse_and_leaves_the_lease_live() -> None:
    q = TransferQueue()
    q.register_stage("rollout", ["prompt"])
    q.register_stage("reward", ["response"], groups=True)
    q.put_blocking(prompts(3))
    pair = q.take_nowait("rollout", 2, min_samples=2)
    assert pair is not None
    with pytest.raises(ValueError, match="holds 2 samples"):
        q.complete_and_take(pair, {"response": "x"}, version=None, stage="rollout")
    (one,) = q.take_each_nowait("rollout", 1)
    with pytest.raises(ValueError, match="whole groups"):
        q.complete_and_take(one, {"response": "x"}, version=None, stage="reward")
    with pytest.raises(ValueError, match="not registered"):
        q.complete_and_take(one, {"response": "x"}, version=None, stage="nope")
    assert q.in_flight("rollout") == 3 and all("response" not in s.fields for s in q._samples.values())
    assert q.complete(pair, {0: {"response": "y"}}) and q.complete(one, {2: {"response": "z"}})


def test_a_write_makes_ready_only_the_stages_that_read_its_fields() -> None:
    q = TransferQueue()
    q.register_stage("a", ["x"])
    q.register_stage("b", ["x", "y"])
    q.register_stage("c", [])  # no fields: ready at once
    (uid,) = q.put_blocking(prompts(1))
    assert (q.ready_count("a"), q.ready_count("b"), q.ready_count("c")) == (0, 0, 1)
    q.write(uid, {"y": 1})
    assert (q.ready_count("a"), q.ready_count("b")) == (0, 0)
    q.write(uid, {"x": 2})
    assert (q.ready_count("a"), q.ready_count("b")) == (1, 1)
    lease = q.take_nowait("b", 1)
    assert lease is not None and lease.samples[0].fields == {"x": 2, "y": 1}


def test_complete_writes_then_acks_and_refuses_an_ended_lease() -> None:
    clock = FakeClock()
    q = TransferQueue(clock=clock, lease_timeout_s=10)
    q.register_stage("rollout", ["prompt"])
    q.register_stage("reward", ["response"])
    q.put_blocking(prompts(2))
    lease = q.take_nowait("rollout", 1)
    assert lease is not None and q.complete(lease, {0: {"response": "a"}}, versions={0: 3})
    got = q.take_nowait("reward", 5)
    assert got is not None and [(s.uid, s.version) for s in got.samples] == [(0, 3)]
    q.ack(got)
    late = q.take_nowait("rollout", 1)
    assert late is not None
    clock.t += 11  # the lease ran out: its result must not land (the sample may be someone else's)
    assert not q.complete(late, {1: {"response": "b"}})
    assert q.ready_count("reward") == 0 and q.ready_count("rollout") == 1


def _recount(q: TransferQueue) -> tuple[dict[str, int], dict[str, int]]:
    """Depth and leased per stage, counted from scratch from the samples and groups."""
    depth: dict[str, int] = {}
    leased: dict[str, int] = {}
    for name, st in q._stages.items():
        def ready(s: Any, st: Any = st) -> bool:  # every field the stage reads is written
            return all(f in s.fields for f in st.fields)

        if st.groups:
            depth[name] = 0
            for g in q._groups.values():
                members = [q._samples[u] for u in g.uids]
                if (members and len(members) == g.size - g.removed and all(ready(m) for m in members)
                        and name not in g.leased and name not in g.consumed):
                    depth[name] += len(members)
        else:
            depth[name] = sum(1 for s in q._samples.values()
                              if ready(s) and name not in s.taken and not s.consumed & st.bit)
        leased[name] = sum(1 for s in q._samples.values() if name in s.taken)
    return depth, leased


def test_counts_stay_exact_under_random_takes_writes_releases_and_removals() -> None:
    """Model check of the readiness index: after every random operation (sample and group takes,
    completes, write-and-refills, releases, plain and removing acks, single removals, whole-group removals) each
    stage's depth and leased count equal a recount from scratch, and sample takes come in
    (priority, uid) order."""
    rng = random.Random(7)
    q = TransferQueue(capacity=10_000)
    q.register_stage("gen", ["prompt"])
    q.register_stage("score", ["resp"], groups=True)
    q.register_stage("train", ["resp", "reward"], groups=True)
    leases: list[Lease] = []
    gid = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.15:
            kind = rng.random()
            if kind < 0.4:  # one object listed 4 times (the feeder's form)
                q.put_blocking([NewSample(gid, 4, {"prompt": gid}, priority=float(rng.randint(0, gid)))] * 4)
            elif kind < 0.5:  # already answered: ready for the group stage "score" at once (not for "gen")
                q.put_blocking([NewSample(gid, 4, {"resp": 0}) for _ in range(4)])
            else:
                q.put_blocking([NewSample(gid, 4, {"prompt": gid}) for _ in range(4)])
            gid += 1
        elif op < 0.35:
            k = rng.randint(1, 3)
            # served lowest (priority, uid) first, also after releases (which go back out of order)
            want = sorted((s.priority, s.uid) for s in q._samples.values()
                          if "prompt" in s.fields and "gen" not in s.taken and not s.consumed & q._stages["gen"].bit)[:k]
            got_gen = q.take_each_nowait("gen", k)
            assert [lease.samples[0].uid for lease in got_gen] == [uid for _, uid in want]
            leases.extend(got_gen)
        elif op < 0.45:
            for stage in ("score", "train"):
                got = q.take_nowait(stage, 8)
                if got is not None:
                    leases.append(got)
        elif op < 0.8 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            choice = rng.random()
            if choice < 0.2:
                q.release(lease)
            elif lease.stage == "gen" and choice < 0.6:  # the rollout hot path: write and refill
                want = min(((s.priority, s.uid) for s in q._samples.values() if "prompt" in s.fields
                            and "gen" not in s.taken and not s.consumed & q._stages["gen"].bit), default=None)
                _, nxt = q.complete_and_take(lease, {"resp": 1}, version=None, stage="gen")
                assert (nxt and nxt.samples[0].uid) == (want and want[1])
                if nxt is not None:
                    leases.append(nxt)
            elif lease.stage == "gen":
                q.complete(lease, {s.uid: {"resp": 1} for s in lease.samples})
            elif lease.stage == "score":
                q.complete(lease, {s.uid: {"reward": 1.0} for s in lease.samples}, remove=choice > 0.9)
            else:
                q.ack(lease, remove=choice > 0.3)
        elif q._samples:
            uids = list(q._samples)
            if rng.random() < 0.5:
                q.remove([rng.choice(uids)])
            else:  # a whole group, the trainer's usual removal
                g = q._samples[rng.choice(uids)].group_id
                q.remove(list(q._groups[g].uids))
        depth, leased = _recount(q)
        m = q.metrics()
        for name in ("gen", "score", "train"):
            assert m[f"depth/{name}"] == depth[name], (name, m, depth)
            assert m[f"leased/{name}"] == leased[name], (name, m, leased)
    assert gid > 300 and q.metrics()["samples"] > 0


def test_a_put_wakes_the_takes_waiting_for_its_stages() -> None:
    """A put's samples wake takes already waiting for them, one waiter per ready sample stage (a
    put counts the samples of each stage its fields make ready, then wakes that stage's waiters)."""
    q = TransferQueue()
    q.register_stage("gen", ["prompt"])
    q.register_stage("also", ["prompt"])

    async def run() -> list[list[int]]:
        waiting = [asyncio.create_task(q.take(stage, 4, min_samples=4, timeout=30)) for stage in ("gen", "also")]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in waiting)
        await q.put([NewSample(0, 4, {"prompt": "p"})] * 4)
        leases = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        return [[s.uid for s in lease.samples] for lease in leases]

    assert asyncio.run(run()) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_drop_all_empties_a_closed_store_and_reports_each_removal() -> None:
    removed: list[dict[str, Any]] = []
    q = TransferQueue(on_remove=removed.append)
    q.register_stage("gen", ["prompt"])
    q.put_blocking(prompts(6, group_size=2))
    lease = q.take_nowait("gen", 2)
    assert lease is not None
    with pytest.raises(RuntimeError, match="still open"):
        q.drop_all()
    assert q.size() == 6  # refused: nothing dropped
    q.close()
    assert q.drop_all() == 6
    assert len(removed) == 6 and q.size() == 0
    m = q.metrics()
    assert m["depth/gen"] == 0 and m["leased/gen"] == 0
    assert not q.ack(lease)  # its lease ended with the store's contents


def test_a_group_take_views_only_the_stage_fields_and_the_extras_asked_for() -> None:
    q = TransferQueue()
    q.register_stage("score", ["resp"], groups=True)
    uids = q.put_blocking([NewSample(0, 2, {"prompt": "p", "resp": 1, "big": [0] * 100}) for _ in range(2)])
    q.write(uids[1], {"note": "n"})
    lease = q.take_nowait("score", 2, fields_extra=["prompt", "missing"])
    assert lease is not None
    assert [s.fields for s in lease.samples] == [{"resp": 1, "prompt": "p"}, {"resp": 1, "prompt": "p"}]
    q.release(lease)
    # a stage whose names cover every field a sample has gets all of them (a copy)
    full = q.take_nowait("score", 2, fields_extra=["prompt", "big", "note"])
    assert full is not None and full.samples[1].fields == {"prompt": "p", "resp": 1, "big": [0] * 100, "note": "n"}
    assert full.samples[0].fields == {"prompt": "p", "resp": 1, "big": [0] * 100}
    full.samples[0].fields["resp"] = 99  # a view is a copy: the store keeps its own
    q.release(full)
    again = q.take_nowait("score", 2)
    assert again is not None and [s.fields for s in again.samples] == [{"resp": 1}, {"resp": 1}]


def test_a_put_that_fails_validation_leaves_the_store_as_it_was() -> None:
    """Fields and priority are checked with everything else before the first sample is admitted: a
    bad one used to fail half way, admitting the samples before it unannounced (their group could
    then never be completed: a retry was refused as 'more than group_size')."""
    q = TransferQueue(capacity=16)
    q.register_stage("s", ["x"])
    for bad, err in ((NewSample(0, 2, None), TypeError), (NewSample(0, 2, {"x": 2}, priority="high"), ValueError),  # type: ignore[arg-type]
                     (NewSample(0, 2, {"x": 2}, priority=float("nan")), ValueError)):
        with pytest.raises(err, match="group 0: "):
            q.put_blocking([NewSample(0, 2, {"x": 1}), bad])
        assert q.size() == 0 and q.ready_count("s") == 0
    assert len(q.put_blocking([NewSample(0, 2, {"x": 1}), NewSample(0, 2, {"x": 2})])) == 2  # the retry goes in
    first = q.reserve_uids(2)
    with pytest.raises(ValueError, match=f"uid {first} is in use"):
        q.put_blocking([NewSample(1, 2, {"x": 1}, uid=first), NewSample(1, 2, {"x": 2}, uid=first)])
    assert q.size() == 2
    for n in (0, -2):
        with pytest.raises(ValueError, match="reserve_uids: n must be an int >= 1"):
            q.reserve_uids(n)


def test_group_ids_and_sizes_are_checked_before_a_put_admits_anything() -> None:
    """One put naming a new group with two sizes made a group that holds more samples than its size
    and is never complete (held its room for good); a str group id failed half way through the
    put, after the samples before it were admitted; a fractional size never completes either."""
    q = TransferQueue(capacity=16)
    q.register_stage("s", ["x"])
    q.register_stage("g", ["x"], groups=True)
    for samples, message in (
        ([NewSample(7, 1, {"x": 1}), NewSample(7, 2, {"x": 2})], "group 7: group_size 2 != 1 put before"),
        ([NewSample(0, 1, {"x": 1}), NewSample("g1", 1, {"x": 2})], "group_id must be an int >= 0, got 'g1'"),  # type: ignore[arg-type]
        ([NewSample(True, 1, {"x": 1})], "group_id must be an int"),
        ([NewSample(3, 2.5, {"x": 1})], r"group 3: group_size must be an int >= 1, got 2.5"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError, match=message):
            q.put_blocking(samples)
        assert q.size() == 0 and q.ready_count("s") == 0 and q.state_dict()["next_uid"] == 0
    q.put_blocking([NewSample(np.int64(7), 2, {"x": 1}), NewSample(7, 2, {"x": 2})])  # (a numpy int is an int)
    lease = q.take_nowait("g", 2)
    assert lease is not None and sorted(s.fields["x"] for s in lease.samples) == [1, 2]


def test_a_reserved_uid_is_put_once_even_after_its_sample_is_removed() -> None:
    """A client uid whose sample was trained and removed could be put again (a retried put would be
    trained twice): only reserved, never-used uids are accepted."""
    q = TransferQueue(capacity=16)
    q.register_stage("s", ["x"])
    first = q.reserve_uids(3)
    q.put_blocking([NewSample(0, 1, {"x": 1}, uid=first)])
    q.remove([first])
    assert q.size() == 0
    with pytest.raises(ValueError, match=f"uid {first} is in use, was used before"):
        q.put_blocking([NewSample(1, 1, {"x": 1}, uid=first)])
    with pytest.raises(ValueError, match="never reserved"):
        q.put_blocking([NewSample(1, 1, {"x": 1}, uid=first + 3)])  # one past the range
    q.put_blocking([NewSample(1, 1, {"x": 1}, uid=first + 2), NewSample(2, 1, {"x": 1}, uid=first + 1)])
    second = q.reserve_uids(2)  # the first range is all used and forgotten; a second one works alike
    q.put_blocking([NewSample(3, 1, {"x": 1}, uid=second + 1)])
    for uid in (first, first + 1, second + 1):
        with pytest.raises(ValueError, match=f"uid {uid} is in use"):
            q.put_blocking([NewSample(4, 1, {"x": 1}, uid=uid)])
    q.put_blocking([NewSample(4, 1, {"x": 1}, uid=second)])
    assert q.size() == 4 and q.ready_count("s") == 4


def test_take_each_leases_whole_groups_and_refuses_a_budget_below_one() -> None:
    q = TransferQueue(capacity=32)
    q.register_stage("g", ["prompt"], groups=True)
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(8, group_size=4))
    leases = q.take_each_nowait("g", 8)
    assert [sorted(s.group_id for s in lease.samples) for lease in leases] == [[0] * 4, [1] * 4]
    for budget in (0, -1):
        with pytest.raises(ValueError, match="min_samples <= max_samples"):
            q.take_each_nowait("s", budget)


def test_take_each_gives_one_lease_per_group_when_group_sizes_differ() -> None:
    """Each lease held as many samples as the largest group, so small groups shared leases (one
    episode task would have got two groups); and a budget below the largest size took nothing."""
    q = TransferQueue(capacity=32)
    q.register_stage("g", ["prompt"], groups=True)
    q.put_blocking(prompts(4, group_size=4) + prompts(4, group_size=2, first_group=1) + prompts(1, first_group=3))
    with pytest.raises(ValueError, match="max_samples 3 < group_size 4"):  # as `take`
        q.take_each_nowait("g", 3)
    leases = q.take_each_nowait("g", 7)  # groups 0 and 1; group 2 would go over the budget
    assert [[s.group_id for s in lease.samples] for lease in leases] == [[0] * 4, [1] * 2]
    leases = q.take_each_nowait("g", 8)
    assert [[s.group_id for s in lease.samples] for lease in leases] == [[2] * 2, [3]]
    assert q.take_each_nowait("g", 8) == []


def test_a_lease_that_expires_wakes_a_waiter_that_started_waiting_before_it_existed() -> None:
    """The waiter's wake time (the next lease expiry) was worked out once, when it began to wait with
    no lease in the store: a lease taken later and abandoned was never reaped, and the waiter slept to
    its own timeout (for ever with none)."""

    async def main() -> tuple[list[int], float]:
        q = TransferQueue(capacity=16, lease_timeout_s=600)
        q.register_stage("s", ["x"])
        start = time.monotonic()
        waiter = asyncio.create_task(q.take("s", 2, min_samples=2, timeout=None))
        await asyncio.sleep(0.05)
        await q.put([NewSample(0, 1, {"x": 0})])
        assert q.take_nowait("s", 1, lease_s=0.2) is not None  # its holder dies: the lease runs out at 0.2 s
        await q.put([NewSample(1, 1, {"x": 1})])
        lease = await asyncio.wait_for(waiter, 30)  # (a bound for the test itself, far above 0.2 s)
        return sorted(s.uid for s in lease.samples), time.monotonic() - start

    got, _ = asyncio.run(main())
    assert got == [0, 1]


def test_a_lease_of_the_default_term_leaves_a_waiter_that_began_with_no_lease_asleep() -> None:
    """A waiter that began waiting with no lease in the store wakes by then + lease_timeout_s, the
    soonest a lease of the default term taken later can expire: such a lease leaves it asleep. (Every
    waiter used to be woken by the first lease taken after the store had none, to retry and fail:
    each idle rollout worker, at each sync step's start.) A shorter lease still wakes it (above)."""

    async def main() -> int:
        q = TransferQueue(capacity=16, lease_timeout_s=600)
        q.register_stage("a", ["x"])
        q.register_stage("b", ["y"])
        tries = 0
        take = q._take_or_wait

        def counted(*args: Any) -> Any:
            nonlocal tries
            tries += args[-1] is not None  # (a waiting take's try; `take_nowait` passes None)
            return take(*args)

        q._take_or_wait = counted  # type: ignore[method-assign]
        waiter = asyncio.create_task(q.take("a", 1, timeout=None))
        await asyncio.sleep(0.01)
        assert tries == 1
        await q.put([NewSample(0, 1, {"y": 0})])
        assert q.take_nowait("b", 1) is not None  # a lease of the default term (600 s)
        await asyncio.sleep(0.01)
        waiting_tries = tries
        await q.put([NewSample(1, 1, {"x": 1})])
        assert uids_of(await asyncio.wait_for(waiter, 30)) == [1]
        return waiting_tries

    assert asyncio.run(main()) == 1


def _store_counting_tries(workers: int) -> tuple[TransferQueue, list[int]]:
    """A store with stage `s` (field `x`) that counts each waiting take's tries by the taking task's
    name (`"0"`..): the count of worker i is `tries[i]`."""
    q = TransferQueue(capacity=16)
    q.register_stage("s", ["x"])
    tries = [0] * workers
    take = q._take_each_or_wait

    def counted(*args: Any) -> Any:
        task = asyncio.current_task()
        if args[-1] is not None and task is not None:  # (a waiting take's try, by the worker's task)
            tries[int(task.get_name())] += 1
        return take(*args)

    q._take_each_or_wait = counted  # type: ignore[method-assign]
    return q, tries


def test_a_put_wakes_only_the_takers_its_samples_serve_counting_their_room() -> None:
    """A rollout worker waits for one slot's worth, and its other slots free up meanwhile; woken, it
    takes that one, then at once fills the rest. A put woke a waiting worker per sample (each asked
    for one), and all but the first then found nothing (at 1,024 rollout workers in PIPE, a third of
    a failed retry per sample). With `room` (its free slots when woken) the put's samples wake the
    first worker only; the others stay asleep, in order, until more samples come."""

    async def main() -> tuple[list[int], list[int]]:
        q, tries = _store_counting_tries(3)

        async def worker() -> int:
            leases = await q.take_each("s", 1, timeout=30, room=lambda: 4)
            more = q.take_each_nowait("s", 3)  # its other free slots, filled at once
            return len(leases) + len(more)

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(worker(), name=str(i)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        await q.put([NewSample(g, 1, {"x": g}) for g in range(4)])
        await asyncio.sleep(0.01)
        assert [t.done() for t in tasks] == [True, False, False]
        await q.put([NewSample(g, 1, {"x": g}) for g in range(4, 12)])
        return [await asyncio.wait_for(t, 30) for t in tasks], tries

    served, tries = asyncio.run(main())
    assert served == [4, 4, 4]
    assert tries == [2, 2, 2]  # each: its first try, and the one its put woke


def test_a_deferred_taker_is_asked_again_after_the_ones_woken_before_it_have_taken_theirs() -> None:
    """Three workers wait for one slot each, with room for four. A put of four wakes the first; the
    other two are deferred. A second put of four comes before the deferred ones are looked at: the
    second worker is woken for its room (four), and the third, which those four would not leave
    enough for, is asked again once the second has taken. The second takes only two (its room
    shrank), so the third is woken then, from the same puts, not left asleep until a later one."""

    async def main() -> tuple[list[int], list[int]]:
        q, tries = _store_counting_tries(3)

        async def worker(fills: int) -> int:
            leases = await q.take_each("s", 1, timeout=30, room=lambda: 4)
            more = q.take_each_nowait("s", fills)
            return len(leases) + len(more)

        tasks = []
        for i, fills in enumerate([3, 1, 3]):
            tasks.append(asyncio.create_task(worker(fills), name=str(i)))
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        await q.put([NewSample(g, 1, {"x": g}) for g in range(4)])
        await q.put([NewSample(g, 1, {"x": g}) for g in range(4, 8)])  # (before the deferred are looked at)
        return [await asyncio.wait_for(t, 5) for t in tasks], tries

    served, tries = asyncio.run(main())
    assert served == [4, 2, 2]
    assert tries == [2, 2, 2]


def test_counters_count_an_expired_lease_as_expired_before_anything_else_calls_the_store() -> None:
    clock = FakeClock()
    q = TransferQueue(lease_timeout_s=10.0, clock=clock)
    q.register_stage("s", ["prompt"])
    q.put_blocking(prompts(2))
    assert q.take_nowait("s", 1) is not None
    clock.t += 11.0
    assert (q.ready_count("s"), q.in_flight("s"), q.metrics()["expired_leases"]) == (2, 0, 1.0)


def test_a_take_that_waited_while_its_owners_process_died_hands_nothing_out() -> None:
    """Ray: a rollout actor's `take_each` waits in the store controller; the actor dies and is
    restarted (same actor id) and its leases are given back (`release_owner`). When samples come,
    the dead process's take must not lease them to the owner: nothing would renew or complete them
    (the new process does not know them) until lease_timeout_s, 600 s by default."""
    from asyncflow.transfer_queue.ray_store import StoreController

    async def main() -> None:
        c = StoreController(capacity=64, lease_timeout_s=600)
        c.register_stage("rollout", ["prompt_ids"], False)
        c.register_stage("reward", ["prompt_ids", "reward"], False)
        old_each = asyncio.ensure_future(c.take_each("rollout", 4, 30, None, None, (), "actor-A"))
        old_take = asyncio.ensure_future(c.take("rollout", 4, 1, 30, None, None, (), "actor-A"))
        await asyncio.sleep(0.01)
        c.release_owner("actor-A")  # the restart's give-back, before any data came
        await c.put(([0] * 4, [4] * 4, [0.0] * 4, [None] * 4), [{"prompt_ids": [1]}] * 4, None, None, None, 5)
        assert await old_each == []
        with pytest.raises(WaitTimeout, match="its caller's process died"):
            await old_take
        assert c.q.in_flight("rollout") == 0 and c.q.ready_count("rollout") == 4
        assert c.lease_owner == {}
        fresh = await c.take_each("rollout", 4, 5, None, None, (), "actor-A")  # the new process takes them
        assert len(fresh) == 4 and set(c.lease_owner.values()) == {"actor-A"}

    asyncio.run(main())


def test_the_store_controller_lets_go_of_blobs_no_sample_holds() -> None:
    """Ray: a put that fails (a full store's timeout) admits nothing, and a completion whose sample
    was removed meanwhile is skipped: their object-store blobs were kept (with their ref) all run."""
    from asyncflow.transfer_queue.ray_store import StoreController

    async def main() -> None:
        c = StoreController(capacity=2, lease_timeout_s=600)
        c.register_stage("rollout", ["prompt_ids"], False)
        c.register_stage("reward", ["prompt_ids", "response_ids"], False)
        put = ([0, 0], [2, 2], [0.0, 0.0], [None, None])
        await c.put(put, [{"prompt_ids": [1]}] * 2, None, None, None, 5)
        with pytest.raises(WaitTimeout):  # the store is full: nothing admitted
            await c.put(([1, 1], [2, 2], [1.0, 1.0], [None, None]), None, ["prompt_ids"], np.array([[8], [8]]),
                        ["ref-of-a-blob"], 0.05)
        assert c.blobs == {}
        leases = await c.take_each("rollout", 2, 5, None, None, (), None)
        (lid, _, _, part, _), _ = leases[0]
        uid = int(part[0][0])
        c.remove([uid])  # (e.g. its group was dropped)
        assert c.complete(lid, "rollout", [uid], None, ["response_ids"], np.array([[8]]), ["ref-of-a-blob"], None,
                          False)
        assert c.blobs == {}

    asyncio.run(main())


def test_the_leases_a_dead_owner_held_are_counted_whoever_gave_them_back() -> None:
    """The restart's line says how many leases went back to the queue. The store's owner watch often
    gives them back first (within 2 s of the death); the restart's own `release_owner` then finds
    none, and a before/after total read around it said 0. `released_of` counts per owner."""
    from asyncflow.transfer_queue.ray_store import StoreController

    async def main() -> None:
        c = StoreController(capacity=64, lease_timeout_s=600)
        c.register_stage("rollout", ["prompt_ids"], False)
        await c.put(([0] * 4, [4] * 4, [0.0] * 4, [None] * 4), [{"prompt_ids": [1]}] * 4, None, None, None, 5)
        assert len(await c.take_each("rollout", 3, 5, None, None, (), "actor-A")) == 3
        assert c.release_owner("actor-A") == 3  # the owner watch saw it die
        assert c.release_owner("actor-A") == 0  # the restart's give-back: nothing left
        assert c.released_of("actor-A") == 3 and c.released_of("actor-B") == 0

    asyncio.run(main())


def test_takers_woken_in_turn_take_what_a_put_brings_in_the_order_they_waited() -> None:
    """A put wakes only the takers its samples can serve; the others keep their turn and are
    served by later puts, in order; a woken taker cancelled before it retries leaves its samples
    to the next one."""

    async def main() -> None:
        q = TransferQueue()
        q.register_stage("gen", ["prompt"])
        takers = [asyncio.create_task(q.take_each("gen", 2, timeout=5)) for _ in range(4)]
        await asyncio.sleep(0)
        q.put_blocking(prompts(2))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert [t.done() for t in takers] == [True, False, False, False]
        assert [uids_of(lease) for lease in takers[0].result()] == [[0], [1]]
        q.put_blocking(prompts(2, first_group=2))
        takers[1].cancel()  # woken by this put, cancelled before it retries
        for _ in range(3):
            await asyncio.sleep(0)
        assert takers[1].cancelled() and takers[2].done() and not takers[3].done()
        assert [uids_of(lease) for lease in takers[2].result()] == [[2], [3]]
        q.put_blocking(prompts(1, first_group=4))
        assert [uids_of(lease) for lease in await takers[3]] == [[4]]
        assert q.metrics()["depth/gen"] == 0 and q.metrics()["leased/gen"] == 5

    asyncio.run(main())
