"""The stall watchdog (`workflow.stall_timeout_s`): a hang planted in each stage of the real pipeline
(simulated engines and trainer on a virtual clock) ends the run with one line naming that stage,
within the timeout, with every stack and the store's counts in the run folder's stall/."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncflow.bench.pipeline import _SimTokenizer, sim_pipeline
from asyncflow.config import load_config
from asyncflow.engines.base import GenRequest, GenResult, WeightUpdateMode
from asyncflow.engines.sim import SimEngine, SimTrainer
from asyncflow.envs.base import Env, EnvStep
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.virtual_loop import VirtualClock, run_virtual
from asyncflow.workflow.watchdog import StallDetected

STALL_S = 300.0
# every per-wait bound far past the watchdog's: the planted hangs are what those bounds do not catch
SETTINGS = ["rollout.n=4", "train.batch_size=16", "train.max_steps=6", "workflow.max_staleness=1",
            "rollout.max_new_tokens=64", f"workflow.stall_timeout_s={STALL_S}", "workflow.step_timeout_s=100000",
            "rollout.request_timeout_s=100000", "reward.timeout_s=100000"]


async def hang_forever() -> None:
    """The planted hang: an await nothing ever ends."""
    await asyncio.Event().wait()


def _parity(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    return [float(i % 2) for i in range(len(prompts))]


class HangingEngine(SimEngine):
    """Generates `ok_requests` requests, then every later one never finishes; or hangs loading
    version `hang_load`."""

    def __init__(self, clock: VirtualClock, *, ok_requests: int = 10**9, hang_load: int = -1) -> None:
        super().__init__(clock, lengths=lambda rng: rng.randint(5, 50), capacity=8, step_s=0.03, load_s=1.0, seed=0)
        self.ok_requests = ok_requests
        self.hang_load = hang_load

    def start_generate(self, request: GenRequest) -> asyncio.Future[GenResult]:
        self.ok_requests -= 1
        if self.ok_requests < 0:
            return asyncio.ensure_future(self.generate_never())
        return super().start_generate(request)

    async def generate_never(self) -> GenResult:
        await hang_forever()
        raise AssertionError("unreachable")

    async def load_weights(self, state: Any, version: int, mode: WeightUpdateMode) -> float:
        if version == self.hang_load:
            await hang_forever()
        return await super().load_weights(state, version, mode)


class HangingTrainer(SimTrainer):
    """Its `hang_step`-th train step never ends."""

    def __init__(self, clock: VirtualClock, hang_step: int) -> None:
        super().__init__(clock, token_s=1e-3, devices=1)
        self.hang_step = hang_step
        self.steps = 0

    async def train(self, tokens: int) -> float:
        self.steps += 1
        if self.steps == self.hang_step:
            await hang_forever()
        return await super().train(tokens)


def _run_until_stall(tmp_path: Path, *, engine: Callable[[VirtualClock], SimEngine] | None = None,
                     trainer: Callable[[VirtualClock], SimTrainer] | None = None,
                     reward_fn: Callable[..., Any] = _parity, env_factory: Any = None,
                     settings: tuple[str, ...] = ()) -> tuple[StallDetected, float]:
    """Run the sim pipeline to its stall; the error and the virtual time it ended at."""
    ended: list[float] = []

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", *SETTINGS, *settings])
        # (rollout.env_timeout_s is refused without rollout.env: this run's environment is an object)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, env_timeout_s=100000.0))
        engines = [engine(clock) if engine else HangingEngine(clock)]
        log = RunLog(tmp_path, metrics=False)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(512)], tokenizer=_SimTokenizer(), reward_fn=reward_fn,
            engines=engines, trainer=trainer(clock) if trainer else SimTrainer(clock, token_s=1e-3, devices=1),
            loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0), env_factory=env_factory)
        try:
            await pipeline.run()
        finally:
            ended.append(clock.now())
            log.close()
            await engines[0].close()

    with pytest.raises(StallDetected) as info:
        run_virtual(main)
    return info.value, ended[0]


def _check_dump(tmp_path: Path, stage: str, err: StallDetected, planted: str) -> dict[str, Any]:
    """The line names `stage`; stall/ holds the stacks (showing `planted`) and the counts; the stall
    was noticed within a tenth of the timeout past it."""
    line = str(err)
    assert "\n" not in line and f"stage {stage} " in line and "workflow.stall_timeout_s=300" in line
    stall = tmp_path / "stall"
    stacks = (stall / "driver.txt").read_text()
    assert "== threads" in stacks and "== asyncio tasks" in stacks
    assert 'test_watchdog.py", line' in stacks and f"in {planted.split('.')[-1]}\n" in stacks
    report = json.loads((stall / "store.json").read_text())
    assert report["stage"] == stage and STALL_S <= report["idle_s"] <= 1.1 * STALL_S
    assert set(report["counts"]) >= {"train"} and all(set(c) == {"ready", "taken"} for c in report["counts"].values())
    return report


def test_a_hung_generation_ends_the_run_naming_rollout(tmp_path: Path) -> None:
    err, _ = _run_until_stall(tmp_path, engine=lambda clock: HangingEngine(clock, ok_requests=40))
    report = _check_dump(tmp_path, "rollout", err, "generate_never")
    assert report["counts"]["rollout"]["taken"] > 0
    assert "holds" in str(err)


def test_a_hung_reward_function_ends_the_run_naming_reward(tmp_path: Path) -> None:
    calls = [0]

    async def stuck_after_five(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        calls[0] += 1
        if calls[0] > 5:
            await hang_forever()
        return [1.0] * len(prompts)

    err, _ = _run_until_stall(tmp_path, reward_fn=stuck_after_five)
    report = _check_dump(tmp_path, "reward", err, "stuck_after_five")
    assert report["counts"]["reward"]["taken"] > 0


def test_a_hung_environment_step_ends_the_run_naming_rollout(tmp_path: Path) -> None:
    steps = [0]

    class StuckEnv(Env):
        name = "stuck"
        max_turns = 2

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            return ""

        async def step(self, action: str) -> EnvStep:
            steps[0] += 1
            if steps[0] > 30:
                await hang_forever()
            await self.clock.sleep(0.1)
            return EnvStep("", reward=float(len(action) % 2), done=True)

    err, _ = _run_until_stall(tmp_path, env_factory=StuckEnv)
    _check_dump(tmp_path, "rollout", err, "StuckEnv.step")
    assert "StuckEnv.step" in str(err)


def test_a_hung_train_step_ends_the_run_naming_train(tmp_path: Path) -> None:
    err, _ = _run_until_stall(tmp_path, trainer=lambda clock: HangingTrainer(clock, hang_step=2))
    _check_dump(tmp_path, "train", err, "HangingTrainer.train")
    assert "train step" in str(err) and "HangingTrainer.train" in str(err)


def test_a_hung_weight_load_ends_the_run_naming_train(tmp_path: Path) -> None:
    err, _ = _run_until_stall(tmp_path, engine=lambda clock: HangingEngine(clock, hang_load=2))
    _check_dump(tmp_path, "train", err, "HangingEngine.load_weights")
    assert "loading weights" in str(err) and "v2" in str(err) and "HangingEngine.load_weights" in str(err)


def test_a_run_that_keeps_moving_is_not_stopped(tmp_path: Path) -> None:
    """With no hang planted the same run trains to its end, and leaves no stall/."""
    async def main(clock: VirtualClock) -> Any:
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", *SETTINGS, "train.max_steps=3"])
        engines = [HangingEngine(clock)]
        log = RunLog(tmp_path, metrics=False)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(512)], tokenizer=_SimTokenizer(), reward_fn=_parity,
            engines=engines, trainer=SimTrainer(clock, token_s=1e-3, devices=1), loss_fn=None, clock=clock,
            log=log, tracer=Tracer(now=clock.now, max_events=0))
        try:
            await pipeline.run()
        finally:
            log.close()
            await engines[0].close()
        return pipeline

    pipeline = run_virtual(main)
    assert pipeline.counters.trained == 48
    assert not (tmp_path / "stall").exists()


def test_the_store_counts_every_change_of_a_sample_and_nothing_else() -> None:
    """The watchdog's progress signal: a put, a take, a write, an ack, a release and a removal each
    move `changes`; a lease renewal (what a hung holder still does) and a read do not."""
    from asyncflow.transfer_queue import NewSample, TransferQueue

    q = TransferQueue(capacity=16, lease_timeout_s=60)
    q.register_stage("score", ["prompt"])
    seen = [q.metrics()["changes"]]

    def moved() -> bool:
        seen.append(q.metrics()["changes"])
        return seen[-1] > seen[-2]

    uids = q.put_blocking([NewSample(0, 2, {"prompt": 1}), NewSample(0, 2, {"prompt": 2})])
    assert moved()
    lease = q.take_blocking("score", 1)
    assert moved()
    q.renew([lease])
    q.metrics()
    assert not moved()
    q.write(lease.samples[0].uid, {"score": 1.0})
    assert moved()
    q.ack(lease)
    assert moved()
    other = q.take_blocking("score", 1)
    assert moved()
    q.release(other)
    assert moved()
    q.remove(uids)
    assert moved()


def test_the_blame_falls_to_a_stage_that_takes_nothing_then_to_the_feeder() -> None:
    """With no publication, train step or held sample: the first stage with samples ready that it
    does not take; with none ready anywhere, the trainer's batch that nothing produces."""
    from asyncflow.workflow.watchdog import blame

    stages = ["rollout", "reward", "train"]
    stage, what = blame({"depth/rollout": 0.0, "depth/reward": 8.0, "leased/reward": 0.0}, {}, stages)
    assert stage == "reward" and "takes none of the 8 sample(s) ready" in what
    stage, what = blame({"depth/train": 4.0}, {}, stages)
    assert stage == "train" and "4 sample(s) ready" in what and "feeder admits no prompts" in what
    stage, what = blame({"leased/rollout": 2.0, "leased/reward": 4.0}, {}, stages)
    assert stage == "rollout" and what.startswith("holds 2 sample(s)")
