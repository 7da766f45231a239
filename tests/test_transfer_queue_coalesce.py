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
    timer.arm(0.0)  # armed already: no second timer, and the first keeps its delay
    assert timer.armed and timer._armings == 1 and fires.count == 0
    timer.cancel()  # (the 60 s timer: so the test does not wait for it)
    timer.arm(0.001)
    assert fires.wait_for(1) and not timer.armed  # it disarmed itself before it fired
    timer.arm(0.001)  # fired: the next item arms a new one
    assert fires.wait_for(2) and fires.count == 2


def test_a_send_now_cancels_the_timer() -> None:
    """The owner's own send cancels: a cancelled timer never fires, and the next item arms again."""
    fires = _Fires()
    timer = CoalesceTimer(fires)
    timer.arm(60.0)
    timer.cancel()
    assert not timer.armed
    timer.cancel()  # (nothing armed: nothing to do)
    timer.arm(0.001)
    assert fires.wait_for(1)
    assert fires.count == 1  # only the second arming fired


def test_a_timer_cancelled_while_it_wakes_up_fires_nothing() -> None:
    """The owner's send and the timer's wake-up can race: the owner holds its lock while it sends
    and cancels, the timer waits for that lock in `fire`; a stale wake-up must not send again."""
    fires = _Fires()
    timer = CoalesceTimer(fires)
    timer.arm(60.0)
    stale = timer._armings
    timer.cancel()
    timer._run(stale)  # (what a timer thread that was already waking up runs)
    timer.arm(60.0)
    timer._run(stale)  # an older arming's wake-up does not fire the new arming either
    assert fires.count == 0 and timer.armed
    timer.cancel()


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
