"""Hints for unknown config keys that are TRL (`GRPOConfig`), PEFT or verl names: each names the
asyncflow key and, in one line, how the units differ (docs/trl.md, docs/verl.md).

A name is matched wherever it is put: bare (`beta:`), under any section (`algorithm.beta`), as a
verl path (`actor_rollout_ref.actor.optim.lr`, also as a section holding it) or a tail of one
(`optim.lr`). No heavy imports: the CLI validates before torch loads.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from asyncflow.config_schema import Config, section_type


@dataclass(frozen=True)
class Alias:
    """Another framework's name for a setting. `target`: the asyncflow key it maps to (None: none)."""

    name: str
    target: str | None
    text: str


TRL: tuple[Alias, ...] = (
    Alias("num_generations", "rollout.n", "TRL's num_generations is rollout.n (samples per prompt)"),
    Alias("per_device_train_batch_size", "train.batch_size",
          "TRL's per_device_train_batch_size counts samples per device and pass: train.batch_size = "
          "per_device_train_batch_size x gradient_accumulation_steps x processes (samples per train step)"),
    Alias("gradient_accumulation_steps", "train.micro_batch_size",
          "TRL's gradient_accumulation_steps has no key here: train.batch_size is the samples per train step, "
          "train.micro_batch_size the samples per forward/backward pass"),
    Alias("steps_per_generation", "train.mini_batches",
          "TRL's steps_per_generation is train.mini_batches (optimizer steps per train step, a count)"),
    Alias("num_iterations", None,
          "TRL's num_iterations has no equivalent: each batch is trained once, in train.mini_batches optimizer steps"),
    Alias("loss_type", "algorithm.agg",
          "TRL's loss_type is algorithm.agg: grpo -> seq_mean_token_mean, bnpo/dapo -> token_mean, dr_grpo -> "
          "dr_grpo (with algorithm.advantage: dr_grpo); cispo is algorithm.loss: cispo"),
    Alias("max_completion_length", "rollout.max_new_tokens",
          "TRL's max_completion_length is rollout.max_new_tokens (per turn with an environment)"),
    Alias("max_prompt_length", None, "TRL's max_prompt_length has no equivalent (prompts are used whole)"),
    Alias("temperature", "rollout.temperature", "TRL's temperature is rollout.temperature"),
    Alias("top_p", "rollout.top_p", "TRL's top_p is rollout.top_p (only with algorithm.loss: reinforce)"),
    Alias("top_k", "rollout.top_k", "TRL's top_k is rollout.top_k (only with algorithm.loss: reinforce)"),
    Alias("learning_rate", "train.lr", "TRL's learning_rate is train.lr (AdamW)"),
    Alias("weight_decay", "train.weight_decay", "TRL's weight_decay is train.weight_decay"),
    Alias("max_grad_norm", "train.max_grad_norm", "TRL's max_grad_norm is train.max_grad_norm"),
    Alias("max_steps", "train.max_steps",
          "TRL's max_steps is train.max_steps (train steps: one batch and one weight publication each)"),
    Alias("num_train_epochs", None,
          "TRL's num_train_epochs has no equivalent: a run is train.max_steps train steps (prompts repeat, reshuffled)"),
    Alias("beta", "algorithm.kl_coef", "TRL's beta is algorithm.kl_coef"),
    Alias("epsilon", "algorithm.clip_low", "TRL's epsilon is algorithm.clip_low (ratio >= 1 - clip_low)"),
    Alias("epsilon_high", "algorithm.clip_high", "TRL's epsilon_high is algorithm.clip_high (ratio <= 1 + clip_high)"),
    Alias("delta", "algorithm.dual_clip",
          "TRL's delta is closest to algorithm.dual_clip, a different formula (docs/trl.md)"),
    Alias("scale_rewards", "algorithm.advantage",
          "TRL's scale_rewards is algorithm.advantage: group -> grpo, none -> dr_grpo (batch: no exact counterpart)"),
    Alias("importance_sampling_level", "algorithm.loss",
          "TRL's importance_sampling_level: sequence is algorithm.loss: gspo"),
    Alias("vllm_importance_sampling_correction", "algorithm.loss",
          "TRL's vllm_importance_sampling_correction is algorithm.loss: tis (or mis, decoupled_ppo)"),
    Alias("vllm_importance_sampling_cap", "algorithm.is_cap", "TRL's vllm_importance_sampling_cap is algorithm.is_cap"),
    Alias("mask_truncated_completions", None,
          "TRL's mask_truncated_completions is not available; algorithm.overlong_buffer shapes over-long responses"),
    Alias("use_peft", "model.lora", "TRL's use_peft is model.lora (a mapping: model.lora.r, alpha, dropout, target_modules)"),
    Alias("lora_r", "model.lora.r", "TRL's lora_r is model.lora.r"),
    Alias("lora_alpha", "model.lora.alpha", "TRL's (and PEFT's) lora_alpha is model.lora.alpha"),
    Alias("lora_dropout", "model.lora.dropout", "TRL's (and PEFT's) lora_dropout is model.lora.dropout"),
    Alias("lora_target_modules", "model.lora.target_modules", "TRL's lora_target_modules is model.lora.target_modules"),
    Alias("use_vllm", "rollout.engine", "TRL's use_vllm is rollout.engine: vllm (or openai with servers)"),
    Alias("reward_funcs", "reward.fn", "TRL's reward_funcs is reward.fn ('module:function', or a list of them)"),
    Alias("reward_weights", "reward.weights", "TRL's reward_weights is reward.weights"),
    Alias("lr_scheduler_type", "train.lr_schedule", "TRL's lr_scheduler_type is train.lr_schedule"),
    Alias("warmup_ratio", "train.warmup_ratio",
          "TRL's warmup_ratio is train.warmup_ratio (of the optimizer steps: train.max_steps x train.mini_batches)"),
    Alias("warmup_steps", "train.warmup_ratio",
          "TRL's warmup_steps is a count: train.warmup_ratio = warmup_steps / (train.max_steps x train.mini_batches)"),
    Alias("gradient_checkpointing", "train.gradient_checkpointing",
          "TRL's gradient_checkpointing is train.gradient_checkpointing"),
    Alias("bf16", "model.dtype", "TRL's bf16 is model.dtype: bfloat16"),
    Alias("report_to", "logging.wandb", "TRL's report_to is logging.tensorboard / logging.wandb (true or false)"),
    Alias("output_dir", None, "TRL's output_dir is the --out argument of asyncflow train"),
    Alias("save_steps", "checkpoint.every",
          "TRL's save_steps is checkpoint.every (train steps; 0, the default, writes no checkpoint)"),
    Alias("save_strategy", "checkpoint.every",
          "TRL's save_strategy: steps (with save_steps) is checkpoint.every (train steps; 0, the default, writes none)"),
    Alias("save_total_limit", "checkpoint.keep", "TRL's save_total_limit is checkpoint.keep (newest checkpoints kept)"),
    Alias("save_only_model", None,
          "TRL's save_only_model has no key: final/ holds the weights alone; a checkpoint (checkpoint.every) holds "
          "the optimizer and run state too, for checkpoint.resume"),
    Alias("resume_from_checkpoint", "checkpoint.resume",
          "TRL's resume_from_checkpoint is checkpoint.resume: auto (the newest complete checkpoint in --out)"),
    Alias("peft_config", "model.lora",
          "PEFT's peft_config (a LoraConfig) is model.lora: its r, lora_alpha, lora_dropout and target_modules "
          "are model.lora.r, alpha, dropout and target_modules"),
    Alias("target_modules", "model.lora.target_modules", "PEFT's target_modules is model.lora.target_modules"),
    Alias("logging_steps", None,
          "TRL's logging_steps has no key: every train step writes its metrics row (metrics.jsonl; TensorBoard "
          "and W&B with logging.tensorboard / logging.wandb)"),
    Alias("logging_strategy", None,
          "TRL's logging_strategy has no key: every train step writes its metrics row (metrics.jsonl)"),
    Alias("logging_dir", "logging.tensorboard",
          "TRL's logging_dir has no key: with logging.tensorboard: true the events go to RUN_DIR/tensorboard"),
    Alias("log_completions", None, "TRL's log_completions has no key: every completion is in RUN_DIR/samples.jsonl"),
    Alias("run_name", None, "TRL's run_name has no key: a run is named by its folder (--out), as is its W&B run"),
    Alias("eval_steps", "eval.every", "TRL's eval_steps is eval.every (train steps; 0: only before and after)"),
    Alias("eval_strategy", "eval.every",
          "TRL's eval_strategy: steps (with eval_steps) is eval.every (train steps; 0: only before and after)"),
    Alias("per_device_eval_batch_size", "rollout.max_batch",
          "TRL's per_device_eval_batch_size has no key: evaluation is generated by a rollout engine, up to "
          "rollout.max_batch sequences at once"),
    Alias("generation_batch_size", "train.batch_size",
          "TRL's generation_batch_size is closest to train.batch_size (samples per train step, split into "
          "train.mini_batches optimizer steps)"),
    Alias("max_length", "rollout.max_new_tokens",
          "max_length has no key here: rollout.max_new_tokens bounds a response (prompts are used whole)"),
    Alias("fp16", "model.dtype", "TRL's fp16 has no equivalent: model.dtype is float32 or bfloat16"),
    Alias("torch_dtype", "model.dtype", "TRL's torch_dtype (model_init_kwargs) is model.dtype (float32 or bfloat16)"),
    Alias("model_name_or_path", "model.path", "TRL's model_name_or_path is model.path (a local folder or a Hub id)"),
    Alias("dataset_name", "dataset.path", "TRL's dataset_name is dataset.path (a Hub id, or a local file or folder)"),
    Alias("dataset_config", "dataset.config", "TRL's dataset_config is dataset.config"),
    Alias("shuffle_dataset", "dataset.shuffle", "TRL's shuffle_dataset is dataset.shuffle"),
    Alias("lr_scheduler_kwargs", "train.min_lr_ratio",
          "TRL's lr_scheduler_kwargs: {min_lr_rate: r} is train.min_lr_ratio: r (with train.lr_schedule: cosine)"),
    Alias("optim", "train.lr", "TRL's optim has no key: the optimizer is AdamW (train.lr, train.weight_decay)"),
    Alias("vllm_mode", "rollout.engine",
          "TRL's vllm_mode: colocate is rollout.engine: vllm; server is rollout.engine: openai with rollout.server_urls"),
    Alias("sync_ref_model", "algorithm.kl_coef",
          "TRL's sync_ref_model has no equivalent: the KL reference is the frozen initial policy (algorithm.kl_coef)"),
    Alias("push_to_hub", None, "TRL's push_to_hub has no equivalent: RUN_DIR/final is a Hugging Face folder to upload"),
    Alias("hub_model_id", None, "TRL's hub_model_id has no equivalent: RUN_DIR/final is a Hugging Face folder to upload"),
)

_AR, _ACT = "actor_rollout_ref", "actor_rollout_ref.actor"
_UNITS = "verl's {} counts prompts: train.batch_size = prompts x rollout.n"
VERL: tuple[Alias, ...] = (
    Alias("data.train_batch_size", "train.batch_size", _UNITS.format("data.train_batch_size")),
    Alias("data.max_response_length", "rollout.max_new_tokens", "verl's data.max_response_length is rollout.max_new_tokens"),
    Alias("data.max_prompt_length", None, "verl's data.max_prompt_length has no equivalent (prompts are used whole)"),
    Alias("data.train_files", "dataset.path", "verl's data.train_files is dataset.path (one jsonl, parquet or datasets folder)"),
    Alias("data.val_files", "eval.path", "verl's data.val_files is eval.path"),
    Alias("data.prompt_key", "dataset.prompt_key", "verl's data.prompt_key is dataset.prompt_key"),
    Alias("data.shuffle", "dataset.shuffle", "verl's data.shuffle is dataset.shuffle"),
    Alias(f"{_AR}.model.path", "model.path", f"verl's {_AR}.model.path is model.path"),
    Alias(f"{_AR}.model.lora_rank", "model.lora.r", "verl's lora_rank is model.lora.r (0 there is model.lora: null)"),
    Alias(f"{_AR}.model.lora_alpha", "model.lora.alpha", "verl's lora_alpha is model.lora.alpha"),
    Alias(f"{_AR}.model.target_modules", "model.lora.target_modules", "verl's target_modules is model.lora.target_modules"),
    Alias(f"{_AR}.model.enable_gradient_checkpointing", "train.gradient_checkpointing",
          f"verl's {_AR}.model.enable_gradient_checkpointing is train.gradient_checkpointing"),
    Alias(f"{_ACT}.optim.lr", "train.lr", f"verl's {_ACT}.optim.lr is train.lr"),
    Alias(f"{_ACT}.optim.weight_decay", "train.weight_decay", f"verl's {_ACT}.optim.weight_decay is train.weight_decay"),
    Alias(f"{_ACT}.optim.lr_warmup_steps_ratio", "train.warmup_ratio",
          "verl's lr_warmup_steps_ratio is train.warmup_ratio"),
    Alias(f"{_ACT}.optim.lr_warmup_steps", "train.warmup_ratio",
          "verl's lr_warmup_steps is a count: train.warmup_ratio = lr_warmup_steps / (train.max_steps x "
          "train.mini_batches)"),
    Alias(f"{_ACT}.optim.warmup_style", "train.lr_schedule", "verl's warmup_style is train.lr_schedule"),
    Alias(f"{_ACT}.ppo_mini_batch_size", "train.mini_batches",
          "verl's ppo_mini_batch_size counts prompts per optimizer step; train.mini_batches is a count: "
          "data.train_batch_size / ppo_mini_batch_size"),
    Alias(f"{_ACT}.ppo_micro_batch_size_per_gpu", "train.micro_batch_size",
          "verl's ppo_micro_batch_size_per_gpu is train.micro_batch_size (samples per pass; with fsdp, per rank)"),
    Alias(f"{_ACT}.ppo_micro_batch_size", "train.micro_batch_size",
          "verl's ppo_micro_batch_size counts samples over all GPUs: train.micro_batch_size is per pass (per rank)"),
    Alias(f"{_ACT}.ppo_epochs", None,
          "verl's ppo_epochs has no equivalent: each batch is trained once, in train.mini_batches optimizer steps"),
    Alias(f"{_ACT}.clip_ratio", "algorithm.clip_low", "verl's clip_ratio is algorithm.clip_low and algorithm.clip_high"),
    Alias(f"{_ACT}.clip_ratio_low", "algorithm.clip_low", "verl's clip_ratio_low is algorithm.clip_low"),
    Alias(f"{_ACT}.clip_ratio_high", "algorithm.clip_high", "verl's clip_ratio_high is algorithm.clip_high"),
    Alias(f"{_ACT}.clip_ratio_c", "algorithm.dual_clip",
          "verl's clip_ratio_c is algorithm.dual_clip (verl's default 3; 0, the default here, is off)"),
    Alias(f"{_ACT}.use_kl_loss", "algorithm.kl_coef", "verl's use_kl_loss: set algorithm.kl_coef > 0 (a loss term)"),
    Alias(f"{_ACT}.kl_loss_coef", "algorithm.kl_coef", "verl's kl_loss_coef is algorithm.kl_coef"),
    Alias(f"{_ACT}.kl_loss_type", "algorithm.kl_estimator",
          "verl's kl_loss_type is algorithm.kl_estimator: kl -> k1, mse -> k2, low_var_kl -> k3"),
    Alias(f"{_ACT}.loss_agg_mode", "algorithm.agg",
          "verl's loss_agg_mode is algorithm.agg: token-mean -> token_mean, seq-mean-token-sum -> seq_mean_token_sum, "
          "seq-mean-token-mean -> seq_mean_token_mean, seq-mean-token-sum-norm -> dr_grpo"),
    Alias(f"{_ACT}.policy_loss.loss_mode", "algorithm.loss",
          "verl's policy_loss.loss_mode is algorithm.loss: vanilla -> ppo, gspo -> gspo (docs/algorithms.md)"),
    Alias(f"{_ACT}.entropy_coeff", None, "verl's entropy_coeff has no equivalent (entropy is logged, not in the loss)"),
    Alias(f"{_ACT}.grad_clip", "train.max_grad_norm", "verl's grad_clip is train.max_grad_norm"),
    Alias(f"{_AR}.rollout.n", "rollout.n", f"verl's {_AR}.rollout.n is rollout.n (samples per prompt)"),
    Alias(f"{_AR}.rollout.name", "rollout.engine",
          "verl's rollout.name is rollout.engine: vllm -> vllm; sglang -> openai with rollout.server_type: sglang"),
    Alias(f"{_AR}.rollout.temperature", "rollout.temperature", "verl's rollout.temperature is rollout.temperature"),
    Alias(f"{_AR}.rollout.top_p", "rollout.top_p", "verl's rollout.top_p is rollout.top_p"),
    Alias(f"{_AR}.rollout.top_k", "rollout.top_k", "verl's rollout.top_k is rollout.top_k (0 is off here, -1 in verl)"),
    Alias(f"{_AR}.rollout.mode", "workflow.mode",
          "verl's rollout.mode (sync or async: the inference engine's API) has no key here; workflow.mode is "
          "something else: sync or async (off-policy) training"),
    Alias(f"{_AR}.rollout.multi_turn.max_assistant_turns", "rollout.max_turns",
          "verl's multi_turn.max_assistant_turns is rollout.max_turns (with rollout.env or rollout.agent)"),
    Alias(f"{_AR}.rollout.response_length", "rollout.max_new_tokens", "verl's response_length is rollout.max_new_tokens"),
    Alias(f"{_AR}.rollout.log_prob_micro_batch_size_per_gpu", "train.micro_batch_size",
          "verl's log_prob_micro_batch_size_per_gpu is train.micro_batch_size (one size for every pass)"),
    Alias(f"{_AR}.ref.log_prob_micro_batch_size_per_gpu", "train.micro_batch_size",
          "verl's log_prob_micro_batch_size_per_gpu is train.micro_batch_size (one size for every pass)"),
    Alias("algorithm.adv_estimator", "algorithm.advantage",
          "verl's adv_estimator is algorithm.advantage: grpo -> grpo, rloo -> rloo, reinforce_plus_plus -> reinforce_pp "
          "(gae: no critic here)"),
    Alias("algorithm.norm_adv_by_std_in_grpo", "algorithm.advantage",
          "verl's norm_adv_by_std_in_grpo: false is algorithm.advantage: dr_grpo"),
    Alias("algorithm.use_kl_in_reward", "algorithm.kl_coef",
          "verl's use_kl_in_reward has no equivalent: algorithm.kl_coef is a loss term"),
    Alias("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef",
          "verl's kl_ctrl.kl_coef (KL in the reward) has no equivalent: algorithm.kl_coef is a loss term"),
    Alias("reward_model.overlong_buffer.len", "algorithm.overlong_buffer",
          "verl's overlong_buffer.len is algorithm.overlong_buffer"),
    Alias("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_penalty",
          "verl's overlong_buffer.penalty_factor is algorithm.overlong_penalty"),
    Alias("custom_reward_function.path", "reward.fn",
          "verl's custom_reward_function.path and .name are reward.fn: 'path/to/file.py:name' (docs/verl.md)"),
    Alias("custom_reward_function.name", "reward.fn",
          "verl's custom_reward_function.path and .name are reward.fn: 'path/to/file.py:name' (docs/verl.md)"),
    Alias("trainer.total_training_steps", "train.max_steps", "verl's trainer.total_training_steps is train.max_steps"),
    Alias("trainer.total_epochs", None,
          "verl's trainer.total_epochs has no equivalent: a run is train.max_steps train steps"),
    Alias("trainer.save_freq", "checkpoint.every", "verl's trainer.save_freq is checkpoint.every"),
    Alias("trainer.test_freq", "eval.every", "verl's trainer.test_freq is eval.every"),
    Alias("trainer.logger", "logging.wandb", "verl's trainer.logger is logging.tensorboard / logging.wandb"),
    Alias("trainer.project_name", "logging.wandb_project", "verl's trainer.project_name is logging.wandb_project"),
    Alias("trainer.default_local_dir", None, "verl's trainer.default_local_dir is the --out argument"),
    Alias("trainer.resume_mode", "checkpoint.resume", "verl's trainer.resume_mode: auto is checkpoint.resume: auto"),
    Alias("trainer.resume_from_path", "checkpoint.resume",
          "verl's trainer.resume_from_path has no key: checkpoint.resume: auto goes on from the newest checkpoint in --out"),
    Alias("trainer.max_actor_ckpt_to_keep", "checkpoint.keep", "verl's trainer.max_actor_ckpt_to_keep is checkpoint.keep"),
    Alias("trainer.n_gpus_per_node", None,
          "verl's trainer.n_gpus_per_node has no key: GPUs come from rollout.workers, train.world_size and runtime.*"),
)

# verl's top-level sections: one holding no known name gets this instead of a spelling guess
VERL_SECTIONS = {
    "actor_rollout_ref": "verl's actor_rollout_ref is split here into model, rollout, train and algorithm (docs/verl.md)",
    "critic": "verl's critic has no equivalent: asyncflow's advantages are critic-free (algorithm.advantage)",
    "trainer": "verl's trainer is split here into train, eval, checkpoint and logging (docs/verl.md)",
    "reward_model": "verl's reward_model is reward.fn here (docs/verl.md)",
    "custom_reward_function": "verl's custom_reward_function is reward.fn here (docs/verl.md)",
}
# verl leaf names too generic to match alone (`lr`, `n`): only their paths, or two segments of them, match
_GENERIC = {"lr", "n", "name", "path", "len", "penalty_factor", "kl_coef", "temperature", "top_p", "top_k",
            "weight_decay", "shuffle", "prompt_key", "logger", "project_name", "mode"}


def schema_keys(cls: type = Config, prefix: str = "") -> set[str]:
    """Every dotted key of the config tree."""
    out: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        section = section_type(tp)
        if section is not None and section is not tp:  # an optional section (null: off) is a key itself
            out.add(f"{prefix}{f.name}")
        if section is not None:
            out |= schema_keys(section, f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def _match(path: str) -> Alias | None:
    """The alias for dotted `path`: a verl path sharing its last two or more segments, else its
    last segment as a TRL or (specific) verl name."""
    parts = path.split(".")
    best, best_len = None, 1
    for alias in VERL:
        theirs = alias.name.split(".")
        n = 0
        while n < min(len(parts), len(theirs)) and parts[-1 - n] == theirs[-1 - n]:
            n += 1
        if n > best_len:
            best, best_len = alias, n
    if best is not None:
        return best
    return _LEAVES.get(parts[-1])


_LEAVES: dict[str, Alias] = {
    **{a.name.rsplit(".", 1)[-1]: a for a in VERL if a.name.rsplit(".", 1)[-1] not in _GENERIC},
    **{a.name: a for a in TRL},  # (TRL's wins a shared leaf name)
}


def _leaf_paths(path: str, value: Any) -> list[str]:
    if isinstance(value, dict) and value:
        return [p for k, v in value.items() for p in _leaf_paths(f"{path}.{k}", v)]
    return [path]


def alias_hint(path: str, value: Any) -> str | None:
    """'; <hint>' for the unknown key `path` (dotted) holding `value`, when it or a key under it is a
    TRL or verl name, or it is a verl section; None otherwise."""
    keys = schema_keys()
    own = _match(path)
    if own is not None and own.target is not None and any(k.startswith(f"{own.target}.") for k in keys):
        return f"; {own.text}"  # a name for a whole section (peft_config: model.lora) answers for what it holds
    found = [(p, a) for p in _leaf_paths(path, value) if (a := _match(p)) is not None]
    if found:
        text = found[0][1].text
        others = len(found) - 1
        more = f" (and {others} more verl or TRL key{'s' if others > 1 else ''} under {path}: docs/verl.md)" if others else ""
        return f"; {text}{more}"
    if own is not None:  # (a mapping under a name of theirs that holds none of theirs: `lr_scheduler_kwargs`)
        return f"; {own.text}"
    if path in VERL_SECTIONS and isinstance(value, dict):
        return f"; {VERL_SECTIONS[path]}"
    leaf = path.rsplit(".", 1)[-1]
    elsewhere = sorted(k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != path)
    if len(elsewhere) == 1:
        return f" (did you mean {elsewhere[0]!r}?)"
    return None
