"""Multi-turn environments: the `Env` API and built-in environments (see `base`)."""

import inspect
from collections.abc import Callable, Mapping

from asyncflow.clock import Clock
from asyncflow.envs.base import Env, EnvError, EnvStep, env_call
from asyncflow.envs.builtin import CalculatorEnv, GuessNumberEnv, safe_arith
from asyncflow.envs.openenv_env import is_openenv_spec, make_openenv_factory
from asyncflow.errors import UserError
from asyncflow.user_code import load_attr

# an OpenEnv server's reply is awaited this long by its client; every environment call is bounded by
# rollout.env_timeout_s anyway (`env_call`), which ends a hung one first unless set above this
OPENENV_MESSAGE_TIMEOUT_S = 3600.0


def make_env_factory(spec: str, *, latency_s: float = 0.0, max_turns: int = 4) -> Callable[[Clock], Env]:
    """`rollout.env` -> a factory of one fresh `Env` per episode, given the run's clock.

    `openenv:...` / `openenv+server:...` is an OpenEnv environment (`envs/openenv_env.py`).

    A `module:factory` is called `factory(clock, max_turns=..., latency_s=...)`, passing each keyword
    it accepts (or all, with `**kwargs`). `rollout.max_turns` bounds every episode: a factory that
    does not take `max_turns` gets it set on the env it returns, and one that does cannot raise it
    (an env allowing more turns is capped to it). A `latency_s > 0` that the factory
    cannot take is refused here (it would be ignored).
    """
    if is_openenv_spec(spec):  # an OpenEnv environment, as its authors wrote it (envs/openenv_env.py)
        if latency_s > 0:
            raise UserError("rollout.env_latency_s: not used with an openenv environment (leave it at 0)")
        return make_openenv_factory(spec, max_turns=max_turns, timeout_s=OPENENV_MESSAGE_TIMEOUT_S)
    if spec == "calculator":
        return lambda clock: CalculatorEnv(clock, latency_s=latency_s, max_turns=max_turns)
    if spec == "guess_number":
        return lambda clock: GuessNumberEnv(clock, latency_s=latency_s, max_turns=max_turns)
    factory = load_attr(spec, "rollout.env", "factory")  # as reward.fn: no folder joins sys.path
    if not callable(factory):
        raise UserError(f"rollout.env: {spec!r} is not callable")
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass the clock only
        params = {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    takes = {k for k in ("max_turns", "latency_s") if var_kw or k in params}
    if latency_s > 0 and "latency_s" not in takes:
        raise UserError(
            f"rollout.env_latency_s: {spec!r} does not take a latency_s keyword, so the setting would be "
            "ignored; add the keyword to the factory or leave env_latency_s at 0"
        )
    kwargs = {k: v for k, v in (("max_turns", max_turns), ("latency_s", latency_s)) if k in takes}

    def make(clock: Clock) -> Env:
        try:
            env = factory(clock, **kwargs)
        except Exception as exc:  # (a factory without the clock parameter, or one that raises): the plugin's
            raise UserError(f"rollout.env: {spec!r} failed to make an environment: {type(exc).__name__}: "
                            f"{exc}") from None  # fault, every episode alike: one line, not a traceback
        if not isinstance(env, Env):
            raise UserError(f"rollout.env: {spec!r} returned {type(env).__name__}, not an asyncflow.envs.Env")
        # the setting bounds every episode, whatever the factory did with the keyword (one taking
        # **kwargs, or `max_turns` it ignores, played as many turns as its env allowed)
        env.max_turns = max_turns if "max_turns" not in takes else min(env.max_turns, max_turns)
        return env  # type: ignore[no-any-return]

    return make


__all__ = [
    "CalculatorEnv",
    "Env",
    "EnvError",
    "EnvStep",
    "GuessNumberEnv",
    "env_call",
    "make_env_factory",
    "safe_arith",
]
