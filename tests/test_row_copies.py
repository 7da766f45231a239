"""A reward function, an environment or an agent cannot change the dataset: what each is handed of
a row shares no mutable object with it, so every later epoch and the evaluation see the row as read."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from asyncflow.bench.pipeline import _SimTokenizer, sim_pipeline
from asyncflow.config import load_config
from asyncflow.engines.sim import SimEngine, SimTrainer
from asyncflow.envs.base import Env, EnvStep
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.virtual_loop import VirtualClock, run_virtual


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": [i], "meta": {"tags": ["t"]}}
            for i in range(n)]


def _run(tmp_path: Path, rows: list[dict[str, Any]], reward_fn: Any, env_factory: Any = None) -> None:
    """The sim pipeline over `rows` for 4 steps of 4 groups: 16 groups, each of 8 rows twice."""

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith", "logging.progress=false", "rollout.n=4", "train.batch_size=16",
                                    "train.max_steps=4", "workflow.max_staleness=1"])
        engines = [SimEngine(clock, lengths=lambda rng: 8, capacity=8, step_s=0.03, load_s=1.0, seed=0)]
        trainer = SimTrainer(clock, token_s=1e-3, devices=1)
        log = RunLog(tmp_path, metrics=False)
        pipeline = sim_pipeline(
            cfg, rows=rows, tokenizer=_SimTokenizer(), reward_fn=reward_fn, engines=engines, trainer=trainer,
            loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now, max_events=0), env_factory=env_factory)
        try:
            await pipeline.run()
        finally:
            log.close()
            await engines[0].close()

    run_virtual(main)


def _vandal(seen: list[Any]) -> Any:
    def reward(prompts: list[Any], completions: list[str], answer: list[Any], meta: list[Any],
               **_: Any) -> list[float]:
        seen.append(copy.deepcopy((prompts[0], answer[0], meta[0])))
        for i in range(len(prompts)):
            prompts[i].append({"role": "judge", "content": "rewritten"})
            answer[i].append(99)
            meta[i]["tags"].append("x")
        return [1.0] * len(prompts)

    return reward


def test_a_reward_function_that_mutates_its_arguments_leaves_the_rows_unchanged(tmp_path: Path) -> None:
    rows = _rows(8)
    pristine = copy.deepcopy(rows)
    seen: list[Any] = []
    _run(tmp_path, rows, _vandal(seen))
    assert rows == pristine
    assert len(seen) >= 16  # every row scored in two epochs at least
    assert all(s == (r["prompt"], r["answer"], r["meta"]) for s in seen
               for r in pristine if r["prompt"][0]["content"] == s[0][0]["content"])
    assert all(len(s[0]) == 1 and len(s[1]) == 1 and s[2] == {"tags": ["t"]} for s in seen)


def test_an_environment_that_mutates_its_row_leaves_the_rows_unchanged(tmp_path: Path) -> None:
    seen: list[Any] = []

    class Vandal(Env):
        name = "vandal"
        max_turns = 1

        def __init__(self, clock: VirtualClock) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            seen.append(copy.deepcopy(row))
            row["prompt"].append({"role": "env"})
            row["answer"].append(99)
            row["meta"]["tags"].clear()
            return ""

        async def step(self, action: str) -> EnvStep:
            await self.clock.sleep(0.1)
            return EnvStep("", reward=1.0, done=True)

    rows = _rows(8)
    pristine = copy.deepcopy(rows)
    _run(tmp_path, rows, lambda prompts, completions, **_: [1.0] * len(prompts), env_factory=Vandal)
    assert rows == pristine and len(seen) >= 64
    assert all(len(s["prompt"]) == 1 and len(s["answer"]) == 1 and s["meta"] == {"tags": ["t"]} for s in seen)


class _ChatTok:
    class hf:  # noqa: N801 (the tokenizer object the evaluator reads prompts with)
        chat_template = "(any)"

        @staticmethod
        def apply_chat_template(messages: Any, **_: Any) -> list[int]:
            return [5, 6]

    def completions(self, ids: Any, conversational: bool) -> list[str]:
        return ["c"] * len(ids)


def test_a_reward_function_that_mutates_its_arguments_at_evaluation_leaves_the_rows_unchanged(tmp_path: Path) -> None:
    from asyncflow.evaluation import Evaluator

    rows = _rows(4)
    pristine = copy.deepcopy(rows)
    seen: list[Any] = []

    async def main(clock: VirtualClock) -> None:
        cfg, _ = load_config(None, ["task=arith"])
        engine = SimEngine(clock, lengths=lambda rng: 3, capacity=2, seed=0, step_s=0.001)
        log = RunLog(tmp_path)
        try:
            evaluator = Evaluator(cfg, rows, _ChatTok(), _vandal(seen), engine, log, Tracer(now=clock.now), clock=clock)
            for step in range(2):
                await evaluator.run(step=step)
        finally:
            log.close()

    run_virtual(main)
    assert rows == pristine and len(seen) == 8
    assert all(len(s[0]) == 1 and len(s[1]) == 1 and s[2] == {"tags": ["t"]} for s in seen)
