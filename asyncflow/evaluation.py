"""Greedy evaluation on held-out prompts, written as `kind: "eval"` rows.

Each distinct prompt is evaluated once and counts once (`eval_set`): its copies would get the same
greedy completion. Copies that differ in another column (a second reference answer) are each scored
against that one completion, and the prompt's reward is the mean over its copies.

Eval requests go through a rollout engine like any other request (they join its continuous batch),
at temperature 0, so evaluating does not need a second copy of the model. With a multi-turn
environment (`rollout.env`) or a black-box agent (`rollout.agent`) each eval prompt is a greedy
episode and its reward the episode's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncflow.clock import wait_detached
from asyncflow.config import Config
from asyncflow.data import row_copy, tokenize_prompt
from asyncflow.engines.base import GenRequest, InferenceEngine
from asyncflow.errors import WaitTimeout
from asyncflow.eval_set import EvalPrompt, distinct_prompts, fold_rewards, prompt_reward
from asyncflow.rewards import (
    PLAIN_CALLS_PER_HOP,
    PlainCalls,
    RewardFn,
    RewardOutcome,
    TrainerState,
    call_reward_fn_async,
    is_async_reward_fn,
)
from asyncflow.telemetry.runlog import RunLog, Tracer


def eval_flattened(accuracies: Sequence[float], patience: int, min_delta: float) -> bool:
    """The last `patience` evaluations did not beat the best one before them by more than `min_delta`
    (`eval.patience`); False while there are not `patience` evaluations after the first."""
    if patience < 1 or len(accuracies) <= patience:
        return False
    return max(accuracies[-patience:]) <= max(accuracies[:-patience]) + min_delta


class Evaluator:
    """Scores greedy completions of the distinct eval prompts with the run's reward function."""

    def __init__(
        self,
        cfg: Config,
        rows: list[dict[str, Any]],
        tokenizer: Any,
        reward_fn: RewardFn,
        engine: InferenceEngine,
        log: RunLog,
        tracer: Tracer,
        env_factory: Callable[[Any], Any] | None = None,
        clock: Any = None,
        lenient_fn: RewardFn | None = None,
        agent: Any = None,
    ) -> None:
        """`env_factory`/`clock`: evaluate greedy episodes of this environment instead of single
        completions scored by `reward_fn`. `rows` may hold copies of a prompt: it is evaluated once.
        `lenient_fn` (`eval.lenient_fn`): also score each answer given `eval.lenient_tokens` tokens.
        `agent`: `rollout.agent`'s function, as the run loaded it (loaded here when not given)."""
        self.cfg = cfg
        if agent is None and cfg.rollout.agent is not None:
            from asyncflow.workflow.agent import load_agent

            agent = load_agent(cfg.rollout.agent)
        self.agent = agent
        self.prompts: list[EvalPrompt] = distinct_prompts(rows, cfg.dataset.prompt_key)
        self.tok = tokenizer
        self.reward_fn = reward_fn
        self.lenient_fn = lenient_fn
        self.engine = engine
        self.log = log
        self.tracer = tracer
        self.prompt_ids = [tokenize_prompt(tokenizer.hf, p.rows[0][cfg.dataset.prompt_key]) for p in self.prompts]
        self.history: list[dict[str, Any]] = []
        self.env_factory = env_factory
        self.clock = clock
        self.max_context: int | None = None  # the model's positions, for episodes (set by the runner)
        # a plain reward function's threads (started on first use); hung calls that hold them all fail
        # the evaluation's remaining prompts, never the run (its final evaluation precedes the final save)
        self._plain_calls = PlainCalls(stop_when_full=False)

    def close(self) -> None:
        """Let the plain reward function's idle threads end (a hung call's thread ends when it returns)."""
        self._plain_calls.close()

    async def run(self, step: int) -> dict[str, Any]:
        """Evaluate the engine's current weights; log and return the eval row."""
        start = self.tracer.now()
        version = self.engine.version
        lenient: list[float | None] = []
        if self.cfg.rollout.agent is not None:
            rewards, error, newest = await self._agent_episodes()
        elif self.env_factory is not None:
            rewards, error, newest = await self._episodes()
        else:
            state = TrainerState(step, step, version, self.cfg.train.max_steps)
            rewards, error, newest, lenient = await self._completions(state)
        threshold = self.cfg.eval.success_threshold
        n = max(len(rewards), 1)
        row = {
            "kind": "eval",
            "step": step,
            "policy_version": version,
            # the newest weights any eval token came from: with rollout.weight_update swap or abort the
            # evaluation runs beside training, and a publication during it moves its later tokens on
            "policy_version_max": version if newest is None else max(version, newest),
            # a prompt whose generation or scoring failed counts reward 0 and is never solved (with
            # eval.success_threshold <= 0 a failure's 0 used to count as solved)
            "eval_reward": sum(r or 0.0 for r in rewards) / n,
            "eval_accuracy": sum(r is not None and r >= threshold for r in rewards) / n,
            "eval_size": len(rewards),
            "eval_errors": sum(r is None for r in rewards),
            "eval_error": error,
            "eval_seconds": self.tracer.now() - start,
        }
        if self.lenient_fn is not None and self.env_factory is None and self.cfg.rollout.agent is None:
            row["eval_lenient_reward"] = sum(r or 0.0 for r in lenient) / n
            row["eval_lenient_accuracy"] = sum(r is not None and r >= threshold for r in lenient) / n
        self.tracer.span("eval", f"eval step {step}", start, self.tracer.now())
        self.log.metric(row)
        self.history.append(row)
        return row

    async def _completions(self, state: TrainerState) -> tuple[list[float | None], str | None, int | None,
                                                               list[float | None]]:
        """Greedy completions, one per distinct prompt, each prompt scored as a group of its own (the
        reward function's contract: one call per group; the group holds the prompt's distinct rows, all
        with its one completion), so one bad value or one slow call costs that prompt (None: failed; the
        first error is reported), not the whole evaluation. With `lenient_fn` the answers are generated
        to `eval.lenient_tokens`: the reward function sees their first rollout.max_new_tokens tokens (what
        greedy decoding gives at that limit), `lenient_fn` all of them (its rewards come last)."""
        budget = self.cfg.rollout.max_new_tokens
        lenient_tokens = self.cfg.eval.lenient_tokens or 4 * budget
        try:
            results = await self._generate(max(budget, lenient_tokens) if self.lenient_fn is not None else budget)
        except WaitTimeout as exc:  # a stuck engine fails the evaluation, not the run (the run has its own bounds)
            failed: list[float | None] = [None] * len(self.prompts)
            return failed, str(exc), None, failed
        rewards, error = await self._scored(self.reward_fn, [r.response_ids[:budget] for r in results], results, state)
        lenient: list[float | None] = []
        if self.lenient_fn is not None:
            lenient, _ = await self._scored(self.lenient_fn, [r.response_ids[:lenient_tokens] for r in results],
                                            results, state)
        return rewards, error, _newest(r.token_versions for r in results), lenient

    async def _scored(self, fn: RewardFn, answers: list[list[int]], results: list[Any],
                      state: TrainerState) -> tuple[list[float | None], str | None]:
        """`fn`'s reward of each distinct prompt's answer (token ids), and the first error."""
        key = self.cfg.dataset.prompt_key
        calls = []
        for p, ids in zip(self.prompts, answers, strict=True):
            k, prompt = len(p.rows), p.rows[0][key]
            completion = self.tok.completions([ids], isinstance(prompt, list))
            calls.append((fn, [prompt] * k, completion * k, [list(ids) for _ in range(k)],
                          {c: [r.get(c) for r in p.rows] for c in p.rows[0] if c != key}, state))
        outcomes = await self._score(fn, calls)
        # (engines never cancel evaluation requests; one that comes back cancelled all the same is a
        # failed prompt, not an answer: scored, its cut-short text counted as the model's)
        outcomes = [RewardOutcome(None, "its generation was cancelled") if r.finish_reason == "cancelled" else o
                    for r, o in zip(results, outcomes, strict=True)]
        rewards = [prompt_reward(o.rewards, p.copies) if o.rewards else None
                   for p, o in zip(self.prompts, outcomes, strict=True)]
        errors = [f"eval prompt {i}: {o.error}" for i, o in enumerate(outcomes) if o.error is not None]
        return rewards, (errors[0] if errors else None)

    async def _generate(self, tokens: int) -> list[Any]:
        """Each distinct prompt's greedy generation of at most `tokens` tokens; WaitTimeout when the
        engine does not finish them."""
        requests = [GenRequest(-(i + 1), ids, tokens, temperature=0.0) for i, ids in enumerate(self.prompt_ids)]
        # at most the engine's capacity in flight (a server engine would otherwise get one connection per
        # eval prompt), so it decodes them in ceil(n / capacity) rounds, each within rollout.request_timeout_s
        capacity = max(1, self.engine.capacity)
        rounds = max(1, -(-len(requests) // capacity))
        gate = asyncio.Semaphore(capacity)

        async def generate(request: GenRequest) -> Any:
            async with gate:
                return await self.engine.generate(request)

        return list(await self.clock.wait_for(
            asyncio.gather(*(generate(r) for r in requests)),
            self.cfg.rollout.request_timeout_s * rounds,
            f"greedy generation of the {len(requests)} eval prompts (rollout.request_timeout_s per round of "
            "the engine's batch)"))

    async def _score(self, fn: RewardFn, calls: list[tuple[Any, ...]]) -> list[RewardOutcome]:
        """The calls' outcomes (`fn`'s), one per eval prompt; a call that fails or times out is its error."""
        timeout = self.cfg.reward.timeout_s
        if is_async_reward_fn(fn):
            limit = asyncio.Semaphore(self.cfg.reward.concurrency)  # (a rate-limited judge's setting holds here too)

            async def one(i: int, call: tuple[Any, ...]) -> RewardOutcome:
                async with limit:
                    try:
                        return await wait_detached(self.clock, call_reward_fn_async(*call), timeout,
                                                   f"the reward function on eval prompt {i}")
                    except WaitTimeout as exc:
                        return RewardOutcome(None, str(exc))

            return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(calls))))
        # a thread hop per 8 prompts, as the reward stage's per 8 groups: a call that hangs (a thread
        # cannot be stopped) costs the rest of its chunk, after reward.timeout_s per prompt of it
        outcomes: list[RewardOutcome] = []
        for at in range(0, len(calls), PLAIN_CALLS_PER_HOP):
            chunk = calls[at:at + PLAIN_CALLS_PER_HOP]
            outcomes += await self._plain_calls.score(
                chunk, self.clock.wait_for, timeout,
                f"the reward function on eval prompts {at}-{at + len(chunk) - 1} (reward.timeout_s per prompt)")
        return outcomes

    async def _episodes(self) -> tuple[list[float | None], str | None, int | None]:
        """Greedy episodes, one per distinct row of each prompt (the environment gets the row); a
        prompt whose episode failed is None and the first error is reported."""
        from asyncflow.clock import SweptClock, run_guarded
        from asyncflow.workflow.episode import EpisodeSettings, hung_episode, run_episode

        ro = self.cfg.rollout
        settings = EpisodeSettings(ro.max_new_tokens, 0.0, ro.request_timeout_s, ro.env_timeout_s,
                                   max_context=self.max_context)
        assert self.env_factory is not None
        # the episodes' waits on a swept clock, each episode guarded: one whose environment ignores the
        # cancellation of a timed-out call is abandoned as failed (awaited in place, the evaluation, and
        # the run, hung for good)
        swept = SweptClock(self.clock)
        try:
            results = await asyncio.gather(*(
                run_guarded(swept, run_episode(env=self.env_factory(self.clock), engine=self.engine, clock=swept,
                                               tok=self.tok, uid=-(i + 1), prompt_ids=ids, row=row_copy(row),
                                               seed=self.cfg.seed * 7_919 + i, settings=settings),
                            functools.partial(hung_episode, ids), ro.env_timeout_s + 1.0)
                for i, (ids, row) in enumerate(self._episode_rows())
            ))
        finally:
            swept.close()
        errors = [r.fields["reward_error"] for r in results if r.fields["reward_error"] is not None]
        return (fold_rewards(self.prompts, [r.fields["reward"] for r in results]), (errors[0] if errors else None),
                _newest(r.fields["token_versions"] for r in results))

    async def _agent_episodes(self) -> tuple[list[float | None], str | None, int | None]:
        """Greedy agent episodes through a recording endpoint of their own, one per distinct row of each
        prompt; a prompt whose episode failed is None."""
        from asyncflow.clock import RealClock
        from asyncflow.workflow.agent import run_agent_episode
        from asyncflow.workflow.agent_proxy import AgentProxy
        from asyncflow.workflow.settings import recorder_settings

        agent = self.agent
        clock = self.clock or RealClock()
        proxy = AgentProxy(wait_s=self.cfg.rollout.request_timeout_s)  # (a queued connection waits behind calls)
        await proxy.start()
        try:
            results = await asyncio.gather(*(
                run_agent_episode(agent=agent, proxy=proxy, engine=self.engine, clock=clock, tok=self.tok,
                                  uid=-(i + 1), row=row_copy(row), seed=self.cfg.seed * 7_919 + i,
                                  settings=recorder_settings(self.cfg, 0.0, self.max_context), timeout_s=self.cfg.rollout.agent_timeout_s)
                for i, (_, row) in enumerate(self._episode_rows())
            ))
        finally:
            await proxy.close()
        errors = [r.fields["reward_error"] for r in results if r.fields["reward_error"] is not None]
        return (fold_rewards(self.prompts, [r.fields["reward"] for r in results]), (errors[0] if errors else None),
                _newest(r.fields["token_versions"] for r in results))

    def _episode_rows(self) -> list[tuple[list[int], dict[str, Any]]]:
        """(prompt ids, row) of every distinct row of every prompt, in order (`fold_rewards` regroups)."""
        return [(ids, row) for ids, p in zip(self.prompt_ids, self.prompts, strict=True) for row in p.rows]


def _newest(versions: Iterable[Sequence[int]]) -> int | None:
    """The newest policy version among sequences of per-token versions (each never goes back, so its
    last token is its newest); None when no token was generated."""
    return max((int(v[-1]) for v in versions if len(v)), default=None)
