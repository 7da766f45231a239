"""The state the workflow's stages share, the counters and the step result (`StageBase`), and
the one bookkeeping call every stage makes: logging samples to samples.jsonl.
"""

from __future__ import annotations

import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncflow.clock import Clock, SweptClock
from asyncflow.config import Config
from asyncflow.engines.base import InferenceEngine, TrainBatch, TrainEngine
from asyncflow.rewards import (
    PlainCalls,
    RewardFn,
    is_async_reward_fn,
)
from asyncflow.rewards.sandbox import require_layers
from asyncflow.telemetry.jsonl import sample_line
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import SampleView, StoreClient, TransferQueue
from asyncflow.workflow.agent import AgentFn, load_agent
from asyncflow.workflow.episode import (
    generated_tokens,
)
from asyncflow.workflow.gate import StalenessGate
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
    reward_fn: RewardFn | None
    _reward_async: bool
    _plain_calls: PlainCalls
    engines: list[InferenceEngine]
    trainer: TrainEngine
    clock: Clock
    _swept: SweptClock
    log: RunLog
    tracer: Tracer
    ref_logprobs: Callable[[TrainBatch], torch.Tensor] | None
    on_step: Callable[[StepResult], Awaitable[None]] | None
    on_trained: Callable[[], None] | None  # after a step's optimizer steps and ack, before its publication
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
    counters: Counters
    version: int  # the trainer's policy version
    t_start: float
    _last_row_time: float
    _last_busy: tuple[float, float]
    _order: Any
    next_group: int
    first_step: int
    last_step: int
    training_step: int
    _stop_early: bool
    max_context: int | None
    _filter_budget: int

    def __init__(
        self,
        cfg: Config,
        *,
        rows: list[dict[str, Any]],
        tokenizer: Tokenizer,
        engines: Sequence[InferenceEngine],
        clock: Clock,
        log: RunLog,
        tracer: Tracer,
        reward_fn: RewardFn | None = None,
        store: StoreClient | None = None,
        gate: Any = None,
        env_factory: Callable[[Clock], Any] | None = None,
    ) -> None:
        """`store`: a store client shared with other processes (the Ray runtime); default: a new
        in-process `TransferQueue`. `gate`: the feeder's gate when the feeder runs elsewhere (see
        RemoteGate); default: a new `StalenessGate`. `env_factory`: a factory of episodes'
        environments given directly (PIPE's simulated environment); default: the one `rollout.env` names."""
        self.cfg = cfg
        self.rows = rows
        self.tok = tokenizer
        self.reward_fn = reward_fn
        self._reward_async = reward_fn is not None and is_async_reward_fn(reward_fn)
        self._plain_calls = PlainCalls()  # a plain reward function's threads (started on first use)
        self.engines = list(engines)
        self.clock = clock
        # episodes wait twice per turn (generation, environment step), an async reward function once
        # per group: one sweeping timer for all of those bounded waits instead of a timer each (SweptClock)
        self._swept = SweptClock(clock)
        self.log = log
        self.tracer = tracer
        self.n = cfg.rollout.n
        self.groups_per_step = cfg.train.batch_size // self.n
        self.k = cfg.staleness
        # `gate`: the feeder's gate when the feeder runs elsewhere (a Ray actor); see RemoteGate
        extra = math.ceil(cfg.workflow.redundancy * self.groups_per_step)
        self.gate = gate if gate is not None else StalenessGate(self.groups_per_step, self.k, cfg.train.max_steps,
                                                                clock, extra=extra)
        # a store of its own (none given) ends with the run: see `run`
        self._own_store: TransferQueue | None = None if store is not None else TransferQueue(
            capacity=store_capacity(cfg), lease_timeout_s=cfg.workflow.lease_timeout_s, clock=clock)
        self.store: StoreClient = store if store is not None else self._own_store  # type: ignore[assignment]
        self.keeper = LeaseKeeper(self.store, clock, cfg.workflow.lease_timeout_s)
        # the staleness floor the engines were last told (`cancel_older_than`): episodes older than
        # it end before their next turn
        self.floor: float = -math.inf
        self.env_factory: Callable[[Clock], Any] | None = env_factory
        require_layers(cfg.reward.sandbox_require)  # an environment or agent may run code in the sandbox
        if env_factory is None and cfg.rollout.env is not None:
            from asyncflow.envs import make_env_factory

            self.env_factory = make_env_factory(cfg.rollout.env, latency_s=cfg.rollout.env_latency_s,
                                                max_turns=cfg.rollout.max_turns)
        self.agent: AgentFn | None = None if cfg.rollout.agent is None else load_agent(cfg.rollout.agent)
        self.episodic = self.env_factory is not None or self.agent is not None
        # queue scheduling: one "rollout" stage every worker pulls from, or with affinity a stage per
        # worker, whose samples carry that worker's routing field (per-field readiness does the routing)
        self.rollout_stages = [f"rollout/{i}" for i in range(cfg.rollout.workers)] if cfg.rollout.affinity else ["rollout"]
        self.counters = Counters()
        self.version = 0
        self.t_start = clock.now()
        self._last_row_time = self.t_start
        self._last_busy = (0.0, 0.0)
        self._order = self._row_order()
        self.next_group = 0  # the feeder's next group id: also how many prompts it has drawn
        self.first_step = 1
        self.last_step = 0  # the last step trained (train.max_steps, or earlier after `stop_early`)
        self.training_step = 0  # the step the trainer is collecting or training (its last after `stop_early`)
        self._stop_early = False
        self.max_context: int | None = None  # the model's positions, for multi-turn episodes (set by the runner)
        self._filter_budget = cfg.algorithm.filter_max_groups_per_step or 4 * self.groups_per_step


    def _row_order(self) -> Any:
        rng = random.Random(self.cfg.seed)
        epoch = 0
        while True:
            idx = list(range(len(self.rows)))
            if self.cfg.dataset.shuffle:
                rng.shuffle(idx)
            yield from idx
            epoch += 1

    def _log_samples(
        self, items: list[tuple[SampleView, int | None, str, str | None]], rewards: list[float | None] | None = None
    ) -> None:
        """One samples.jsonl row per item; `rewards`: the reward each was trained with, item by item
        (default: its `reward` field)."""
        key = self.cfg.dataset.prompt_key
        rows, decode = self.rows, self.tok.decode
        tokens_by, count_by = self.counters.response_tokens, self.counters.response_count
        lines = []
        for i, (s, trained_version, status, error) in enumerate(items):
            f = s.fields
            resp = f.get("response_ids")
            n_resp = 0 if resp is None else len(resp)
            if n_resp:
                tokens_by[status] = tokens_by.get(status, 0) + n_resp
                count_by[status] = count_by.get(status, 0) + 1
            version = f.get("behavior_version")
            reward = f.get("reward") if rewards is None else rewards[i]
            extra = None
            if "loss_mask" in f:
                extra = {"turns": f.get("turns"), "generated_tokens": generated_tokens(f["loss_mask"])}
            if "agent_calls" in f:
                extra = {**(extra or {}), "agent_calls": f["agent_calls"], "agent_calls_dropped": f["agent_calls_dropped"]}
            lines.append(sample_line(
                s.uid, s.group_id, rows[f["row"]].get(key) if "row" in f else None,
                None if resp is None else decode(resp),
                None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else reward,
                None if version is None or version < 0 else version, trained_version, status, error, extra))
        self.log.sample_lines(lines)


def store_capacity(cfg: Config) -> int:
    """Room for every admitted sample: the gate admits at most (k+1) steps' worth (plus the redundant
    share), plus slack."""
    steps = cfg.staleness + 2 + math.ceil(cfg.workflow.redundancy)
    return max(cfg.workflow.store_capacity, steps * cfg.train.batch_size)
