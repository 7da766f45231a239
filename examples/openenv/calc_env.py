"""A calculator tool written against OpenEnv's own API (no asyncflow import): the `calc` task's tool
as an OpenEnv `Environment`, so the shipped `calc` model can play it.

A turn `<calc>37*48</calc>` is answered `<result>1776</result>`; a turn `<answer>1776</answer>` ends
the episode with reward 1.0 when it equals the `answer` that `reset` was given (the dataset row's
column), else 0.0. Served as is by OpenEnv (`app` below) or run in process.
"""

from __future__ import annotations

import ast
import operator
import re
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


class CalcAction(Action):
    message: str


class CalcObservation(Observation):
    result: str = ""


def evaluate(expr: str) -> int:
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("not a sum or product of integers")

    return ev(ast.parse(expr.strip(), mode="eval"))


class CalcToolEnvironment(Environment[CalcAction, CalcObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # no shared state between instances

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()))
        self.answer: str | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, answer: Any = None,
              **kwargs: Any) -> CalcObservation:
        self._state = State(episode_id=episode_id or str(uuid.uuid4()))
        self.answer = None if answer is None else str(answer).strip()
        return CalcObservation(result="")

    def step(self, action: CalcAction, timeout_s: float | None = None, **kwargs: Any) -> CalcObservation:
        self._state.step_count += 1
        answer = ANSWER.search(action.message)
        if answer is not None:
            return CalcObservation(result="", done=True, reward=1.0 if answer.group(1) == self.answer else 0.0)
        call = CALL.search(action.message)
        if call is None:
            return CalcObservation(result="<result>use <calc>expression</calc> or <answer>number</answer></result>",
                                   reward=0.0)
        try:
            return CalcObservation(result=f"<result>{evaluate(call.group(1))}</result>", reward=0.0)
        except (ValueError, SyntaxError) as exc:
            return CalcObservation(result=f"<result>error: {exc}</result>", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(CalcToolEnvironment, CalcAction, CalcObservation, max_concurrent_envs=16)
