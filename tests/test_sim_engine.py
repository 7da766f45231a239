"""The simulated continuous-batching engine on the virtual clock: timing, batching, weight modes."""

from __future__ import annotations

import asyncio

import pytest

from asyncflow.engines.base import GenRequest
from asyncflow.engines.sim import EOS, SimEngine
from asyncflow.virtual_loop import VirtualClock, run_virtual


def _req(uid: int, max_new: int = 1000) -> GenRequest:
    return GenRequest(uid, [5, 6, 7], max_new)


def test_equal_requests_take_batches_times_steps() -> None:
    async def main(clock: VirtualClock):
        engine = SimEngine(clock, lengths=lambda rng: 10, capacity=64, step_s=0.03)
        results = await asyncio.gather(*(engine.generate(_req(i)) for i in range(128)))
        return clock.now(), results, engine

    end, results, engine = run_virtual(main)
    assert end == pytest.approx(2 * 10 * 0.03)  # two full batches of 64, ten decode steps each
    assert all(len(r.response_ids) == 10 and r.response_ids[-1] == EOS and r.finish_reason == "stop" for r in results)
    assert engine.steps == 20 and engine.busy_seconds() == pytest.approx(end)


def test_a_short_request_leaves_early_and_its_slot_is_refilled() -> None:
    lengths = iter([100, 5, 5])

    async def main(clock: VirtualClock):
        engine = SimEngine(clock, lengths=lambda rng: next(lengths), capacity=2, step_s=1.0)
        finished: dict[int, float] = {}

        async def one(uid: int) -> None:
            await engine.generate(_req(uid))
            finished[uid] = clock.now()

        await asyncio.gather(one(0), one(1), one(2))
        return finished

    finished = run_virtual(main)
    # 1 ends after 5 steps; 2 takes its slot at once and ends 5 steps later; 0 runs on to 100
    assert finished == {1: pytest.approx(5.0), 2: pytest.approx(10.0), 0: pytest.approx(100.0)}


def test_max_new_tokens_cuts_without_eos() -> None:
    async def main(clock: VirtualClock):
        engine = SimEngine(clock, lengths=lambda rng: 50, step_s=0.01)
        return await engine.generate(_req(0, max_new=8))

    res = run_virtual(main)
    assert len(res.response_ids) == 8 and res.finish_reason == "length" and EOS not in res.response_ids


@pytest.mark.parametrize("mode", ["swap", "drain", "abort"])
def test_weight_modes_keep_per_token_versions_right(mode: str) -> None:
    async def main(clock: VirtualClock):
        engine = SimEngine(clock, lengths=lambda rng: 20, capacity=4, step_s=1.0, load_s=2.0)
        running = [asyncio.ensure_future(engine.generate(_req(i))) for i in range(4)]
        await clock.sleep(5.5)  # five tokens in
        load = asyncio.ensure_future(engine.load_weights(None, 1, mode))
        await clock.sleep(0.1)
        late = await engine.generate(_req(99, max_new=3))
        return await asyncio.gather(*running), late, await load, engine

    results, late, load_s, engine = run_virtual(main)
    assert engine.version == 1
    for res in results:
        v = res.token_versions
        assert len(v) == 20 and v == sorted(v) and v[0] == 0
        if mode == "drain":
            assert set(v) == {0}  # finished on the old weights; the load waited for them
        else:
            assert v.count(0) in (5, 6) and v[-1] == 1  # the rest came from the new weights
    assert set(late.token_versions) == {1}
    # drain: waits for the 14-15 remaining steps, then 2 s of loading; swap/abort: about the load alone
    assert load_s == pytest.approx(16.5 if mode == "drain" else 2.5, abs=1.0)


def test_cancel_older_than_ends_only_requests_with_old_tokens() -> None:
    async def main(clock: VirtualClock):
        engine = SimEngine(clock, lengths=lambda rng: 100, capacity=2, step_s=1.0)
        old = asyncio.ensure_future(engine.generate(_req(0)))
        await clock.sleep(3.5)
        await engine.load_weights(None, 1, "swap")
        fresh = asyncio.ensure_future(engine.generate(_req(1, max_new=4)))
        await clock.sleep(0.1)
        assert engine.cancel_older_than(1) == 1
        return await old, await fresh

    old, fresh = run_virtual(main)
    assert old.finish_reason == "cancelled" and 3 <= len(old.response_ids) < 100
    assert fresh.finish_reason == "length" and set(fresh.token_versions) == {1}


def test_the_cpu_meter_counts_cpu_time_not_time_spent_waiting_for_a_core() -> None:
    """It summed elapsed time: on a busy machine every moment the process waited for a core inside a
    simulated section was subtracted as simulation CPU, halving the reported scheduler cost (54 us
    against 112 with a busy loop sharing the core). Waiting (here: sleeping) now counts nothing."""
    import time

    from asyncflow.engines.sim import CpuMeter, meter_overhead_s

    meter = CpuMeter()
    with meter:
        time.sleep(0.2)
    with meter:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
    assert meter.entries == 2 and 0.05 <= meter.seconds < 0.15
    assert 0.0 <= meter_overhead_s(2_000) < 1e-4
