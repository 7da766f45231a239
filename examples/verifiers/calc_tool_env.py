"""A multi-turn verifiers environment written against verifiers' own API (no asyncflow import): the
`calc` task's calculator as environment feedback. Its `Env.run` holds the agent's conversation open
(`interaction`) and answers each `<calc>expr</calc>` turn with `<result>value</result>`, until the
agent answers `<answer>n</answer>` (or the tool calls run out); the task's `@vf.reward` scores that
answer. The prompts are calc's: a product with a four-digit value ("37*48=").
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

CALL = re.compile(r"<calc>\s*(\d+)\s*\*\s*(\d+)\s*</calc>")
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        found = ANSWER.search(trace.last_reply)
        return 1.0 if found is not None and found.group(1) == task.answer else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        rng = random.Random(0)
        for _ in range(200):
            a, b = (rng.randint(100, 999), rng.randint(2, 9)) if rng.random() < 0.5 else \
                (rng.randint(10, 99), rng.randint(10, 99))
            while a * b < 1000:
                a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield CalcTask(CalcData(prompt=f"{a}*{b}=", answer=str(a * b)))


class CalcToolEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    max_tool_calls: int = 2


class CalcToolEnv(vf.Env[CalcToolEnvConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(self.config.max_tool_calls):
                call = CALL.search(segment.last_reply)
                if segment.terminated or call is None:
                    break
                segment = await chat.turn(f"<result>{int(call.group(1)) * int(call.group(2))}</result>")


__all__ = ["CalcTaskset", "CalcToolEnv"]
