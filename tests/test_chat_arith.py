"""The `chat_arith` task pack (its questions, checks and data for a pretrained model) and the eval's
lenient check: one greedy generation per prompt, the reward on its first rollout.max_new_tokens
tokens, the looser check on all of them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncflow.engines.base import GenResult
from asyncflow.engines.sim import SimEngine
from asyncflow.tasks import chat_arith


def test_the_questions_are_distinct_and_the_eval_split_is_held_out() -> None:
    pool = chat_arith.questions()
    assert len(pool) == 18 * 18 + 49 * 49 == len({q for q, _ in pool})
    train, evals = chat_arith.make_splits(seed=0)
    assert len(evals) == chat_arith.EVAL_SIZE >= 500 and len(train) + len(evals) == len(pool)
    text = {json.dumps(r["prompt"]) for r in evals}
    assert not text & {json.dumps(r["prompt"]) for r in train}
    assert evals[0]["prompt"][0]["role"] == "user" and evals[0]["prompt"][0]["content"].startswith("What is ")
    assert chat_arith.make_splits(seed=1)[1] != evals and chat_arith.make_splits(seed=0)[1] == evals


def test_the_reward_pays_the_last_number_and_the_lenient_check_any_number() -> None:
    answers = ["210", "210", "210", "1000"]
    completions: list[Any] = ["14 * 15 = 210", "It is 210, since 14 * 15 is 14 * 10 + 14 * 5.",
                              [{"role": "assistant", "content": "So the answer is 200."}], "1,000"]
    assert chat_arith.reward_fn([None] * 4, completions, answers) == [1.0, 0.0, 0.0, 1.0]
    assert chat_arith.lenient_fn([None] * 4, completions, answers) == [1.0, 1.0, 0.0, 1.0]


def test_a_run_given_another_model_folder_reads_the_tasks_prompts_from_the_cache(tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs
    from tests.test_eval_set import _model_dir

    model = _model_dir(tmp_path / "smollm2")
    cfg, _ = load_config(None, ["task=chat_arith", f"model.path={model}", f"model.cache_dir={tmp_path / 'cache'}"])
    notes: list[str] = []
    inputs = resolve_inputs(cfg, notes.append)
    assert len(inputs.train_rows) == len(chat_arith.questions()) - chat_arith.EVAL_SIZE
    assert len(inputs.eval_rows) == 500 and Path(inputs.eval_path).parent.parent == tmp_path / "cache"
    assert inputs.reward_fn_path.endswith("chat_arith:reward_fn") and inputs.lenient_fn_path.endswith(":lenient_fn")
    assert resolve_inputs(cfg, notes.append).train_path == inputs.train_path and len(notes) == 1  # (written once)
    # a reward function of the user's own: the task's looser check is not its second look
    cfg, _ = load_config(None, ["task=chat_arith", f"model.path={model}", f"model.cache_dir={tmp_path / 'cache'}",
                                "reward.fn=examples.byo.reward:score"])
    assert resolve_inputs(cfg, notes.append).lenient_fn_path is None


class _Rambler(SimEngine):
    """Greedy answers "9 9 9 ... 12": the right number (12) only as its 4th token."""

    def __init__(self, clock: Any) -> None:
        super().__init__(clock, lengths=lambda rng: 1, capacity=4, seed=0, step_s=0.001)
        self.budgets: list[int] = []

    async def generate(self, request):  # type: ignore[no-untyped-def]
        self.budgets.append(request.max_new_tokens)
        ids = [ord("9"), ord(" "), ord("9"), ord(" "), ord("1"), ord("2")][: request.max_new_tokens]
        return GenResult(request.uid, ids, [0.0] * len(ids), [self.version] * len(ids), "stop")


def test_the_lenient_check_scores_the_same_generation_given_more_tokens(tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual
    from tests.test_eval_set import _BytesTok

    engines: list[_Rambler] = []

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=chat_arith", "rollout.max_new_tokens=3", "eval.lenient_tokens=8"])
        engine = _Rambler(clock)
        engines.append(engine)
        log = RunLog(tmp_path)
        try:
            rows = [{"prompt": "What is 3 * 4?", "answer": "12"}, {"prompt": "What is 2 * 6?", "answer": "12"}]
            return await Evaluator(cfg, rows, _BytesTok(), chat_arith.reward_fn, engine, log, Tracer(now=clock.now),
                                   clock=clock, lenient_fn=chat_arith.lenient_fn).run(step=0)
        finally:
            log.close()

    row = run_virtual(main)
    assert engines[0].budgets == [8, 8]  # one generation per prompt, to the longer budget
    assert row["eval_accuracy"] == 0.0 and row["eval_lenient_accuracy"] == 1.0


def test_the_lenient_check_is_refused_for_episodes_and_its_tokens_without_it() -> None:
    from asyncflow.config import load_config
    from asyncflow.errors import UserError

    with pytest.raises(UserError, match="eval.lenient_fn: single-turn runs only"):
        load_config(None, ["task=arith", "rollout.env=calculator", "eval.lenient_fn=a:b"])
    with pytest.raises(UserError, match="eval.lenient_tokens: only used with eval.lenient_fn"):
        load_config(None, ["task=null", "model.path=m", "dataset.path=d.jsonl", "reward.fn=a:b",
                           "eval.lenient_tokens=100"])
