"""Each workflow stage's settings, frozen, read from the config in one place (`from_config`): the
only workflow module that reads the config. A stage is built from its settings, its context and
the components it uses, so a test builds one without a config file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from asyncflow.config import Config, max_generated_tokens
from asyncflow.config_schema import torch_threads
from asyncflow.engines.base import WeightUpdateMode
from asyncflow.workflow.agent_proxy import RecorderSettings
from asyncflow.workflow.episode import EpisodeSettings


def groups_per_step(cfg: Config) -> int:
    return cfg.train.batch_size // cfg.rollout.n


def store_capacity(cfg: Config) -> int:
    """Room for every admitted sample: the gate admits at most (k+1) steps' worth (plus the redundant
    share), plus slack."""
    steps = cfg.staleness + 2 + math.ceil(cfg.workflow.redundancy)
    return max(cfg.workflow.store_capacity, steps * cfg.train.batch_size)


def rollout_stage_names(cfg: Config) -> list[str]:
    """Queue scheduling: one "rollout" stage every worker pulls from, or with affinity a stage per
    worker, whose samples carry that worker's routing field (per-field readiness does the routing)."""
    return [f"rollout/{i}" for i in range(cfg.rollout.workers)] if cfg.rollout.affinity else ["rollout"]


def recorder_settings(cfg: Config, temperature: float, max_context: int | None = None) -> RecorderSettings:
    """How an agent episode's calls are sampled (`temperature`: the run's, or 0 for evaluation;
    `max_context`: the model's positions, when known)."""
    ro = cfg.rollout
    return RecorderSettings(ro.max_new_tokens, temperature, ro.temperature, ro.request_timeout_s, ro.max_turns,
                            ro.top_p, ro.top_k, max_context)


@dataclass(frozen=True)
class ContextSettings:
    """What a process's `StageContext` is built with."""

    prompt_key: str  # the prompt column, for samples.jsonl
    lease_timeout_s: float  # the lease keeper renews every quarter of it

    @classmethod
    def from_config(cls, cfg: Config) -> ContextSettings:
        return cls(cfg.dataset.prompt_key, cfg.workflow.lease_timeout_s)


@dataclass(frozen=True)
class GateSettings:
    """The staleness gate's admission credit (`StalenessGate`)."""

    groups_per_step: int
    max_staleness: int
    max_steps: int
    redundant_groups: int  # admitted beyond a step's groups (`workflow.redundancy`)

    @classmethod
    def from_config(cls, cfg: Config) -> GateSettings:
        gps = groups_per_step(cfg)
        return cls(gps, cfg.staleness, cfg.train.max_steps, math.ceil(cfg.workflow.redundancy * gps))


@dataclass(frozen=True)
class FeederSettings:
    prompt_key: str
    n: int  # samples per prompt
    rollout_stages: tuple[str, ...]  # with affinity: one per worker, each prompt routed to the least loaded
    affinity: bool
    seed: int
    shuffle: bool
    step_timeout_s: float

    @classmethod
    def from_config(cls, cfg: Config) -> FeederSettings:
        return cls(cfg.dataset.prompt_key, cfg.rollout.n, tuple(rollout_stage_names(cfg)), cfg.rollout.affinity,
                   cfg.seed, cfg.dataset.shuffle, cfg.workflow.step_timeout_s)


@dataclass(frozen=True)
class RolloutSettings:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    request_timeout_s: float
    env_timeout_s: float
    agent_timeout_s: float
    step_timeout_s: float
    affinity: bool
    turn_barrier: bool
    seed: int
    fail_fast_calls: int  # the first this many episodes all failed: stop the run (`reward.fail_fast_calls`)
    episode: EpisodeSettings
    recorder: RecorderSettings
    group_timeout_s: float | None = None  # a request running this long is aborted as a straggler (None: never)

    @classmethod
    def from_config(cls, cfg: Config, max_context: int | None = None) -> RolloutSettings:
        """`max_context`: the model's positions (multi-turn episodes stop short of them), when known."""
        ro = cfg.rollout
        episode = EpisodeSettings(ro.max_new_tokens, ro.temperature, ro.request_timeout_s, ro.env_timeout_s,
                                  ro.top_p, ro.top_k, max_context)
        return cls(ro.max_new_tokens, ro.temperature, ro.top_p, ro.top_k, ro.request_timeout_s, ro.env_timeout_s,
                   ro.agent_timeout_s, cfg.workflow.step_timeout_s, ro.affinity, ro.turn_barrier, cfg.seed,
                   cfg.reward.fail_fast_calls, episode, recorder_settings(cfg, ro.temperature, max_context),
                   ro.group_timeout_s)


@dataclass(frozen=True)
class RewardSettings:
    n: int
    prompt_key: str
    concurrency: int  # groups scored at once by an `async def` reward function
    timeout_s: float
    fail_fast_calls: int
    step_timeout_s: float
    max_steps: int  # for the reward function's `trainer_state`

    @classmethod
    def from_config(cls, cfg: Config) -> RewardSettings:
        r = cfg.reward
        return cls(cfg.rollout.n, cfg.dataset.prompt_key, r.concurrency, r.timeout_s, r.fail_fast_calls,
                   cfg.workflow.step_timeout_s, cfg.train.max_steps)


@dataclass(frozen=True)
class ReferenceSettings:
    batch_size: int  # most responses per forward pass
    step_timeout_s: float
    threads: int  # torch threads of the forward pass

    @classmethod
    def from_config(cls, cfg: Config) -> ReferenceSettings:
        return cls(cfg.train.batch_size, cfg.workflow.step_timeout_s, torch_threads(cfg))


@dataclass(frozen=True)
class TrainerSettings:
    max_steps: int
    batch_size: int
    n: int
    groups_per_step: int
    max_staleness: int
    step_timeout_s: float
    checkpoint_every: int
    filter_groups: bool
    filter_budget: int  # most equal-reward groups one step filters; past it they train (`filter_overflow`)
    weight_update: WeightUpdateMode
    threads: int  # torch threads of a weight export
    group_min_samples: int = 2  # a group with aborted stragglers trains on its finished samples if this many

    @classmethod
    def from_config(cls, cfg: Config) -> TrainerSettings:
        gps = groups_per_step(cfg)
        a = cfg.algorithm
        return cls(cfg.train.max_steps, cfg.train.batch_size, cfg.rollout.n, gps, cfg.staleness,
                   cfg.workflow.step_timeout_s, cfg.checkpoint.every, a.filter_groups,
                   a.filter_max_groups_per_step or 4 * gps, cfg.workflow.weight_update, torch_threads(cfg),
                   cfg.rollout.group_min_samples)


@dataclass(frozen=True)
class LearnerSettings:
    advantage: str
    loss: str
    overlong_buffer: int
    overlong_penalty: float
    max_generated_tokens: int  # the longest response (the over-long penalty's reference)
    temperature: float  # the rollout's: the trainer's log-probs are taken at it
    threads: int
    distill: bool = False  # the samples carry `teacher_logprobs` (`algorithm.distill`)
    distill_coef: float = 0.0  # the per-token reverse KL's weight in each token's advantage
    reward_coef: float = 1.0  # the task reward's advantage's weight beside it

    @classmethod
    def from_config(cls, cfg: Config) -> LearnerSettings:
        a, d = cfg.algorithm, cfg.algorithm.distill
        return cls(a.advantage, a.loss, a.overlong_buffer, a.overlong_penalty, max_generated_tokens(cfg),
                   cfg.rollout.temperature, torch_threads(cfg), distill=d is not None,
                   distill_coef=0.0 if d is None else d.coef, reward_coef=1.0 if d is None else d.reward_coef)


@dataclass(frozen=True)
class PipelineSettings:
    n: int
    rollout_stages: tuple[str, ...]
    affinity: bool  # each rollout stage takes only the samples routed to it
    gc_threshold: int  # the young generation's threshold while the run lasts (0: Python's)
    env_timeout_s: float  # a stopping episode's grace to close its environment
    sandbox_require: tuple[str, ...]  # isolation layers every scoring process requires (`reward.sandbox_require`)
    stall_timeout_s: float = 0.0  # the stall watchdog's (`workflow.stall_timeout_s`; 0: off)

    @classmethod
    def from_config(cls, cfg: Config) -> PipelineSettings:
        return cls(cfg.rollout.n, tuple(rollout_stage_names(cfg)), cfg.rollout.affinity, cfg.workflow.gc_threshold,
                   cfg.rollout.env_timeout_s, tuple(cfg.reward.sandbox_require or ()), cfg.workflow.stall_timeout_s)
