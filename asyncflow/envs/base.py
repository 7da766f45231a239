"""The environment API for multi-turn agents.

An episode is its own task: LLM turn, `env.step(action)`, next LLM turn, ... with no barrier across
episodes, so a slow environment holds only its own episode (ROLL Flash's environment-level
asynchrony). Environments are async: waiting on a tool, a sandbox or a game server yields to the
other episodes instead of blocking a thread.

Contract:
- `reset(row, seed)` returns the first observation (the text the model sees first); `row` is the
  dataset row (question, answer, any columns), `seed` makes the episode reproducible.
- `step(action)` takes the model's text for one turn and returns an `EnvStep`: the observation text
  to append (it is tokenized and masked out of the loss: the tokens trained are the tokens generated),
  a reward for this step, and `done`. The episode's reward is the sum of its step rewards.
- Every call is bounded: `env_call` ends a call that exceeds its timeout with `EnvError` naming the
  environment and the call, so a hung environment ends its episode with an error instead of hanging
  the run. An exception raised by the environment is reported the same way.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncflow.clock import Clock
from asyncflow.errors import WaitTimeout

T = TypeVar("T")


@dataclass
class EnvStep:
    """What one environment step returns."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class EnvError(Exception):
    """An environment call failed or timed out; the episode ends with this message."""


class Env(abc.ABC):
    """One episode of an environment (a fresh instance per episode)."""

    name: str = "env"
    max_turns: int = 8
    """Most LLM turns per episode; the episode ends (not done) after them."""

    @abc.abstractmethod
    async def reset(self, row: dict[str, Any], seed: int) -> str:
        """Start the episode; return the first observation."""

    @abc.abstractmethod
    async def step(self, action: str) -> EnvStep:
        """Apply the model's turn; return the next observation, this step's reward and done."""

    async def close(self) -> None:
        """Release resources (called once per episode, also after errors)."""
        return None


async def env_call(clock: Clock, aw: Awaitable[T], timeout_s: float, env: Env, what: str) -> T:
    """Await an environment call with a bound; failures become `EnvError` naming env and call."""
    try:
        return await clock.wait_for(aw, timeout_s, f"environment {env.name!r} {what}")
    except WaitTimeout as exc:
        raise EnvError(f"environment {env.name!r} hung: {what} took longer than {timeout_s:g} s") from exc
    except EnvError:
        raise
    except Exception as exc:  # the environment's own bug: end this episode, keep the run
        raise EnvError(f"environment {env.name!r} failed in {what}: {type(exc).__name__}: {exc}") from exc
    except asyncio.CancelledError as exc:
        if not own_cancel():
            raise  # (the run, or its timeout, cancelled this episode)
        raise EnvError(f"environment {env.name!r} failed in {what}: CancelledError raised by the environment "
                       "itself (e.g. it awaited a task it had cancelled)") from exc


def own_cancel() -> bool:
    """Whether a `CancelledError` came from the awaited plugin's own code (it awaited a task it had
    cancelled, say), not from a cancellation of the current task: that one ended the episode's task
    unreported (no reward_error, no ack), and an evaluation with a traceback."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # (Python >= 3.11)
    return task is not None and cancelling is not None and cancelling() == 0
