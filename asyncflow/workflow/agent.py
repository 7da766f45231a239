"""Black-box agent episodes (`rollout.agent`): run the user's agent against its own recording
endpoint and turn the recorded calls into one training sample.

The agent is `async def agent(base_url: str, row: dict, seed: int) -> float` (or a dict with
`reward`); it may use any OpenAI client against `base_url` (see `agent_proxy.py`). Each episode is
run on an event loop and thread of its own (`agent_thread.py`), so a slow agent holds only its own
episode, and one that blocks (a synchronous HTTP call in an `async def`) cannot stall the worker.

Stitching: the calls, in the order they finished, form one multi-turn trajectory while each call's
prompt ids extend the previous call's prompt + response ids (a prefix check on token ids). The
sample's prompt is the first call's prompt; its response is everything after, with `loss_mask` 1 on
generated tokens and 0 on the tokens the agent added between calls (via `Trajectory`, like an
environment's observations). When a call does not extend the context (the agent rewrote history),
only the longest consistent prefix of calls is kept — the sample's reward is the episode's — and the
rest are counted as `agent_calls_dropped`: one sample per episode keeps GRPO groups whole, and the
tokens are never mis-aligned. An agent that raises, hangs past `rollout.agent_timeout_s`, returns no
reward or makes no model call ends its episode with `reward_error` (kept out of the loss).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncflow.clock import Clock
from asyncflow.engines.base import InferenceEngine
from asyncflow.envs.verifiers_env import is_verifiers_spec
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.user_code import load_attr
from asyncflow.workflow.agent_proxy import AgentProxy, Call, EpisodeRecorder, RecorderSettings
from asyncflow.workflow.agent_thread import AgentBlocked, AgentCancelled, run_agent_thread
from asyncflow.workflow.episode import EpisodeResult, Trajectory

AgentFn = Callable[[str, dict[str, Any], int], Awaitable[Any]]


def load_agent(spec: str) -> AgentFn:
    """`rollout.agent` (`module:function` or `path/to/file.py:function`, found as `reward.fn` is:
    no folder joins sys.path) -> the async agent function; bad specs are a UserError.
    `verifiers:...` is a verifiers environment played as an agent (`envs/verifiers_env.py`)."""
    if is_verifiers_spec(spec):
        from asyncflow.envs.verifiers_env import VerifiersAgent

        return VerifiersAgent(spec)
    fn = load_attr(spec, "rollout.agent")
    if not inspect.iscoroutinefunction(fn):
        raise UserError(f"rollout.agent: {spec!r} must be an async function (base_url, row, seed) -> reward")
    return fn  # type: ignore[no-any-return]


def stitch(calls: Sequence[Call]) -> tuple[list[int], Trajectory, int]:
    """(prompt ids, trajectory, calls kept): the longest prefix of calls that each extend the
    previous context; the first call's prompt is the prompt."""
    prompt = list(calls[0].prompt_ids)
    traj = Trajectory()
    context: list[int] = []
    kept = 0
    for i, c in enumerate(calls):
        if i:
            if c.prompt_ids[: len(context)] != context:
                break
            traj.add_env(c.prompt_ids[len(context):])
        traj.add_generated(c.response_ids, c.logprobs, c.versions)
        context = [*c.prompt_ids, *c.response_ids]
        kept += 1
    return prompt, traj, kept


def _reward_of(value: Any) -> float:
    reward = value.get("reward") if isinstance(value, dict) else value
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise ValueError(f"the agent returned {value!r}; expected a finite number or a dict with 'reward'")
    return float(reward)


async def run_agent_episode(
    *,
    agent: AgentFn,
    proxy: AgentProxy,
    engine: InferenceEngine,
    clock: Clock,
    tok: Any,
    uid: int,
    row: dict[str, Any],
    seed: int,
    settings: RecorderSettings,
    timeout_s: float,
    floor: Callable[[], float] | None = None,
) -> EpisodeResult:
    """Run one agent episode to its end; its fields as `run_episode` returns them, plus `prompt_ids`
    (the first call's prompt) and `agent_calls`/`agent_calls_dropped`. A generation failure
    propagates (it is the run's, not the agent's)."""
    rec = EpisodeRecorder(engine, tok, uid, settings, clock, floor)
    base_url = proxy.register(rec)
    reward: float | None = None
    error: str | None = None
    try:
        # on a loop and thread of its own (`agent_thread.py`): an agent that blocks (a synchronous HTTP
        # call to this endpoint) froze the worker's loop, endpoint and timeouts with it; one that
        # swallows the cancellation of its timeout still ends its episode at the limit
        reward = _reward_of(await run_agent_thread(clock, agent, (base_url, row, seed), timeout_s,
                                                   f"agent episode {uid}"))
    except WaitTimeout as exc:
        error = f"agent hung: episode {uid} took longer than rollout.agent_timeout_s={timeout_s:g} s"
        if isinstance(exc, AgentBlocked):
            error += (f"; its event loop is blocked in a synchronous call at {exc.where} (an async agent must not "
                      "block: use an async client, or asyncio.to_thread)")
    except AgentCancelled as exc:
        error = f"agent failed: {exc}"
    except Exception as exc:  # the agent's own failure: end this episode, keep the run
        error = f"agent failed: {type(exc).__name__}: {exc}"
    finally:
        proxy.unregister(base_url)
    if rec.failure is not None:
        raise rec.failure
    calls = list(rec.calls)
    if not calls:
        fields = Trajectory().fields()
        fields.update(response_ids=[], behavior_logprobs=[], token_versions=[], loss_mask=[])
        error = error or "agent made no model call"
        kept = 0
    else:
        prompt, traj, kept = stitch(calls)
        fields = {**traj.fields(), "prompt_ids": prompt}
    used = calls[:kept]
    finish = "cancelled" if rec.stale or any(c.finish_reason == "cancelled" for c in calls) else \
        (used[-1].finish_reason if used else "length")
    fields.update(finish_reason=finish, turns=kept, agent_calls=len(calls), agent_calls_dropped=len(calls) - kept,
                  reward=None if error else reward, reward_error=error)
    return EpisodeResult(fields)
