"""The typed configuration tree: every section's fields with their defaults, docs and bounds, the
values derived from them (`episodic`, `max_generated_tokens`) and how a field's type is spelled.

A leaf (nothing from the package): loading, validation and the generated reference all read it.
Every field has a docstring (`doc` metadata) so the reference in docs/ is generated from here.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # every `*timeout*` key's maximum (config.py): a week is "never" for a run
LORA_LR = 1e-5  # train.lr when model.lora is set and neither the config nor its task pack gives one (its doc)


def _f(default: Any, doc: str, *, lo: float | None = None, hi: float | None = None) -> Any:
    """A config field with its docstring and optional numeric bounds (inclusive)."""
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi})


@dataclass
class LoraConfig:
    """LoRA: train a PEFT adapter instead of the whole model (needs `pip install 'asyncflow[lora]'`)."""

    r: int = _f(16, "Rank of the adapter's update matrices.", lo=1)
    alpha: float = _f(32.0, "Scale of the update: the adapted weight is W + (alpha / r) B A.", lo=0.0)
    dropout: float = _f(0.0, "Dropout on the adapter's input in train steps (never in log-prob or reference passes).",
                        lo=0.0, hi=0.99)
    target_modules: str | list[str] = _f("all-linear", "Module names (or name suffixes) to adapt, e.g. [q_proj, v_proj]; "
                                                       "all-linear: every linear layer but the output head.")
    save_merged: bool = _f(False, "Also write the merged model (base + adapter, a plain Hugging Face folder) to "
                                  "final/merged; final/ itself holds the adapter in PEFT layout.")


@dataclass
class ModelConfig:
    """The policy model."""

    path: str | None = _f(None, "Hugging Face causal-LM folder; a Hub id (exactly org/name, e.g. "
                                "Qwen/Qwen2.5-0.5B-Instruct, with no local folder of that name) fetched into the "
                                "Hugging Face cache without its code files (HF_HOME, HF_HUB_CACHE; HF_HUB_OFFLINE=1: "
                                "the cache only; the run logs that it read the Hub); a path that does not exist and "
                                "is not org/name (./org/name, ../x, /abs, a/b/c) is an error naming the absolute "
                                "path looked for, never a download; or a .gguf file, converted once into a Hugging "
                                "Face folder in model.cache_dir (needs pip install 'asyncflow[gguf]'; architectures "
                                "and quantizations: docs/tasks.md). null: the task pack prepares (and caches) its "
                                "model.")
    cache_dir: str | None = _f(None, "Where prepared task models and folders converted from a .gguf model.path are "
                                     "cached. null: $ASYNCFLOW_CACHE or ~/.cache/asyncflow.")
    task_seed: int = _f(0, "Seed of the task pack's base model and data (model.path null). 0: the base model shipped "
                           "inside the package (built by `asyncflow prepare TASK`, the same on every machine); another "
                           "seed is prepared once into model.cache_dir (minutes). `seed` seeds the run, not this.",
                        lo=0, hi=2**31 - 1)
    dtype: Literal["float32", "bfloat16"] = _f("float32", "Compute dtype for rollout and the trainer's passes; the trainer keeps float32 master weights and optimizer states either way (float32 keeps behaviour and trainer log-probs equal). bfloat16: about twice float32's speed on CPUs with native bf16 matmuls (AVX512-BF16, AMX) and on GPUs.")
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto",
        "Where the hf rollout engines and the torch trainer run. auto: on a GPU when the process sees one "
        "(rollout workers spread over the GPUs; with runtime.kind=ray, only actors given GPUs by "
        "runtime.rollout_gpus / runtime.train_gpus use one), else on the CPU; cuda: refused without a GPU. "
        "The KL reference model runs in the driver: on the torch trainer's device, else (ray, fsdp, local "
        "vllm) on the CPU. (train.engine=fsdp places its ranks itself; "
        "rollout.engine=vllm always runs on a GPU.)",
    )
    lora: LoraConfig | None = field(default=None, metadata={"doc": "LoRA (a mapping: model.lora.r, ...): train a PEFT "
                                    "adapter on the frozen base model and publish only the adapter to the rollout "
                                    "engines; the KL reference is the base model with the adapter off. null: full "
                                    "fine-tuning. docs/algorithms.md (LoRA)."})


@dataclass
class DatasetConfig:
    """Training prompts."""

    path: str | None = _f(None, "jsonl, parquet, a saved `datasets` folder (its `train` split, or its only one), or a "
                                "Hub dataset id (org/name, e.g. openai/gsm8k; read with `datasets`; told from a local path, "
                                "cached and offline as model.path). null: the task pack's train split.")
    config: str | None = _f(None, "Configuration (subset) of a Hub dataset id in dataset.path or eval.path, e.g. "
                                  "main for openai/gsm8k (TRL's dataset_config). null: its only or default one.")
    prompt_key: str = _f("prompt", "Column holding the prompt (text, or a list of chat messages).")
    label_key: str | None = _f("answer", "Column passed to the reward function under its own name (null: none required).")
    shuffle: bool = _f(True, "Shuffle the prompt order (seeded by `seed`) once per epoch.")


@dataclass
class RewardConfig:
    """The reward function."""

    fn: str | list[str] | None = _f(
        None,
        "`module:function` (imported from sys.path as Python set it up: installed, or on PYTHONPATH) or "
        "`path/to/file.py:function` (loaded by its path, a relative one from the working directory; docs/rewards.md) "
        "with TRL's signature fn(prompts, completions, **columns) "
        "-> list[float] (a None fails the group's call); a function taking `trainer_state` gets the step and version. "
        "A list: several functions, the reward their weighted sum (reward.weights), each one's mean logged as "
        "`reward/<name>`. A `verl:` prefix (`verl:file.py:compute_score`) takes a verl compute_score(data_source, "
        "solution_str, ground_truth, extra_info) unchanged. null: the task pack's verifier.")
    weights: list[float] | None = _f(None, "One weight per reward.fn function (TRL's reward_weights); the reward is "
                                           "the weighted sum. null: 1.0 each.")
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
    sandbox_require: list[str] | None = _f(
        None,
        "Isolation layers the code sandbox (asyncflow.rewards.sandbox: run_code, run_tests) must see hold before it "
        "runs model-written code, e.g. [seccomp, pidns, uid_switch]; without one, each call is refused and the group "
        "is a reward_error. Sets ASYNCFLOW_SANDBOX_REQUIRE in every process that scores. docs/rewards.md lists the "
        "layers and where each holds. null: none required.")


@dataclass
class RolloutConfig:
    """Generation."""

    engine: Literal["hf", "openai", "vllm"] = _f(
        "hf",
        "Inference engine adapter: hf (transformers with continuous batching, in this process), openai (an "
        "OpenAI-compatible server per rollout.server_urls entry: asyncflow serve, vLLM or SGLang) or vllm "
        "(in-process vLLM on a GPU; needs the vllm package; on Ray, runtime.rollout_gpus >= 1). On Ray each rollout "
        "actor builds its engine (openai: actor i drives server_urls[i]). docs/engines.md.",
    )
    workers: int = _f(1, "Number of rollout workers (one engine each).", lo=1, hi=4096)
    n: int = _f(8, "Samples per prompt (a GRPO group). Each is its own request (prompt replication).", lo=1)
    max_new_tokens: int = _f(256, "Longest response, in tokens (per turn with rollout.env or rollout.agent). 256: TRL's "
                                  "max_completion_length default.", lo=1)
    temperature: float = _f(1.0, "Sampling temperature. The trainer divides logits by it too.", lo=1e-3)
    top_p: float = _f(
        1.0,
        "Nucleus sampling: sample from the smallest set of tokens with this much probability; behavior "
        "log-probs are then of that truncated distribution, so only algorithm.loss=reinforce (on-policy: "
        "workflow.max_staleness 0) accepts < 1.",
        lo=1e-6,
        hi=1.0,
    )
    top_k: int = _f(0, "Sample from the k most likely tokens (0: off); like top_p, only with algorithm.loss=reinforce.", lo=0)
    max_batch: int = _f(256, "Most sequences one engine decodes at once (continuous-batching slots).", lo=1)
    request_timeout_s: float = _f(600.0, "Longest one generation request may take before it is failed.", lo=0.001)
    group_timeout_s: float | None = _f(
        None,
        "Straggler deadline: a generation request still running this long after its worker took it is aborted "
        "(cancelled in the engine) and logged with status `aborted`; its group trains on the samples that finished "
        "(advantages over those), or, with fewer than rollout.group_min_samples of them, is not trained (its samples "
        "logged `aborted`). Counted in the train rows' `groups_partial` and `stragglers_aborted`. Single-turn "
        "requests only (not with rollout.env or rollout.agent); below rollout.request_timeout_s. A request is "
        "aborted between 1 and 1.125 times this after it started. null: off (a group waits for its slowest sample).",
        lo=0.001)
    group_min_samples: int = _f(
        2, "rollout.group_timeout_s: fewest finished samples a group past its deadline needs to be trained "
           "(a group-relative advantage needs 2).", lo=1)
    env: str | None = _f(
        None,
        "Multi-turn environment: null (single-turn, scored by reward.fn), calculator, guess_number, or "
        "`module:factory` or `path/to/file.py:factory` (found as reward.fn is) with factory(clock[, max_turns=, "
        "latency_s=]) -> asyncflow.envs.Env (docs/tasks.md). Each sample is an episode (LLM turn, "
        "env step, next turn); its reward is the sum of the env's step rewards; env tokens are masked "
        "out of the loss. An OpenEnv environment, unchanged: `openenv:module:Class` (in process), "
        "`openenv+server:module:app` (a local server the run starts) or `openenv:http://host:port` "
        "(docs/environments.md).",
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
        "Black-box agent: `module:function` or `path/to/file.py:function` (found as reward.fn is) with async "
        "function(base_url, row, seed) -> reward (a float, or a dict "
        "with `reward`). Each sample is one agent episode that talks to its own OpenAI-compatible base_url; its "
        "calls, with exact token ids, become the sample (docs/tasks.md); on Ray the agent and its endpoint run in the "
        "rollout actors (a file by the driver's absolute path; the driver's working directory is searched last for a "
        "module). `verifiers:[ENV+]TASKSET` plays a verifiers environment, unchanged: its tasks are the prompts "
        "and its rubric the reward (docs/environments.md). Not with rollout.env or reward.fn.",
    )
    agent_timeout_s: float = _f(
        600.0, "rollout.agent: longest one agent episode may take; an agent that hangs or raises ends its episode "
        "with an error (kept out of the loss).", lo=0.001)
    server_urls: list[str] | None = _f(
        None,
        "rollout.engine=openai: base URLs of the servers (e.g. http://127.0.0.1:8000), one rollout worker each. "
        "They must serve model.path's weights; the trainer's weights are loaded into them before the first request "
        "(version 0, or a resumed run's version). On Ray rollout actor i drives server_urls[i].",
    )
    launch_servers: str | None = _f(
        None,
        "rollout.engine=openai with runtime.kind=ray: start one server per rollout worker as a Ray actor instead of "
        "using rollout.server_urls: asyncflow (asyncflow serve), vllm (vllm serve rollout.sync_dir) or sglang. Each "
        "server shares its rollout actor's placement-group bundle (its GPUs are the server's), listens on that node's "
        "loopback, requires a random token of its own (given through its environment, never its command line), is "
        "health checked and restarted when it dies (runtime.max_restarts). null: rollout.server_urls. docs/ray.md.",
    )
    server_start_timeout_s: float = _f(
        600.0, "rollout.launch_servers: longest a started (or restarted) server may take to answer GET /v1/models.",
        lo=0.001)
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
        "The token itself never goes into config.yaml. Not with rollout.launch_servers (each server the run starts "
        "has a token of its own).",
    )
    sync_dir: str | None = _f(
        None,
        "rollout.engine=openai: folder each weight version is written to (once per version) for the servers to load: "
        "by the driver, or on Ray by the rollout actors, so it must be on a file system the writers and servers "
        "share. null: RUN_DIR/weight_sync.",
    )
    sync_timeout_s: float = _f(600.0, "rollout.engine=openai: longest one weight load or other admin call to a server may take.", lo=0.001)


@dataclass
class TrainConfig:
    """The trainer."""

    engine: Literal["torch", "fsdp"] = _f(
        "torch",
        "Train engine adapter: torch (plain PyTorch, one process) or fsdp (PyTorch FSDP2 over train.world_size "
        "ranks: locally worker processes, NCCL with one GPU per rank when that many GPUs are visible, else gloo "
        "on CPU; on Ray one actor per rank, each in its own placement-group bundle with runtime.train_cpus and "
        "runtime.train_gpus, NCCL when those GPUs are given). docs/engines.md, docs/ray.md.",
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
    lr: float = _f(1e-6, "AdamW learning rate. 1e-6: the default of TRL's GRPOConfig and verl's actor optimizer, for "
                         "full fine-tuning; with model.lora set, 1e-5: LoRA wants about ten times full "
                         "fine-tuning's rate (TRL's LoRA Without Regret guide). A task pack sets its own. null: as if "
                         "not given.", lo=0.0, hi=10.0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", lo=0.0, hi=10.0)
    max_steps: int = _f(100, "Train steps (weight publications) in the run.", lo=1)
    max_grad_norm: float = _f(1.0, "Gradient-norm clip per optimizer step (0: no clipping).", lo=0.0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _f(
        "constant",
        "How train.lr changes per optimizer step (train.max_steps x train.mini_batches of them), with "
        "transformers' schedules step for step: constant; linear: down to 0 at the run's end (TRL's "
        "default); cosine: down to train.min_lr_ratio x lr. After the warmup; logged per train row as `lr`.",
    )
    warmup_ratio: float = _f(
        0.0,
        "Fraction of the run's optimizer steps (rounded up) over which lr rises linearly from 0 (TRL's "
        "warmup_ratio; the first warmup step has lr 0, as in transformers). Any train.lr_schedule.",
        lo=0.0, hi=1.0,
    )
    min_lr_ratio: float = _f(0.0, "cosine: the lr it decays to, as a fraction of train.lr (transformers' "
                                  "cosine_with_min_lr).", lo=0.0, hi=1.0)
    gradient_checkpointing: bool = _f(
        False,
        "Recompute each decoder layer's activations in backward instead of keeping them "
        "(model.gradient_checkpointing_enable): less memory, about one more forward pass of time.",
    )


@dataclass
class DistillConfig:
    """On-policy distillation: a teacher scores every token the policy samples; each token's advantage
    gains -coef x (policy log-prob - teacher log-prob), the per-token reverse KL (docs/algorithms.md)."""

    teacher: str | None = _f(None, "The teacher: a Hugging Face causal-LM folder with the policy's vocabulary (e.g. a "
                                   "run's final/ or checkpoints/step_N/; a LoRA run's final/merged), or an OpenAI-compatible server's base URL "
                                   "(http://HOST:PORT/v1) whose /v1/completions returns prompt log-probs (echo with "
                                   "logprobs: vLLM, asyncflow serve). Required.")
    coef: float = _f(1.0, "Weight of the per-token reverse KL in each token's advantage.", lo=0.0)
    reward_coef: float = _f(1.0, "Weight of the task reward's advantage beside it. 0: distillation alone (rewards are "
                                 "still computed and logged, so the run's accuracy stays measured).", lo=0.0)
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "Where a teacher folder runs (in the driver process). auto: "
                                                        "the KL reference model's device (model.device).")
    timeout_s: float = _f(120.0, "A server teacher: most seconds one scoring request may take.", lo=0.001)
    token_env: str = _f("", "A server teacher: environment variable holding its bearer token (empty: none is sent; "
                            "the token never goes into config.yaml).")


@dataclass
class AlgorithmConfig:
    """Advantage estimator and policy loss."""

    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = _f(
        "grpo",
        "grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: r - mean of the group's other "
        "samples; reinforce_pp: (r - batch mean) / batch std (REINFORCE++, no group baseline). Computed at "
        "batch assembly.",
    )
    loss: Literal["ppo", "decoupled_ppo", "tis", "mis", "cispo", "topr", "gspo", "reinforce", "m2po", "icepop"] = _f(
        "ppo",
        "Policy loss (docs/algorithms.md). ppo: clipped ratio current/behavior; decoupled_ppo: clip against "
        "the proximal policy (recomputed), importance weight proximal/behavior; tis / mis: truncated / "
        "masked importance sampling current/behavior; cispo: clipped IS weight on log pi; topr: tapered "
        "off-policy REINFORCE; gspo: sequence-level ratio; reinforce: -A log pi; m2po: ratio current/behavior, "
        "tokens masked to bound its second moment; icepop: ratio current/behavior, tokens outside a window masked.",
    )
    clip_low: float | None = _f(
        None, "Lower clip: ratio >= 1 - clip_low (ppo, decoupled_ppo, cispo, gspo). null: 0.2, or 3e-4 with "
        "loss=gspo (its sequence ratio is a geometric mean: GSPO's paper and verl clip it this tightly).", lo=0.0, hi=1.0)
    clip_high: float | None = _f(
        None, "Upper clip: ratio <= 1 + clip_high, clip-higher (ppo, decoupled_ppo, cispo, gspo). null: 0.28, or "
        "4e-4 with loss=gspo.", lo=0.0)
    dual_clip: float = _f(
        0.0, "Dual clip c (ppo, decoupled_ppo): a negative-advantage token's loss is at most c x |A|. 0: off; else > 1.", lo=0.0
    )
    is_level: Literal["token", "sequence", "geometric"] = _f(
        "token",
        "Importance-weight level (decoupled_ppo, tis, mis, topr): per token, the sequence's product, or its "
        "geometric mean (biased as a weight: docs/algorithms.md). topr: token (default, lower variance) or "
        "sequence (the trajectory ratio of TOPR's bound).",
    )
    is_mode: Literal["truncate", "mask"] = _f(
        "truncate",
        "decoupled_ppo's proximal/behavior weight above is_cap: truncate to is_cap, or mask (weight 0; AReaL's "
        "behav_imp_weight_cap).",
    )
    is_cap: float = _f(
        2.0,
        "Importance-weight cap (decoupled_ppo: see is_mode; tis: truncate above it; mis: mask weights above it "
        "or below 1/cap).",
        lo=1.0,
    )
    m2_threshold: float = _f(
        0.04,
        "M2PO's second-moment bound (loss=m2po): the fewest tokens with the largest (log r)^2, r = current/behavior, "
        "are masked so that the kept tokens' mean (log r)^2 is at most this (per micro-batch).",
        lo=0.0,
    )
    icepop_low: float = _f(0.5, "IcePop's window (loss=icepop): tokens whose ratio current/behavior is below this are masked.",
                           lo=0.0, hi=1.0)
    icepop_high: float = _f(5.0, "IcePop's window (loss=icepop): tokens whose ratio current/behavior is above this are masked.",
                            lo=1.0)
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
    distill: DistillConfig | None = field(default=None, metadata={"doc": "On-policy distillation (a mapping: "
                                          "algorithm.distill.teacher, ...): the teacher's per-token log-probs of each "
                                          "sampled response join its advantage; a stage of its own, like the KL "
                                          "reference's. null: off. docs/algorithms.md (On-policy distillation)."})


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
    stall_timeout_s: float = _f(
        1200.0,
        "Stall watchdog: when no sample has changed state (put, written, taken, finished) for this long, the run "
        "writes every process's stacks (threads and asyncio tasks; each Ray actor's) and the store's counts per "
        "state into the run folder's stall/, and ends with one line naming the stage it waits on (exit 1; "
        "resumable from the last checkpoint). Keep it above the longest train step, weight load, evaluation and checkpoint save. "
        "0: off.", lo=0.0)
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
                                "split). null: the task's eval split, else a held-out slice of the dataset: distinct "
                                "prompts drawn at random with every copy of each (none is trained on), up to eval.size "
                                "of them and at most 10% of the distinct prompts, their copies at most 20% of the rows "
                                "(a prompt with more copies than the room left stays in training). Under 10 distinct "
                                "prompts: evaluation on the training prompts, with a note.")
    every: int = _f(10, "Evaluate every this many train steps (0: only before and after).", lo=0)
    size: int = _f(1000, "Most distinct eval prompts used (the first ones of the eval file or split, every copy of each). Copies "
                         "of a prompt (the same text or message list) are generated once, greedily, and count as one "
                         "prompt; copies whose other columns differ are each scored against that completion, and the "
                         "prompt's reward is the mean over its copies.", lo=1)
    success_threshold: float = _f(1.0, "A prompt counts as solved when its greedy reward >= this.")
    patience: int = _f(0, "Stop training early once this many evaluations in a row have not raised eval accuracy "
                          "above the best before them by more than eval.min_delta (the eval curve has flattened); "
                          "the run then ends at the next step with its final evaluation. 0: train to train.max_steps.",
                       lo=0)
    min_delta: float = _f(0.01, "The rise in eval accuracy that counts as progress for eval.patience.", lo=0.0, hi=1.0)
    lenient_fn: str | None = _f(
        None,
        "A second look at the same greedy answers: `module:function` or `file.py:function` (found as reward.fn is; "
        "its signature) scoring each answer "
        "given eval.lenient_tokens tokens, e.g. the right answer anywhere in it, logged as eval_lenient_accuracy "
        "beside eval_accuracy, so a gain in form (answering briefly, as asked) is told apart from one in "
        "capability. One generation serves both: greedy decoding's first rollout.max_new_tokens tokens are the "
        "strict answer. Single-turn runs only. null: the task pack's, where reward.fn is the task's too, else none.")
    lenient_tokens: int | None = _f(None, "Tokens each answer gets for eval.lenient_fn. null: 4 x rollout.max_new_tokens.",
                                    lo=1)


@dataclass
class RuntimeConfig:
    """Where components run."""

    kind: Literal["local", "ray"] = _f(
        "local",
        "local: one process, asyncio + threads. ray: every rollout worker, reward worker and the trainer is "
        "a Ray actor in its own process, placed with a placement group; the store is a controller actor with "
        "data in Ray's object store (runtime.colocate: rollout actor 0 is also the store, the feeder and the "
        "reward workers).",
    )
    address: str | None = _f(None, "Ray cluster address to join (runtime.kind: ray); null starts a local Ray (loopback, no dashboard).")
    rollout_cpus: float = _f(1.0, "CPUs reserved per rollout worker actor (ray).", lo=0.0)
    rollout_gpus: float = _f(0.0, "GPUs per rollout worker actor (ray); its hf engine runs on them (model.device); vllm needs >= 1.", lo=0.0)
    train_cpus: float = _f(1.0, "CPUs reserved for the trainer actor, or per FSDP rank actor (ray); an FSDP rank "
                           "uses as many torch threads (at least 1).", lo=0.0)
    train_gpus: float = _f(0.0, "GPUs for the trainer actor, or per FSDP rank actor (ray); the trainer runs on them "
                           "(model.device).", lo=0.0)
    colocate: bool | None = _f(
        None,
        "true: rollout actor 0 is also the store controller, the feeder and the reward workers (ray), so its "
        "engine's per-sample traffic (take a prompt, write a response, score a group) stays in its process, as "
        "in the local runtime; only the trainer's batches, the weights and the other rollout actors' samples "
        "cross processes. Its death then ends the run (it holds the store), so it is never restarted. false: "
        "each is an actor of its own, every rollout and reward actor restartable. null: true on the one machine of "
        "a Ray the run starts (runtime.address: null) whose rollout actors get no GPU (runtime.rollout_gpus: 0: "
        "their engines share the CPU cores with every other process, and each process a sample passes through "
        "costs throughput); false on a joined cluster or with GPU engines. docs/ray.md.",
    )
    reward_workers: int = _f(1, "Reward worker actors (ray); each scores whole groups as they complete.", lo=1)
    reward_cpus: float = _f(0.0, "CPUs reserved per reward worker actor (ray); 0 for light verifiers.", lo=0.0)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = _f(
        "PACK", "Ray placement-group strategy for the worker bundles."
    )
    train_resource: str | None = _f(
        None,
        "A custom Ray resource (a node label: `ray start --resources='{\"trainer\": 1}'`) the trainer's bundles "
        "need, 0.001 of it each: the trainer's ranks go only to the nodes that offer it (ray). null: any node.",
    )
    rollout_resource: str | None = _f(
        None,
        "A custom Ray resource the rollout actors' bundles need (0.001 each): they go only to nodes that offer "
        "it, and a restarted one only to another such node (ray). null: any node.",
    )
    weight_sync: Literal["object_store", "collective"] = _f(
        "object_store",
        "How new weights reach the rollout actors (ray). object_store: the trainer exports them once into Ray's "
        "object store and every actor fetches them. collective: a bucketed broadcast from the trainer's rank 0 "
        "to every rollout actor over a process group of their own (NCCL when the trainer and rollout actors all "
        "have GPUs, gloo otherwise); an actor that restarted or missed one takes that version from the object "
        "store. Server engines (rollout.engine: openai) always load from rollout.sync_dir. docs/ray.md.",
    )
    weight_sync_delta: bool = _f(
        False,
        "Publish each new version as a delta: the trainer keeps the last published copy in the rollout dtype "
        "(model.dtype) and sends, per tensor, the indices and values of the elements that changed (or the whole "
        "tensor where that is smaller); engines write them in place and check a checksum of the result. An engine "
        "that missed a version, or whose checksum differs, loads the full weights of that version. The first "
        "publication is full. Every path (in process, runtime.weight_sync object_store and collective, server "
        "weight folders). Needs a trainer that exports in this process or its own actor (train.engine: torch). "
        "docs/concepts.md.",
    )
    weight_bucket_mb: float = _f(256.0, "Bucket size of the collective weight broadcast, in MiB (ray).", lo=0.001)
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
        "ends the run. A trainer, feeder or store death always ends the run (so does the colocated hub's: "
        "runtime.colocate).",
        lo=0,
    )
    torch_threads: int | None = _f(
        None,
        "torch CPU threads of each thread that computes: every rollout engine's decode thread and the "
        "trainer's passes (the driver's own thread runs torch with one, so it keeps no OpenMP pool beside "
        "theirs). null: all the cores the process may run on (its CPU affinity: taskset, a container's "
        "cpuset) in sync mode (each phase has the machine to itself); half of them in async mode (rollout and "
        "training run at once and split the cores).",
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
        "(0: never, so the run cannot be resumed, which its first line says; final/ is always written).",
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

    task: str | None = _f(None, "Built-in task pack (arith, calc, chat_arith) supplying what is not given: its model, "
                                "data, reward and the defaults listed under Task packs below. null: none; model.path, "
                                "dataset.path and reward.fn are required and the defaults are the ones in this table.")
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


CLIP_DEFAULTS = {"gspo": (3e-4, 4e-4)}  # (clip_low, clip_high) where a loss's differ from PPO's (0.2, 0.28)


def clip_defaults(loss: str) -> tuple[float, float]:
    """`algorithm.clip_low` / `clip_high` when null: per loss (GSPO clips its sequence ratio hundreds of times tighter)."""
    return CLIP_DEFAULTS.get(loss, (0.2, 0.28))


def torch_threads(cfg: Config) -> int:
    """CPU threads for torch: measured best placement per mode (docs/performance.md, E2E)."""
    if cfg.runtime.torch_threads is not None:
        return cfg.runtime.torch_threads
    return usable_cores() if cfg.workflow.mode == "sync" else max(1, usable_cores() // 2)


def colocated(cfg: Config) -> bool:
    """`runtime.colocate`, with null resolved (see its doc)."""
    if cfg.runtime.colocate is not None:
        return cfg.runtime.colocate
    return cfg.runtime.address is None and cfg.runtime.rollout_gpus == 0


def usable_cores() -> int:
    """The cores this process may run on (`taskset`, a container's cpuset), not the machine's:
    `os.cpu_count()` put 2 torch threads on the 1 core a `taskset -c 0` run had."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)


def max_generated_tokens(cfg: Config) -> int:
    """The most tokens one sample can generate: max_new_tokens, per turn with an environment."""
    return cfg.rollout.max_new_tokens * (cfg.rollout.max_turns if episodic(cfg) else 1)


def episodic(cfg: Config) -> bool:
    """Whether each sample is a multi-turn episode that carries its own reward (rollout.env or rollout.agent)."""
    return cfg.rollout.env is not None or cfg.rollout.agent is not None


def section_type(tp: Any) -> type | None:
    """The dataclass of a config section's type: `X` or an optional section `X | None` (null: off)."""
    if dataclasses.is_dataclass(tp):
        return typing.cast(type, tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(kinds) == 1 and dataclasses.is_dataclass(kinds[0]):
            return typing.cast(type, kinds[0])
    return None


def type_name(tp: Any) -> str:
    """A field type as the reference and error messages spell it (`int or null`, `hf / openai / vllm`)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " / ".join(str(c).lower() if isinstance(c, bool) else str(c) for c in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
