"""Built-in environments: a calculator tool (tool use) and a number-guessing game (multi-turn).

Both take an adjustable per-step latency (`latency_s`, waited on the run's clock) so that the
benefit of environment-level asynchrony can be measured, and both parse the model's text with
simple tags, the format their task pack warm-starts the model on:

The prompt (the dataset row's prompt column) is what the model sees first; `reset` returns text
appended after it, empty for both.

- `CalculatorEnv`: the row holds the question (the prompt) and `answer`. A turn may call the tool with
  `<calc>12*(3+4)</calc>`; the observation is `<result>84</result>`. A turn with
  `<answer>84</answer>` ends the episode with reward 1.0 if it equals the row's answer, else 0.0.
  Expressions are evaluated by `safe_arith` (numbers and + - * / // % ** only; no names, no calls;
  exponents up to 64, integers up to 256 bits, finite real results: anything else is an error
  result, `<result>error: ...</result>`, never an error of the episode).
- `GuessNumberEnv`: a secret number in [1, high] drawn from the episode's seed; a turn
  `<guess>37</guess>` gets `higher`, `lower` or `correct`; a correct guess ends the episode with
  reward 1.0 (later turns are worth the same: the score is success). A turn without a guess gets a
  reminder of the format.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from asyncflow.clock import Clock
from asyncflow.envs.base import Env, EnvStep

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPR_CHARS = 200
MAX_POWER = 64
MAX_RESULT_BITS = 256  # every intermediate integer: nested powers grew without bound (hours on the loop)


def _bounded(value: int | float) -> int | float:
    """`value`, or ValueError when it is infinite or an integer over `MAX_RESULT_BITS` bits."""
    if (value.bit_length() > MAX_RESULT_BITS) if isinstance(value, int) else not math.isfinite(value):
        raise ValueError("result too large")
    return value


def safe_arith(expr: str) -> int | float:
    """Evaluate an arithmetic expression without `eval`; raises ValueError on anything else."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expr!r}") from exc

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return _bounded(node.value)  # (`1e999` is inf; a literal may be longer than the bound)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
                raise ValueError(f"exponent above {MAX_POWER}")
            try:
                value = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError as exc:
                raise ValueError("division by zero") from exc
            except OverflowError as exc:  # (float overflow, or an int too large for a float division)
                raise ValueError("result too large") from exc
            if isinstance(value, complex):  # (a negative number to a fractional power)
                raise ValueError("the result is not a real number")
            return _bounded(value)  # type: ignore[arg-type]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _bounded(_UNARY[type(node.op)](ev(node.operand)))
        raise ValueError(f"not allowed in an arithmetic expression: {type(node).__name__}")

    return ev(tree)


def _fmt(x: int | float) -> str:
    return str(x) if isinstance(x, int) else str(int(x)) if x.is_integer() else f"{x:.6g}"


class _Timed(Env):
    def __init__(self, clock: Clock, latency_s: float = 0.0, max_turns: int = 8) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.max_turns = max_turns

    async def _latency(self) -> None:
        if self.latency_s > 0:
            await self.clock.sleep(self.latency_s)


class CalculatorEnv(_Timed):
    """Tool use: the model may call a calculator before it answers."""

    name = "calculator"
    CALL = re.compile(r"<calc>(.*?)</calc>", re.S)
    ANSWER = re.compile(r"<answer>\s*(-?[\d.]+)\s*</answer>")

    async def reset(self, row: dict[str, Any], seed: int) -> str:
        self.answer = str(row["answer"]).strip()
        await self._latency()
        return ""  # the prompt already asks the question

    async def step(self, action: str) -> EnvStep:
        await self._latency()
        ans = self.ANSWER.search(action)
        if ans is not None:
            ok = same_number(ans.group(1), self.answer)
            return EnvStep("", reward=1.0 if ok else 0.0, done=True, info={"correct": ok})
        call = self.CALL.search(action)
        if call is None:
            return EnvStep("<result>use <calc>expression</calc> or <answer>number</answer></result>")
        try:
            return EnvStep(f"<result>{_fmt(safe_arith(call.group(1)))}</result>", info={"tool_calls": 1})
        except ValueError as exc:
            return EnvStep(f"<result>error: {exc}</result>", info={"tool_calls": 1, "tool_error": True})


class GuessNumberEnv(_Timed):
    """A multi-turn game: find the secret number from higher/lower hints."""

    name = "guess_number"
    PROMPT = "Guess my number between 1 and {high}. Reply <guess>n</guess>."
    GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")

    def __init__(self, clock: Clock, latency_s: float = 0.0, max_turns: int = 8, high: int = 100) -> None:
        super().__init__(clock, latency_s, max_turns)
        self.high = high

    async def reset(self, row: dict[str, Any], seed: int) -> str:
        self.secret = random.Random(seed).randint(1, self.high)
        await self._latency()
        return ""  # the prompt states the game (see `GuessNumberEnv.PROMPT`)

    async def step(self, action: str) -> EnvStep:
        await self._latency()
        m = self.GUESS.search(action)
        if m is None:
            return EnvStep("reply with <guess>n</guess>")
        g = int(m.group(1))
        if g == self.secret:
            return EnvStep("correct", reward=1.0, done=True)
        return EnvStep("higher" if g < self.secret else "lower")


def same_number(a: str, b: str) -> bool:
    """Integers compare exactly (as floats, two beyond 2**53 that differ were equal: the calculator
    computes exact integers, so a wrong large answer was paid); other numbers within 1e-9."""
    try:
        return int(a) == int(b)
    except ValueError:
        pass
    try:
        return abs(float(a) - float(b)) < 1e-9
    except ValueError:
        return a.strip() == b.strip()
