"""Multi-turn environments: the `Env` API and built-in environments (see `base`)."""

import importlib
from collections.abc import Callable

from asyncflow.envs.base import Env, EnvError, EnvStep, env_call
from asyncflow.envs.builtin import CalculatorEnv, GuessNumberEnv, safe_arith
from asyncflow.errors import UserError
from asyncflow.runtime.clock import Clock


def make_env_factory(spec: str, *, latency_s: float = 0.0, max_turns: int = 4) -> Callable[[Clock], Env]:
    """`rollout.env` -> a factory of one fresh `Env` per episode, given the run's clock."""
    if spec == "calculator":
        return lambda clock: CalculatorEnv(clock, latency_s=latency_s, max_turns=max_turns)
    if spec == "guess_number":
        return lambda clock: GuessNumberEnv(clock, latency_s=latency_s, max_turns=max_turns)
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"rollout.env: cannot import {spec!r}: {exc}") from None
    if not callable(factory):
        raise UserError(f"rollout.env: {spec!r} is not callable")
    return factory  # type: ignore[no-any-return]


__all__ = [
    "make_env_factory","CalculatorEnv", "Env", "EnvError", "EnvStep", "GuessNumberEnv", "env_call", "safe_arith"]
