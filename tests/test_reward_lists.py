"""TRL-style reward lists (`reward.fn` a list, `reward.weights`), `trainer_state`, the verl
`compute_score` adapter, and the train row's reward and length metrics."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.errors import UserError
from asyncflow.rewards import (
    RewardFns,
    TrainerState,
    call_reward_fn,
    call_reward_fn_async,
    is_async_reward_fn,
    load_reward,
    verl_compute_score,
)
from asyncflow.telemetry.runlog import scalars
from asyncflow.transfer_queue import SampleView
from asyncflow.workflow.batch import batch_metrics

STATE = TrainerState(global_step=3, step=3, version=2, max_steps=10)


def correct(prompts, completions, answer, **kw):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def short(completions, **kw):
    return [-len(c) / 10 for c in completions]


def test_a_list_scores_the_weighted_sum_and_keeps_each_functions_rewards() -> None:
    fns = RewardFns([correct, short], [2.0, 0.5])
    out = call_reward_fn(fns, ["1+1="] * 2, ["2", "33"], [[5], [6, 6]], {"answer": ["2", "2"]})
    assert out.error is None and out.rewards == pytest.approx([2.0 - 0.05, -0.1])
    assert out.parts == {"correct": [1.0, 0.0], "short": [-0.1, -0.2]}


def test_one_failing_function_fails_the_group_naming_it() -> None:
    def broken(completions, **kw):
        raise ValueError("verifier down")

    out = call_reward_fn(RewardFns([correct, broken], [1.0, 1.0]), ["p"], ["2"], [[5]], {"answer": ["2"]})
    line = broken.__code__.co_firstlineno + 1
    assert out.rewards is None and out.error is not None
    assert out.error.startswith("broken: reward function raised ValueError at ")
    assert out.error.endswith(f"test_reward_lists.py:{line}: verifier down")


def test_functions_sharing_a_name_get_unique_metric_names() -> None:
    assert RewardFns([correct, correct, short], [1, 1, 1]).names == ["correct", "correct_2", "short"]


def test_a_mixed_list_is_awaited_with_its_plain_functions_off_the_event_loop() -> None:
    async def judge(completions, trainer_state, **kw):
        return [float(trainer_state.global_step)] * len(completions)

    fns = RewardFns([judge, correct], [1.0, 1.0])
    assert is_async_reward_fn(fns) and not is_async_reward_fn(RewardFns([correct], [1.0]))
    out = asyncio.run(call_reward_fn_async(fns, ["p"] * 2, ["2", "3"], [[5], [6]], {"answer": ["2", "2"]}, STATE))
    assert out.rewards == [4.0, 3.0] and out.parts == {"judge": [3.0, 3.0], "correct": [1.0, 0.0]}


def test_trainer_state_goes_to_functions_that_take_it_or_kwargs_only() -> None:
    seen: list[Any] = []

    def takes(prompts, completions, trainer_state):
        seen.append(trainer_state)
        return [0.0] * len(completions)

    def kwargs(completions, **kw):
        seen.append(kw.get("trainer_state"))
        return [0.0] * len(completions)

    def neither(prompts, completions):
        return [0.0] * len(completions)

    for fn in (takes, kwargs, neither):
        assert call_reward_fn(fn, ["p"], ["c"], [[1]], {}, STATE).error is None
    assert seen == [STATE, STATE] and STATE.global_step == 3 and STATE.max_steps == 10


def test_the_verl_adapter_maps_its_four_arguments() -> None:
    calls: list[dict[str, Any]] = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        calls.append({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                      "extra_info": extra_info})
        return {"score": 1.0, "acc": True} if solution_str.strip() == ground_truth else 0.0

    fn = verl_compute_score(compute_score, label_key="answer", data_source="gsm8k")
    out = call_reward_fn(fn, ["q"] * 2, ["42", [{"role": "assistant", "content": "7"}]], [[1], [2]],
                         {"answer": ["42", "42"], "level": [3, 3]}, STATE)
    assert out.rewards == [1.0, 0.0]
    assert calls[0] == {"data_source": "gsm8k", "solution_str": "42", "ground_truth": "42",
                        "extra_info": {"answer": "42", "level": 3}}
    assert calls[1]["solution_str"] == "7"
    # verl's own parquet layout: data_source and extra_info columns, reward_model.ground_truth
    verl_row = {"data_source": ["openai/gsm8k"], "extra_info": [{"index": 7}],
                "reward_model": [{"style": "rule", "ground_truth": "42"}]}
    out = call_reward_fn(verl_compute_score(compute_score, label_key=None), ["q"], ["42"], [[1]], verl_row)
    assert out.rewards == [1.0]
    assert calls[-1] == {"data_source": "openai/gsm8k", "solution_str": "42", "ground_truth": "42",
                         "extra_info": {"index": 7}}


def test_load_reward_reads_lists_weights_and_verl_files(tmp_path: Path) -> None:
    (tmp_path / "my_verl.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(solution_str == ground_truth)\n")
    single = load_reward("tests.test_reward_lists:correct")
    assert not isinstance(single, RewardFns) and single.__name__ == "correct"  # one, unweighted: as it is
    fns = load_reward(["tests.test_reward_lists:correct", f"verl:{tmp_path / 'my_verl.py'}:compute_score"], [1.0, 3.0])
    assert isinstance(fns, RewardFns) and fns.names == ["correct", "compute_score"]
    out = call_reward_fn(fns, ["q"], ["5"], [[1]], {"answer": ["5"]})
    assert out.rewards == [4.0]
    with pytest.raises(UserError, match=r"^reward.weights: 1 weights for 2 reward functions"):
        load_reward(["tests.test_reward_lists:correct", "tests.test_reward_lists:short"], [1.0])


@pytest.mark.parametrize(("sets", "message"), [
    (["reward.fn=[a:f, b:g]", "reward.weights=[1.0]"], "reward.weights: 1 weights for 2 reward functions"),
    (["reward.fn=[]"], "reward.fn: an empty list"),
    (["reward.fn=[a:f, nocolon]"], "reward.fn: 'nocolon' must be"),
    (["reward.weights=[1, 2]"], "reward.weights: 2 weights for 1 reward functions"),
])
def test_bad_lists_are_one_line_errors_naming_the_key(sets: list[str], message: str) -> None:
    with pytest.raises(UserError) as err:
        load_config(None, ["task=arith", *sets])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _sample(uid: int, group: int, reward: float | None, length: int, finish: str,
            parts: dict[str, float] | None = None) -> SampleView:
    fields: dict[str, Any] = {"reward": reward, "reward_error": None if reward is not None else "boom",
                              "response_ids": [1] * length, "finish_reason": finish}
    if parts is not None:
        fields["reward_parts"] = parts
    return SampleView(uid, group, 0, fields)


def test_batch_metrics_on_a_constructed_batch() -> None:
    groups = [
        [_sample(0, 0, 1.0, 4, "stop", {"a": 1.0, "b": 0.0}), _sample(1, 0, 1.0, 8, "length", {"a": 1.0, "b": 0.0})],
        [_sample(2, 1, 0.0, 2, "stop", {"a": 0.0, "b": 0.0}), _sample(3, 1, 3.0, 8, "length", {"a": 1.0, "b": 2.0})],
        [_sample(4, 2, None, 6, "stop"), _sample(5, 2, 2.0, 5, "stop", {"a": 0.0, "b": 2.0})],  # one scored: not "zero std"
    ]
    valid = [True, True, True, True, False, True]
    rewards = [1.0, 1.0, 0.0, 3.0, 0.0, 2.0]
    m = batch_metrics(groups, valid, rewards)
    # scored rewards 1, 1, 0, 3, 2: mean 1.4, population variance (0.16*2 + 1.96 + 2.56 + 0.36) / 5 = 1.04
    assert m["reward_std"] == pytest.approx(math.sqrt(1.04))
    assert m["zero_std_group_frac"] == pytest.approx(1 / 3)
    assert m["truncated_frac"] == pytest.approx(2 / 6)
    assert (m["response_len_min"], m["response_len_max"]) == (2.0, 8.0)
    assert m["reward/a"] == pytest.approx(3 / 5) and m["reward/b"] == pytest.approx(4 / 5)  # failed sample left out
    # groups the dynamic-sampling filter dropped while the batch was collected had zero variance too
    assert batch_metrics(groups, valid, rewards, filtered=1)["zero_std_group_frac"] == pytest.approx(2 / 4)


def test_eval_rows_go_to_tensorboard_and_wandb_without_a_doubled_prefix() -> None:
    row = {"kind": "eval", "step": 2, "eval_accuracy": 0.5, "eval_reward": 0.25, "policy_version": 2}
    assert scalars(row) == {"eval/accuracy": 0.5, "eval/reward": 0.25, "eval/policy_version": 2.0}
    assert scalars({"kind": "train", "step": 1, "train_busy_frac": 0.5}) == {"train/train_busy_frac": 0.5}


@pytest.mark.slow
def test_a_run_with_two_weighted_functions_logs_each_and_their_sum(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow.runner import train

    steps_file = tmp_path / "steps.txt"
    (tmp_path / "rewards_a.py").write_text(
        "def score(prompts, completions, answer, **kw):\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    (tmp_path / "rewards_b.py").write_text(
        "def score(prompts, completions, trainer_state):\n"
        f"    with open({str(steps_file)!r}, 'a') as f:\n"
        "        f.write(f'{trainer_state.global_step} {trainer_state.version} {trainer_state.max_steps}\\n')\n"
        "    return [float(len(c) % 2) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    cfg, _ = load_config(None, ["task=arith",
        "train.max_steps=3", "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=8",
        "eval.every=0", "logging.progress=false", f"model.path={arith_dir}", "workflow.mode=sync",
        "reward.fn=[rewards_a.py:score, rewards_b.py:score]", "reward.weights=[2.0, 0.5]"])
    train(cfg, tmp_path / "run", progress_enabled=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 3
    for r in train_rows:
        for key in ("reward_std", "zero_std_group_frac", "truncated_frac", "response_len_mean", "response_len_min",
                    "response_len_max", "lr", "reward/score", "reward/score_2"):
            assert key in r, key
        assert r["reward_mean"] == pytest.approx(2.0 * r["reward/score"] + 0.5 * r["reward/score_2"], abs=1e-9)
        assert r["lr"] == cfg.train.lr and 0.0 <= r["truncated_frac"] <= 1.0
        assert r["response_len_min"] <= r["response_len_mean"] <= r["response_len_max"] <= 4
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert all(s["reward"] in (0.0, 0.5, 2.0, 2.5) for s in samples)
    # sync training: each group is scored at the step that trains it, its version the same
    seen = [tuple(map(int, line.split())) for line in steps_file.read_text().splitlines()]
    assert {(0, 0, 3), (1, 1, 3), (2, 2, 3)} <= set(seen) and all(m == 3 for _, _, m in seen)


def test_a_list_is_also_callable_as_one_plain_function() -> None:
    fns = RewardFns([correct, short], [1.0, 1.0])
    assert fns(["q"], ["2"], answer=["2"]) == pytest.approx([0.9])
    with pytest.raises(ValueError, match="correct: reward function raised TypeError"):
        fns(["q"], ["2"])  # (no answer column)
