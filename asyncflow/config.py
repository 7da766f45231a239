"""The typed configuration tree: defaults, YAML loading, `--set` overrides and validation.

Precedence (lowest first): the defaults below < the task pack's defaults < the YAML file < `--set`.
Every field has a docstring (`doc` metadata) so the reference in docs/ is generated from here.
Validation happens before torch/transformers/ray are imported, so a typo costs milliseconds: an
unknown key is an error that suggests the closest known key, and a wrong type, an out-of-range value
or a contradictory pair of settings names the key. Nothing is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncflow.errors import UserError


def _f(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None) -> Any:
    """A config field with its docstring and optional numeric bounds (inclusive)."""
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi})


@dataclass
class ModelConfig:
    """The policy model."""

    path: str | None = _f(None, "Hugging Face causal-LM folder. null: the task pack prepares (and caches) its model.")
    cache_dir: str | None = _f(None, "Where prepared task models are cached. null: $ASYNCFLOW_CACHE or ~/.cache/asyncflow.")
    task_seed: int = _f(0, "Seed of the task pack's base model and data (model.path null). 0: the base model shipped "
                           "inside the package (built by `asyncflow prepare TASK`, the same on every machine); another "
                           "seed is prepared once into model.cache_dir (minutes). `seed` seeds the run, not this.",
                        lo=0, hi=2**31 - 1)
    dtype: Literal["float32", "bfloat16"] = _f("float32", "Compute dtype for rollout and the trainer's passes; the trainer keeps float32 master weights and optimizer states either way (float32 keeps behaviour and trainer log-probs equal).")
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto",
        "Where the hf rollout engines and the torch trainer run. auto: on a GPU when the process sees one "
        "(rollout workers spread over the GPUs; with runtime.kind=ray, only actors given GPUs by "
        "runtime.rollout_gpus / runtime.train_gpus use one), else on the CPU; cuda: refused without a GPU. "
        "The KL reference model runs in the driver: on the torch trainer's device, else (ray, fsdp, local "
        "vllm) on the CPU. (train.engine=fsdp places its ranks itself; "
        "rollout.engine=vllm always runs on a GPU.)",
    )


@dataclass
class DatasetConfig:
    """Training prompts."""

    path: str | None = _f(None, "jsonl, parquet or a saved `datasets` folder (its `train` split, or its only one). "
                                "null: the task pack's train split.")
    prompt_key: str = _f("prompt", "Column holding the prompt (text, or a list of chat messages).")
    label_key: str | None = _f("answer", "Column passed to the reward function under its own name (null: none required).")
    shuffle: bool = _f(True, "Shuffle the prompt order (seeded by `seed`) once per epoch.")


@dataclass
class RewardConfig:
    """The reward function."""

    fn: str | None = _f(None, "`module:function` (or `path/to/file.py:function`) with TRL's signature fn(prompts, completions, **columns) -> list[float] (a None fails the group's call). null: the task pack's verifier.")
    timeout_s: float = _f(60.0, "Longest one reward call may take before its samples are marked as failed.", lo=0.001)
    fail_fast_calls: int = _f(32, "If this many first reward calls of a run all fail, stop the run (exit 2). "
                               "With rollout.env or rollout.agent: this many first episodes.", lo=1)
    concurrency: int = _f(
        64,
        "Most groups scored at once by an async def reward function (awaited on the event loop, e.g. a remote judge), "
        "per reward worker (runtime.kind=ray: per reward actor): each batch of ready groups is scored in its own task. "
        "A plain function runs one batch at a time in a worker thread (setting this key for one is refused).",
        lo=1,
    )


@dataclass
class RolloutConfig:
    """Generation."""

    engine: Literal["hf", "openai", "vllm"] = _f(
        "hf",
        "Inference engine adapter: hf (transformers with continuous batching, in this process), openai (an "
        "OpenAI-compatible server per rollout.server_urls entry: asyncflow serve, vLLM or SGLang) or vllm "
        "(in-process vLLM on a GPU; needs the vllm package; runtime.kind=local only). docs/engines.md.",
    )
    workers: int = _f(1, "Number of rollout workers (one engine each).", lo=1, hi=4096)
    n: int = _f(8, "Samples per prompt (a GRPO group). Each is its own request (prompt replication).", lo=1)
    max_new_tokens: int = _f(16, "Longest response, in tokens.", lo=1)
    temperature: float = _f(1.0, "Sampling temperature. The trainer divides logits by it too.", lo=1e-3)
    top_p: float = _f(
        1.0,
        "Nucleus sampling: sample from the smallest set of tokens with this much probability; behavior "
        "log-probs are then of that truncated distribution, so only algorithm.loss=reinforce accepts < 1.",
        lo=1e-6,
        hi=1.0,
    )
    top_k: int = _f(0, "Sample from the k most likely tokens (0: off); like top_p, only with algorithm.loss=reinforce.", lo=0)
    max_batch: int = _f(256, "Most sequences one engine decodes at once (continuous-batching slots).", lo=1)
    request_timeout_s: float = _f(600.0, "Longest one generation request may take before it is failed.", lo=0.001)
    env: str | None = _f(
        None,
        "Multi-turn environment: null (single-turn, scored by reward.fn), calculator, guess_number, or "
        "`module:factory` with factory(clock[, max_turns=, latency_s=]) -> asyncflow.envs.Env (docs/tasks.md). Each sample is an episode (LLM turn, "
        "env step, next turn); its reward is the sum of the env's step rewards; env tokens are masked "
        "out of the loss.",
    )
    max_turns: int = _f(4, "Most LLM turns per episode (multi-turn environments; bounds every env, built-in or not, and the "
                        "model calls of a rollout.agent episode).", lo=1)
    env_latency_s: float = _f(
        0.0,
        "Added latency of each environment call, in seconds (to study env asynchrony); a module:factory env "
        "must take a latency_s keyword for a nonzero value.",
        lo=0.0,
    )
    affinity: bool = _f(
        False,
        "Route all n samples of a prompt to one rollout worker — the least loaded (queued + in flight) when "
        "the prompt is admitted — so an engine with a prefix cache computes the prompt once. Off: each sample "
        "goes to whichever worker has a free slot first, so a prompt's samples spread across workers.",
    )
    turn_barrier: bool = _f(
        False,
        "Multi-turn baseline: the episodes a worker takes as one batch advance turn by turn together (a barrier "
        "after every generation and every environment step), as batch-synchronous agent loops do. Off: each "
        "episode runs on its own (environment-level asynchrony). For measuring what the asynchrony buys.",
    )
    env_timeout_s: float = _f(60.0, "Longest one environment call may take; a hung env ends its episode with an error.", lo=0.001)
    agent: str | None = _f(
        None,
        "Black-box agent: `module:function` with async function(base_url, row, seed) -> reward (a float, or a dict "
        "with `reward`). Each sample is one agent episode that talks to its own OpenAI-compatible base_url; its "
        "calls, with exact token ids, become the sample (docs/tasks.md). Not with rollout.env or reward.fn.",
    )
    agent_timeout_s: float = _f(
        600.0, "rollout.agent: longest one agent episode may take; an agent that hangs or raises ends its episode "
        "with an error (kept out of the loss).", lo=0.001)
    server_urls: list[str] | None = _f(
        None,
        "rollout.engine=openai: base URLs of the servers (e.g. http://127.0.0.1:8000), one rollout worker each. "
        "They must serve model.path's weights; the trainer loads its initial weights into them as version 0.",
    )
    server_type: Literal["asyncflow", "vllm", "sglang"] = _f(
        "asyncflow",
        "rollout.engine=openai: how weights reach the servers. asyncflow: POST /admin/load_weights (tested here); "
        "vllm: /pause, /collective_rpc reload_weights, /resume (dev mode; rollout.sync_dir must be the folder vLLM "
        "serves); sglang: /update_weights_from_disk. vllm and sglang are written to their documented APIs and only "
        "unit-tested here.",
    )
    server_model: str | None = _f(None, "rollout.engine=openai: model name sent with requests. null: the first one the server lists.")
    server_token_env: str = _f(
        "ASYNCFLOW_SERVER_TOKEN",
        "rollout.engine=openai: environment variable holding the servers' bearer token (unset: none is sent). "
        "The token itself never goes into config.yaml.",
    )
    sync_dir: str | None = _f(
        None,
        "rollout.engine=openai: folder the trainer writes each weight version to for the servers to load (a file "
        "system they share). null: RUN_DIR/weight_sync.",
    )
    sync_timeout_s: float = _f(600.0, "rollout.engine=openai: longest one weight load or other admin call to a server may take.", lo=0.001)


@dataclass
class TrainConfig:
    """The trainer."""

    engine: Literal["torch", "fsdp"] = _f(
        "torch",
        "Train engine adapter: torch (plain PyTorch, one process) or fsdp (PyTorch FSDP2 over train.world_size "
        "worker processes: NCCL with one GPU per rank when that many GPUs are visible, else gloo on CPU; "
        "runtime.kind=local only). docs/engines.md.",
    )
    world_size: int = _f(
        1,
        "Processes (ranks) the fsdp engine shards the policy over; each optimizer step's rows are split "
        "between them, so batch_size must be divisible by world_size x mini_batches. fsdp only.",
        lo=1,
    )
    worker_timeout_s: float = _f(
        600.0,
        "Longest the fsdp engine waits for its workers (start-up, one train step, a weight gather) before it "
        "stops them all with an error naming the rank. fsdp only.",
        lo=0.001,
    )
    batch_size: int = _f(64, "Samples per train step; must be divisible by rollout.n (whole groups).", lo=1, hi=2**20)
    mini_batches: int = _f(1, "Optimizer steps per train step (the batch is split into this many parts).", lo=1)
    micro_batch_size: int | None = _f(
        None,
        "Samples per forward/backward pass (gradient accumulation); with fsdp, per rank. null: the whole "
        "mini-batch (with fsdp: the rank's share of it).",
        lo=1,
    )
    lr: float = _f(1e-6, "AdamW learning rate (task packs set one that suits their model). null: the task pack's, "
                   "else this default.", lo=0.0, hi=10.0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", lo=0.0, hi=10.0)
    max_steps: int = _f(100, "Train steps (weight publications) in the run.", lo=1)
    max_grad_norm: float = _f(1.0, "Gradient-norm clip per optimizer step (0: no clipping).", lo=0.0)


@dataclass
class AlgorithmConfig:
    """Advantage estimator and policy loss."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = _f(
        "grpo",
        "grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: r - mean of the group's other "
        "samples; reinforce_pp: (r - batch mean) / batch std (REINFORCE++, no group baseline). Computed at "
        "batch assembly.",
    )
    loss: Literal["ppo", "decoupled_ppo", "tis", "mis", "cispo", "topr", "gspo", "reinforce"] = _f(
        "ppo",
        "Policy loss (docs/algorithms.md). ppo: clipped ratio current/behavior; decoupled_ppo: clip against "
        "the proximal policy (recomputed), importance weight proximal/behavior; tis / mis: truncated / "
        "masked importance sampling current/behavior; cispo: clipped IS weight on log pi; topr: tapered "
        "off-policy REINFORCE; gspo: sequence-level ratio; reinforce: -A log pi.",
    )
    clip_low: float = _f(0.2, "Lower clip: ratio >= 1 - clip_low (ppo, decoupled_ppo, cispo, gspo).", lo=0.0, hi=1.0)
    clip_high: float = _f(0.28, "Upper clip: ratio <= 1 + clip_high, clip-higher (ppo, decoupled_ppo, cispo, gspo).", lo=0.0)
    dual_clip: float = _f(
        0.0, "Dual clip c (ppo, decoupled_ppo): a negative-advantage token's loss is at most c x |A|. 0: off; else > 1.", lo=0.0
    )
    is_level: Literal["token", "sequence", "geometric"] = _f(
        "token",
        "Importance-weight level (decoupled_ppo, tis, mis): per token, the sequence's product, or its geometric mean.",
    )
    is_cap: float = _f(
        2.0,
        "Importance-weight cap (decoupled_ppo, tis: truncate above it; mis: mask weights above it or below 1/cap).",
        lo=1.0,
    )
    agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo"] = _f(
        "token_mean",
        "Loss aggregation over the mini-batch: token_mean, seq_mean_token_sum, seq_mean_token_mean, or dr_grpo "
        "(sum / (sequences x norm_length)). Invariant to micro_batch_size. With loss=gspo, when not given: "
        "seq_mean_token_mean (GSPO's objective is a mean over sequences; token_mean weights them by length).",
    )
    norm_length: int | None = _f(
        None,
        "Dr.GRPO's constant length L (agg=dr_grpo only). null: the most tokens a sample can generate "
        "(rollout.max_new_tokens, x rollout.max_turns with an env).",
        lo=1,
    )
    kl_coef: float = _f(0.0, "Weight of the KL penalty to the frozen initial policy (0: no reference model).", lo=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = _f(
        "k3", "KL estimator (with kl_coef > 0): k1 = log(pi/ref), k2 = log(pi/ref)^2 / 2, k3 = ref/pi - log(ref/pi) - 1. "
        "As a loss term: k2's gradient is that of KL(pi||ref), k3's (GRPO's choice) that of KL(ref||pi); k1's "
        "expected gradient is 0 (it only adds noise; docs/algorithms.md)."
    )
    overlong_buffer: int = _f(
        0,
        "DAPO over-long shaping: responses within this many tokens of the length limit get a penalty rising "
        "linearly to overlong_penalty at the limit, added to the reward before advantages. 0: off.",
        lo=0,
    )
    overlong_penalty: float = _f(1.0, "The largest over-long penalty (with overlong_buffer > 0).", lo=0.0)
    filter_groups: bool = _f(
        False,
        "Dynamic sampling (DAPO): drop groups whose rewards (before over-long shaping) are all equal (zero "
        "advantage, no learning signal, unless the shaping separates them) and admit replacements. Logged "
        "as status `filtered`; metrics compare their response lengths with the trained ones, since the "
        "filter biases what is trained.",
    )
    filter_max_groups_per_step: int = _f(
        0,
        "Most groups one step may filter before it trains on equal-reward groups anyway (0: 4 x groups per "
        "step), so a run where nothing varies cannot stall.",
        lo=0,
    )


@dataclass
class WorkflowConfig:
    """How the stages overlap."""

    mode: Literal["async", "sync"] = _f("async", "async: rollout and training overlap within max_staleness; sync: a barrier, staleness 0.")
    max_staleness: int | None = _f(None, "Async ratio: most policy versions a trained sample may lag. null: 1 in async, 0 in sync.", lo=0)
    weight_update: Literal["drain", "swap", "abort"] = _f(
        "swap",
        "drain: finish in-flight requests on old weights, then load; swap: load between two decode steps, keeping "
        "the KV cache; abort: stop in-flight requests, load, re-prefill prompt + tokens so far and continue.",
    )
    redundancy: float = _f(
        0.0,
        "Over-provisioning (ROLL Flash redundant rollouts): admit this fraction more groups than a step "
        "trains. The trainer takes the groups that finish first; in sync mode the rest are cancelled at "
        "the next publication (status cancelled / dropped_stale), in async mode they feed the next step "
        "unless they fall out of max_staleness.",
        lo=0.0,
        hi=4.0,
    )
    store_capacity: int = _f(8192, "Most samples the store holds; producers block beyond it (backpressure). Raised to "
                             "(staleness + 2 + ceil(workflow.redundancy)) x train.batch_size when smaller: what the "
                             "staleness gate may admit must fit.", lo=1)
    lease_timeout_s: float = _f(600.0, "A taken sample not acked within this returns to the queue "
                                   "(a live holder renews its leases every quarter of this: only a dead or hung one loses them).",
                                   lo=1.0)
    step_timeout_s: float = _f(1800.0, "Longest the trainer waits for one batch before failing with a message.", lo=0.001)
    gc_threshold: int = _f(
        0,
        "Python's young-generation GC threshold while the run lasts, in the process that runs the pipeline (the "
        "driver; Ray actors keep their own), gc.set_threshold's first value, restored after. 0: leave it (700 "
        "by default). A driver moving thousands of samples a second spends ~15% of its "
        "CPU on collections that find nothing: set it above what one train step allocates (~25 tracked objects "
        "per sample, so ~32 x train.batch_size) and steady state, where each step frees what it admitted, "
        "collects almost never. Cyclic garbage then waits longer to be freed.",
        lo=0, hi=2**31 - 1,  # (gc.set_threshold takes a C int: above it the run failed at its start)
    )


@dataclass
class EvalConfig:
    """Greedy evaluation on held-out prompts."""

    path: str | None = _f(None, "Eval prompts (a saved `datasets` folder: its `test`, else `validation`, else only "
                                "split). null: the task's eval split, else a held-out slice of whole prompts, at most "
                                "10% of the dataset and eval.size rows.")
    every: int = _f(10, "Evaluate every this many train steps (0: only before and after).", lo=0)
    size: int = _f(1000, "Most eval prompts used.", lo=1)
    success_threshold: float = _f(1.0, "A prompt counts as solved when its greedy reward >= this.")
    patience: int = _f(0, "Stop training early once this many evaluations in a row have not raised eval accuracy "
                          "above the best before them by more than eval.min_delta (the eval curve has flattened); "
                          "the run then ends at the next step with its final evaluation. 0: train to train.max_steps.",
                       lo=0)
    min_delta: float = _f(0.01, "The rise in eval accuracy that counts as progress for eval.patience.", lo=0.0, hi=1.0)


@dataclass
class RuntimeConfig:
    """Where components run."""

    kind: Literal["local", "ray"] = _f(
        "local",
        "local: one process, asyncio + threads (fastest on one small machine). ray: every rollout worker, "
        "reward worker and the trainer is a Ray actor in its own process, placed with a placement group; "
        "the store is a controller actor with data in Ray's object store.",
    )
    address: str | None = _f(None, "Ray cluster address to join (runtime.kind: ray); null starts a local Ray (loopback, no dashboard).")
    rollout_cpus: float = _f(1.0, "CPUs reserved per rollout worker actor (ray).", lo=0.0)
    rollout_gpus: float = _f(0.0, "GPUs per rollout worker actor (ray); its hf engine runs on them (model.device).", lo=0.0)
    train_cpus: float = _f(1.0, "CPUs reserved for the trainer actor (ray).", lo=0.0)
    train_gpus: float = _f(0.0, "GPUs for the trainer actor (ray); its torch trainer runs on them (model.device).", lo=0.0)
    reward_workers: int = _f(1, "Reward worker actors (ray); each scores whole groups as they complete.", lo=1)
    reward_cpus: float = _f(0.0, "CPUs reserved per reward worker actor (ray); 0 for light verifiers.", lo=0.0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _f(
        "PACK", "Ray placement-group strategy for the worker bundles."
    )
    placement_timeout_s: float = _f(
        120.0,
        "How long the run waits for Ray to place the worker bundles (ray) before it stops with a message "
        "naming them; raise it for a joined cluster whose autoscaler adds nodes. A local Ray (runtime.address: "
        "null) that cannot ever hold them is refused at once.",
        lo=1.0,
    )
    max_restarts: int = _f(
        3,
        "How many times each rollout and reward actor is restarted after it dies (ray); its leased samples "
        "go back to the queue and a restarted rollout actor gets the latest weights first. 0: an actor death "
        "ends the run. A trainer, feeder or store death always ends the run.",
        lo=0,
    )
    torch_threads: int | None = _f(
        None,
        "torch CPU threads of the process. null: all the cores it may run on (its CPU affinity: taskset, a "
        "container's cpuset) in sync mode (each phase has the machine to itself); half of them in async "
        "mode (rollout and training run at once and split the cores).",
        lo=1, hi=4096,
    )


@dataclass
class LoggingConfig:
    """Outputs besides the run folder's files."""

    progress: bool = _f(True, "Live progress display (plain lines when not a terminal).")
    tensorboard: bool = _f(
        False, "Also write every metric row as TensorBoard scalars to RUN_DIR/tensorboard (needs the tensorboard package)."
    )
    wandb: bool = _f(False, "Also log every metric row to Weights & Biases (needs the wandb package; WANDB_* env vars apply).")
    wandb_project: str = _f("asyncflow", "W&B project name (logging.wandb).")


@dataclass
class CheckpointConfig:
    """Checkpoints."""

    every: int = _f(
        0,
        "Save a checkpoint every this many train steps to RUN_DIR/checkpoints/step_N/: the policy as a Hugging Face "
        "folder plus optimizer, RNG, data position, policy version, counters and the store's in-flight samples "
        "(0: never; final/ is always written).",
        lo=0,
    )
    keep: int = _f(2, "Newest checkpoints kept (older ones are deleted once a newer one is complete).", lo=1)
    resume: Literal[False, "auto"] = _f(
        False,
        "auto: continue the run in --out from its newest complete checkpoint (a new or empty --out starts "
        "fresh); the logs are cut back to that checkpoint, so no step or sample is counted twice.",
    )


@dataclass
class Config:
    """The whole run."""

    task: str | None = _f("arith", "Built-in task pack supplying what is not given (model, data, reward, defaults).")
    seed: int = _f(0, "Seed for data order, sampling and initialisation (0 to 2^31-1: seeds derived from it must fit "
                   "the 64-bit seeds of torch and the engines).", lo=0, hi=2**31 - 1)
    model: ModelConfig = field(default_factory=ModelConfig, metadata={"doc": ModelConfig.__doc__})
    dataset: DatasetConfig = field(default_factory=DatasetConfig, metadata={"doc": DatasetConfig.__doc__})
    reward: RewardConfig = field(default_factory=RewardConfig, metadata={"doc": RewardConfig.__doc__})
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata={"doc": RolloutConfig.__doc__})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"doc": TrainConfig.__doc__})
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig, metadata={"doc": AlgorithmConfig.__doc__})
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig, metadata={"doc": WorkflowConfig.__doc__})
    eval: EvalConfig = field(default_factory=EvalConfig, metadata={"doc": EvalConfig.__doc__})
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig, metadata={"doc": RuntimeConfig.__doc__})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"doc": LoggingConfig.__doc__})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"doc": CheckpointConfig.__doc__})

    @property
    def staleness(self) -> int:
        """The effective staleness bound (0 in sync mode)."""
        if self.workflow.max_staleness is not None:
            return self.workflow.max_staleness
        return 0 if self.workflow.mode == "sync" else 1


# --------------------------------------------------------------------------------------------------
# loading


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `over` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"--set {item!r}: empty key segment")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {part} is set both as a value and as a section")
        node[parts[-1]] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error: the plain loader keeps
    the last one without a word, and a config never ignores what it was given."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain value, got {type(key).__name__}", key_node.start_mark) from None
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one section", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict, with clear errors."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a folder; give the config's YAML file")
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read the config file: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise UserError(f"{p}:{where}: {problem}") from None
    if data is None:
        if not text.strip():  # (comments only is a choice; no text at all looks like a file cut short)
            raise UserError(f"{p}: the config file is empty; write the settings into it (for the built-in default "
                            "run: `asyncflow demo`)")
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of config sections at the top level")
    return data


def task_defaults(task: str | None) -> dict[str, Any]:
    """The task pack's config defaults (light import: no torch)."""
    if task is None:
        return {}
    from asyncflow.tasks import TASK_NAMES, task_default_config

    if task not in TASK_NAMES:
        hint = _closest(task, list(TASK_NAMES))
        raise UserError(f"task: unknown task pack {task!r}{hint}; known: {', '.join(TASK_NAMES)}")
    return task_default_config(task)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> tuple[Config, set[str]]:
    """Build the resolved config. Returns it with the set of dotted keys the user set explicitly."""
    user = read_yaml(path) if path is not None else {}
    cli = parse_set(overrides or [])
    _check_sections(user, cli)
    explicit = merge(user, cli)
    task = explicit.get("task", Config.task)
    if task is not None and not isinstance(task, str):
        raise UserError(f"task: expected a task name or null, got {task!r}")
    train = explicit.get("train")
    if isinstance(train, dict) and "lr" in train and train["lr"] is None:
        # `lr: null` (DESIGN.md's contract config): the task pack's rate, else the default, as if not given
        explicit = {**explicit, "train": {k: v for k, v in train.items() if k != "lr"}}
    raw = merge(task_defaults(task), explicit)
    cfg = from_dict(raw)
    for section, key in _PATH_KEYS:  # `~/data.jsonl` means the home folder, as in a shell
        holder = getattr(cfg, section)
        value = getattr(holder, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(holder, key, os.path.expanduser(value))
    validate(cfg, _flatten(explicit))
    return cfg, _flatten(explicit)


_PATH_KEYS = (("model", "path"), ("model", "cache_dir"), ("dataset", "path"), ("eval", "path"), ("rollout", "sync_dir"))


def _check_sections(user: dict[str, Any], cli: dict[str, Any], prefix: str = "") -> None:
    """A `--set` into a section the file gives as something else (`train: 5`) would replace it
    silently; refuse it, naming the file's value, as it is refused without the `--set`."""
    for key, value in cli.items():
        if isinstance(value, dict) and key in user:
            if isinstance(user[key], dict):
                _check_sections(user[key], value, f"{prefix}{key}.")
            elif user[key] is not None:
                raise UserError(f"{prefix}{key}: expected a mapping, got {user[key]!r}")


def _flatten(d: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in d.items():
        name = f"{prefix}{key}"
        out.add(name)
        if isinstance(value, dict):
            out |= _flatten(value, name + ".")
    return out


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, checking keys, types and bounds."""
    return typing.cast(Config, _build(Config, raw, ""))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise UserError(f"{prefix}{key}: unknown key{_closest(str(key), list(fields))}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw[name], f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], tp, f.metadata)
    return cls(**values)


def _check_value(key: str, value: Any, tp: Any, meta: Any) -> Any:
    value = _coerce(key, value, tp)
    lo, hi = meta.get("lo"), meta.get("hi")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and value < lo:
            raise UserError(f"{key}: {value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise UserError(f"{key}: {value} is above the maximum {hi}")
    return value


def _yaml_text(value: Any) -> str:
    """A value as YAML writes it (true, null, 2024-01-01), a string in quotes: messages speak the
    config's language, not Python's (`True`, `datetime.date(...)`)."""
    if value is None or isinstance(value, (bool, int, float)) or hasattr(value, "isoformat"):
        return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    return repr(value)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except UserError as exc:
                errors.append(str(exc))
        raise UserError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is not valid here ({_type_name(tp)})")
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            if value == choice and type(value) is type(choice):
                return value
        shown = ", ".join(_yaml_text(c) for c in choices)
        hint = _closest(str(value), [_yaml_text(c).strip("'") for c in choices]) if isinstance(value, str) else ""
        raise UserError(f"{key}: {_yaml_text(value)} is not one of {shown}{hint}")
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        quoted = " (a string: remove the quotes)" if isinstance(value, str) and value.lower() in ("true", "false") else ""
        raise UserError(f"{key}: expected true or false, got {_yaml_text(value)}{quoted}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # (an int beyond a float's range: a traceback)
                raise UserError(f"{key}: expected a finite number, got an integer of {len(str(value))} digits") from None
        elif isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string: accept what is clearly a number
            try:
                number = float(value)
            except ValueError:
                number = None
        if number is None:
            raise UserError(f"{key}: expected a number, got {value!r}")
        # nan passes every bound (nan < lo is False) and an infinite timeout is no timeout: no key takes either
        if not math.isfinite(number):
            raise UserError(f"{key}: expected a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{key}: expected a string, got {_yaml_text(value)} (YAML reads it as a {type(value).__name__}: "
                        f"quote it)")
    raise TypeError(f"config type {tp} of {key} is not supported")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " / ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def validate(cfg: Config, explicit: set[str]) -> None:
    """Cross-field checks: settings that cannot be honoured together are refused, never ignored."""
    if cfg.train.batch_size % cfg.rollout.n:
        raise UserError(
            f"train.batch_size: {cfg.train.batch_size} is not divisible by rollout.n={cfg.rollout.n} (a batch is whole groups)"
        )
    if cfg.train.batch_size < cfg.train.mini_batches:
        raise UserError(f"train.mini_batches: {cfg.train.mini_batches} is more than train.batch_size={cfg.train.batch_size}")
    if cfg.workflow.mode == "sync" and cfg.workflow.max_staleness not in (None, 0):
        raise UserError(
            f"workflow.max_staleness: {cfg.workflow.max_staleness} contradicts workflow.mode=sync (sync is staleness 0)"
        )
    if cfg.rollout.agent is not None:
        _validate_agent(cfg, explicit)
    if cfg.rollout.turn_barrier and cfg.rollout.env is None:
        raise UserError("rollout.turn_barrier: only used with rollout.env (multi-turn episodes)")
    if cfg.rollout.env is not None and cfg.reward.fn is not None and "reward.fn" in explicit:
        raise UserError("reward.fn: not used with rollout.env (an episode's reward is the sum of its environment's "
                        "step rewards); remove one of them")
    if cfg.task is None:
        for key in ("model.path", "dataset.path", *(() if episodic(cfg) else ("reward.fn",))):
            section, name = key.split(".")
            if getattr(getattr(cfg, section), name) is None:
                raise UserError(f"{key}: required when task is null (no task pack to supply it)")
    if "model.task_seed" in explicit and (cfg.task is None or cfg.model.path is not None):
        raise UserError("model.task_seed: not used with " + ("task null" if cfg.task is None else "model.path set")
                        + " (it seeds the task pack's own base model)")
    if cfg.rollout.env is not None and cfg.rollout.env not in ENV_NAMES and ":" not in cfg.rollout.env:
        raise UserError(f"rollout.env: {cfg.rollout.env!r} is neither a built-in ({', '.join(ENV_NAMES)}) nor 'module:factory'")
    if cfg.reward.fn is not None and ":" not in cfg.reward.fn:
        raise UserError(f"reward.fn: {cfg.reward.fn!r} must be 'module:function' or 'path/to/file.py:function'")
    _validate_algorithm(cfg, explicit)
    _validate_servers(cfg, explicit)
    _validate_engines(cfg, explicit)
    # Accepted keys whose feature is not built yet are refused, never silently ignored.
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("logging.tensorboard: the tensorboard package is not installed (pip install tensorboard)")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError("logging.wandb: the wandb package is not installed (pip install wandb)")
    if "logging.wandb_project" in explicit and not cfg.logging.wandb:
        raise UserError("logging.wandb_project: not used while logging.wandb is false")
    if cfg.eval.patience > 0 and cfg.eval.every == 0:
        raise UserError("eval.patience: needs eval.every > 0 (evaluations during training to watch)")
    if "eval.min_delta" in explicit and cfg.eval.patience == 0:
        raise UserError("eval.min_delta: not used while eval.patience is 0 (no early stop)")
    if "checkpoint.keep" in explicit and cfg.checkpoint.every == 0:
        raise UserError("checkpoint.keep: not used while checkpoint.every is 0 (no periodic checkpoints)")
    if cfg.runtime.address is not None and cfg.runtime.kind == "local":
        raise UserError("runtime.address: only used with runtime.kind=ray")
    if cfg.runtime.address is not None:
        _check_ray_address(cfg.runtime.address)
    if cfg.runtime.kind == "local":
        for key in _RAY_KEYS:
            if f"runtime.{key}" in explicit:
                raise UserError(f"runtime.{key}: only used with runtime.kind=ray (kind is local)")
    if cfg.rollout.env is None:
        for key in ("env_latency_s", "env_timeout_s"):
            if f"rollout.{key}" in explicit:
                raise UserError(f"rollout.{key}: only used with rollout.env (multi-turn environments)")
    if episodic(cfg):  # an episode's reward comes from its environment or agent: no reward function runs
        for key in ("timeout_s", "concurrency"):
            if f"reward.{key}" in explicit:
                raise UserError(f"reward.{key}: not used with rollout.env or rollout.agent (no reward function "
                                "runs: an episode is scored by its environment or agent)")
    if not episodic(cfg) and "rollout.max_turns" in explicit:
        raise UserError("rollout.max_turns: only used with rollout.env or rollout.agent (multi-turn episodes)")
    if cfg.rollout.agent is None and "rollout.agent_timeout_s" in explicit:
        raise UserError("rollout.agent_timeout_s: only used with rollout.agent")
    if not cfg.algorithm.filter_groups and "algorithm.filter_max_groups_per_step" in explicit:
        raise UserError("algorithm.filter_max_groups_per_step: not used while algorithm.filter_groups is false")
    if cfg.runtime.kind == "ray" and cfg.model.device == "cuda" and not (cfg.runtime.rollout_gpus and cfg.runtime.train_gpus):
        raise UserError("model.device: cuda with runtime.kind=ray needs runtime.rollout_gpus and runtime.train_gpus "
                        "above 0 (Ray shows an actor only the GPUs it was given)")


def _check_ray_address(address: str) -> None:
    """`auto`, HOST:PORT or ray://HOST:PORT (what `ray.init` joins); anything else was a traceback
    from inside Ray (`foo`: ValueError), or a dashboard URL that Ray retried for minutes."""
    if address.startswith(("http://", "https://")):
        raise UserError(f"runtime.address: {address!r} is a web address (the dashboard's or job submission's?); "
                        "give the head's HOST:PORT from `ray start --head` (port 6379 by default) or ray://HOST:PORT")
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if address != "auto" and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise UserError(f"runtime.address: expected auto, HOST:PORT or ray://HOST:PORT, got {address!r}")


ENV_NAMES = ("calculator", "guess_number")
# runtime.* keys only the Ray runtime reads (placement of its actors)
_RAY_KEYS = ("rollout_cpus", "rollout_gpus", "train_cpus", "train_gpus", "reward_workers", "reward_cpus",
             "placement_strategy", "max_restarts")


def _validate_agent(cfg: Config, explicit: set[str]) -> None:
    """rollout.agent replaces both the environment and the reward function."""
    agent = cfg.rollout.agent
    assert agent is not None
    if ":" not in agent:
        raise UserError(f"rollout.agent: {agent!r} must be 'module:function'")
    if cfg.rollout.env is not None:
        raise UserError("rollout.agent: not used with rollout.env (the agent is its own environment); remove one of them")
    if cfg.runtime.kind != "local":
        raise UserError("rollout.agent: only with runtime.kind=local (the Ray rollout actors do not host agent "
                        "endpoints yet)")
    if cfg.reward.fn is not None and "reward.fn" in explicit:
        raise UserError("reward.fn: not used with rollout.agent (an agent episode's reward is what the agent "
                        "returns); remove one of them")
_SERVER_KEYS = ("server_urls", "server_type", "server_model", "server_token_env", "sync_dir", "sync_timeout_s")


def _validate_servers(cfg: Config, explicit: set[str]) -> None:
    """rollout.engine=openai needs its servers; its keys are refused with any other engine."""
    ro = cfg.rollout
    if ro.engine != "openai":
        for key in _SERVER_KEYS:
            if f"rollout.{key}" in explicit:
                raise UserError(f"rollout.{key}: only used with rollout.engine=openai (engine is {ro.engine})")
        return
    if not ro.server_urls:
        raise UserError("rollout.server_urls: rollout.engine=openai needs at least one server URL (e.g. http://127.0.0.1:8000)")
    for url in ro.server_urls:
        if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
            raise UserError(f"rollout.server_urls: {url!r} is not an http:// or https:// URL")
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018  (parsing it is the check: out of range or not a number raises)
        except ValueError as exc:
            raise UserError(f"rollout.server_urls: {url!r}: {exc}") from None
        if not parts.hostname:
            raise UserError(f"rollout.server_urls: {url!r} has no host")
    if len(set(u.rstrip("/") for u in ro.server_urls)) != len(ro.server_urls):
        raise UserError("rollout.server_urls: a server is listed twice")
    if "rollout.workers" in explicit and ro.workers != len(ro.server_urls):
        raise UserError(f"rollout.workers: {ro.workers} contradicts rollout.server_urls ({len(ro.server_urls)} servers, "
                        "one rollout worker each); remove rollout.workers")
    ro.workers = len(ro.server_urls)  # resolved: one rollout worker per server
    if cfg.runtime.kind != "local":
        raise UserError("rollout.engine: openai is only wired for runtime.kind=local (the servers are the parallel part)")
    if ro.server_type == "vllm" and ro.sync_dir is None:
        raise UserError("rollout.sync_dir: required with rollout.server_type=vllm (the folder the vLLM server was "
                        "started from; vLLM reloads its weights in place)")


def _validate_engines(cfg: Config, explicit: set[str]) -> None:
    """Engine choices the chosen runtime and batch shape can honour (no heavy imports)."""
    t = cfg.train
    if t.engine != "fsdp":
        for key in ("world_size", "worker_timeout_s"):
            if f"train.{key}" in explicit:
                raise UserError(f"train.{key}: only used with train.engine=fsdp (engine is {t.engine})")
    else:
        if cfg.runtime.kind != "local":
            raise UserError("train.engine: fsdp runs only with runtime.kind=local in this version (the Ray "
                            "trainer actor holds a plain torch engine)")
        if t.batch_size % (t.world_size * t.mini_batches):
            raise UserError(
                f"train.world_size: batch_size={t.batch_size} is not divisible by world_size x mini_batches="
                f"{t.world_size} x {t.mini_batches} (every rank takes an equal share of each optimizer step)"
            )
    if cfg.rollout.engine == "vllm":
        if cfg.runtime.kind != "local":
            raise UserError("rollout.engine: vllm runs only with runtime.kind=local in this version")
        if importlib.util.find_spec("vllm") is None:
            raise UserError("rollout.engine: vllm is not installed (pip install 'asyncflow[vllm]', needs a GPU); use hf")

# algorithm.* keys each loss reads; a key set explicitly for a loss that does not read it is refused
_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "ppo": ("clip_low", "clip_high", "dual_clip"),
    "decoupled_ppo": ("clip_low", "clip_high", "dual_clip", "is_level", "is_cap"),
    "tis": ("is_level", "is_cap"),
    "mis": ("is_level", "is_cap"),
    "cispo": ("clip_low", "clip_high"),
    "topr": (),
    "gspo": ("clip_low", "clip_high"),
    "reinforce": (),
}


def _validate_algorithm(cfg: Config, explicit: set[str]) -> None:
    a = cfg.algorithm
    if a.loss == "gspo" and "algorithm.agg" not in explicit:
        a.agg = "seq_mean_token_mean"  # GSPO's own aggregation (a mean over sequences), unless asked otherwise
    used = _LOSS_KEYS[a.loss]
    for key in ("clip_low", "clip_high", "dual_clip", "is_level", "is_cap"):
        if f"algorithm.{key}" in explicit and key not in used:
            users = ", ".join(loss for loss, keys in _LOSS_KEYS.items() if key in keys)
            raise UserError(f"algorithm.{key}: not used by algorithm.loss={a.loss} (used by: {users}); remove it")
    if 0 < a.dual_clip <= 1:
        raise UserError(f"algorithm.dual_clip: {a.dual_clip} must be 0 (off) or > 1")
    if a.loss == "mis" and a.is_cap <= 1:
        raise UserError(f"algorithm.is_cap: {a.is_cap:g} with algorithm.loss=mis keeps only weights of exactly 1 "
                        "(the window is [1/cap, cap]): any engine/trainer difference masks every token; use a cap > 1")
    if "algorithm.kl_estimator" in explicit and a.kl_coef == 0:
        raise UserError("algorithm.kl_estimator: not used while algorithm.kl_coef is 0 (no KL term); set kl_coef > 0")
    if a.norm_length is not None and a.agg != "dr_grpo":
        raise UserError(f"algorithm.norm_length: only used with algorithm.agg=dr_grpo (agg is {a.agg})")
    if "algorithm.overlong_penalty" in explicit and a.overlong_buffer == 0:
        raise UserError("algorithm.overlong_penalty: not used while algorithm.overlong_buffer is 0; set a buffer")
    if a.overlong_buffer >= max_generated_tokens(cfg):
        raise UserError(
            f"algorithm.overlong_buffer: {a.overlong_buffer} must be below the response length limit "
            f"({max_generated_tokens(cfg)} tokens)"
        )
    if (cfg.rollout.top_p < 1.0 or cfg.rollout.top_k > 0) and a.loss != "reinforce":
        key = "rollout.top_p" if cfg.rollout.top_p < 1.0 else "rollout.top_k"
        raise UserError(
            f"{key}: truncated sampling with algorithm.loss={a.loss} is refused: the behavior log-probs would be "
            "those of the truncated distribution, which the loss's importance ratios cannot use; use top_p=1 and "
            "top_k=0, or algorithm.loss=reinforce"
        )
    if cfg.rollout.n == 1 and a.advantage in ("grpo", "dr_grpo", "rloo"):
        raise UserError(f"rollout.n: group advantages (algorithm.advantage={a.advantage}) need n >= 2")


def max_generated_tokens(cfg: Config) -> int:
    """The most tokens one sample can generate: max_new_tokens, per turn with an environment."""
    return cfg.rollout.max_new_tokens * (cfg.rollout.max_turns if episodic(cfg) else 1)


def episodic(cfg: Config) -> bool:
    """Whether each sample is a multi-turn episode that carries its own reward (rollout.env or rollout.agent)."""
    return cfg.rollout.env is not None or cfg.rollout.agent is not None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (for config.yaml)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The fully resolved config as YAML."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field: the generated configuration reference."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows += field_docs(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            rows.append((f"{prefix}{f.name}", _type_name(tp), f.default, f.metadata.get("doc", "")))
    return rows


def reference_markdown() -> str:
    """docs/configuration.md, generated from the typed config (a test keeps the file in sync)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `asyncflow/config.py` (`python -c \"from asyncflow.config import reference_markdown as r; print(r(), end='')\" > docs/configuration.md`).",
        "Precedence: built-in defaults < the task pack's defaults < the YAML file < `--set key.path=value`.",
        "Unknown keys, wrong types, out-of-range values and contradictory settings are refused (exit 2).",
        "",
    ]
    section = None
    for key, type_name, default, doc in field_docs():
        head = key.split(".")[0] if "." in key else "(top level)"
        if head != section:
            section = head
            lines += ["", f"## {head}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        shown = "null" if default is None else repr(default) if isinstance(default, str) else str(default).lower() if isinstance(default, bool) else str(default)
        lines.append(f"| `{key}` | {type_name} | `{shown}` | {doc} |")
    return "\n".join(lines) + "\n"
