"""The environment API and the built-in environments (run on the virtual clock: latencies are free)."""

from __future__ import annotations

import asyncio

import pytest

from asyncflow.envs import CalculatorEnv, Env, EnvError, EnvStep, GuessNumberEnv, env_call, safe_arith
from asyncflow.virtual_loop import VirtualClock, run_virtual


@pytest.mark.parametrize(
    ("expr", "value"), [("12*(3+4)", 84), ("7/2", 3.5), ("-3**2", -9), ("2**10 % 1000", 24), ("17//5", 3)]
)
def test_safe_arith_evaluates_arithmetic(expr: str, value: float) -> None:
    assert safe_arith(expr) == value


@pytest.mark.parametrize(
    "expr", ["__import__('os')", "x+1", "len('abc')", "1/0", "2**1000", "1" * 300, "(1,2)", "'a'*3",
             # a model's text used to end its episode with TypeError/OverflowError, or to run for hours
             # on the event loop (nested powers pass the exponent rule)
             "(-1)**.5", "10**64*10**64*10**64*10**64*10**64", "((((9**64)**64)**64)**64)**64", "1e308*10*1",
             # literals beyond the bounds the docs give (inf; 662 bits), alone or negated
             "1e999", "-1e999", "9" * 199, "-" + "9" * 150]
)
def test_safe_arith_refuses_everything_else(expr: str) -> None:
    with pytest.raises(ValueError):
        safe_arith(expr)


def test_calculator_episode_tool_call_then_answer() -> None:
    async def main(clock: VirtualClock):
        env = CalculatorEnv(clock, latency_s=2.0)
        first = await env.reset({"question": "What is 12*(3+4)?", "answer": "84"}, seed=0)
        tool = await env.step("let me compute <calc>12*(3+4)</calc>")
        bad = await env.step("<calc>import os</calc>")
        final = await env.step("<answer>84</answer>")
        return first, tool, bad, final, clock.now()

    first, tool, bad, final, t = run_virtual(main)
    assert first == ""  # the prompt asks the question; reset adds nothing
    assert tool == EnvStep("<result>84</result>", 0.0, False, {"tool_calls": 1})
    assert bad.observation.startswith("<result>error:") and not bad.done
    assert final.done and final.reward == 1.0
    assert t == pytest.approx(8.0)  # reset + 3 steps at 2 s each, on the run's clock


def test_guess_number_game_gives_hints_until_correct() -> None:
    async def main(clock: VirtualClock):
        env = GuessNumberEnv(clock, high=100)
        await env.reset({}, seed=7)
        lo, hi, turns = 1, 100, 0
        while True:  # binary search through the env's hints
            turns += 1
            g = (lo + hi) // 2
            step = await env.step(f"<guess>{g}</guess>")
            if step.done:
                return turns, step, g, env.secret
            lo, hi = (g + 1, hi) if step.observation == "higher" else (lo, g - 1)

    turns, step, g, secret = run_virtual(main)
    assert g == secret and step.reward == 1.0 and turns <= 7


def test_a_hung_or_broken_environment_ends_its_episode_with_an_error() -> None:
    class Hung(Env):
        name = "hung"

        async def reset(self, row, seed):
            return "hi"

        async def step(self, action):
            await asyncio.sleep(10_000)
            return EnvStep("never")

    class Broken(Hung):
        name = "broken"

        async def step(self, action):
            raise KeyError("state")

    async def main(clock: VirtualClock):
        with pytest.raises(EnvError, match=r"environment 'hung' hung: step took longer than 30 s"):
            await env_call(clock, Hung().step("x"), 30.0, Hung(), "step")
        with pytest.raises(EnvError, match=r"environment 'broken' failed in step: KeyError"):
            await env_call(clock, Broken().step("x"), 30.0, Broken(), "step")
        return clock.now()

    assert run_virtual(main) == pytest.approx(30.0)
