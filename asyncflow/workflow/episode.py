"""One multi-turn episode: LLM turn, environment step, next turn — with exact token bookkeeping.

Each episode is its own asyncio task (see `RolloutWorker.run`), so a slow environment holds
only its own episode while the engine decodes other episodes' turns (ROLL Flash's environment-level
asynchrony; no barrier across environments).

Token bookkeeping: the response is every token after the prompt, in order — generated tokens exactly
as the engine returned them, environment text tokenized once and appended at the id level. Nothing
is ever re-tokenized, so the tokens trained are the tokens generated. `loss_mask` is 1 on generated
tokens and 0 on environment tokens (masked out of the loss); environment tokens carry log-prob 0 and
the version of the generated token before them, so the sample's oldest version is that of its oldest
generated token. Columns stay run-length (`Runs`) when the engine returns runs (PIPE's simulated
engine), so thousand-token episodes stay small.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from asyncflow.clock import Clock, bounded
from asyncflow.engines.base import GenRequest, GenResult, InferenceEngine, requester
from asyncflow.envs.base import Env, EnvError, EnvStep, env_call
from asyncflow.runs import Runs, concat, oldest, total, without_end


class EpisodeTokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass
class EpisodeSettings:
    max_new_tokens: int
    temperature: float
    request_timeout_s: float
    env_timeout_s: float
    top_p: float = 1.0
    top_k: int = 0
    # the model's positions (None: unknown): a turn generates at most what is left of them, and an
    # episode whose context has filled them ends (`length`). The context grows by every turn and
    # observation; past the positions a server refused the request (ending the run) and a model with
    # learned position embeddings failed with an index error.
    max_context: int | None = None


# One piece of a response, in order: (ids, logprobs, versions, generated). `versions` is None for
# environment text (filled in at the end). A tuple, not an object: one is made per turn.
_Segment = tuple[Sequence[int], Sequence[float], Sequence[int] | None, bool]


@dataclass
class Trajectory:
    """The growing response of an episode, as segments (concatenated once, at the end), after
    `prefix` (the prompt): `context()` is prefix + response so far, the next turn's request."""

    prefix: Sequence[int] = ()
    segments: list[_Segment] = field(default_factory=list)
    _context: Sequence[int] | None = None  # prefix + every segment so far (kept up to date: read every turn)

    def add_generated(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        self.segments.append((ids, logprobs, versions, True))
        self._context = concat((self.context() if self._context is None else self._context, ids))

    def add_env(self, ids: Sequence[int]) -> None:
        if len(ids):
            self.segments.append((ids, Runs([(0.0, len(ids))]), None, False))
            self._context = concat((self.context(), ids))

    def context(self) -> Sequence[int]:
        if self._context is None:
            self._context = concat([self.prefix])  # a copy: requests never share the stored prompt
        return self._context

    def response_ids(self) -> Sequence[int]:
        return concat([s[0] for s in self.segments])

    def fields(self) -> dict[str, Any]:
        """`response_ids`, `behavior_logprobs`, `token_versions`, `loss_mask`, `behavior_version`.
        Environment tokens carry the version of the generated token before them (the first
        generated token's, before any)."""
        segments = self.segments
        last = -1
        for s in segments:  # only generated segments carry versions
            if s[2] is not None and len(s[2]):
                last = s[2][0]
                break
        versions: list[Sequence[int]] = []
        behavior: int | None = None
        for ids, _, v, _ in segments:
            if v is not None and len(v):
                versions.append(v)
                last = v[-1]
                o = oldest(v)
                if behavior is None or o < behavior:
                    behavior = o
            else:
                versions.append(Runs([(last, len(ids))]))
        return {
            "response_ids": self.response_ids(),
            "behavior_logprobs": concat([s[1] for s in segments]),
            "token_versions": concat(versions),
            "loss_mask": Runs([(1 if s[3] else 0, len(s[0])) for s in segments]),  # (merges, skips empties)
            "behavior_version": -1 if behavior is None else behavior,
        }


class TurnBarrier:
    """Lock-step turns for a batch of episodes — the baseline that environment-level asynchrony
    removes: every live episode of the batch reaches the same point (all generations of a turn
    done, then all environment steps done) before any goes on. A finished episode leaves."""

    def __init__(self, parties: int, timeout_s: float) -> None:
        self.parties = parties
        self.timeout_s = timeout_s  # the longest an episode waits for the others (WaitTimeout)
        self._arrived = 0
        self._released = asyncio.Event()

    async def wait(self) -> None:
        released = self._released
        self._arrived += 1
        self._maybe_release()
        await bounded(released.wait(), self.timeout_s, f"the turn barrier's {self.parties} episodes")

    def leave(self) -> None:
        self.parties -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._arrived and self._arrived >= self.parties:
            released, self._released, self._arrived = self._released, asyncio.Event(), 0
            released.set()

    def party(self) -> BarrierParty:
        """One episode's handle: it leaves at most once (an abandoned episode is made to leave by
        its owner, and again by its own `finally` should it ever end)."""
        return BarrierParty(self)


class BarrierParty:
    __slots__ = ("barrier", "left")

    def __init__(self, barrier: TurnBarrier) -> None:
        self.barrier, self.left = barrier, False

    async def wait(self) -> None:
        if not self.left:  # (one made to leave is no longer counted: it released a turn early)
            await self.barrier.wait()

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self.barrier.leave()


@dataclass
class EpisodeResult:
    fields: dict[str, Any]
    """Store fields: the `Trajectory` columns plus `finish_reason`, `turns`, `reward`, `reward_error`."""


async def run_episode(
    *,
    env: Env,
    engine: InferenceEngine,
    clock: Clock,
    tok: EpisodeTokenizer,
    uid: int,
    prompt_ids: Sequence[int],
    row: dict[str, Any],
    seed: int,
    settings: EpisodeSettings,
    on_env_step: Callable[[int, float, float], None] | None = None,
    barrier: TurnBarrier | BarrierParty | None = None,
    floor: Callable[[], float] | None = None,
) -> EpisodeResult:
    """Play one episode to its end. An environment that fails or hangs ends the episode with its
    error as `reward_error` (the sample is then kept out of the loss); a cancelled generation ends
    it with `finish_reason: cancelled` (the trainer drops its group). Generation failures propagate.
    `on_env_step(turn, start, end)` is told the clock times of every environment step (tracing).
    `barrier`: wait for the batch's other episodes after every generation and environment step.
    `floor()`: the oldest policy version a sample may still be trained with (`max_staleness`); an
    episode whose earliest generated token is older ends before its next turn with `finish_reason:
    cancelled`, as the engine cancels a single-turn request (the engine sees only the current turn's
    tokens, so without this a stale episode played all its remaining turns, then was dropped)."""
    traj = Trajectory(prompt_ids)
    progress = _Progress()
    submit = requester(engine)
    closed = False
    try:
        traj.add_env(tok.encode(_observation(
            await env_call(clock, env.reset(row, seed), settings.env_timeout_s, env, "reset"), env, "reset")))
        await _play_turns(traj, progress, env=env, submit=submit, clock=clock, tok=tok, uid=uid, settings=settings,
                          on_env_step=on_env_step, barrier=barrier, floor=floor)
    except EnvError as exc:
        progress.error = str(exc)
    except GeneratorExit:  # an abandoned episode's coroutine, closed at exit: nothing may be awaited now
        closed = True
        raise
    finally:
        if barrier is not None:
            barrier.leave()
        if not closed:
            close_error = await _close_env(env, clock, settings.env_timeout_s)
            if close_error is not None:
                progress.error = progress.error or close_error
    fields = traj.fields()
    fields.update(finish_reason=progress.finish, turns=progress.turns,
                  reward=None if progress.error else progress.reward, reward_error=progress.error)
    return EpisodeResult(fields)


@dataclass
class _Progress:
    """How far an episode got: updated as it goes, so whatever ends it (an `EnvError` mid-turn
    included) reports the turns and reward reached."""

    reward: float = 0.0
    error: str | None = None
    finish: str = "length"
    turns: int = 0


async def _play_turns(
    traj: Trajectory,
    progress: _Progress,
    *,
    env: Env,
    submit: Callable[[GenRequest], Awaitable[GenResult]],
    clock: Clock,
    tok: EpisodeTokenizer,
    uid: int,
    settings: EpisodeSettings,
    on_env_step: Callable[[int, float, float], None] | None,
    barrier: TurnBarrier | BarrierParty | None,
    floor: Callable[[], float] | None,
) -> None:
    """`run_episode`'s turns after the reset: generate, step the environment, append its observation,
    until the environment is done, the turns or positions run out, or the episode is cancelled."""
    first_version = math.inf  # the oldest version of the tokens generated so far
    ends = end_ids(tok)
    for turn in range(1, env.max_turns + 1):
        if floor is not None and first_version < floor():
            progress.finish = "cancelled"
            return
        context = traj.context()
        max_new = settings.max_new_tokens if settings.max_context is None else _turn_limit(len(context), settings)
        if max_new is None:
            if turn == 1:  # nothing generated: not a sample to train (its reward would say nothing)
                progress.error = (f"the prompt and the environment's first observation take {len(context)} of the "
                                  f"model's {settings.max_context} positions: no room for a turn")
            return  # (finish stays "length": the episode ran out of room)
        progress.turns = turn
        req = GenRequest(uid, context, max_new,  # type: ignore[arg-type]
                         settings.temperature, settings.top_p, settings.top_k)
        res = await clock.wait_for(submit(req), settings.request_timeout_s,
                                   f"generation of sample {uid}, turn {turn}")
        traj.add_generated(res.response_ids, res.behavior_logprobs, res.token_versions)
        if first_version == math.inf and floor is not None and len(res.token_versions):
            # (versions never go back, so the first turn with tokens holds the episode's oldest)
            first_version = oldest(res.token_versions)
        if barrier is not None:
            await barrier.wait()
        if res.finish_reason == "cancelled":
            progress.finish = "cancelled"
            return
        # the environment's step on the turn's text, decoded without its end token (in place, not a
        # coroutine of its own: one frame less to create and to resume through, every turn)
        start = 0.0 if on_env_step is None else clock.now()
        step = _checked_step(await env_call(clock, env.step(tok.decode(without_end(res.response_ids, ends))),
                                            settings.env_timeout_s, env, f"step {turn}"), env, turn)
        if on_env_step is not None:  # (its clock times, for tracing)
            on_env_step(turn, start, clock.now())
        if barrier is not None:
            await barrier.wait()
        progress.reward += float(step.reward)
        if step.done:
            progress.finish = "stop"
            return
        if turn < env.max_turns:
            obs = tok.encode(step.observation)
            if settings.max_context is not None and len(traj.context()) + len(obs) >= settings.max_context:
                return  # no room for it and a turn: the episode ran out of positions (finish "length";
                # appended, the sample outgrew the model's positions and failed the trainer)
            traj.add_env(obs)


def _turn_limit(context_len: int, settings: EpisodeSettings) -> int | None:
    """The most tokens the next turn may generate after `context_len` tokens of context; None when
    the context leaves no position for one (only with `max_context`)."""
    max_new = settings.max_new_tokens
    if settings.max_context is not None:
        max_new = min(max_new, settings.max_context - context_len)
        if max_new < 1:
            return None
    return max_new


async def _close_env(env: Env, clock: Clock, timeout_s: float) -> str | None:
    """Close the episode's environment; the error closing it, if any."""
    try:  # (a task given up on closes on the wrapped clock: `SweptClock.for_cleanup`)
        cleanup = clock.for_cleanup() if hasattr(clock, "for_cleanup") else clock
        await env_call(cleanup, env.close(), timeout_s, env, "close")
    except EnvError as exc:
        return str(exc)
    return None


def end_ids(tok: EpisodeTokenizer) -> Collection[int]:
    """The ids a finished turn ends with: the EOS and generation_config's stop ids (`Tokenizer.ends`;
    a tokenizer without them, just its EOS)."""
    return getattr(tok, "ends", None) or (tok.eos_token_id,)


def hung_episode(prompt_ids: Sequence[int], error: str) -> EpisodeResult:
    """The fields of an episode abandoned because its environment ignores cancellation
    (`clock.run_guarded`'s `on_stuck`): nothing of it is kept, `error` is its reward_error."""
    fields = Trajectory(prompt_ids).fields()
    fields.update(finish_reason="length", turns=0, reward=None, reward_error=f"environment hung: {error}")
    return EpisodeResult(fields)


def _observation(value: Any, env: Env, what: str) -> str:
    if not isinstance(value, str):
        raise EnvError(f"environment {env.name!r} {what} returned {type(value).__name__}, expected the observation "
                       "text (str)")
    return value


def _checked_step(step: Any, env: Env, turn: int) -> EnvStep:
    """What `Env.step` returned, checked: an `EnvStep` with a text observation, a finite real reward
    and a bool `done`. Anything else ends the episode with an `EnvError` naming it (it went into the
    trajectory unchecked: a NaN reward made a whole group's advantages NaN, and a wrong type stopped
    the run with a traceback)."""
    if type(step) is EnvStep and type(step.observation) is str and type(step.reward) is float \
            and math.isfinite(step.reward) and type(step.done) is bool:
        return step  # (the common case, in one expression: this runs every turn of every episode)
    what = f"step {turn}"
    if not isinstance(step, EnvStep):
        raise EnvError(f"environment {env.name!r} {what} returned {type(step).__name__}, expected an EnvStep")
    _observation(step.observation, env, f"{what} observation")
    r = step.reward
    try:  # (an int beyond a float's range raised OverflowError here, which stopped the rollout worker)
        finite = not isinstance(r, bool) and isinstance(r, numbers.Real) and math.isfinite(float(r))
    except (OverflowError, TypeError, ValueError):
        finite = False
    if not finite:
        raise EnvError(f"environment {env.name!r} {what} returned reward {r!r}, expected a finite number")
    if not isinstance(step.done, (bool, np.bool_)):
        raise EnvError(f"environment {env.name!r} {what} returned done={step.done!r}, expected True or False")
    return step


def generated_tokens(loss_mask: Sequence[int]) -> int:
    """How many tokens of a response were generated (trained), from its loss mask."""
    return int(total(loss_mask))  # type: ignore[arg-type]
