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
