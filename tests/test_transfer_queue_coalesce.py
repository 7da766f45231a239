"""The Ray store client's coalescing without Ray: the timer that sends a lone item (`coalesce`) and
the queue of updates that ride on the next take (`op_queue`), driven with fake send functions."""

from __future__ import annotations

import asyncio
import threading

from asyncflow.transfer_queue.coalesce import CoalesceTimer
from asyncflow.transfer_queue.op_queue import Op, OpQueue


class _Fires:
    """A fire callback that counts its calls and signals each one."""

    def __init__(self) -> None:
        self.count = 0
        self.cond = threading.Condition()

    def __call__(self) -> None:
        with self.cond:
            self.count += 1
            self.cond.notify_all()

    def wait_for(self, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.count >= n, timeout=10.0)


def test_the_timer_fires_once_per_arming_however_often_it_is_armed() -> None:
    fires = _Fires()
    timer = CoalesceTimer(fires)
    timer.arm(60.0)
    timer.arm(0.0)  # armed already: the first arming keeps its delay
    assert timer.armed and fires.count == 0
    timer.cancel()  # (the 60 s arming: so the test does not wait for it)
    timer.arm(0.001)
    assert fires.wait_for(1) and not timer.armed  # it disarmed itself before it fired
    timer.arm(0.001)  # fired: the next item arms it again
    assert fires.wait_for(2) and fires.count == 2


def test_a_send_now_cancels_the_timer() -> None:
    """The owner's own send cancels: a cancelled arming never fires, and the next item arms again."""
    fires = _Fires()
    timer = CoalesceTimer(fires)
    timer.arm(0.05)
    timer.cancel()
    assert not timer.armed
    timer.cancel()  # (nothing armed: nothing to do)
    timer.arm(0.2)
    assert fires.wait_for(1)
    assert fires.count == 1  # only the second arming fired, once


def test_one_thread_serves_a_burst_of_armings_and_ends_when_idle() -> None:
    """An arming does not start a thread while the last one still runs; an idle timer's thread ends
    (`IDLE_EXIT_S`) and the next arming starts another."""
    fires = _Fires()
    timer = CoalesceTimer(fires)
    timer.arm(0.001)
    assert fires.wait_for(1)
    first = timer._thread
    timer.arm(0.001)
    assert fires.wait_for(2) and timer._thread is first is not None
    first.join(timeout=10.0)
    assert not first.is_alive() and timer._thread is None
    timer.arm(0.001)
    assert fires.wait_for(3) and timer._thread is not first


class _Calls:
    """A fake `apply` call: records each batch of updates sent and returns a ref-like number."""

    def __init__(self) -> None:
        self.batches: list[list[Op]] = []
        self.cond = threading.Condition()

    def __call__(self, ops: list[Op]) -> int:
        with self.cond:
            self.batches.append(ops)
            self.cond.notify_all()
            return len(self.batches)

    def wait_for(self, n: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.batches) >= n, timeout=10.0)


def test_acks_and_renews_ride_after_a_take_and_other_updates_first_in_order() -> None:
    calls = _Calls()
    queue = OpQueue(calls, coalesce_s=60.0)  # (a plain thread: acks wait for the 60 s timer)
    queue.add("ack", (1,))
    queue.add("renew", ([1], None))
    assert queue.carried() == ([], [("ack", (1,)), ("renew", ([1], None))])
    assert queue.carried() == ([], [])  # taken: each update rides once
    assert calls.batches == []


def test_any_other_update_sends_all_first_in_order_and_unsettles_takes() -> None:
    calls = _Calls()
    queue = OpQueue(calls, coalesce_s=60.0, ride_along_s=60.0)

    async def on_loop() -> tuple[list[Op], list[Op]]:  # (on a loop nothing is sent before the take)
        queue.add("ack", (1,))
        queue.add("write", (7, "x"))
        queue.add("ack", (2,))
        return queue.carried()

    assert asyncio.run(on_loop()) == ([("ack", (1,)), ("write", (7, "x")), ("ack", (2,))], [])
    assert calls.batches == [] and not queue.unsettled
    queue.add("release", (3, "s"))  # a plain thread's update other than ack: sent at once
    assert calls.batches == [[("release", (3, "s"))]] and queue.unsettled and queue.unanswered == 1
    queue.add("ack", (4,))
    assert queue.carried() == ([], [])  # the release is unanswered: nothing rides, the take waits
    assert queue.drain() == [1, 2]  # the caller waits for both (the ack sent now) ...
    assert calls.batches[-1] == [("ack", (4,))]
    assert not queue.unsettled and queue.unanswered == 0  # ... so the next take need not
    queue.add("ack", (5,))
    assert queue.carried(blocked=True) == ([], [])  # the client's puts are unanswered
    assert queue.carried() == ([], [("ack", (5,))])


def test_a_plain_thread_s_ack_goes_out_alone_after_coalesce_s_and_a_send_cancels_that() -> None:
    calls = _Calls()
    queue = OpQueue(calls, coalesce_s=60.0)
    queue.add("ack", (1,))
    queue.send()  # sent now: the 60 s timer is cancelled
    assert calls.batches == [[("ack", (1,))]] and not queue._timer.armed
    queue.coalesce_s = 0.001
    queue.add("ack", (2,))
    queue.add("renew", ([2], None))
    assert calls.wait_for(2)
    assert calls.batches == [[("ack", (1,))], [("ack", (2,)), ("renew", ([2], None))]]


def test_on_a_loop_updates_wait_ride_along_s_or_coalesce_s_while_a_take_waits() -> None:
    calls = _Calls()
    queue = OpQueue(calls, coalesce_s=0.001, ride_along_s=60.0)

    async def main() -> None:
        queue.add("write", (1, "a"))
        await asyncio.sleep(0)
        assert calls.batches == []  # waits up to ride_along_s for a take to carry it
        queue.send()
        with queue.taking():  # a take waits in the controller: the next update goes after coalesce_s
            queue.add("write", (2, "b"))
            while len(calls.batches) < 2:  # (the loop's timer sends it: bounded by the wait_for below)
                await asyncio.sleep(0.001)

    asyncio.run(asyncio.wait_for(main(), 10.0))
    assert calls.batches == [[("write", (1, "a"))], [("write", (2, "b"))]]
