"""The eval set counts distinct prompts: the engine is asked each once and the eval row counts prompts;
the held-out slice, `eval.size` and an explicit eval file count them; a checkpoint whose slice was
counted in rows resumes on it."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asyncflow.engines.sim import SimEngine
from asyncflow.errors import UserError


def _model_dir(path: Path) -> Path:
    """A model folder as far as the file checks go (config, weights, a tokenizer file)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "tokenizer.json").write_text("{}")
    save_file({"w": np.zeros(2, dtype=np.float32)}, str(path / "model.safetensors"))
    return path


def _products(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` rows drawn from the 324 prompts "What is a * b?" (a, b in 2..19), as RL datasets repeat them."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(2, 20) for b in range(2, 20)]
    with path.open("w") as f:
        for a, b in (rng.choice(pairs) for _ in range(rows)):
            f.write(json.dumps({"prompt": f"What is {a} * {b}?", "answer": str(a * b)}) + "\n")
    return path


def _inputs(tmp_path: Path, sets: list[str], log: Any = print, saved_rows: str | None = None) -> Any:
    from asyncflow.config import load_config
    from asyncflow.inputs import resolve_inputs

    model = tmp_path / "model"
    if not model.exists():
        _model_dir(model)
    cfg, _ = load_config(None, ["task=null", f"model.path={model}", "reward.fn=x:y", *sets])
    return resolve_inputs(cfg, log, saved_rows=saved_rows)


class _BytesTok:
    """Text as its UTF-8 bytes, both ways."""

    hf = staticmethod(lambda text: {"input_ids": list(text.encode())})

    def completions(self, ids: Any, conversational: bool) -> list[str]:
        return [bytes(i).decode() for i in ids]


class _Multiplier(SimEngine):
    """Answers "What is A * B?" greedily (right when A < 10, one too many otherwise) and records the
    prompt of every request it gets."""

    def __init__(self, clock: Any) -> None:
        super().__init__(clock, lengths=lambda rng: 1, capacity=4, seed=0, step_s=0.001)
        self.asked: list[str] = []

    async def generate(self, request):  # type: ignore[no-untyped-def]
        import re

        from asyncflow.engines.base import GenResult

        text = bytes(request.prompt_ids).decode()
        self.asked.append(text)
        a, b = (int(x) for x in re.findall(r"\d+", text))
        ids = list(str(a * b + (a >= 10)).encode())
        return GenResult(request.uid, ids, [0.0] * len(ids), [self.version] * len(ids), "stop")


def evaluate_products(tmp_path: Path, rows: list[dict[str, Any]], reward_fn: Any,
                      overrides: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """One evaluation of `rows` on `_Multiplier`: the eval row and the prompts the engine was asked."""
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    asked: list[str] = []

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=arith", *list(overrides)])
        engine = _Multiplier(clock)
        log = RunLog(tmp_path)
        try:
            row = await Evaluator(cfg, rows, _BytesTok(), reward_fn, engine, log, Tracer(now=clock.now),
                                  clock=clock).run(step=0)
        finally:
            log.close()
        asked.extend(engine.asked)
        return row

    return run_virtual(main), asked


def _exact(prompts: list[Any], completions: list[str], answer: list[str], **kw: Any) -> list[float]:
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer, strict=True)]


def test_the_evaluator_sends_each_distinct_prompt_to_the_engine_once_and_scores_per_prompt(tmp_path: Path) -> None:
    """Greedy decoding gives every copy of a prompt the same answer: the copies are one request and one
    prompt in the row (10 copies of a solved prompt do not outweigh 2 unsolved ones)."""
    rows = ([{"prompt": "What is 3 * 4?", "answer": "12"}] * 10
            + [{"prompt": "What is 12 * 2?", "answer": "24"}, {"prompt": "What is 11 * 5?", "answer": "55"}]
            + [{"prompt": "What is 12 * 2?", "answer": "24"}])
    row, asked = evaluate_products(tmp_path, rows, _exact)
    assert sorted(asked) == ["What is 11 * 5?", "What is 12 * 2?", "What is 3 * 4?"]
    assert row["eval_size"] == 3 and row["eval_accuracy"] == 1 / 3 and row["eval_reward"] == 1 / 3


def test_copies_of_a_prompt_with_different_answers_are_each_scored_and_the_prompt_counts_their_mean(
        tmp_path: Path) -> None:
    """The prompt's one completion is scored against each distinct row of its copies, in one call (a
    group of its own); its reward is the mean over its copies, and it is solved when that mean reaches
    eval.success_threshold."""
    calls: list[list[str]] = []

    def reward(prompts: list[Any], completions: list[str], answer: list[str], **kw: Any) -> list[float]:
        calls.append(answer)
        return _exact(prompts, completions, answer)

    rows = [{"prompt": "What is 2 * 3?", "answer": "6"}] * 3 + [{"prompt": "What is 2 * 3?", "answer": "7"}]
    row, asked = evaluate_products(tmp_path, rows, reward)
    assert asked == ["What is 2 * 3?"] and calls == [["6", "7"]]
    assert row["eval_size"] == 1 and row["eval_reward"] == 0.75 and row["eval_accuracy"] == 0.0
    row, _ = evaluate_products(tmp_path, rows, _exact, ("eval.success_threshold=0.75",))
    assert row["eval_accuracy"] == 1.0


def test_environment_episodes_run_once_per_distinct_row_and_count_per_prompt(tmp_path: Path) -> None:
    """An environment gets the row, so copies that differ in a column are an episode each; equal copies
    are one episode; the row counts prompts."""
    from asyncflow.config import load_config
    from asyncflow.envs import Env, EnvStep
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    episodes: list[str] = []

    class Checks(Env):
        name = "checks"
        max_turns = 1

        def __init__(self, clock: Any) -> None:
            self.answer = ""

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            episodes.append(row["answer"])
            self.answer = row["answer"]
            return ""

        async def step(self, action: str) -> EnvStep:
            return EnvStep("", reward=1.0 if self.answer == "1" else 0.0, done=True)

    class Tok:
        hf = staticmethod(lambda text: {"input_ids": [5, 6]})
        eos_token_id = 1

        def encode(self, text: str) -> list[int]:
            return [7] * len(text)

        def decode(self, ids: Any) -> str:
            return "x" * len(ids)

    rows = [{"prompt": "a", "answer": "1"}] * 3 + [{"prompt": "b", "answer": "1"}, {"prompt": "b", "answer": "2"}]

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=arith", "rollout.env=calculator", "rollout.max_turns=1"])
        log = RunLog(tmp_path)
        try:
            return await Evaluator(cfg, rows, Tok(), None,  # type: ignore[arg-type]
                                   SimEngine(clock, lengths=lambda rng: 3, capacity=4, seed=0), log,
                                   Tracer(now=clock.now), env_factory=Checks, clock=clock).run(step=0)
        finally:
            log.close()

    row = run_virtual(main)
    assert sorted(episodes) == ["1", "1", "2"]
    assert row["eval_size"] == 2 and row["eval_reward"] == 0.75 and row["eval_accuracy"] == 0.5


def test_many_copies_of_few_prompts_hold_out_whole_distinct_prompts_counted_by_eval_size(tmp_path: Path) -> None:
    """4,000 rows over 324 prompts: the slice is up to eval.size distinct prompts (10% of the 324 at
    most), every copy of each (20% of the rows at most), none of them trained on, and every row
    trained or evaluated."""
    data = _products(tmp_path / "products.jsonl", 4000)
    counts = Counter(json.loads(line)["prompt"] for line in data.read_text().splitlines())
    assert len(counts) == 324
    for size, expected in [(100, 32), (10, 10)]:
        inputs = _inputs(tmp_path, [f"dataset.path={data}", f"eval.size={size}"])
        held = Counter(r["prompt"] for r in inputs.eval_rows)
        assert len(held) == expected, size
        assert all(n == counts[p] for p, n in held.items())  # every copy
        assert not held.keys() & {r["prompt"] for r in inputs.train_rows}
        assert len(inputs.train_rows) + len(inputs.eval_rows) == 4000 and len(inputs.eval_rows) <= 800


def test_a_dataset_of_distinct_prompts_holds_out_up_to_eval_size_of_them(tmp_path: Path) -> None:
    data = tmp_path / "distinct.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10_000)))
    for size, expected in [(300, 300), (1000, 1000), (5000, 1000)]:  # (10% of the prompts at most)
        inputs = _inputs(tmp_path, [f"dataset.path={data}", f"eval.size={size}"])
        assert len(inputs.eval_rows) == expected and len(inputs.train_rows) == 10_000 - expected


def test_one_prompt_repeated_throughout_is_evaluated_on_its_training_rows_with_a_note(tmp_path: Path) -> None:
    data = tmp_path / "one.jsonl"
    data.write_text('{"prompt": "What is 2 * 3?", "answer": "6"}\n' * 50)
    notes: list[str] = []
    inputs = _inputs(tmp_path, [f"dataset.path={data}"], notes.append)
    assert len(inputs.train_rows) == 50 and len(inputs.eval_rows) == 50  # (the evaluator asks it once)
    assert len(notes) == 1 and "has 50 rows of 1 distinct prompt(s), too few to hold out an eval set" in notes[0]


def test_an_explicit_eval_file_with_duplicates_is_deduplicated_the_same_way(tmp_path: Path) -> None:
    """eval.size counts the eval file's distinct prompts (their copies kept: they may carry other
    answers); the evaluation then asks the engine each one once."""
    train = _products(tmp_path / "train.jsonl", 200, seed=1)
    evals = _products(tmp_path / "eval.jsonl", 400, seed=2)
    in_file = [json.loads(line)["prompt"] for line in evals.read_text().splitlines()]
    first = list(dict.fromkeys(in_file))[:20]
    inputs = _inputs(tmp_path, [f"dataset.path={train}", f"eval.path={evals}", "eval.size=20"])
    assert len(inputs.train_rows) == 200
    assert [r["prompt"] for r in inputs.eval_rows] == [p for p in in_file if p in first]
    assert inputs.eval_rows.lines == [i + 1 for i, p in enumerate(in_file) if p in first]  # (messages name them)
    row, asked = evaluate_products(tmp_path, inputs.eval_rows, _exact)
    assert sorted(asked) == sorted(first) and row["eval_size"] == 20
    solved = sum(int(p.split()[2]) < 10 for p in first)  # (`_Multiplier` is right when a < 10)
    assert row["eval_accuracy"] == solved / 20


def test_a_checkpoint_whose_slice_was_counted_in_rows_resumes_on_it(tmp_path: Path) -> None:
    """A checkpoint records the fingerprint of the rows it trained on. One saved when eval.size counted
    rows (a slice of up to eval.size rows) resumes on that slice; other training rows are refused."""
    from asyncflow.checkpoint import Resume, check_rows, rows_fingerprint
    from asyncflow.data import read_rows
    from asyncflow.eval_set import draw_held_out, rows_by_prompt

    data = _products(tmp_path / "products.jsonl", 4000)
    rows = read_rows(data)
    groups = rows_by_prompt(rows, "prompt")
    by_rows = set(draw_held_out(groups, len(groups), 100, seed=1))  # eval.size=100 rows, seed 0 (+1)
    saved = rows_fingerprint([r for i, r in enumerate(rows) if i not in by_rows], ("prompt", "answer"))
    notes: list[str] = []
    inputs = _inputs(tmp_path, [f"dataset.path={data}", "eval.size=100"], notes.append, saved_rows=saved)
    assert inputs.fingerprint == saved and len(inputs.eval_rows) == len(by_rows) <= 100
    assert len(notes) == 1 and f"held out {len(by_rows)} rows of {data} for eval" in notes[0]
    resume = Resume(tmp_path, 2, 2, {"train_rows": saved}, [])
    check_rows(resume, inputs.fingerprint)
    moved = _inputs(tmp_path, [f"dataset.path={data}", "eval.size=100", "seed=1"], notes.append, saved_rows=saved)
    with pytest.raises(UserError, match="the training rows differ from the run's"):
        check_rows(resume, moved.fingerprint)


def test_without_copies_counting_prompts_or_rows_holds_out_the_same_rows() -> None:
    """On a dataset of distinct prompts both counts draw the same slice, so its checkpoints resume as
    they are (their training rows' fingerprint is unchanged)."""
    from asyncflow.eval_set import draw_held_out

    groups = [[i] for i in range(1234)]
    for size in (5, 123, 1000):
        assert draw_held_out(groups, min(size, 123), 123, 7) == draw_held_out(groups, 1234, min(size, 123), 7)
