"""The state the workflow's stages share, the counters and the step result (`StageBase`), and
the one bookkeeping call every stage makes: logging samples to samples.jsonl.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow.clock import Clock, SweptClock
from asyncflow.config import Config
from asyncflow.engines.base import InferenceEngine, LossFn, TrainBatch, TrainEngine
from asyncflow.rewards import (
    PlainCalls,
    RewardFn,
)
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import SampleView, StoreClient
from asyncflow.workflow.agent import AgentFn
from asyncflow.workflow.episode import (
    generated_tokens,
)
from asyncflow.workflow.lease_keeper import LeaseKeeper

CANCELLED = "cancelled: could no longer meet max_staleness"


@dataclass
class Counters:
    """Cumulative counts of what happened to samples."""

    produced: int = 0  # samples whose rollout (generation or episode) finished and was written
    trained: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    filter_overflow: int = 0  # equal-reward groups trained because a step hit its filter budget
    response_tokens: dict[str, int] = field(default_factory=dict)  # by final status, for bias metrics
    response_count: dict[str, int] = field(default_factory=dict)
    reward_errors: int = 0
    cancelled: int = 0
    reward_calls: int = 0  # reward calls made by this process (a resume starts them again: fail-fast)
    reward_call_failures: int = 0
    episodes: int = 0  # multi-turn episodes ended (environment or agent), and those that failed (likewise)
    episode_failures: int = 0
    train_busy_s: float = 0.0


@dataclass
class StepResult:
    """What the trainer hands to the logger after a step."""

    step: int
    version: int
    metrics: dict[str, float] = field(default_factory=dict)


class StageBase:
    """What the stages share, set up by `Pipeline.__init__` (the wiring): the config, the store and
    gate they meet in, the clock, the log and trace, the lease keeper and the counters. Each stage
    class (feeder, rollout, reward, trainer) reads and writes these and nothing of the others'."""

    cfg: Config
    rows: list[dict[str, Any]]
    tok: Tokenizer
    reward_fn: RewardFn
    _reward_async: bool
    _plain_calls: PlainCalls
    engines: list[InferenceEngine]
    trainer: TrainEngine
    loss_fn: LossFn
    clock: Clock
    _swept: SweptClock
    log: RunLog
    tracer: Tracer
    ref_logprobs: Callable[[TrainBatch], torch.Tensor] | None
    on_step: Callable[[StepResult], Awaitable[None]] | None
    n: int  # samples per prompt
    groups_per_step: int
    k: int  # max staleness
    gate: Any  # StalenessGate, or a Ray runtime's RemoteGate
    store: StoreClient
    keeper: LeaseKeeper
    floor: float  # the staleness floor the engines were last told (`cancel_older_than`)
    rollout_stages: list[str]
    env_factory: Callable[[Clock], Any] | None
    agent: AgentFn | None
    episodic: bool
    advantage_fn: Any
    needs_proximal: bool
    counters: Counters
    version: int  # the trainer's policy version
    t_start: float
    _last_row_time: float
    _last_busy: tuple[float, float]
    _order: Any
    next_group: int
    first_step: int
    last_step: int
    _stop_early: bool
    max_context: int | None
    _filter_budget: int

    def _log_samples(
        self, items: list[tuple[SampleView, int | None, str, str | None]], rewards: list[float | None] | None = None
    ) -> None:
        """One samples.jsonl row per item; `rewards`: the reward each was trained with, item by item
        (default: its `reward` field)."""
        key = self.cfg.dataset.prompt_key
        rows, decode = self.rows, self.tok.decode
        tokens_by, count_by = self.counters.response_tokens, self.counters.response_count
        out = []
        for i, (s, trained_version, status, error) in enumerate(items):
            f = s.fields
            resp = f.get("response_ids")
            n_resp = 0 if resp is None else len(resp)
            if n_resp:
                tokens_by[status] = tokens_by.get(status, 0) + n_resp
                count_by[status] = count_by.get(status, 0) + 1
            version = f.get("behavior_version")
            reward = f.get("reward") if rewards is None else rewards[i]
            row = {
                "uid": s.uid,
                "group_id": s.group_id,
                "prompt": rows[f["row"]].get(key) if "row" in f else None,
                "response": None if resp is None else decode(resp),
                "reward": None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else reward,
                "behavior_version": None if version is None or version < 0 else version,
                "trained_version": trained_version,
                "status": status,
                "error": error,
            }
            if "loss_mask" in f:
                row["turns"] = f.get("turns")
                row["generated_tokens"] = generated_tokens(f["loss_mask"])
            if "agent_calls" in f:
                row["agent_calls"] = f["agent_calls"]
                row["agent_calls_dropped"] = f["agent_calls_dropped"]
            out.append(row)
        self.log.samples(out)
