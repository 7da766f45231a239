"""PIPE: the real pipeline driven by simulated engines on a virtual clock (small, fast settings)."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from typing import Any

import pytest

from asyncflow.bench.pipeline import (
    _capped_lognormal_mean,
    _lognormal_sigma,
    make_profile,
    run_pipeline,
    split_devices,
)
from asyncflow.errors import UserError

DESIGN_KEYS = {"profile", "devices", "runtime", "mode", "rollout_devices", "train_devices", "samples_per_s",
               "ideal_samples_per_s", "efficiency", "rollout_busy_frac", "train_busy_frac", "scheduler_us_per_sample"}


def test_rlvr_pipe_rows_async_beats_sync_within_the_staleness_bound() -> None:
    rows = run_pipeline(["profiles=rlvr", "devices=4", "steps=3", "warmup_steps=1", "prompts_per_device=8"])
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"sync", "async"}
    for r in rows:
        assert set(r) >= DESIGN_KEYS
        assert r["samples"] == 3 * 4 * 8 * 8  # steps x devices x prompts/device x n, all trained
        assert 0 < r["efficiency"] <= 1.1 and r["ideal_samples_per_s"] == pytest.approx(4 / (2104.5 * (0.03 / 64 + 0.15e-3)), rel=1e-3)
        assert 0 < r["scheduler_us_per_sample"] < 20_000
        # one request per sample (a request ended at the run's end may not have been written)
        assert r["scheduler_us_per_request"] == pytest.approx(r["scheduler_us_per_sample"], rel=0.05)
    sync, asyn = by_mode["sync"], by_mode["async"]
    assert sync["staleness_max"] == 0 and 1 <= asyn["staleness_max"] <= 2
    assert (sync["rollout_devices"], sync["train_devices"]) == (4, 4)
    assert asyn["rollout_devices"] + asyn["train_devices"] == 4
    assert asyn["efficiency"] > sync["efficiency"] and asyn["speedup_vs_sync"] > 1.5


def test_agentic_pipe_runs_multi_turn_episodes(caplog: pytest.LogCaptureFixture) -> None:
    import gc

    rows = run_pipeline(["profiles=agentic", "devices=2", "steps=2", "warmup_steps=1", "prompts_per_device=2",
                         "modes=async"])
    gc.collect()
    # every task of the run ended with it (the episodes' deadline sweeper once outlived its loop)
    assert "Task was destroyed but it is pending" not in caplog.text
    (r,) = rows
    assert r["samples"] == 2 * 2 * 2 * 8
    # episodes of 5-20 turns of 100-300 tokens: trained tokens per sample near the profile's 2,500
    assert 1500 < r["mean_tokens_trained"] < 3500 and r["mean_tokens_profile"] == 2500
    assert r["staleness_max"] <= 2
    # an episode is 5-20 requests (turns): its scheduler cost per request is that much smaller
    assert 4 <= r["scheduler_us_per_sample"] / r["scheduler_us_per_request"] <= 25


def test_capped_lognormal_mean_matches_sampling() -> None:
    sigma = _lognormal_sigma(20.0)
    rng = random.Random(0)
    draws = [min(16_384, rng.lognormvariate(math.log(1000), sigma)) for _ in range(200_000)]
    assert _capped_lognormal_mean(1000, sigma, 16_384) == pytest.approx(sum(draws) / len(draws), rel=0.02)
    p99 = sorted(rng.lognormvariate(math.log(1000), sigma) for _ in range(200_000))[int(0.99 * 200_000)]
    assert p99 == pytest.approx(20_000, rel=0.1)  # p99 = 20x the median
    assert make_profile("rlvr").mean_tokens == pytest.approx(2104.5, rel=1e-3)


def test_split_devices_balances_rollout_and_training() -> None:
    rollout, train = split_devices(64, 0.9866, 0.3157)
    assert (rollout, train) == (48, 16)
    assert split_devices(2, 1.0, 1.0) == (1, 1)


@pytest.mark.parametrize(
    ("arg", "message"),
    [("bogus=1", "bogus=1"), ("devices=x", "devices"), ("steps=1", "steps"), ("profiles=chat", "chat"),
     ("modes=fast", "modes"), ("slots=abc", "slots"), ("split=yes", "split")],
)
def test_bad_bench_pipeline_settings_exit_2_with_one_line(arg: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        run_pipeline([arg])
    proc = subprocess.run([sys.executable, "-m", "asyncflow", "bench", "pipeline", "--set", arg],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bench_pipeline_json_is_the_last_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow", "bench", "pipeline", "--json", "--set", "profiles=rlvr", "--set", "devices=2",
         "--set", "steps=2", "--set", "warmup_steps=1", "--set", "prompts_per_device=2"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["workload"] == "PIPE" and [r["mode"] for r in doc["rows"]] == ["sync", "async"]


@pytest.mark.parametrize("affinity", [True, False])
def test_affinity_routes_a_prompts_samples_to_one_least_loaded_worker(affinity: bool, tmp_path) -> None:
    """Queue scheduling spreads a prompt's n samples over the workers; `rollout.affinity` keeps them on
    one (the least loaded at admission), while every worker still gets work."""
    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import VirtualClock, run_virtual

    seen: dict[int, set[int]] = {}  # group -> workers that generated its samples

    class Recording(SimEngine):
        index = 0

        def start_generate(self, request):  # type: ignore[no-untyped-def]  # (generate goes through it too)
            seen.setdefault(request.uid // 8, set()).add(self.index)
            return super().start_generate(request)

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=8", "train.batch_size=64", "train.max_steps=4", "rollout.workers=3",
                                    "rollout.max_batch=4", "rollout.max_new_tokens=50", f"rollout.affinity={affinity}"])
        engines = []
        for i in range(3):
            e = Recording(clock, lengths=lambda rng: rng.randint(1, 40), capacity=4, seed=i)
            e.index = i
            engines.append(e)
        log = RunLog(tmp_path, metrics=False)
        trainer = SimTrainer(clock, token_s=1e-3, devices=1)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(64)], tokenizer=_SimTokenizer(), reward_fn=_reward, engines=engines,
            trainer=trainer, loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0))
        await pipeline.run()
        log.close()

    run_virtual(main)
    assert len(seen) >= 32
    spread = [len(w) for w in seen.values()]
    if affinity:
        assert max(spread) == 1
    else:
        assert max(spread) > 1
    assert set().union(*seen.values()) == {0, 1, 2}


def test_gc_threshold_holds_for_the_run_and_is_restored(tmp_path) -> None:
    """`workflow.gc_threshold` sets the young-generation threshold while the pipeline runs (seen from
    inside a train step) and puts the process's own setting back afterwards, also after a failure. A
    run that ends well frees its own store's leftovers first (counted in the final accounting); a
    failed one leaves them in place."""
    import gc

    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import VirtualClock, run_virtual
    from asyncflow.workflow.gate import StalenessGate

    seen: list[int] = []
    pipelines: list[Any] = []

    async def main(clock: VirtualClock, fail: bool) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=4", "train.batch_size=16", "train.max_steps=2", "rollout.max_batch=4",
                                    "rollout.max_new_tokens=20", "workflow.gc_threshold=123457"])
        trainer = SimTrainer(clock, token_s=1e-3, devices=1)
        log = RunLog(tmp_path, metrics=False)

        class Watching:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            async def step(self, *args: Any) -> Any:
                seen.append(gc.get_threshold()[0])
                if fail:
                    raise RuntimeError("train step failed")
                return await self.inner.step(*args)

        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(16)], tokenizer=_SimTokenizer(), reward_fn=_reward,
            engines=[SimEngine(clock, lengths=lambda rng: rng.randint(1, 20), capacity=4)], trainer=trainer,
            loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0),
            gate=StalenessGate(4, cfg.staleness, 5, clock))  # admits past the last step: leftovers
        pipeline.trainer.learner = Watching(pipeline.trainer.learner)
        pipelines.append(pipeline)
        try:
            await pipeline.run()
        finally:
            log.close()

    before = gc.get_threshold()
    assert before[0] != 123457
    run_virtual(lambda clock: main(clock, fail=False))
    assert seen == [123457, 123457] and gc.get_threshold() == before
    accounting = pipelines[-1].final_accounting
    assert accounting["in_store_at_end"] > 0 and accounting["lost"] == 0
    assert pipelines[-1].store.size() == 0
    with pytest.raises(RuntimeError, match="train step failed"):
        run_virtual(lambda clock: main(clock, fail=True))
    assert seen[-1] == 123457 and gc.get_threshold() == before
    assert pipelines[-1].store.size() > 0


def test_child_tasks_first_error_stops_their_stage_loop() -> None:
    """`Children`: the first child that fails cancels the loop, which ends with that error (not a bare
    cancellation); later failures are not raised over it; the other children are cancelled."""
    import asyncio

    from asyncflow.workflow.flight import Children

    ended: list[str] = []

    async def child(name: str, delay: float, error: BaseException | None) -> None:
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            ended.append(f"{name} cancelled")
            raise
        if error is not None:
            raise error

    async def loop() -> None:
        kids = Children()
        released: list[int] = []
        kids.spawn(child("first", 0.01, ValueError("first failure")), lambda t: released.append(1))
        kids.spawn(child("second", 0.02, KeyError("second failure")))
        kids.spawn(child("slow", 60, None))
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            assert released == [1]  # on_done ran for the failed child
            kids.reraise()
            raise
        finally:
            kids.cancel_all()

    async def main() -> None:
        with pytest.raises(ValueError, match="first failure"):
            await asyncio.wait_for(loop(), 5)
        await asyncio.sleep(0)

    asyncio.run(main())
    assert "slow cancelled" in ended and "second cancelled" in ended


def test_a_failing_on_done_does_not_hide_the_childs_error() -> None:
    """`on_done` and the error check share one done callback: when `on_done` raises, the child's own
    error still stops the loop, and the child leaves the set."""
    import asyncio

    from asyncflow.workflow.flight import Children

    def broken(task: asyncio.Task[None]) -> None:
        raise RuntimeError("on_done failed")

    async def failing() -> None:
        raise ValueError("the child's error")

    async def loop() -> Children:
        kids = Children()
        kids.spawn(failing(), broken)
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            assert not kids.tasks
            kids.reraise()
            raise
        return kids

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: None)  # (the on_done error is logged)
        with pytest.raises(ValueError, match="the child's error"):
            await asyncio.wait_for(loop(), 5)

    asyncio.run(main())


def test_an_episode_whose_generation_fails_ends_the_run_with_that_error(tmp_path) -> None:
    """A multi-turn episode is its own task; an engine error (not an environment's, which only ends
    its episode) stops the rollout worker and the run with the engine's message."""
    from asyncflow.bench.pipeline import (
        _env_factory,
        _reward,
        _SimTokenizer,
        make_profile,
        sim_pipeline,
    )
    from asyncflow.config import load_config
    from asyncflow.engines.sim import CpuMeter, SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import VirtualClock, run_virtual

    class Failing(SimEngine):
        def start_generate(self, request):  # type: ignore[no-untyped-def]
            if request.uid == 5 and len(request.prompt_ids) > 64:  # sample 5's second turn
                raise RuntimeError("engine lost its device")
            return super().start_generate(request)

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=4", "train.batch_size=16", "train.max_steps=2", "rollout.max_batch=4",
                                    "rollout.max_new_tokens=300"])
        trainer = SimTrainer(clock, token_s=1e-4, devices=1)
        log = RunLog(tmp_path, metrics=False)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(16)], tokenizer=_SimTokenizer(), reward_fn=_reward,
            engines=[Failing(clock, lengths=lambda rng: rng.randint(100, 300), capacity=4)], trainer=trainer,
            loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0),
            env_factory=_env_factory(make_profile("agentic"), CpuMeter()))
        try:
            await pipeline.run()
        finally:
            log.close()

    with pytest.raises(RuntimeError, match="engine lost its device"):
        run_virtual(main)


@pytest.mark.parametrize("affinity", [False, True])
def test_the_feeder_admits_what_the_credit_allows_in_one_put(affinity: bool, tmp_path) -> None:
    """A publication frees a step's credit at once: the feeder puts those prompts together (at most
    FEED_BURST per put, never past the credit), in draw order; with affinity routing one prompt a
    put, so each is routed after the previous one was counted. Every group is admitted once."""
    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.transfer_queue import TransferQueue
    from asyncflow.virtual_loop import VirtualClock, run_virtual
    from asyncflow.workflow.feeder import FEED_BURST

    puts: list[list[int]] = []  # the group ids of each put, in order
    over_credit: list[int] = []

    class Recording(TransferQueue):
        gate: Any = None

        async def put(self, samples, timeout=None):  # type: ignore[no-untyped-def]
            groups = list(dict.fromkeys(s.group_id for s in samples))
            assert all(len([s for s in samples if s.group_id == g]) == 8 for g in groups)
            if self.gate.credit() < 0:  # (admitted before the put: never more than the credit)
                over_credit.append(self.gate.credit())
            puts.append(groups)
            return await super().put(samples, timeout)

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=8", "train.batch_size=400", "train.max_steps=3", "rollout.workers=2",
                                    "rollout.max_batch=16", "rollout.max_new_tokens=50", f"rollout.affinity={affinity}",
                                    "workflow.max_staleness=1"])
        engines = [SimEngine(clock, lengths=lambda rng: rng.randint(1, 40), capacity=16, seed=i) for i in range(2)]
        store = Recording(capacity=4096, lease_timeout_s=1e5, clock=clock)
        log = RunLog(tmp_path, metrics=False)
        trainer = SimTrainer(clock, token_s=1e-3, devices=1)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(64)], tokenizer=_SimTokenizer(), reward_fn=_reward, engines=engines,
            trainer=trainer, loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0), store=store)
        store.gate = pipeline.gate
        await pipeline.run()
        log.close()

    run_virtual(main)
    flat = [g for p in puts for g in p]
    assert flat == list(range(len(flat))) and len(flat) >= 3 * 50  # each group once, in draw order
    assert not over_credit
    sizes = [len(p) for p in puts]
    if affinity:
        assert max(sizes) == 1
    else:
        assert FEED_BURST > 1 and max(sizes) == FEED_BURST  # the first credit (100 groups) comes in bursts of 32, 32, 32, 4
        assert len(puts) < len(flat) / 4


def test_split_attributes_ticks_to_the_part_running() -> None:
    """`SplitMeter`: a tick inside simulation code, a store call, a worker's callback, another
    callback or between callbacks goes to sim, store, workers, trainer, loop (ticks driven by hand)."""
    import asyncio
    import contextvars

    from asyncflow.bench.pipeline import _WORKER, SplitMeter
    from asyncflow.engines.sim import CpuMeter

    sim = CpuMeter()
    split = SplitMeter(sim)

    class Store:
        def write(self) -> None:
            split._tick(0, None)
            self.complete()  # a store call inside another: still the store's

        def complete(self) -> None:
            split._tick(0, None)

    store = Store()
    split.meter_store(store, ("write", "complete"))

    def worker_callback() -> None:
        split._tick(0, None)
        store.write()
        with sim:
            split._tick(0, None)
        split._tick(0, None)

    worker_ctx = contextvars.copy_context()
    worker_ctx.run(_WORKER.set, True)
    loop = asyncio.new_event_loop()
    try:
        split.run_handle(asyncio.Handle(worker_callback, (), loop, worker_ctx))
        split.run_handle(asyncio.Handle(lambda: split._tick(0, None), (), loop, contextvars.copy_context()))
    finally:
        loop.close()
    split._tick(0, None)
    assert split.ticks == {"sim": 1, "store": 2, "workers": 2, "trainer": 1, "loop": 1}
    parts = split.parts(sched_s=6e-6 * 10, samples=10)  # 6 us a sample over 6 non-simulation ticks
    assert {k: parts[k] for k in ("store_us_per_sample", "workers_us_per_sample", "trainer_us_per_sample",
                                  "loop_us_per_sample")} == {"store_us_per_sample": 2.0, "workers_us_per_sample": 2.0,
                                                             "trainer_us_per_sample": 1.0, "loop_us_per_sample": 1.0}


@pytest.mark.parametrize("profile", ["rlvr", "agentic"])
def test_split_rows_add_up_to_the_scheduler_total(profile: str) -> None:
    import signal

    def mine(*_: Any) -> None:  # a profiler of the caller's own: its handler and timer are put back after
        pass

    before = signal.signal(signal.SIGPROF, mine)
    signal.setitimer(signal.ITIMER_PROF, 1000.0, 1000.0)
    settings = [f"profiles={profile}", "devices=32" if profile == "rlvr" else "devices=8", "steps=2", "warmup_steps=1",
                "prompts_per_device=16" if profile == "rlvr" else "prompts_per_device=8", "modes=async"]
    try:
        (r,) = run_pipeline([*settings, "split=true"])
        timer, handler = signal.getitimer(signal.ITIMER_PROF), signal.getsignal(signal.SIGPROF)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, before)
    parts = [r[f"{k}_us_per_sample"] for k in ("store", "workers", "trainer", "loop")]
    # (the kernel delivers the CPU-time timer at its scheduler tick: ~4 ms on the dev VM, which
    # gives ~140 ticks for this rlvr run; a part holding ~30% of 50 ticks has none with p ~ 1e-8)
    assert r["split_ticks"] > 50 and all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(r["scheduler_us_per_sample"], abs=0.3)  # (each part rounded to 0.1)
    assert parts[0] > 0 and parts[1] > 0  # every sample passes through the store and a rollout worker
    if profile == "agentic":  # the episodes run in the rollout workers' tasks: most of the cost is theirs
        assert parts[1] > max(parts[0], parts[2])
    # the caller's profiling timer and handler are back as they were
    assert timer[1] == 1000.0 and 990.0 < timer[0] <= 1000.0 and handler is mine
    (plain,) = run_pipeline(settings)
    assert "store_us_per_sample" not in plain and plain["efficiency"] == r["efficiency"]  # (virtual time unchanged)


def test_split_marks_every_store_entry_point_the_store_has() -> None:
    """`_STORE_CALLS` names methods of the real store (a renamed one would silently go unmarked)."""
    from asyncflow.bench.pipeline import _STORE_CALLS
    from asyncflow.transfer_queue.store import TransferQueue

    assert all(callable(getattr(TransferQueue, name, None)) for name in _STORE_CALLS)


def test_split_refuses_a_verifier_thread() -> None:
    """A verifier thread's CPU is in the total but its ticks reach the loop's thread, which is then
    waiting for it: it was charged to loop and trainer."""
    with pytest.raises(UserError, match="split=true: needs reward=async"):
        run_pipeline(["split=true", "reward=thread"])


def test_flight_wakes_its_worker_once_enough_slots_are_free() -> None:
    """`Flight.free(at_least)` (a rollout worker refilling in batches) sleeps through releases that
    free fewer slots and returns the number free once enough are; at most `limit` are ever asked for."""
    import asyncio

    from asyncflow.clock import RealClock
    from asyncflow.workflow.flight import Flight

    async def main() -> list[tuple[str, int]]:
        flight = Flight(8, lambda start: None, RealClock())
        for _ in range(8):
            flight.acquire()
        seen: list[tuple[str, int]] = []

        async def worker() -> None:
            seen.append(("free", await flight.free(3)))

        task = asyncio.create_task(worker())
        for i in range(4):
            await asyncio.sleep(0)
            seen.append(("released", i + 1))
            flight.release()
        await asyncio.wait_for(task, 5)
        for _ in range(4):
            flight.release()
        seen.append(("all free", await flight.free(100)))
        return seen

    assert asyncio.run(main()) == [("released", 1), ("released", 2), ("released", 3), ("free", 3),
                                   ("released", 4), ("all free", 8)]



def _sim_run(tmp_path, settings: list[str], store: Any = None, trainer: Any = None, on_trained: Any = None) -> None:
    """The sim pipeline on a virtual clock: one engine of 8 slots, 64 prompts, `settings` on top
    (`on_trained(pipeline)`: the pipeline's `on_trained` hook)."""
    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import VirtualClock, run_virtual

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=4", "train.batch_size=32", "train.max_steps=3", "rollout.max_batch=8",
                                    "rollout.max_new_tokens=50", *settings])
        engines = [SimEngine(clock, lengths=lambda rng: rng.randint(1, 40), capacity=8, seed=0)]
        log = RunLog(tmp_path, metrics=False)
        sim = SimTrainer(clock, token_s=1e-3, devices=1) if trainer is None else trainer(clock)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(64)], tokenizer=_SimTokenizer(), reward_fn=_reward, engines=engines,
            trainer=sim, loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0),
            store=None if store is None else store(clock))
        if on_trained is not None:
            pipeline.trainer.on_trained = lambda: on_trained(pipeline)
        await pipeline.run()
        log.close()

    run_virtual(main)


def test_the_trainer_takes_each_batch_in_one_lease(tmp_path) -> None:
    """Groups finish one by one, yet the trainer leases each step's batch in one take, woken when the
    last group it needs is scored (sync mode: nothing stale or left over, so one take a step)."""
    from asyncflow.transfer_queue import TransferQueue

    leases: list[int] = []  # samples per trainer lease

    class Recording(TransferQueue):
        async def take(self, stage, max_samples, **kw):  # type: ignore[no-untyped-def]
            lease = await super().take(stage, max_samples, **kw)
            if stage == "train":
                leases.append(len(lease.samples) + len(lease.expired))
            return lease

    _sim_run(tmp_path, ["workflow.mode=sync"], store=lambda clock: Recording(capacity=4096, lease_timeout_s=1e5,
                                                                             clock=clock))
    assert leases == [32, 32, 32]


def test_a_step_s_samples_leave_the_store_before_its_weights_are_published(tmp_path) -> None:
    """`on_trained` runs once a step, after the step's ack and before its publication: the store then
    holds none of the step's samples (nothing leased to the trainer, all of them logged), and the
    engine still has the weights the step trained."""
    seen: list[tuple[float, int, int, int]] = []

    def on_trained(pipeline: Any) -> None:
        m = pipeline.store.metrics()
        seen.append((m["leased/train"], pipeline.counters.trained, pipeline.version, pipeline.engines[0].version))

    _sim_run(tmp_path, ["workflow.mode=sync"], on_trained=on_trained)
    assert seen == [(0.0, 32, 0, 0), (0.0, 64, 1, 1), (0.0, 96, 2, 2)]


@pytest.mark.parametrize("blocks", [True, False])
def test_a_blocking_export_runs_in_a_worker_thread_and_a_reference_inline(blocks: bool, tmp_path) -> None:
    """`export_blocks`: an export that copies the weights runs off the event loop; one that only hands
    out a reference (the Ray trainer's) runs on it, without a thread hop per step."""
    import threading

    from asyncflow.engines.sim import SimTrainer

    threads: list[bool] = []  # per export: whether it ran on the event loop's thread

    class Exporting(SimTrainer):
        export_blocks = blocks

        def export_weights(self) -> dict[str, Any]:
            threads.append(threading.current_thread() is threading.main_thread())
            return {}

    _sim_run(tmp_path, [], trainer=lambda clock: Exporting(clock, token_s=1e-3, devices=1))
    assert threads == [not blocks] * 3
