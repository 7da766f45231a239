"""Each workflow stage built alone, from a store, a virtual clock, a simulated engine and its settings
(no config file), and driven: what it takes from the store, what it writes back, what it counts."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.engines.sim import SimEngine, SimTrainer
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.transfer_queue import NewSample, TransferQueue
from asyncflow.virtual_loop import VirtualClock, run_virtual
from asyncflow.workflow.agent_proxy import RecorderSettings
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.episode import EpisodeSettings
from asyncflow.workflow.feeder import Feeder
from asyncflow.workflow.gate import StalenessGate
from asyncflow.workflow.reference import ReferenceWorker
from asyncflow.workflow.reward import RewardWorker
from asyncflow.workflow.rollout import RolloutWorker
from asyncflow.workflow.settings import (
    ContextSettings,
    FeederSettings,
    ReferenceSettings,
    RewardSettings,
    RolloutSettings,
    TrainerSettings,
)
from asyncflow.workflow.trainer import StepResult, Trainer

N = 2  # samples per prompt
ROWS = [{"prompt": f"q{i}", "answer": i} for i in range(8)]


class Tok:
    """A prompt's ids are its row number's; responses decode to their length."""

    pad_token_id = 0
    eos_token_id = 1

    def prompt_ids(self, prompt: Any) -> list[int]:
        return [10 + int(prompt[1:])] * 3

    def decode(self, ids: Sequence[int]) -> str:
        return f"len{len(ids)}"

    def completions(self, responses: Sequence[Sequence[int]], conversational: bool) -> list[str]:
        return [self.decode(r) for r in responses]


def _context(clock: VirtualClock, tmp_path: Path) -> tuple[StageContext, RunLog]:
    store = TransferQueue(capacity=1000, lease_timeout_s=60.0, clock=clock)
    log = RunLog(tmp_path, metrics=False)
    ctx = StageContext(store, clock, Tracer(now=clock.now, max_events=0), log, ContextSettings("prompt", 60.0),
                       rows=ROWS, tok=Tok())  # type: ignore[arg-type]
    return ctx, log


def _samples(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]


async def _stop(task: asyncio.Task[None], ctx: StageContext) -> None:
    ctx.store.close()
    task.cancel()
    await asyncio.wait([task])
    ctx.close()


def test_the_feeder_admits_n_samples_per_prompt_as_far_as_the_gate_gives_credit(tmp_path: Path) -> None:
    """2 groups a step, max_staleness 1: 4 groups before any publication, 2 more after version 1;
    each prompt is admitted as N samples of one group, in the seeded stream's order."""

    async def main(clock: VirtualClock) -> tuple[list[float], list[list[int]]]:
        ctx, log = _context(clock, tmp_path)
        gate = StalenessGate(2, 1, 10, clock)
        feeder = Feeder(ctx, FeederSettings("prompt", N, ("rollout",), False, seed=3, shuffle=True,
                                            step_timeout_s=30.0), rows=ROWS, tok=Tok(), gate=gate)  # type: ignore[arg-type]
        ctx.store.register_stage("rollout", ["prompt_ids"])
        task = asyncio.create_task(feeder.run())
        await clock.sleep(1.0)
        put = [ctx.store.metrics()["groups_put"]]
        gate.publish(1)
        await clock.sleep(1.0)
        put.append(ctx.store.metrics()["groups_put"])
        lease = await ctx.store.take("rollout", 100, timeout=1.0, fields_extra=["row"])
        by_group: dict[int, list[int]] = {}
        for s in lease.samples:
            by_group.setdefault(s.group_id, []).append(s.fields["row"])
        gate.close()
        await _stop(task, ctx)
        log.close()
        assert feeder.next_group == 6
        return put, [by_group[g] for g in sorted(by_group)]

    put, rows = run_virtual(main)
    assert put == [4, 6]
    assert all(len(r) == N and len(set(r)) == 1 for r in rows)  # each group: N samples of one prompt
    order = list(range(len(ROWS)))
    random.Random(3).shuffle(order)
    assert [r[0] for r in rows] == order[:6]


def _rollout_settings() -> RolloutSettings:
    episode = EpisodeSettings(16, 1.0, 30.0, 30.0)
    recorder = RecorderSettings(16, 1.0, 1.0, 30.0, 4)
    return RolloutSettings(16, 1.0, 1.0, 0, request_timeout_s=30.0, env_timeout_s=30.0, agent_timeout_s=30.0,
                           step_timeout_s=30.0, affinity=False, turn_barrier=False, seed=0, fail_fast_calls=10,
                           episode=episode, recorder=recorder)


def test_a_rollout_worker_generates_every_admitted_sample_and_writes_its_response(tmp_path: Path) -> None:
    """Each admitted sample gets its response, behavior log-probs and version written once; a group
    whose responses are all written is then ready for the reward stage."""

    async def main(clock: VirtualClock) -> tuple[list[Any], int]:
        ctx, log = _context(clock, tmp_path)
        engine = SimEngine(clock, lengths=lambda rng: rng.randint(2, 6), capacity=4, seed=0)
        worker = RolloutWorker(ctx, _rollout_settings(), index=0, engine=engine, rows=ROWS, tok=Tok())  # type: ignore[arg-type]
        ctx.store.register_stage("rollout", ["prompt_ids"])
        ctx.store.register_stage("reward", ["response_ids"], groups=True)
        await ctx.store.put([NewSample(g, N, {"prompt_ids": [5, 6], "row": g}) for g in range(3) for _ in range(N)])
        task = asyncio.create_task(worker.run())
        lease = await ctx.store.take("reward", 3 * N, min_samples=3 * N, timeout=60.0,
                                     fields_extra=["behavior_logprobs", "behavior_version", "finish_reason"])
        await _stop(task, ctx)
        await engine.close()
        log.close()
        return lease.samples, ctx.counters.produced

    samples, produced = run_virtual(main)
    assert produced == 3 * N and len(samples) == 3 * N
    for s in samples:
        assert 2 <= len(s.fields["response_ids"]) <= 6
        assert len(s.fields["behavior_logprobs"]) == len(s.fields["response_ids"])
        assert s.fields["behavior_version"] == 0 and s.version == 0


def test_a_reward_worker_scores_each_complete_group_in_one_call(tmp_path: Path) -> None:
    """One reward call per group, with the group's completions and its row's columns; the rewards
    are written to the samples, and the calls counted."""
    calls: list[tuple[list[str], list[int]]] = []

    def reward(prompts: list[Any], completions: list[str], answer: list[int], **_: Any) -> list[float]:
        calls.append((completions, answer))
        return [float(len(c)) + a for c, a in zip(completions, answer, strict=True)]

    async def main(clock: VirtualClock) -> list[Any]:
        ctx, log = _context(clock, tmp_path)
        worker = RewardWorker(ctx, RewardSettings(N, "prompt", 1, 30.0, 10, 30.0, 10), reward_fn=reward, rows=ROWS,
                              tok=Tok())  # type: ignore[arg-type]
        ctx.store.register_stage("reward", ["response_ids"], groups=True)
        ctx.store.register_stage("train", ["reward"], groups=True)
        await ctx.store.put([NewSample(g, N, {"prompt_ids": [5], "row": g, "response_ids": [7] * (g + 1 + i),
                                              "token_versions": [0] * (g + 1 + i), "finish_reason": "stop"})
                             for g in range(2) for i in range(N)])
        task = asyncio.create_task(worker.run())
        lease = await ctx.store.take("train", 2 * N, min_samples=2 * N, timeout=60.0)
        await _stop(task, ctx)
        worker.close()
        log.close()
        assert ctx.counters.reward_calls == 2 and ctx.counters.reward_call_failures == 0
        return lease.samples

    samples = run_virtual(main)
    assert sorted(len(c) for c, _ in calls) == [N, N]
    assert sorted(tuple(a) for _, a in calls) == [(0, 0), (1, 1)]
    # completions decode to "len<k>" (4 characters), plus the row's answer
    assert sorted((s.group_id, s.fields["reward"]) for s in samples) == [(0, 4.0), (0, 4.0), (1, 5.0), (1, 5.0)]


def test_a_reference_worker_writes_each_responses_own_log_probs(tmp_path: Path) -> None:
    """The reference model's per-position log-probs are cut to each response's tokens: position
    len(prompt)-1 onwards, one per response token."""

    def ref_logprobs(batch: Any) -> torch.Tensor:
        rows, cols = batch.input_ids.shape
        return torch.arange(cols, dtype=torch.float32).repeat(rows, 1) + 100 * torch.arange(rows).unsqueeze(1)

    async def main(clock: VirtualClock) -> list[Any]:
        ctx, log = _context(clock, tmp_path)
        worker = ReferenceWorker(ctx, ReferenceSettings(8, 30.0, 1), ref_logprobs=ref_logprobs, pad_token_id=0)
        ctx.store.register_stage("reference", ["response_ids"])
        ctx.store.register_stage("train", ["ref_logprobs"])
        await ctx.store.put([NewSample(0, 1, {"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}),
                             NewSample(1, 1, {"prompt_ids": [5], "response_ids": [8, 9, 10]})])
        task = asyncio.create_task(worker.run())
        lease = await ctx.store.take("train", 2, min_samples=2, timeout=60.0, fields_extra=["prompt_ids"])
        await _stop(task, ctx)
        log.close()
        return lease.samples

    samples = {s.group_id: s.fields["ref_logprobs"] for s in run_virtual(main)}
    assert samples[0] == [2.0, 3.0]  # prompt of 3: positions 2, 3 (row 0 of the batch)
    assert samples[1] == [100.0, 101.0, 102.0]  # prompt of 1: positions 0..2 (row 1)


class RecordingLearner:
    """A stand-in optimizer step (this test is about the trainer loop, not the loss)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, list[int]]] = []

    async def step(self, samples: list[Any], valid: list[bool], rewards: list[float],
                   version: int) -> tuple[dict[str, Any], int]:
        self.steps.append((version, sorted(s.uid for s in samples)))
        return {"loss": 0.0}, sum(len(s.fields["response_ids"]) for s in samples)


def test_the_trainer_trains_whole_groups_publishes_each_version_and_logs_every_sample(tmp_path: Path) -> None:
    """Two steps of two groups: each step trains whole groups, exports and loads version v+1 into the
    engine, opens it at the gate, hands its row to `on_step`; every sample is logged trained and
    leaves the store. A group whose every reward failed is logged and dropped, its slot freed."""
    learner = RecordingLearner()
    rows: list[StepResult] = []

    async def on_step(result: StepResult) -> None:
        rows.append(result)

    async def main(clock: VirtualClock) -> tuple[int, int, int, float]:
        ctx, log = _context(clock, tmp_path)
        engine = SimEngine(clock, lengths=lambda rng: 3, capacity=4, seed=0)
        gate = StalenessGate(2, 1, 2, clock)
        gate.admit(5)
        settings = TrainerSettings(max_steps=2, batch_size=2 * N, n=N, groups_per_step=2, max_staleness=1,
                                   step_timeout_s=30.0, checkpoint_every=0, filter_groups=False, filter_budget=8,
                                   weight_update="drain", threads=1)
        trainer = Trainer(ctx, settings, learner=learner, engine=SimTrainer(clock, token_s=0.01, devices=1),  # type: ignore[arg-type]
                          engines=[engine], gate=gate, collect_ahead=False, on_step=on_step)
        ctx.store.register_stage("train", ["reward"], groups=True)
        failed = {"reward": None, "reward_error": "boom"}
        ok = {"reward": 1.0, "reward_error": None}
        await ctx.store.put([NewSample(g, N, {"prompt_ids": [5], "row": g, "response_ids": [7, 7],
                                              "behavior_logprobs": [-1.0, -1.0], "token_versions": [0, 0],
                                              "behavior_version": 0, "finish_reason": "stop",
                                              **(failed if g == 1 else ok)}) for g in range(5) for _ in range(N)])
        await trainer.run()
        left = int(ctx.store.metrics()["samples"])
        ctx.close()
        await engine.close()
        log.close()
        return ctx.board.version, gate.version, left, ctx.board.floor

    version, gate_version, left, floor = run_virtual(main)
    assert version == gate_version == 2 and floor == 1  # (version 2's floor: max_staleness 1)
    assert [v for v, _ in learner.steps] == [0, 1] and all(len(uids) == 2 * N for _, uids in learner.steps)
    assert [(r.step, r.version) for r in rows] == [(1, 1), (2, 2)]
    logged = _samples(tmp_path)
    assert sorted(r["status"] for r in logged) == ["reward_error"] * N + ["trained"] * 4 * N
    assert left == 0 and {r["group_id"] for r in logged if r["status"] == "reward_error"} == {1}


def _counting(monkeypatch: pytest.MonkeyPatch) -> collections.Counter[str]:
    """Counts, in this process, what the actor classes construct: lease keepers, staleness gates,
    tokenizer loads, environment factories."""
    import asyncflow.envs
    import asyncflow.runtime.ray_actors as actors
    from asyncflow.workflow.lease_keeper import LeaseKeeper

    made: collections.Counter[str] = collections.Counter()

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            made[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    keeper_init = LeaseKeeper.__init__
    monkeypatch.setattr(LeaseKeeper, "__init__", counted("lease keeper", keeper_init))
    monkeypatch.setattr(actors, "make_gate", counted("gate", actors.make_gate))
    monkeypatch.setattr(actors, "_tokenizer", counted("tokenizer", actors._tokenizer))
    monkeypatch.setattr(asyncflow.envs, "make_env_factory", counted("env factory", asyncflow.envs.make_env_factory))
    return made


def test_each_ray_actor_builds_only_its_stage_and_one_lease_keeper_per_process(
        serve_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built in this process (no Ray needed to construct them): the feeder actor builds its gate and
    no environment; a reward actor no gate; a rollout actor of an environment task loads its
    tokenizer once and builds the environment factory; the colocated hub, hosting the feeder, two
    reward loops and rollout worker 0, builds one context: one lease keeper, one tokenizer load."""
    from asyncflow.config import load_config
    from asyncflow.runtime.ray_actors import FeederActor, RewardActor, RolloutActor
    from asyncflow.runtime.ray_hub import HubActor

    made = _counting(monkeypatch)
    base = ["task=arith", f"model.path={serve_dir}", "logging.progress=false"]
    single, _ = load_config(None, base)
    episodic, _ = load_config(None, [*base, "rollout.env=calculator"])
    model, out = str(serve_dir), str(tmp_path)
    store = TransferQueue(capacity=100, lease_timeout_s=60.0)
    rows = [{"prompt": "1+1=", "answer": "2"}]
    built = {}
    for name, make in [
        ("feeder", lambda: FeederActor(episodic, model, rows, out, store)),
        ("reward", lambda: RewardActor(0, single, model, rows, out, store, "asyncflow.tasks.arith:reward_fn")),
        ("rollout", lambda: RolloutActor(0, episodic, model, rows, out, store, threads=1)),
        ("hub", lambda: HubActor((100, 60.0, 1.0, 0), single, model, rows, out, "asyncflow.tasks.arith:reward_fn",
                                 2, threads=1)),
    ]:
        made.clear()
        make()
        built[name] = dict(made)
    assert built == {
        "feeder": {"lease keeper": 1, "gate": 1, "tokenizer": 1},
        "reward": {"lease keeper": 1, "tokenizer": 1},
        "rollout": {"lease keeper": 1, "tokenizer": 1, "env factory": 1},
        "hub": {"lease keeper": 1, "gate": 1, "tokenizer": 1},
    }
