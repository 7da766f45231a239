"""An arithmetic taskset written against verifiers' own API (no asyncflow import): the `chat_arith`
questions ("What is 14 * 15?"), scored by two `@vf.reward` methods (a weighted rubric): the answer's
last number is the right one (weight 1), and the reply is brief (weight 0.1).

    asyncflow train examples/verifiers/config.yaml
"""

from __future__ import annotations

import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+")


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        numbers = NUMBER.findall(trace.last_reply)
        return 1.0 if numbers and numbers[-1] == task.answer else 0.0

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return 1.0 if len(trace.last_reply) <= 40 else 0.0


class ArithTaskset(vf.Taskset[ArithTask, vf.TasksetConfig]):
    def load(self):
        for a in range(2, 20):
            for b in range(2, 20):
                yield ArithTask(ArithData(prompt=f"What is {a} * {b}?", answer=str(a * b)))


__all__ = ["ArithTaskset"]
