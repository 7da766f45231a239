"""The virtual-time event loop: sleeps cost no wall time, thread work stops the clock, and the real
store and staleness gate keep their timeouts in virtual seconds."""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import NewSample, TransferQueue
from asyncflow.virtual_loop import VirtualClock, run_virtual


def test_an_hour_of_concurrent_sleeps_takes_no_wall_time() -> None:
    order: list[tuple[str, float]] = []

    async def main(clock: VirtualClock) -> float:
        async def sleeper(name: str, seconds: float) -> None:
            await clock.sleep(seconds)
            order.append((name, clock.now()))

        await asyncio.gather(sleeper("b", 3600.0), sleeper("a", 5.0), sleeper("c", 60.0))
        return clock.now()

    t0 = time.monotonic()
    end = run_virtual(main)
    assert time.monotonic() - t0 < 2.0
    assert end == pytest.approx(3600.0)
    assert order == [("a", pytest.approx(5.0)), ("c", pytest.approx(60.0)), ("b", pytest.approx(3600.0))]


def test_timeouts_fire_in_virtual_seconds() -> None:
    async def main(clock: VirtualClock) -> float:
        with pytest.raises(WaitTimeout, match="virtual s waiting for the slow thing"):
            await clock.wait_for(clock.sleep(100.0), 7.0, "the slow thing")
        return clock.now()

    assert run_virtual(main) == pytest.approx(7.0)


def test_thread_work_does_not_advance_virtual_time() -> None:
    async def main(clock: VirtualClock) -> tuple[float, float, float]:
        sleeper = asyncio.ensure_future(clock.sleep(1.0))
        before = clock.now()
        await asyncio.to_thread(time.sleep, 0.05)  # real work of unknown virtual duration
        after = clock.now()
        await sleeper
        return before, after, clock.now()

    before, after, end = run_virtual(main)
    assert before == after == 0.0  # the pending 1 s sleep did not fire while the thread ran
    assert end == pytest.approx(1.0)



def test_timers_run_in_time_order_equal_times_in_the_order_set_and_cancelled_ones_never() -> None:
    """The loop's own timer heap: due order, first-set-first-run at equal times, cancelled timers
    skipped (including after mass cancellation compacts the heap), and virtual time jumps straight
    to each timer."""

    async def main(clock: VirtualClock) -> tuple[list[tuple[str, float]], float]:
        loop = asyncio.get_running_loop()
        ran: list[tuple[str, float]] = []
        for name in ("t1", "t2", "t3"):  # three timers at the same time
            loop.call_later(5.0, lambda n=name: ran.append((n, clock.now())))
        loop.call_later(2.0, lambda: ran.append(("early", clock.now())))
        doomed = [loop.call_later(3.0 + i * 1e-3, lambda i=i: ran.append((f"doomed {i}", clock.now()))) for i in range(500)]
        for h in doomed:
            h.cancel()  # 500 of 504 pending timers cancelled: the heap is compacted
        await clock.sleep(10.0)
        return ran, clock.now()

    ran, end = run_virtual(main)
    assert ran == [("early", 2.0), ("t1", 5.0), ("t2", 5.0), ("t3", 5.0)]
    assert end == pytest.approx(10.0)


def test_a_callback_from_another_thread_runs_while_virtual_time_flies() -> None:
    """`call_soon_threadsafe` from a plain thread (no executor job) is served: the loop polls its
    self-pipe at least every millisecond of real time, jumping virtual time in between."""
    import threading

    async def main(clock: VirtualClock) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[float] = loop.create_future()
        t0 = time.monotonic()
        ticker = asyncio.ensure_future(_tick(clock, got, t0 + 10.0))  # keeps virtual time moving meanwhile
        threading.Timer(0.05, lambda: loop.call_soon_threadsafe(got.set_result, 1.0)).start()
        value = await got
        ticker.cancel()
        return value, time.monotonic() - t0

    value, real = run_virtual(main)
    assert value == 1.0 and real < 5.0


async def _tick(clock: VirtualClock, got: asyncio.Future[float], give_up_at: float) -> None:
    """Advance virtual time in small steps; fail `got` if the thread's callback never arrives (10 s real)."""
    while time.monotonic() < give_up_at:
        await clock.sleep(0.5)
    got.set_exception(AssertionError("the other thread's callback never ran"))

def test_store_take_waits_and_times_out_on_the_virtual_clock() -> None:
    async def main(clock: VirtualClock) -> tuple[float, float]:
        store = TransferQueue(clock=clock, lease_timeout_s=50.0)
        store.register_stage("s", ["x"])

        async def late_producer() -> None:
            await clock.sleep(20.0)
            await store.put([NewSample(0, 1, {"x": 1})])

        producer = asyncio.ensure_future(late_producer())
        lease = await store.take("s", 1, timeout=30.0)
        got_at = clock.now()
        await producer
        t0 = clock.now()
        with pytest.raises(WaitTimeout, match=r"timed out after 10.0 virtual s waiting for 1 sample\(s\) ready for stage 's'"):
            await store.take("s", 1, timeout=10.0)
        assert clock.now() == pytest.approx(t0 + 10.0)  # at its deadline, not at the lease's expiry
        # the unacked lease expires after 50 virtual seconds and the sample comes back
        again = await store.take("s", 1, timeout=100.0)
        assert [s.uid for s in again.samples] == [s.uid for s in lease.samples]
        return got_at, clock.now()

    got_at, end = run_virtual(main)
    assert got_at == pytest.approx(20.0)
    assert end == pytest.approx(70.0)


def test_swept_clock_bounds_many_waits_with_one_timer() -> None:
    from asyncflow.clock import SweptClock

    async def main(clock: VirtualClock):
        swept = SweptClock(clock)
        hang = asyncio.get_running_loop().create_future()  # never resolved

        async def bounded(timeout: float, work: float) -> tuple[str, float, int]:
            start = clock.now()
            try:
                await swept.wait_for(clock.sleep(work), timeout, f"work of {work:g} s")
                return "ok", clock.now() - start, asyncio.current_task().cancelling()
            except WaitTimeout as exc:
                return str(exc), clock.now() - start, asyncio.current_task().cancelling()

        long_first = asyncio.ensure_future(bounded(800.0, 10_000.0))  # the sweeper starts at a 100 s tick
        await clock.sleep(1.0)
        results = await asyncio.gather(bounded(8.0, 3.0), bounded(8.0, 100.0), bounded(40.0, 100.0), long_first)
        # a wait cancelled from outside is a cancellation, not a timeout
        outer = asyncio.ensure_future(swept.wait_for(hang, 100.0, "never"))
        await clock.sleep(1.0)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        await clock.sleep(50.0)
        return results, swept._waits, swept._sweeper

    results, waits, sweeper = run_virtual(main)
    ok, short, medium, long = results
    assert ok == ("ok", 3.0, 0)
    assert short[0] == "timed out after 8.0 virtual s waiting for work of 100 s" and 8.0 <= short[1] <= 9.0
    assert medium[0].startswith("timed out after 40.0 virtual s") and 40.0 <= medium[1] <= 45.0
    assert long[0].startswith("timed out after 800.0 virtual s") and 800.0 <= long[1] <= 900.0
    assert short[2] == medium[2] == long[2] == 0  # the timeout's cancel was taken back (uncancel)
    assert waits == {} and sweeper.done()  # nothing left waiting: the sweeper ended by itself


def test_swept_clock_keeps_one_sweeper_across_waits_that_end_at_once() -> None:
    """Waits that end before the sweeper first runs (an `async def` reward function that returns at
    once) share one sweeper, which lives a tick past the last wait and then ends by itself."""
    from asyncflow.clock import SweptClock

    async def instant() -> int:
        return 1

    async def main(clock: VirtualClock):
        swept = SweptClock(clock)
        sweepers = []
        for _ in range(20):
            assert await swept.wait_for(instant(), 80.0, "instant") == 1
            sweepers.append(swept._sweeper)
            await asyncio.sleep(0)  # the sweeper's first step runs
        still = not sweepers[-1].done()
        await clock.sleep(11.0)  # past one tick (80 / 8 s)
        return sweepers, still, swept._sweeper.done()

    sweepers, still, done = run_virtual(main)
    assert len({id(s) for s in sweepers}) == 1 and still and done
