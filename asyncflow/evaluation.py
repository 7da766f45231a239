"""Greedy evaluation on held-out prompts, written as `kind: "eval"` rows.

Eval requests go through a rollout engine like any other request (they join its continuous batch),
at temperature 0, so evaluating does not need a second copy of the model. With a multi-turn
environment (`rollout.env`) or a black-box agent (`rollout.agent`) each eval prompt is a greedy
episode and its reward the episode's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asyncflow.config import Config
from asyncflow.data import tokenize_prompt
from asyncflow.engines.base import GenRequest, InferenceEngine
from asyncflow.errors import WaitTimeout
from asyncflow.rewards import RewardFn, score_group
from asyncflow.telemetry.runlog import RunLog, Tracer


class Evaluator:
    """Scores greedy completions of the eval prompts with the run's reward function."""

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
    ) -> None:
        """`env_factory`/`clock`: evaluate greedy episodes of this environment instead of single
        completions scored by `reward_fn`."""
        self.cfg = cfg
        self.rows = rows
        self.tok = tokenizer
        self.reward_fn = reward_fn
        self.engine = engine
        self.log = log
        self.tracer = tracer
        self.prompt_ids = [tokenize_prompt(tokenizer.hf, r[cfg.dataset.prompt_key]) for r in rows]
        self.history: list[dict[str, Any]] = []
        self.env_factory = env_factory
        self.clock = clock

    async def run(self, step: int) -> dict[str, Any]:
        """Evaluate the engine's current weights; log and return the eval row."""
        start = self.tracer.now()
        version = self.engine.version
        if self.cfg.rollout.agent is not None:
            rewards, error = await self._agent_episodes()
        elif self.env_factory is not None:
            rewards, error = await self._episodes()
        else:
            rewards, error = await self._completions()
        threshold = self.cfg.eval.success_threshold
        row = {
            "kind": "eval",
            "step": step,
            "policy_version": version,
            "eval_reward": sum(rewards) / max(len(rewards), 1),
            "eval_accuracy": sum(r >= threshold for r in rewards) / max(len(rewards), 1),
            "eval_size": len(rewards),
            "eval_error": error,
            "eval_seconds": self.tracer.now() - start,
        }
        self.tracer.span("eval", f"eval step {step}", start, self.tracer.now())
        self.log.metric(row)
        self.history.append(row)
        return row

    async def _completions(self) -> tuple[list[float], str | None]:
        requests = [
            GenRequest(-(i + 1), ids, self.cfg.rollout.max_new_tokens, temperature=0.0) for i, ids in enumerate(self.prompt_ids)
        ]
        # bounded as rollout requests are: all are submitted at once, so the engine decodes them in
        # ceil(n / capacity) rounds, each within rollout.request_timeout_s
        rounds = max(1, -(-len(requests) // max(1, self.engine.capacity)))
        try:
            results = await self.clock.wait_for(
                asyncio.gather(*(self.engine.generate(r) for r in requests)),
                self.cfg.rollout.request_timeout_s * rounds,
                f"greedy generation of the {len(requests)} eval prompts (rollout.request_timeout_s per round of "
                "the engine's batch)")
        except WaitTimeout as exc:  # a stuck engine fails the evaluation, not the run (the run has its own bounds)
            return [0.0] * len(self.rows), str(exc)
        key = self.cfg.dataset.prompt_key
        completions_ids = [r.response_ids for r in results]
        conversational = bool(self.rows) and isinstance(self.rows[0][key], list)
        completions = self.tok.completions(completions_ids, conversational)
        columns = {c: [r.get(c) for r in self.rows] for c in self.rows[0] if c != key} if self.rows else {}
        try:
            outcome = await self.clock.wait_for(
                score_group(self.reward_fn, [r[key] for r in self.rows], completions, completions_ids, columns),
                self.cfg.reward.timeout_s, "the reward function on the eval set")
        except WaitTimeout as exc:
            return [0.0] * len(self.rows), str(exc)
        return outcome.rewards or [0.0] * len(self.rows), outcome.error

    async def _episodes(self) -> tuple[list[float], str | None]:
        """Greedy episodes; an episode that failed counts 0 and the first error is reported."""
        from asyncflow.workflow.episode import EpisodeSettings, run_episode

        ro = self.cfg.rollout
        settings = EpisodeSettings(ro.max_new_tokens, 0.0, ro.request_timeout_s, ro.env_timeout_s)
        assert self.env_factory is not None
        results = await asyncio.gather(*(
            run_episode(env=self.env_factory(self.clock), engine=self.engine, clock=self.clock, tok=self.tok,
                        uid=-(i + 1), prompt_ids=ids, row=row, seed=self.cfg.seed * 7_919 + i, settings=settings)
            for i, (ids, row) in enumerate(zip(self.prompt_ids, self.rows, strict=True))
        ))
        errors = [r.fields["reward_error"] for r in results if r.fields["reward_error"] is not None]
        return [r.fields["reward"] or 0.0 for r in results], (errors[0] if errors else None)

    async def _agent_episodes(self) -> tuple[list[float], str | None]:
        """Greedy agent episodes through a recording endpoint of their own; failed episodes count 0."""
        from asyncflow.runtime.clock import RealClock
        from asyncflow.workflow.agent import load_agent, run_agent_episode
        from asyncflow.workflow.agent_proxy import AgentProxy
        from asyncflow.workflow.pipeline import recorder_settings

        assert self.cfg.rollout.agent is not None
        agent = load_agent(self.cfg.rollout.agent)
        clock = self.clock or RealClock()
        proxy = AgentProxy()
        await proxy.start()
        try:
            results = await asyncio.gather(*(
                run_agent_episode(agent=agent, proxy=proxy, engine=self.engine, clock=clock, tok=self.tok,
                                  uid=-(i + 1), row=row, seed=self.cfg.seed * 7_919 + i,
                                  settings=recorder_settings(self.cfg, 0.0), timeout_s=self.cfg.rollout.agent_timeout_s)
                for i, row in enumerate(self.rows)
            ))
        finally:
            await proxy.close()
        errors = [r.fields["reward_error"] for r in results if r.fields["reward_error"] is not None]
        return [r.fields["reward"] or 0.0 for r in results], (errors[0] if errors else None)
