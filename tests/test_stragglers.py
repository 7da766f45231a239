"""Straggler-tolerant groups (`rollout.group_timeout_s`): past the deadline a request is abandoned in
its engine and logged `aborted`; its group trains on the samples that finished (advantages over
those) or, with fewer than `rollout.group_min_samples`, is dropped and frees its admission slot once.
The real pipeline on a virtual clock (simulated engines and trainer, as PIPE) with planted stragglers."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.algorithms.advantages import make_advantage_fn
from asyncflow.bench.pipeline import SimLearner, _SimTokenizer
from asyncflow.config import load_config
from asyncflow.engines.base import GenRequest
from asyncflow.engines.sim import SimEngine, SimTrainer
from asyncflow.errors import UserError
from asyncflow.telemetry.audit import audit
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.virtual_loop import VirtualClock, run_virtual
from asyncflow.workflow.build import build_pipeline
from asyncflow.workflow.context import STRAGGLER

N = 4
STUCK = 3000  # tokens of a planted straggler: 90 virtual s at 30 ms a step, against a 5 s deadline
BASE = [f"rollout.n={N}", "train.batch_size=16", "train.max_steps=6", "workflow.max_staleness=1",
        "rollout.max_new_tokens=4096", "rollout.group_timeout_s=5"]


def _alternating(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
    """Rewards 0, 1, 2, ... within each call: a group's spread depends on which samples it has."""
    return [float(i) for i in range(len(prompts))]


class RecordingLearner(SimLearner):
    """PIPE's learner, keeping each batch it was given: (samples, valid, rewards)."""

    def __init__(self, sim_trainer: Any) -> None:
        super().__init__(sim_trainer)
        self.batches: list[tuple[list[Any], list[bool], list[float]]] = []

    async def step(self, samples: list[Any], valid: list[bool], rewards: list[float],
                   version: int) -> tuple[dict[str, Any], int]:
        self.batches.append((list(samples), list(valid), list(rewards)))
        return await super().step(samples, valid, rewards, version)


def _run(tmp_path: Path, settings: list[str], stuck_frac: float,
         collect_ahead: bool = False) -> tuple[Any, RecordingLearner, list[dict[str, Any]]]:
    """The sim pipeline to its end with a share `stuck_frac` of requests planted as stragglers;
    `collect_ahead`: the trainer collects the next batch during a step, as with a store in another
    process (the Ray runtime)."""

    def lengths(rng: random.Random) -> int:
        return STUCK if rng.random() < stuck_frac else rng.randint(5, 50)

    async def main(clock: VirtualClock) -> tuple[Any, RecordingLearner]:
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", *settings])
        engines = [SimEngine(clock, lengths=lengths, capacity=8, step_s=0.03, load_s=1.0, seed=0)]
        trainer: Any = SimTrainer(clock, token_s=1e-3, devices=1)  # (a TrainEngine in all that PIPE uses)
        learner = RecordingLearner(trainer)
        tokenizer: Any = _SimTokenizer()
        log = RunLog(tmp_path, metrics=False)
        pipeline = build_pipeline(
            cfg, rows=[{"prompt": i} for i in range(512)], tokenizer=tokenizer, reward_fn=_alternating,
            engines=engines, train_engine=trainer, learner=learner, clock=clock, log=log,
            tracer=Tracer(now=clock.now, max_events=0), collect_ahead=collect_ahead)
        try:
            await pipeline.run()
        finally:
            log.close()
            await engines[0].close()
        return pipeline, learner

    pipeline, learner = run_virtual(main)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    return pipeline, learner, rows


def _check_accounting(pipeline: Any, rows: list[dict[str, Any]]) -> None:
    """Nothing lost, samples.jsonl agrees with the counts, and each dropped group freed its slot
    once: the gate's live groups are those admitted less those that left untrained."""
    acc = pipeline.final_accounting
    assert acc["lost"] == 0
    assert audit(acc, collections.Counter(r["status"] for r in rows)) == []
    by_group: dict[int, list[str]] = collections.defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r["status"])
    dropped = sum(1 for statuses in by_group.values() if len(statuses) == N and "trained" not in statuses)
    assert pipeline.gate.admitted == int(pipeline.store.metrics()["groups_put"]) - dropped


@pytest.mark.parametrize("collect_ahead", [False, True])
def test_stragglers_are_aborted_and_their_groups_train_on_the_samples_that_finished(tmp_path: Path,
                                                                                     collect_ahead: bool) -> None:
    pipeline, learner, rows = _run(tmp_path, BASE, stuck_frac=0.2, collect_ahead=collect_ahead)
    _check_accounting(pipeline, rows)
    c = pipeline.counters
    stragglers = [r for r in rows if r["status"] == "aborted" and r["error"] == STRAGGLER]
    assert stragglers and c.stragglers_aborted == len(stragglers)
    assert all(r["response"] == "" and r["trained_version"] is None and r["reward"] is None for r in stragglers)
    # every trained group: its trained samples and its aborted stragglers make the whole group
    by_group: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_group[r["group_id"]][r["status"]] += 1
    trained_groups = {g: s for g, s in by_group.items() if s["trained"]}
    partial = {g for g, s in trained_groups.items() if s["trained"] < N}
    assert all(s["trained"] + s["aborted"] == N and s["trained"] >= 2 for s in trained_groups.values())
    assert partial and c.groups_partial == len(partial)
    # the learner saw only finished samples, and a partial group's advantages are over those alone
    grpo = make_advantage_fn("grpo")
    checked = 0
    for samples, valid, rewards in learner.batches:
        assert all(s.fields["finish_reason"] != "aborted" for s in samples)
        adv = grpo(torch.tensor(rewards), torch.tensor([s.group_id for s in samples]), torch.tensor(valid))
        members: dict[int, list[int]] = collections.defaultdict(list)
        for i, s in enumerate(samples):
            members[s.group_id].append(i)
        for gid, idx in members.items():
            if gid not in partial:
                continue
            rs = [rewards[i] for i in idx]
            mean, std = statistics.fmean(rs), statistics.stdev(rs)
            for i in idx:
                assert float(adv[i]) == pytest.approx((rewards[i] - mean) / (std + 1e-6), abs=1e-5)
            checked += 1
    assert checked == len(partial)


def test_a_group_left_with_fewer_than_the_minimum_is_dropped_and_frees_its_slot_once(tmp_path: Path) -> None:
    pipeline, _, rows = _run(tmp_path, [*BASE, "rollout.group_min_samples=3"], stuck_frac=0.35)
    _check_accounting(pipeline, rows)
    too_few = [r for r in rows if r["status"] == "aborted" and r["error"] != STRAGGLER]
    assert too_few and all("fewer than rollout.group_min_samples=3" in r["error"] for r in too_few)
    trained = collections.Counter(r["group_id"] for r in rows if r["status"] == "trained")
    assert min(trained.values()) >= 3
    assert pipeline.counters.trained == sum(trained.values())


def test_a_cancelled_request_leaves_the_simulated_engine_after_the_step_under_way() -> None:
    """Abandoning a request's future frees its slot, as a real engine does: the engine is idle
    after the step under way, not after the request's 3,000 steps."""

    async def main(clock: VirtualClock) -> tuple[int, float, float]:
        engine = SimEngine(clock, lengths=lambda rng: STUCK, capacity=2, step_s=0.03, load_s=1.0, seed=0)
        fut = engine.start_generate(GenRequest(1, [5, 6], 4096, 1.0, 1.0, 0))
        await clock.sleep(1.0)
        fut.cancel()
        await clock.sleep(1.0)
        await engine.close()
        return engine.load(), engine.busy_seconds(), clock.now()

    load, busy, now = run_virtual(main)
    assert load == 0
    assert busy < 1.1 < STUCK * 0.03


@pytest.mark.parametrize(("settings", "needle"), [
    (["rollout.group_timeout_s=700"], "rollout.group_timeout_s: 700 must be below rollout.request_timeout_s=600"),
    (["rollout.group_timeout_s=5", "rollout.group_min_samples=9"], "rollout.group_min_samples: 9 is more than rollout.n=8"),
    (["rollout.group_min_samples=3"], "rollout.group_min_samples: only used with rollout.group_timeout_s"),
    (["rollout.group_timeout_s=5", "rollout.env=calculator"], "rollout.group_timeout_s: single-turn requests only"),
])
def test_straggler_settings_that_cannot_be_honoured_are_refused(settings: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace(".", r"\.")):
        load_config(None, ["task=arith", *settings])


@pytest.mark.slow
def test_a_real_run_with_stuck_requests_trains_partial_groups_and_loses_nothing(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncflow train` on arith (the real hf engine and trainer) where every fifth request is stuck
    (its engine never answers): each is aborted at the deadline, its group trains without it."""
    from asyncflow.engines.hf import HFEngine
    from asyncflow.runner import train

    real = HFEngine.start_generate

    def stuck_or_real(self: HFEngine, request: GenRequest) -> Any:
        if request.uid >= 0 and request.uid % 5 == 0:  # (evaluation requests have uid < 0)
            return asyncio.get_running_loop().create_future()  # never answered: only its cancellation ends it
        return real(self, request)

    monkeypatch.setattr(HFEngine, "start_generate", stuck_or_real)
    cfg, _ = load_config(None, ["task=arith", "train.batch_size=32", "rollout.n=4", "rollout.max_new_tokens=4",
                                "train.max_steps=3", "eval.size=16", "eval.every=100", "logging.progress=false",
                                "rollout.group_timeout_s=2"])
    summary = train(cfg, tmp_path / "run", progress_enabled=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    acc = summary["accounting"]
    assert acc["lost"] == 0
    assert audit(acc, collections.Counter(r["status"] for r in rows)) == []
    assert not [r for r in rows if r["status"] == "trained" and r["uid"] % 5 == 0]
    stragglers = [r for r in rows if r["status"] == "aborted" and r["error"] == STRAGGLER]
    assert any(r["uid"] % 5 == 0 for r in stragglers)  # (a request slowed by a loaded machine may be one too)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m["kind"] == "train"][-1]
    assert last["stragglers_aborted"] == len(stragglers) and last["groups_partial"] > 0
    assert last["samples"] == sum(1 for r in rows if r["status"] == "trained") < 3 * 32
