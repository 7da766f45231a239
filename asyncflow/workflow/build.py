"""Wiring a run's pipeline in one process: its context, its gate and store (unless the runtime gives
them), each stage from its settings and components, and the `Pipeline` that runs them
(`build_pipeline`). A Ray actor builds its one stage itself (asyncflow/runtime/ray_actors.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from asyncflow.clock import Clock
from asyncflow.config import Config
from asyncflow.engines.base import InferenceEngine, LossFn, TrainEngine
from asyncflow.rewards import RewardFn
from asyncflow.rewards.sandbox import require_layers
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import StoreClient, TransferQueue
from asyncflow.workflow.agent import AgentFn, load_agent
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.feeder import Feeder
from asyncflow.workflow.gate import GateControl, StalenessGate
from asyncflow.workflow.learner import EngineLearner, Learner
from asyncflow.workflow.pipeline import Pipeline
from asyncflow.workflow.reference import ReferenceFn, ReferenceWorker
from asyncflow.workflow.reward import RewardWorker
from asyncflow.workflow.rollout import EnvFactory, RolloutWorker
from asyncflow.workflow.settings import (
    ContextSettings,
    FeederSettings,
    GateSettings,
    LearnerSettings,
    PipelineSettings,
    ReferenceSettings,
    RewardSettings,
    RolloutSettings,
    TrainerSettings,
    store_capacity,
)
from asyncflow.workflow.trainer import StepResult, Trainer


def make_gate(settings: GateSettings, clock: Clock) -> StalenessGate:
    return StalenessGate(settings.groups_per_step, settings.max_staleness, settings.max_steps, clock,
                         extra=settings.redundant_groups)


def episode_components(cfg: Config) -> tuple[EnvFactory | None, AgentFn | None]:
    """The environment factory (`rollout.env`) and the agent (`rollout.agent`) of multi-turn
    episodes; (None, None) for single-turn generation. Imports the user's plugin: bad specs are a
    `UserError`."""
    env_factory = None
    if cfg.rollout.env is not None:
        from asyncflow.envs import make_env_factory

        env_factory = make_env_factory(cfg.rollout.env, latency_s=cfg.rollout.env_latency_s,
                                       max_turns=cfg.rollout.max_turns)
    return env_factory, None if cfg.rollout.agent is None else load_agent(cfg.rollout.agent)


def build_pipeline(
    cfg: Config,
    *,
    rows: list[dict[str, Any]],
    tokenizer: Tokenizer,
    engines: Sequence[InferenceEngine],
    train_engine: TrainEngine,
    clock: Clock,
    log: RunLog,
    tracer: Tracer,
    reward_fn: RewardFn | None = None,
    loss_fn: LossFn | None = None,
    learner: Learner | None = None,
    ref_logprobs: ReferenceFn | None = None,
    teacher_logprobs: ReferenceFn | None = None,
    on_step: Callable[[StepResult], Awaitable[None]] | None = None,
    on_trained: Callable[[], None] | None = None,
    store: StoreClient | None = None,
    gate: GateControl | None = None,
    env_factory: EnvFactory | None = None,
    agent: AgentFn | None = None,
    collect_ahead: bool = False,
    stages_elsewhere: bool = False,
    max_context: int | None = None,
) -> Pipeline:
    """The pipeline of a run. `store`, `gate`: the runtime's (Ray: the store controller's client, the
    feeder actor's gate); default: a new in-process store and gate. `learner`: the optimizer step;
    default: `train_engine`'s with `loss_fn`. `env_factory`/`agent`: multi-turn episodes (see
    `episode_components`). `collect_ahead`: the trainer collects its next batch during a train step
    (the runtime says when that pays: a store in another process). `stages_elsewhere`: the feeder,
    rollout and reward stages run in actors; only the trainer (and the reference and teacher) run here.
    `ref_logprobs`, `teacher_logprobs`: the KL reference's and the distillation teacher's log-probs.
    `max_context`: the model's positions, for multi-turn episodes."""
    ps = PipelineSettings.from_config(cfg)
    require_layers(ps.sandbox_require)  # (a reward function, environment or agent may run code in the sandbox)
    own_store = None if store is not None else TransferQueue(
        capacity=store_capacity(cfg), lease_timeout_s=cfg.workflow.lease_timeout_s, clock=clock)
    the_store: StoreClient = store if store is not None else own_store  # type: ignore[assignment]
    ctx = StageContext(the_store, clock, tracer, log, ContextSettings.from_config(cfg), rows=rows, tok=tokenizer)
    the_gate = gate if gate is not None else make_gate(GateSettings.from_config(cfg), clock)
    if learner is None:
        if loss_fn is None:
            raise ValueError("build_pipeline: give a loss_fn (for the train engine's step) or a learner")
        if cfg.algorithm.distill is not None and teacher_logprobs is None:
            raise ValueError("build_pipeline: algorithm.distill is on: give the teacher's teacher_logprobs")
        learner = EngineLearner(LearnerSettings.from_config(cfg), train_engine, loss_fn,
                                pad_token_id=tokenizer.pad_token_id, with_reference=ref_logprobs is not None)
    trainer = Trainer(ctx, TrainerSettings.from_config(cfg), learner=learner, engine=train_engine, engines=engines,
                      gate=the_gate, collect_ahead=collect_ahead, on_step=on_step, on_trained=on_trained)
    episodic = env_factory is not None or agent is not None
    scorers = [ReferenceWorker(ctx, ReferenceSettings.from_config(cfg), ref_logprobs=fn,
                               pad_token_id=tokenizer.pad_token_id, stage=stage, field=field)
               for fn, stage, field in ((ref_logprobs, "reference", "ref_logprobs"),
                                        (teacher_logprobs, "teacher", "teacher_logprobs")) if fn is not None]
    parts: dict[str, Any] = {"trainer": trainer, "gate": the_gate, "engines": engines, "episodic": episodic,
                             "scorers": scorers, "own_store": own_store}
    if stages_elsewhere:
        return Pipeline(ctx, ps, **parts)
    if not isinstance(the_gate, StalenessGate):
        raise ValueError("build_pipeline: the feeder runs here, so its gate must be a StalenessGate")
    if reward_fn is None and not episodic:
        raise ValueError("build_pipeline: single-turn samples need a reward_fn")
    rs = RolloutSettings.from_config(cfg, max_context)
    rollout = [RolloutWorker(ctx, rs, index=i, engine=e, rows=rows, tok=tokenizer, env_factory=env_factory, agent=agent)
               for i, e in enumerate(engines)]
    rewards = [] if episodic or reward_fn is None else [
        RewardWorker(ctx, RewardSettings.from_config(cfg), reward_fn=reward_fn, rows=rows, tok=tokenizer)]
    feeder = Feeder(ctx, FeederSettings.from_config(cfg), rows=rows, tok=tokenizer, gate=the_gate)
    return Pipeline(ctx, ps, feeder=feeder, rollout=rollout, rewards=rewards, **parts)
