"""The staleness gate: admission credit, drops, publications (also when they arrive out of order)."""

from __future__ import annotations

import asyncio

from asyncflow.clock import RealClock
from asyncflow.workflow.gate import StalenessGate


def test_credit_is_staleness_plus_one_steps_of_groups_and_drops_free_slots() -> None:
    gate = StalenessGate(groups_per_step=4, max_staleness=1, max_steps=10, clock=RealClock())
    assert gate.credit() == 8  # (k + 1) steps x 4 groups before anything is published
    for _ in range(8):
        gate.admit()
    assert gate.credit() == 0
    gate.drop(2)  # two groups will never be trained: two replacements may be admitted
    assert gate.credit() == 2
    gate.publish(1)
    assert gate.credit() == 6 and gate.min_version(3) == 2


def test_publish_never_goes_back_so_remote_updates_may_arrive_out_of_order() -> None:
    gate = StalenessGate(groups_per_step=2, max_staleness=0, max_steps=10, clock=RealClock())
    gate.publish(3)
    gate.publish(2)  # a late message from an earlier publication
    assert gate.version == 3 and gate.credit() == 8


def test_credit_is_capped_by_max_steps_and_close_wakes_waiters() -> None:
    gate = StalenessGate(groups_per_step=2, max_staleness=4, max_steps=2, clock=RealClock())
    assert gate.credit() == 4  # never admit work for steps that will not run
    for _ in range(4):
        gate.admit()

    async def scenario() -> tuple[bool, bool]:
        timed_out = await gate.wait_for_credit(0.05)
        waiter = asyncio.ensure_future(gate.wait_for_credit(30))
        await asyncio.sleep(0.01)
        gate.close()
        return timed_out, await waiter

    assert asyncio.run(scenario()) == (False, False)


def test_redundancy_adds_extra_groups_of_credit() -> None:
    gate = StalenessGate(groups_per_step=4, max_staleness=0, max_steps=10, clock=RealClock(), extra=2)
    assert gate.credit() == 6  # one step's groups plus the two redundant ones
    for _ in range(6):
        gate.admit()
    gate.publish(1)
    assert gate.credit() == 4  # the redundant groups are still live until the trainer drops them
    gate.drop(2)
    assert gate.credit() == 6
