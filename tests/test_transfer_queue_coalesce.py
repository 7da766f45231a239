"""The Ray store client's coalescing without Ray: the timer that sends a lone item (`coalesce`) and
the queue of updates that ride on the next take (`op_queue`), driven with fake send functions."""

from __future__ import annotations

import threading

from asyncflow.transfer_queue.coalesce import CoalesceTimer


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
