"""Multi-turn environments: the `Env` API and built-in environments (see `base`)."""

from asyncflow.envs.base import Env, EnvError, EnvStep, env_call
from asyncflow.envs.builtin import CalculatorEnv, GuessNumberEnv, safe_arith

__all__ = ["CalculatorEnv", "Env", "EnvError", "EnvStep", "GuessNumberEnv", "env_call", "safe_arith"]
