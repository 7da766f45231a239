"""Unknown keys that are TRL or verl names get the asyncflow key and the unit difference as the hint."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncflow.config import load_config
from asyncflow.config_hints import TRL, VERL, schema_keys
from asyncflow.errors import UserError


def _error(overrides: list[str]) -> str:
    with pytest.raises(UserError) as exc:
        load_config(None, ["task=arith", *overrides])
    return str(exc.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # the five of issue 34, which got a wrong hint or none
        (["rollout.num_generations=8"],
         "rollout.num_generations: unknown key; TRL's num_generations is rollout.n (samples per prompt)"),
        (["actor_rollout_ref.rollout.n=8"],
         "actor_rollout_ref: unknown key; verl's actor_rollout_ref.rollout.n is rollout.n (samples per prompt)"),
        (["train.learning_rate=1e-6"], "train.learning_rate: unknown key; TRL's learning_rate is train.lr (AdamW)"),
        (["algorithm.beta=0.04"], "algorithm.beta: unknown key; TRL's beta is algorithm.kl_coef"),
        (["algorithm.epsilon=0.2"],
         "algorithm.epsilon: unknown key; TRL's epsilon is algorithm.clip_low (ratio >= 1 - clip_low)"),
        # the units trap, wherever the name is put
        (["data.train_batch_size=32"],
         "data: unknown key; verl's data.train_batch_size counts prompts: train.batch_size = prompts x rollout.n"),
        (["train.train_batch_size=32"],
         "train.train_batch_size: unknown key; verl's data.train_batch_size counts prompts: "
         "train.batch_size = prompts x rollout.n"),
        (["ppo_mini_batch_size=8"],
         "ppo_mini_batch_size: unknown key; verl's ppo_mini_batch_size counts prompts per optimizer step; "
         "train.mini_batches is a count: data.train_batch_size / ppo_mini_batch_size"),
        (["epsilon_high=0.28"], "epsilon_high: unknown key; TRL's epsilon_high is algorithm.clip_high (ratio <= 1 + clip_high)"),
        (["algorithm.adv_estimator=grpo"],
         "algorithm.adv_estimator: unknown key; verl's adv_estimator is algorithm.advantage: grpo -> grpo, "
         "rloo -> rloo, reinforce_plus_plus -> reinforce_pp (gae: no critic here)"),
        (["trainer.total_training_steps=5"],
         "trainer: unknown key; verl's trainer.total_training_steps is train.max_steps"),
        (["train.optim.lr=1e-6"], "train.optim: unknown key; verl's actor_rollout_ref.actor.optim.lr is train.lr"),
        (["rollout.name=vllm"],
         "rollout.name: unknown key; verl's rollout.name is rollout.engine: vllm -> vllm; sglang -> openai with "
         "rollout.server_type: sglang"),
        (["critic.optim.lr=1e-5"],
         "critic: unknown key; verl's actor_rollout_ref.actor.optim.lr is train.lr"),
        (["critic.model.foo=1"],
         "critic: unknown key; verl's critic has no equivalent: asyncflow's advantages are critic-free "
         "(algorithm.advantage)"),
        # a key of another section; and plain typos keep their spelling hint
        (["rollout.lr=1e-6"], "rollout.lr: unknown key (did you mean 'train.lr'?)"),
        (["data.path=x.jsonl"], "data: unknown key (did you mean 'dataset'?)"),
        (["train.batchsize=3"], "train.batchsize: unknown key (did you mean 'batch_size'?)"),
    ],
)
def test_their_names_get_the_asyncflow_key(overrides: list[str], message: str) -> None:
    assert _error(overrides) == message


def test_a_verl_section_names_its_first_key_and_counts_the_rest(tmp_path: Path) -> None:
    f = tmp_path / "verl.yaml"
    f.write_text("actor_rollout_ref:\n  actor:\n    clip_ratio_c: 3.0\n    kl_loss_type: low_var_kl\n"
                 "    loss_agg_mode: token-mean\n")
    with pytest.raises(UserError) as exc:
        load_config(f)
    assert str(exc.value) == (
        "actor_rollout_ref: unknown key; verl's clip_ratio_c is algorithm.dual_clip (verl's default 3; 0, the "
        "default here, is off) (and 2 more verl or TRL keys under actor_rollout_ref: docs/verl.md)")


def test_a_trl_schedule_key_names_its_key() -> None:
    message = _error(["train.lr_scheduler_type=linear"])
    assert message == "train.lr_scheduler_type: unknown key; TRL's lr_scheduler_type is train.lr_schedule"


def test_every_target_is_a_real_key() -> None:
    keys = schema_keys()
    for alias in (*TRL, *VERL):
        if alias.target is not None:
            assert alias.target in keys, alias
        assert alias.name.rsplit(".", 1)[-1] in alias.text, alias  # the hint names their key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # checkpoints and resume: each got a spelling guess of another key ('max_steps', 'gradient_checkpointing')
        (["train.save_steps=50"],
         "train.save_steps: unknown key; TRL's save_steps is checkpoint.every (train steps; 0, the default, "
         "writes no checkpoint)"),
        (["save_strategy=steps"],
         "save_strategy: unknown key; TRL's save_strategy: steps (with save_steps) is checkpoint.every (train "
         "steps; 0, the default, writes none)"),
        (["train.resume_from_checkpoint=true"],
         "train.resume_from_checkpoint: unknown key; TRL's resume_from_checkpoint is checkpoint.resume: auto "
         "(the newest complete checkpoint in --out)"),
        (["save_total_limit=3"],
         "save_total_limit: unknown key; TRL's save_total_limit is checkpoint.keep (newest checkpoints kept)"),
        # LoRA: PEFT's mapping answers for itself, whatever it holds
        (["peft_config.r=16", "peft_config.lora_alpha=32"],
         "peft_config: unknown key; PEFT's peft_config (a LoraConfig) is model.lora: its r, lora_alpha, "
         "lora_dropout and target_modules are model.lora.r, alpha, dropout and target_modules"),
        (["target_modules=[q_proj]"], "target_modules: unknown key; PEFT's target_modules is model.lora.target_modules"),
        (["model.target_modules=[q_proj]"],  # (verl's actor_rollout_ref.model.target_modules)
         "model.target_modules: unknown key; verl's target_modules is model.lora.target_modules"),
        (["model.lora_rank=8"], "model.lora_rank: unknown key; verl's lora_rank is model.lora.r (0 there is model.lora: null)"),
        # TRL names that got a misleading spelling guess
        (["train.logging_steps=10"],
         "train.logging_steps: unknown key; TRL's logging_steps has no key: every train step writes its metrics "
         "row (metrics.jsonl; TensorBoard and W&B with logging.tensorboard / logging.wandb)"),
        (["train.eval_steps=10"],
         "train.eval_steps: unknown key; TRL's eval_steps is eval.every (train steps; 0: only before and after)"),
        (["train.max_length=512"],
         "train.max_length: unknown key; max_length has no key here: rollout.max_new_tokens bounds a response "
         "(prompts are used whole)"),
        (["train.generation_batch_size=64"],
         "train.generation_batch_size: unknown key; TRL's generation_batch_size is closest to train.batch_size "
         "(samples per train step, split into train.mini_batches optimizer steps)"),
        (["train.lr_scheduler_kwargs.min_lr_rate=0.1"],
         "train.lr_scheduler_kwargs: unknown key; TRL's lr_scheduler_kwargs: {min_lr_rate: r} is "
         "train.min_lr_ratio: r (with train.lr_schedule: cosine)"),
        (["run_name=x"], "run_name: unknown key; TRL's run_name has no key: a run is named by its folder (--out), "
                         "as is its W&B run"),
        (["dataset_name=org/data"],
         "dataset_name: unknown key; TRL's dataset_name is dataset.path (a Hub id, or a local file or folder)"),
        (["rollout.vllm_mode=colocate"],
         "rollout.vllm_mode: unknown key; TRL's vllm_mode: colocate is rollout.engine: vllm; server is "
         "rollout.engine: openai with rollout.server_urls"),
        (["rollout.mode=async"],
         "rollout.mode: unknown key; verl's rollout.mode (sync or async: the inference engine's API) has no key "
         "here; workflow.mode is something else: sync or async (off-policy) training"),
        (["trainer.resume_from_path=x"],
         "trainer: unknown key; verl's trainer.resume_from_path has no key: checkpoint.resume: auto goes on from "
         "the newest checkpoint in --out"),
        # a verl section named like a TRL name keeps its verl hint; a bare asyncflow key its right section
        (["train.optim.lr=1e-6"], "train.optim: unknown key; verl's actor_rollout_ref.actor.optim.lr is train.lr"),
        (["mode=async"], "mode: unknown key (did you mean 'workflow.mode'?)"),
    ],
)
def test_checkpoint_lora_and_logging_names_get_their_key(overrides: list[str], message: str) -> None:
    assert _error(overrides) == message


def test_no_common_trl_or_verl_name_gets_another_keys_spelling() -> None:
    """A GRPOConfig / PEFT / verl name given under any section gets its own hint, never a spelling
    guess of an unrelated key ('did you mean max_steps?' for save_steps)."""
    names = ["save_steps", "save_strategy", "resume_from_checkpoint", "peft_config", "lora_r", "lora_alpha",
             "lora_dropout", "target_modules", "logging_steps", "report_to", "num_generations",
             "max_completion_length", "beta", "per_device_train_batch_size", "gradient_accumulation_steps", "bf16",
             "fp16", "eval_steps", "per_device_eval_batch_size", "generation_batch_size", "max_length", "run_name",
             "logging_dir", "optim", "hub_model_id", "save_only_model", "sync_ref_model", "shuffle_dataset"]
    for name in names:
        for section in ("", "train.", "model."):
            message = _error([f"{section}{name}=1"])
            assert "did you mean" not in message and name in message.partition("; ")[2], message
