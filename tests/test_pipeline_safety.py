"""Nothing lost, nothing trained twice, no stall: the real pipeline on a virtual clock (simulated
engines and trainer, as PIPE) under slow holders, failing environments and an aggressive filter."""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncflow.bench.pipeline import _SimTokenizer, sim_pipeline
from asyncflow.config import load_config
from asyncflow.engines.sim import SimEngine, SimTrainer
from asyncflow.envs.base import Env, EnvStep
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.virtual_loop import VirtualClock, run_virtual


def _parity(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    return [float(i % 2) for i in range(len(prompts))]


def _sim_run(tmp_path: Path, settings: list[str], *, token_s: float = 1e-3,
             lengths: Callable[[random.Random], int] = lambda rng: rng.randint(5, 50),
             reward_fn: Callable[..., list[float]] = _parity,
             env_factory: Callable[[VirtualClock], Env] | None = None,
             setup: Callable[[Any, VirtualClock], None] | None = None) -> tuple[Any, list[dict[str, Any]]]:
    """Run the sim pipeline to its end (`setup(pipeline, clock)` first); returns it and its
    samples.jsonl rows."""

    async def main(clock: VirtualClock) -> Any:
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", *settings])
        engines = [SimEngine(clock, lengths=lengths, capacity=8, step_s=0.03, load_s=1.0, seed=0)]
        trainer = SimTrainer(clock, token_s=token_s, devices=1)
        log = RunLog(tmp_path, metrics=False)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(512)], tokenizer=_SimTokenizer(), reward_fn=reward_fn,
            engines=engines, trainer=trainer, loss_fn=None, clock=clock, log=log,
            tracer=Tracer(now=clock.now, max_events=0), env_factory=env_factory)
        if setup is not None:
            setup(pipeline, clock)
        try:
            await pipeline.run()
        finally:
            log.close()
            await engines[0].close()
        return pipeline

    pipeline = run_virtual(main)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    return pipeline, rows


BASE = ["rollout.n=4", "train.batch_size=16", "train.max_steps=4", "workflow.max_staleness=1",
        "rollout.max_new_tokens=4096"]


def test_a_train_step_longer_than_the_lease_trains_every_sample_once(tmp_path: Path) -> None:
    """The trainer holds its batch's leases while it trains (here ~40 virtual s against a 20 s
    lease); they are renewed, so they neither expire under it nor come back to be trained again
    (which also freed their admission slots twice)."""
    pipeline, rows = _sim_run(tmp_path, [*BASE, "workflow.lease_timeout_s=20", "workflow.step_timeout_s=100000",
                                         "rollout.request_timeout_s=100000"], token_s=0.5)
    trained = collections.Counter(r["uid"] for r in rows if r["status"] == "trained")
    assert len(trained) == 64 and max(trained.values()) == 1
    assert pipeline.counters.trained == 64
    assert pipeline.store.metrics()["expired_leases"] == 0
    assert pipeline.final_accounting["lost"] == 0


def _collecting_ahead(pipeline: Any, clock: VirtualClock) -> None:
    """A `setup` under which the trainer, with the store in process, collects the next batch during a
    train step, as it does with the store in another process."""
    pipeline.trainer.collect_ahead = True


def _watch_train_takes(log: list[tuple[str, float, int, int]], *, remote: bool = True) -> Callable[[Any, VirtualClock], None]:
    """A `setup` that records each of the trainer's takes (`take`, time, the version then, its
    min_version) and each publication's start (`publish`, time, the version then, -1) in `log`;
    `remote`: with `_collecting_ahead`."""

    def setup(pipeline: Any, clock: VirtualClock) -> None:
        if remote:
            _collecting_ahead(pipeline, clock)
        take, publish = pipeline.store.take, pipeline.trainer.publish

        async def recorded_take(stage: str, *args: Any, **kwargs: Any) -> Any:
            if stage == "train":
                log.append(("take", clock.now(), pipeline.version, kwargs["min_version"]))
            return await take(stage, *args, **kwargs)

        async def recorded_publish(*args: Any) -> Any:
            log.append(("publish", clock.now(), pipeline.version, -1))
            return await publish(*args)

        pipeline.store.take, pipeline.trainer.publish = recorded_take, recorded_publish

    return setup


@pytest.mark.parametrize("remote", [True, False], ids=["store-in-another-process", "store-in-process"])
def test_the_next_batch_is_taken_while_a_step_trains_within_the_floor_of_the_version_it_publishes(
        tmp_path: Path, remote: bool) -> None:
    """With the store in another process, step k+1's batch is asked for as step k's training begins,
    not after it; its floor is that of version v+1, the version it trains from, so no trained sample
    is staler than max_staleness. In process it is asked for once step k's weights are exported
    (the trainer's version is then v+1)."""
    log: list[tuple[str, float, int, int]] = []
    pipeline, rows = _sim_run(tmp_path, BASE, token_s=0.5, setup=_watch_train_takes(log, remote=remote))
    events = [e[0] for e in log]
    if remote:
        assert events == ["take", "take", "publish", "take", "publish", "take", "publish", "publish"]
    else:
        assert events == ["take", "publish", "take", "publish", "take", "publish", "take", "publish"]
    takes = [(version, floor) for kind, _, version, floor in log if kind == "take"]
    # each step's floor is that of the version it trains from (0..3, less max_staleness 1), whenever
    # it was asked for: during the step before (the trainer still at the version before) or after it
    assert [floor for _, floor in takes] == [-1, 0, 1, 2]
    assert [version for version, _ in takes] == ([0, 0, 1, 2] if remote else [0, 1, 2, 3])
    trained = [r for r in rows if r["status"] == "trained"]
    assert len(trained) == 64 and max(r["trained_version"] - r["behavior_version"] for r in trained) <= 1
    assert pipeline.final_accounting["lost"] == 0


@pytest.mark.parametrize(("settings", "remote", "row_first"), [
    ([], True, [False, False, False]),
    (["checkpoint.every=2"], True, [False, True, False]),
    (["workflow.mode=sync", "workflow.max_staleness=0"], True, [True, True, True]),
    ([], False, [True, True, True]),
], ids=["async", "async-checkpoints", "sync", "async-store-in-process"])
def test_the_next_step_trains_while_the_engines_load_and_each_row_counts_its_own_step(
        tmp_path: Path, settings: list[str], remote: bool, row_first: list[bool]) -> None:
    """With the store and engines in other processes, in async mode step k+1's training begins
    before step k's weights are loaded (1 virtual s a load) and its row written; a step whose
    checkpoint is due, every sync step (its next batch needs the new version) and every step with the
    store in process have their row before the next step trains. Each row counts its own samples."""
    events: list[tuple[str, float, int]] = []

    def setup(pipeline: Any, clock: VirtualClock) -> None:
        if remote:
            _collecting_ahead(pipeline, clock)
        learner = pipeline.trainer.learner

        class Recorded:
            async def step(self, *args: Any) -> Any:
                events.append(("train", clock.now(), pipeline.version))
                return await learner.step(*args)

        async def on_step(result: Any) -> None:
            events.append(("row", clock.now(), pipeline.counters.trained))
            assert result.version == result.step and pipeline.gate.version == result.step

        pipeline.trainer.learner, pipeline.trainer.on_step = Recorded(), on_step

    _sim_run(tmp_path, [*BASE, *settings], token_s=0.05, setup=setup)
    trains = [e for e in events if e[0] == "train"]
    rows = [e for e in events if e[0] == "row"]
    assert [e[2] for e in trains] == [0, 1, 2, 3]  # (the trainer's version as each step begins)
    assert [e[2] for e in rows] == [16, 32, 48, 64]
    assert [rows[k][1] <= trains[k + 1][1] for k in range(3)] == row_first


def test_a_load_that_fails_ends_the_wait_for_the_next_batch_with_its_error(tmp_path: Path) -> None:
    """Sync mode, the store in another process: step 2's batch can only come after version 1 is
    loaded. The load fails; the trainer's wait for the batch ends with the load's error, not the
    batch timeout's."""

    def setup(pipeline: Any, clock: VirtualClock) -> None:
        _collecting_ahead(pipeline, clock)

        async def load_fails(state: Any, version: int, mode: str) -> None:
            raise RuntimeError(f"the engine could not load version {version}")

        pipeline.engines[0].load_weights = load_fails

    with pytest.raises(RuntimeError, match="could not load version 1"):
        _sim_run(tmp_path, [*BASE, "workflow.mode=sync", "workflow.max_staleness=0", "workflow.step_timeout_s=600"],
                 setup=setup)


def test_a_batch_taken_during_a_step_longer_than_the_batch_timeout_does_not_time_out(tmp_path: Path) -> None:
    """workflow.step_timeout_s bounds the trainer's own wait, not a train step: in sync mode the next
    batch cannot exist before the ~40 s step publishes, and the take asked for at its start (the store
    in another process) waits
    through it (longer than the 20 s timeout) without failing the run."""
    pipeline, rows = _sim_run(tmp_path, [*BASE, "workflow.mode=sync", "workflow.max_staleness=0",
                                         "workflow.step_timeout_s=20", "rollout.request_timeout_s=100000"],
                              token_s=0.5, setup=_collecting_ahead)
    assert sum(r["status"] == "trained" for r in rows) == 64
    assert pipeline.final_accounting["lost"] == 0


@pytest.mark.parametrize(("settings", "last_step"), [([], 3), (["checkpoint.every=2"], 2)],
                         ids=["mid-step", "checkpoint-step"])
def test_an_early_stop_gives_the_batch_taken_for_the_next_step_back(tmp_path: Path, settings: list[str],
                                                                     last_step: int) -> None:
    """A run stopped by step 2's hooks (eval.patience's early stop) ends after step 3, the step
    training meanwhile (after step 2 itself where its checkpoint is due: the trainer waits for its
    hooks), with the next step's batch in hand: its samples go back to the store, not held by a lease
    until the end."""
    log: list[tuple[str, float, int, int]] = []
    last: list[int] = []  # (what stop_early says the last step is)
    watch = _watch_train_takes(log)

    def setup(pipeline: Any, clock: VirtualClock) -> None:
        watch(pipeline, clock)

        async def on_step(result: Any) -> None:
            if result.step == 2:
                last.append(pipeline.stop_early())

        pipeline.trainer.on_step = on_step

    pipeline, rows = _sim_run(tmp_path, [*BASE, *settings], token_s=0.5, setup=setup)  # (the next batch is whole)
    assert sum(r["status"] == "trained" for r in rows) == 16 * last_step
    assert last == [last_step] and pipeline.last_step == last_step
    assert [e[0] for e in log].count("take") == last_step + 1  # (the next step's batch was taken)
    assert pipeline.store.in_flight("train") == 0
    assert pipeline.final_accounting["in_store_at_end"] >= 16 and pipeline.final_accounting["lost"] == 0


def test_an_episode_longer_than_the_lease_is_played_once(tmp_path: Path) -> None:
    """A 10-turn episode takes ~700 virtual s, longer than the default 600 s lease: it keeps its
    sample (renewed) instead of the sample being leased again and started over while it runs."""
    resets: collections.Counter[int] = collections.Counter()

    class SlowEnv(Env):
        name = "slow"
        max_turns = 10

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock
            self.turn = 0

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            resets[seed] += 1
            return ""

        async def step(self, action: str) -> EnvStep:
            await self.clock.sleep(50)
            self.turn += 1
            return EnvStep("", reward=float(self.turn % 2), done=self.turn >= 10)

    pipeline, rows = _sim_run(tmp_path, ["rollout.n=2", "train.batch_size=4", "train.max_steps=2",
                                         "workflow.max_staleness=1",
                                         "rollout.max_new_tokens=4096", "workflow.step_timeout_s=5000"],
                              lengths=lambda rng: 5000, env_factory=SlowEnv)
    assert pipeline.counters.trained == 8
    assert set(resets.values()) == {1}
    assert pipeline.store.metrics()["expired_leases"] == 0
    assert all(r["turns"] == 10 for r in rows if r["status"] == "trained")


def test_a_filter_that_drops_more_than_the_store_holds_does_not_stall(tmp_path: Path) -> None:
    """Every group has equal rewards, so the dynamic-sampling filter drops up to 4 x a step's groups
    before it lets some through: more than this store holds (48 samples). Dropped groups leave the
    store at once, so the feeder keeps admitting (before: the store filled with groups the trainer
    had dropped, and the run stopped with a store-full timeout)."""
    pipeline, rows = _sim_run(
        tmp_path, [*BASE, "train.max_steps=3", "algorithm.filter_groups=true", "workflow.store_capacity=1",
                   "workflow.step_timeout_s=500"], reward_fn=lambda prompts, completions, **_: [1.0] * len(prompts))
    assert pipeline.store.capacity == 48
    status = collections.Counter(r["status"] for r in rows)
    assert status["filtered"] == pipeline.counters.filtered > 48
    assert status["trained"] == pipeline.counters.trained == 48
    assert pipeline.final_accounting["lost"] == 0


def test_an_environment_failing_before_its_first_turn_costs_only_its_own_sample(tmp_path: Path) -> None:
    """An episode whose environment fails in `reset` has no generated token, hence no version. It is
    a reward_error kept out of the loss, logged with no reward; its group's other samples train
    (before: its version -1 put the whole group under the staleness floor, logged dropped_stale)."""

    class FlakyEnv(Env):
        name = "flaky"
        max_turns = 2

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            if seed % 8 == 3:  # one sample of every other group (n=4)
                raise RuntimeError("sandbox failed to start")
            return ""

        async def step(self, action: str) -> EnvStep:
            await self.clock.sleep(0.1)
            return EnvStep("", reward=float(len(action) % 2), done=True)

    pipeline, rows = _sim_run(tmp_path, [*BASE, "train.max_steps=3"], env_factory=FlakyEnv)
    failed = [r for r in rows if r["status"] == "reward_error"]
    assert failed and all("sandbox failed to start" in r["error"] and r["reward"] is None for r in failed)
    assert pipeline.counters.dropped_stale == 0
    by_group = collections.defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r["status"])
    for r in failed:
        assert sorted(by_group[r["group_id"]]) == ["reward_error", "trained", "trained", "trained"]


def test_a_filtered_group_logs_its_failed_samples_as_reward_errors(tmp_path: Path) -> None:
    """The dynamic-sampling filter drops a group whose valid rewards are all equal; a sample of it
    whose environment failed is logged (and counted) as `reward_error` with its own error, not as
    `filtered` with the filter's message."""

    class OneFails(Env):
        name = "onefails"
        max_turns = 1

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            if seed % 4 == 3:  # one sample of every group (n=4)
                raise RuntimeError("sandbox failed to start")
            return ""

        async def step(self, action: str) -> EnvStep:
            await self.clock.sleep(0.1)
            return EnvStep("", reward=1.0, done=True)

    pipeline, rows = _sim_run(tmp_path, [*BASE, "train.max_steps=2", "algorithm.filter_groups=true"],
                              env_factory=OneFails)
    status = collections.Counter(r["status"] for r in rows)
    assert status["filtered"] == pipeline.counters.filtered > 0
    assert status["reward_error"] == pipeline.counters.reward_errors == status["filtered"] // 3 + status["trained"] // 3
    assert all("sandbox failed to start" in r["error"] for r in rows if r["status"] == "reward_error")
    assert all(r["reward"] == 1.0 for r in rows if r["status"] == "filtered")
    assert pipeline.final_accounting["lost"] == 0


def test_sync_drain_cancels_the_requests_the_next_version_drops_before_it_waits(tmp_path: Path) -> None:
    """Sync (max_staleness 0) with redundancy and `weight_update: drain`: at a publication every
    request still generating is below the new floor. It is cancelled before the load, so the drain
    does not wait for the long stragglers that redundancy exists to cut (it waited, then dropped them
    all: slower than no redundancy, and nothing counted cancelled)."""
    long_tail = lambda rng: 2000 if rng.random() < 0.1 else 20  # noqa: E731
    base = ["rollout.n=4", "train.batch_size=16", "train.max_steps=6", "rollout.max_new_tokens=4096",
            "workflow.mode=sync", "workflow.weight_update=drain", "workflow.step_timeout_s=50000"]
    plain, _ = _sim_run(tmp_path / "plain", base, lengths=long_tail)
    redundant, rows = _sim_run(tmp_path / "redundant", [*base, "workflow.redundancy=1.0"], lengths=long_tail)
    assert redundant.counters.cancelled > 0 and redundant.counters.trained == plain.counters.trained == 96
    assert redundant.ctx.clock.now() - redundant.t_start < 0.5 * (plain.ctx.clock.now() - plain.t_start)
    assert redundant.final_accounting["lost"] == 0 and len({r["uid"] for r in rows}) == len(rows)


def test_an_episode_that_can_no_longer_meet_the_staleness_bound_ends_before_its_next_turn(tmp_path: Path) -> None:
    """The groups of one prompt in 8 play 8 slow turns, the rest 1: with max_staleness 1 the long
    episodes fall under the trainer's floor while they play. Each ends at its next turn boundary as
    `cancelled` (before: it played all 8 turns, then the trainer dropped it as stale)."""
    steps: collections.Counter[int] = collections.Counter()  # environment steps per episode (its seed: its uid at seed 0)

    class Uneven(Env):
        name = "uneven"
        max_turns = 8

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock
            self.turn = 0

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            self.seed, self.turns = seed, 8 if row["prompt"] % 8 == 0 else 1
            return ""

        async def step(self, action: str) -> EnvStep:
            await self.clock.sleep(50)
            self.turn += 1
            steps[self.seed] += 1
            return EnvStep("", reward=float((self.seed + self.turn) % 2), done=self.turn >= self.turns)

    pipeline, rows = _sim_run(tmp_path, ["rollout.n=4", "train.batch_size=16", "train.max_steps=6",
                                         "workflow.max_staleness=1", "rollout.max_new_tokens=16"],
                              env_factory=Uneven)
    cancelled = [r for r in rows if r["status"] == "cancelled"]
    assert cancelled and pipeline.counters.cancelled == len(cancelled)
    assert all(r["prompt"] % 8 == 0 and r["turns"] < 8 for r in cancelled)
    assert all(steps[r["uid"]] < 8 for r in cancelled)
    assert not [r for r in rows if r["status"] == "dropped_stale" and r["turns"] == 8]
    assert pipeline.final_accounting["lost"] == 0


def test_a_plain_reward_function_that_keeps_hanging_stops_the_run_instead_of_freezing_it(tmp_path: Path) -> None:
    """Each reward call past `reward.timeout_s` keeps its thread (threads cannot be stopped). The
    calls run on reward threads of their own, so the trainer's steps still get threads; once hung
    calls hold every reward thread the run stops with a one-line error naming reward.fn (before:
    they took asyncio's default threads, the trainer's step never started, and the run froze)."""
    import asyncio
    import threading

    import pytest

    from asyncflow.clock import RealClock
    from asyncflow.errors import UserError
    from asyncflow.workflow.build import build_pipeline

    release = threading.Event()
    calls = {"n": 0}

    def reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        calls["n"] += 1
        if calls["n"] > 20:
            release.wait(60)
        return [float(i % 2) for i in range(len(prompts))]

    class ThreadedStep:  # the optimizer step in a worker thread, as the real one
        async def step(self, samples: list[Any], valid: list[bool], rewards: list[float],
                       version: int) -> tuple[dict[str, Any], int]:
            await asyncio.to_thread(lambda: None)
            return {"loss": 0.0}, 1

    async def main() -> None:
        clock = RealClock()
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", "rollout.n=2", "train.batch_size=4", "train.max_steps=1000",
                                    "reward.timeout_s=0.2", "rollout.max_new_tokens=8"])
        engine = SimEngine(clock, lengths=lambda rng: 4, capacity=8, step_s=0.001)
        log = RunLog(tmp_path, metrics=False)
        pipeline = build_pipeline(cfg, rows=[{"prompt": i} for i in range(1000)], tokenizer=_SimTokenizer(),
                                  reward_fn=reward, engines=[engine], train_engine=SimTrainer(clock, token_s=0, devices=1),
                                  clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0),
                                  learner=ThreadedStep())
        try:
            await asyncio.wait_for(pipeline.run(), 60)
        finally:
            log.close()
            await engine.close()

    try:
        with pytest.raises(UserError, match=r"^reward\.fn: 4 reward calls are still running after reward\.timeout_s=0\.2 s"):
            asyncio.run(main())
    finally:
        release.set()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sum(r["status"] == "trained" for r in rows) >= 8  # the first 20 calls' groups trained


def test_an_environment_that_never_works_stops_the_run_after_the_fail_fast_count(tmp_path: Path) -> None:
    """Episodes share reward.fail_fast_calls: if the first N all fail, the run stops with the last
    error (exit 2 at the CLI) instead of logging failed samples until the trainer's batch timeout."""
    import pytest

    from asyncflow.errors import UserError

    class Broken(Env):
        name = "broken"
        max_turns = 2

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            return ""

        async def step(self, action: str) -> EnvStep:
            raise ValueError("no such tool")

    with pytest.raises(UserError, match=r"^rollout\.env: the first 6 episodes all failed \(reward\.fail_fast_calls\); "
                                        r"last error: environment 'broken' failed in step 1: ValueError: no such tool$"):
        _sim_run(tmp_path, [*BASE, "reward.fail_fast_calls=6"], env_factory=Broken)
