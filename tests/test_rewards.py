"""Reward plugins: loading by `module:function`, TRL-signature calls, validation of what they return."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow.clock import RealClock
from asyncflow.errors import UserError
from asyncflow.rewards import (
    PlainCalls,
    RewardFns,
    RewardOutcome,
    call_reward_fn,
    load_reward_fn,
    validate_rewards,
)


def test_trl_style_function_gets_prompts_completions_ids_and_columns() -> None:
    seen: dict[str, object] = {}

    def fn(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, answer=answer, extra=sorted(kwargs))
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    out = call_reward_fn(fn, ["1+1="] * 2, ["2", "3"], [[5], [6]], {"answer": ["2", "2"], "level": [1, 1]})
    assert out.rewards == [1.0, 0.0] and out.error is None
    assert seen == {"prompts": ["1+1="] * 2, "completion_ids": [[5], [6]], "answer": ["2", "2"], "extra": ["level"]}


def test_columns_the_function_does_not_take_are_not_passed() -> None:
    def narrow(prompts, completions):
        return [1.0] * len(completions)

    assert call_reward_fn(narrow, ["p"], ["c"], [[1]], {"answer": ["x"]}).rewards == [1.0]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, None], "returned None for completion 1"),
        ([1.0, "yes"], "returned str 'yes' for completion 1"),
        ([1.0, math.nan], "returned nan for completion 1"),
        ([math.inf, 1.0], "returned inf for completion 0"),
        (None, "returned NoneType, expected a list of 2 numbers"),
        ([True, 1.0], "returned bool True for completion 0"),
        (0.5, "returned float, expected a list of 2 numbers"),
        ([1.0, 10**400], "returned an int too large for a float for completion 1"),
        # finite, but inf as the trainer's float32 (the group's advantages became NaN/inf, silently)
        ([1e39, 1.0], "returned 1e+39 for completion 0, beyond float32's range"),
        ([1.0, -10**39], "for completion 1, beyond float32's range"),
    ],
)
def test_bad_return_values_become_an_error_for_the_group(value: object, message: str) -> None:
    out = validate_rewards(value, 2)
    assert out.rewards is None and message in str(out.error)


def test_a_zero_dimensional_array_or_tensor_is_an_error_not_a_crash() -> None:
    """`.squeeze()` of a group of one (an eval prompt) gives a 0-d value, whose tolist() is a number:
    it crashed the run with a TypeError; a 1-element array is fine."""
    import numpy as np
    import torch

    for value in (np.float64(1.0), np.array(1.0), torch.tensor(1.0)):
        out = validate_rewards(value, 1)
        assert out.rewards is None and "returned a 0-d" in str(out.error) and "a list of 1 numbers" in str(out.error)
    assert validate_rewards(np.array([1.0]), 1).rewards == [1.0]
    assert validate_rewards(torch.tensor([0.5]), 1).rewards == [0.5]


def test_good_return_values_become_floats_whatever_their_number_type() -> None:
    import numpy as np

    for value in ([1, 0.5], (1, 0.5), np.array([1.0, 0.5]), [np.float64(1.0), np.int64(0)], [np.float32(0.5), 2]):
        out = validate_rewards(value, 2)
        assert out.error is None and out.rewards is not None
        assert all(type(r) is float for r in out.rewards) and out.rewards[1] in (0.5, 0.0, 2.0)
    assert validate_rewards([3, -2.5], 2).rewards == [3.0, -2.5]


def _line(fn: Any, below: int) -> str:
    """`file:line` of the line `below` lines under `fn`'s `def`, as an error names it (from the working directory)."""
    path = Path(fn.__code__.co_filename).resolve()
    shown = os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)
    return f"{shown}:{fn.__code__.co_firstlineno + below}"


def test_a_raising_function_marks_its_samples_instead_of_crashing() -> None:
    def boom(prompts, completions, **kw):
        raise KeyError("missing")

    out = call_reward_fn(boom, ["p"], ["c"], [[1]], {})
    assert out.rewards is None and out.error == f"reward function raised KeyError at {_line(boom, 1)}: 'missing'"


def test_a_raising_function_is_named_at_its_own_innermost_line() -> None:
    """The error names the user's file:line: the innermost frame in their code, not asyncflow's (which
    called it) nor the standard library's (which raised for it)."""
    import json

    def parse(text):
        return json.loads(text)  # raises inside the json module

    def score(prompts, completions, **kw):
        return [parse(c) for c in completions]

    out = call_reward_fn(score, ["p"], ["not json"], [[1]], {})
    assert out.error is not None and out.error.startswith(f"reward function raised JSONDecodeError at {_line(parse, 1)}: ")
    wrapped = RewardFns([score], [1.0])  # (called through asyncflow's own list of functions)
    assert call_reward_fn(wrapped, ["p"], ["x"], [[1]], {}).error.startswith(
        f"score: reward function raised JSONDecodeError at {_line(parse, 1)}: ")


def test_sys_exit_or_a_stray_cancellation_in_a_reward_function_marks_its_samples() -> None:
    import asyncio

    from asyncflow.rewards import call_reward_fn_async

    def exits(prompts, completions, **kw):
        sys.exit("usage: grader [-h]")  # e.g. an argparse helper inside the verifier

    def bad_tolist(prompts, completions, **kw):
        class Rewards(list):
            def __iter__(self):
                raise NotImplementedError("meta tensor")
        return Rewards([1.0])

    assert call_reward_fn(exits, ["p"], ["c"], [[1]], {}).error == (
        f"reward function raised SystemExit at {_line(exits, 1)}: usage: grader [-h]")
    assert call_reward_fn(bad_tolist, ["p"], ["c"], [[1]], {}).error.startswith("reward function raised NotImplementedError")

    async def inner_cancelled(prompts, completions, **kw):
        raise asyncio.CancelledError()  # its own request was cancelled; this call was not

    async def interrupted(prompts, completions, **kw):
        raise KeyboardInterrupt

    out = asyncio.run(call_reward_fn_async(inner_cancelled, ["p"], ["c"], [[1]], {}))
    assert out.rewards is None and out.error.startswith("reward function raised CancelledError")
    assert asyncio.run(call_reward_fn_async(interrupted, ["p"], ["c"], [[1]], {})).error == (
        f"reward function raised KeyboardInterrupt at {_line(interrupted, 1)}: ")

    async def cancelled_from_outside() -> None:
        async def slow(prompts, completions, **kw):
            await asyncio.sleep(60)
            return [1.0]

        task = asyncio.ensure_future(call_reward_fn_async(slow, ["p"], ["c"], [[1]], {}))
        await asyncio.sleep(0.01)
        task.cancel()  # a timeout: must stay a cancellation, not become a reward error
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_from_outside())


def test_loading_names_the_module_or_function_at_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plug_ok.py").write_text("def score(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    (tmp_path / "plug_broken.py").write_text("import does_not_exist\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # (as PYTHONPATH would)
    assert load_reward_fn("plug_ok:score")(["p"], ["c"]) == [0.0]
    with pytest.raises(UserError, match="module 'plug_ok' has no function 'nope'"):
        load_reward_fn("plug_ok:nope")
    with pytest.raises(UserError, match="cannot import module 'plug_broken': ModuleNotFoundError: No module named "
                                        "'does_not_exist'$"):
        load_reward_fn("plug_broken:score")
    with pytest.raises(UserError, match="must be 'module:function'"):
        load_reward_fn("plug_ok")


def test_a_module_in_the_working_directory_is_not_imported_by_name(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`module:function` is looked up on sys.path as Python set it up; the working directory is not
    added, and the error says how to name the file instead."""
    (tmp_path / "cwd_only_rewards.py").write_text("def score(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(UserError, match=r"^reward.fn: cannot import module 'cwd_only_rewards': ModuleNotFoundError: "
                                        r".*\(the working directory is not searched for modules: name the file, "
                                        r"'cwd_only_rewards.py:score', or add the working directory to PYTHONPATH\)$"):
        load_reward_fn("cwd_only_rewards:score")
    assert load_reward_fn("cwd_only_rewards.py:score")(["p"], ["c"]) == [1.0]


def test_a_reward_function_loads_from_a_python_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.rewards import absolute_reward_path

    (tmp_path / "graders").mkdir()
    (tmp_path / "graders" / "helpers.py").write_text("def norm(s):\n    return s.strip()\n")
    (tmp_path / "graders" / "score.py").write_text(
        "import dataclasses\nfrom .helpers import norm\n@dataclasses.dataclass\nclass R:\n    v: float\n"
        "def exact(prompts, completions, answer, **kw):\n"
        "    return [R(float(norm(c) == a)).v for c, a in zip(completions, answer)]\n")
    (tmp_path / "graders" / "broken.py").write_text("raise RuntimeError('no key')\n")
    (tmp_path / "graders" / "as_script.py").write_text("import helpers\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    fn = load_reward_fn("graders/score.py:exact")
    assert fn(["p", "p"], [" 4 ", "5"], ["4", "4"]) == [1.0, 0.0]
    assert load_reward_fn(str(tmp_path / "graders" / "score.py") + ":exact") is fn  # loaded once per file
    assert absolute_reward_path("graders/score.py:exact") == f"{tmp_path.resolve()}/graders/score.py:exact"
    assert absolute_reward_path("my_mod:exact") == "my_mod:exact"
    with pytest.raises(UserError, match=r"reward.fn: no file 'graders/nope.py' in "):
        load_reward_fn("graders/nope.py:exact")
    with pytest.raises(UserError, match=r"reward.fn: cannot load '.*broken.py': RuntimeError: no key$"):
        load_reward_fn("graders/broken.py:exact")
    with pytest.raises(UserError, match=r"file 'graders/score.py' has no function 'nope'"):
        load_reward_fn("graders/score.py:nope")
    with pytest.raises(UserError, match=r"a file is given as 'path/to/file.py:function'"):
        load_reward_fn("graders/score:exact")
    # the file's folder is not on sys.path: a helper beside it imports relatively
    with pytest.raises(UserError, match=r"cannot load '.*as_script.py': ModuleNotFoundError: No module named 'helpers' "
                                        r"\(its folder is not on sys.path: import the helper beside it as "
                                        r"`from \. import helpers`\)$"):
        load_reward_fn("graders/as_script.py:exact")


def test_loading_a_reward_puts_no_folder_on_sys_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `csv.py` in the working directory (a model folder run from) or beside a reward file would run in
    place of the standard library's at the next `import csv` (the tokenizer's, the data reader's) had
    either folder gone on sys.path."""
    ran = tmp_path / "planted_ran"
    plant = f"open({str(ran)!r}, 'w').close()\n"
    (tmp_path / "csv.py").write_text(plant)
    (tmp_path / "graders").mkdir()
    (tmp_path / "graders" / "csv.py").write_text(plant)
    (tmp_path / "graders" / "score.py").write_text("def exact(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    load_reward_fn("graders/score.py:exact")
    load_reward_fn("tests.test_rewards:constant_reward")
    assert sys.path == before
    monkeypatch.delitem(sys.modules, "csv")
    import csv

    assert not ran.exists() and csv.__file__ != str(tmp_path / "csv.py")


def constant_reward(prompts: list, completions: list, **kw: object) -> list[float]:
    return [1.0] * len(completions)


def test_async_functions_are_recognised_and_validated_like_plain_ones() -> None:
    import asyncio

    from asyncflow.rewards import call_reward_fn, call_reward_fn_async, is_async_reward_fn

    async def judge(prompts, completions, answer):  # no **kwargs: gets only the columns it names
        await asyncio.sleep(0)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    class Judge:
        async def __call__(self, prompts, completions, **kw):
            return [0.5] * len(completions)

    def plain(prompts, completions, **kw):
        return [1.0] * len(completions)

    assert is_async_reward_fn(judge) and is_async_reward_fn(Judge()) and not is_async_reward_fn(plain)
    cols = {"answer": ["4", "5"], "other": [1, 2]}
    out = asyncio.run(call_reward_fn_async(judge, ["p", "p"], ["4", "4"], [[1], [1]], cols))
    assert out == RewardOutcome([1.0, 0.0], None)
    assert asyncio.run(call_reward_fn_async(Judge(), ["p"], ["x"], [[1]], {})) == RewardOutcome([0.5], None)
    assert call_reward_fn(plain, ["p"], ["x"], [[1]], {}) == RewardOutcome([1.0], None)

    async def wrong(prompts, completions, **kw):
        return [None] * len(completions)

    async def raises(prompts, completions, **kw):
        raise KeyError("judge down")

    assert asyncio.run(call_reward_fn_async(wrong, ["p"], ["x"], [[1]], {})).error == "reward function returned None for completion 0"
    assert asyncio.run(call_reward_fn_async(raises, ["p"], ["x"], [[1]], {})).error == (
        f"reward function raised KeyError at {_line(raises, 1)}: 'judge down'")


def _hanging_after(release: threading.Event, good: int):
    """A plain reward function whose calls after the first `good` block until `release` (or 30 s)."""
    count = {"n": 0}

    def fn(prompts, completions):
        count["n"] += 1
        if count["n"] > good:
            release.wait(30)
        return [1.0] * len(completions)

    return fn


def test_a_hung_plain_call_costs_its_group_and_those_after_it_not_the_ones_before() -> None:
    release = threading.Event()
    fn = _hanging_after(release, good=1)
    calls = [(fn, ["p"], ["c"], [[1]], {})] * 3
    plain = PlainCalls(threads=2)

    async def run() -> tuple[list[RewardOutcome], int]:
        out = await plain.score(calls, RealClock().wait_for, 0.1, "reward function on group(s) [0, 1, 2]")
        # the default executor (the trainer's steps) is not where the hung call sits
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 5) == 7
        return out, plain.running

    try:
        outcomes, running = asyncio.run(run())
    finally:
        release.set()
    assert outcomes[0] == RewardOutcome([1.0], None)
    assert [o.rewards for o in outcomes[1:]] == [None, None]
    assert all("timed out after 0.3 s waiting for reward function on group(s) [0, 1, 2]" in str(o.error)
               for o in outcomes[1:])
    assert running == 1


def test_when_hung_calls_hold_every_reward_thread_the_run_stops_with_one_line() -> None:
    release = threading.Event()
    fn = _hanging_after(release, good=0)
    plain = PlainCalls(threads=2)

    async def run() -> None:
        first = await plain.score([(fn, ["p"], ["c"], [[1]], {})], RealClock().wait_for, 0.1, "group [0]")
        assert first[0].error is not None  # one thread left: the run goes on
        await plain.score([(fn, ["p"], ["c"], [[1]], {})], RealClock().wait_for, 0.1, "group [1]")

    try:
        with pytest.raises(UserError, match=r"^reward\.fn: 2 reward calls are still running after "
                                            r"reward\.timeout_s=0\.1 s and hold every reward thread"):
            asyncio.run(run())
    finally:
        release.set()
    for _ in range(100):  # released, the threads finish their calls
        if plain.running == 0:
            break
        time.sleep(0.05)
    assert plain.running == 0
    plain.close()


def test_for_evaluation_hung_calls_holding_every_thread_fail_the_rest_at_once_instead_of_stopping_the_run() -> None:
    """Evaluation's calls (`stop_when_full=False`): once hung calls hold every thread, later calls fail
    at once with the reason (no wait of reward.timeout_s per call for a thread that never frees, and
    no error that would stop a run before its final save)."""
    release = threading.Event()
    fn = _hanging_after(release, good=0)
    plain = PlainCalls(threads=1, stop_when_full=False)

    async def run() -> tuple[list[RewardOutcome], list[RewardOutcome]]:
        first = await plain.score([(fn, ["p"], ["c"], [[1]], {})] * 2, RealClock().wait_for, 0.1, "eval prompts 0-1")
        # (had it waited for a thread, these would read "timed out after 30 s")
        later = await plain.score([(fn, ["p"], ["c"], [[1]], {})] * 3, RealClock().wait_for, 10.0, "eval prompts 2-4")
        return first, later

    try:
        first, later = asyncio.run(run())
    finally:
        release.set()
    assert all(o.rewards is None and "timed out after 0.2 s" in str(o.error) for o in first)
    assert len(later) == 3
    assert all(str(o.error).startswith("reward.fn: 1 reward calls are still running after reward.timeout_s=10 s and "
                                       "hold every reward thread") for o in later)


def test_a_run_puts_neither_its_model_folder_nor_the_working_directory_on_sys_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_line_error: Any
) -> None:
    """The CLI's `train` loads `reward.fn` and `eval.lenient_fn` before the tokenizer: a `csv.py` in the
    model folder or in the working directory ran at the tokenizer's `import csv` when either folder went
    first on sys.path. (`reward.concurrency` with a plain function stops the run right after the loads.)"""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(Path(__file__).resolve().parent.parent / "asyncflow/tasks/base_models/arith-v3-seed0", model)
    ran = tmp_path / "planted_ran"
    for folder in (tmp_path, model):
        (folder / "csv.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    (tmp_path / "run.yaml").write_text(
        f"task: null\nmodel: {{path: {model}}}\ndataset: {{path: {model / 'train.jsonl'}}}\n"
        "reward: {fn: 'tests.test_rewards:constant_reward', concurrency: 8}\n"
        "eval: {lenient_fn: 'tests.test_rewards:constant_reward'}\nlogging: {progress: false}\n")
    err = one_line_error(["train", "run.yaml", "--out", str(tmp_path / "run")])
    assert "reward.concurrency: applies to an async def reward function" in err
    assert sys.path == before
    monkeypatch.delitem(sys.modules, "csv")
    import csv

    assert not ran.exists() and csv.__file__ != str(model / "csv.py")
