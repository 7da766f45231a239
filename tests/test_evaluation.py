"""Greedy evaluation: the reward function's per-group contract, and the load it puts on an engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from asyncflow.engines.sim import SimEngine
from asyncflow.transfer_queue import NewSample, TransferQueue


class _Tok:
    hf = staticmethod(lambda text: {"input_ids": [5, 6]})

    def completions(self, ids: Any, conversational: bool) -> list[str]:
        return [f"c{len(i)}" for i in ids]


class _Counting(SimEngine):
    """Counts the requests in flight at once."""

    in_flight = 0
    most = 0

    async def generate(self, request):  # type: ignore[no-untyped-def]
        type(self).in_flight += 1
        type(self).most = max(type(self).most, type(self).in_flight)
        try:
            return await super().generate(request)
        finally:
            type(self).in_flight -= 1


def _evaluate(tmp_path: Path, reward_fn: Any, overrides: list[str], prompts: int = 6, real: bool = False,
              engine_cls: type[_Counting] = _Counting) -> dict[str, Any]:
    """One evaluation on a simulated engine, on virtual time (`real`: on the wall clock, for a reward
    function that blocks a thread: virtual time stands still while a thread job is outstanding)."""
    from asyncflow.clock import RealClock
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=arith", *overrides])
        engine = engine_cls(clock, lengths=lambda rng: 3, capacity=2, seed=0, step_s=0.001)
        log = RunLog(tmp_path)
        try:
            rows = [{"prompt": f"p{i}", "answer": str(i), "level": i % 2} for i in range(prompts)]
            evaluator = Evaluator(cfg, rows, _Tok(), reward_fn, engine, log, Tracer(now=clock.now), clock=clock)
            return await evaluator.run(step=0)
        finally:
            log.close()

    _Counting.in_flight = _Counting.most = 0
    return asyncio.run(main(RealClock())) if real else run_virtual(main)


def test_each_eval_prompt_is_a_group_of_its_own_and_a_bad_value_costs_only_that_prompt(tmp_path: Path) -> None:
    """The reward function is called once per group (docs/rewards.md); at eval a group is one prompt's
    greedy completion. It used to get the whole eval set in one call, so one bad value zeroed it."""
    calls: list[tuple[list[Any], list[str], dict[str, Any]]] = []

    def reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[Any]:
        calls.append((prompts, completions, columns))
        if columns["answer"] == ["2"]:
            return [None]
        return [1.0 if columns["level"][0] == 0 else 0.0]

    row = _evaluate(tmp_path, reward, [])
    assert sorted(c[0] for c in calls) == [[f"p{i}"] for i in range(6)]
    assert all(c[1] == ["c3"] and c[2]["answer"] == [c[0][0][1:]] for c in calls)
    assert row["eval_size"] == 6
    assert row["eval_accuracy"] == 2 / 6  # p0 and p4 (level 0, not p2, whose value was None)
    assert row["eval_error"] == "eval prompt 2: reward function returned None for completion 0"
    assert _Counting.most == 2  # never more requests in flight than the engine's capacity


def test_a_failed_eval_prompt_is_never_solved_and_the_row_counts_the_failures(tmp_path: Path) -> None:
    """A failure counts reward 0; with eval.success_threshold <= 0 (rewards of -1 / +1, say) that 0
    used to count as solved, so an evaluation whose every reward call failed reported accuracy 1.0."""

    def reward(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
        if columns["level"] == [1]:
            raise ValueError("judge down")
        return [-1.0]

    row = _evaluate(tmp_path, reward, ["eval.success_threshold=0.0"])
    assert row["eval_accuracy"] == 0.0 and row["eval_errors"] == 3 and row["eval_size"] == 6
    assert row["eval_reward"] == -3 / 6  # (a failure counts 0 in the mean reward, as before)
    assert row["eval_error"].startswith("eval prompt 1: reward function raised ValueError")


def test_an_async_reward_that_hangs_on_one_eval_prompt_fails_only_that_prompt(tmp_path: Path) -> None:
    async def judge(prompts: list[Any], completions: list[str], answer: list[str]) -> list[float]:
        if answer == ["4"]:
            await asyncio.sleep(3600)
        return [1.0]

    row = _evaluate(tmp_path, judge, ["reward.timeout_s=5"])
    assert row["eval_accuracy"] == 5 / 6
    assert row["eval_error"] == "eval prompt 4: timed out after 5.0 virtual s waiting for the reward function on eval prompt 4"


def test_a_plain_reward_function_that_hangs_costs_the_rest_of_its_chunk_of_eval_prompts(tmp_path: Path) -> None:
    """Plain functions run in a thread hop per 8 eval prompts (as the reward stage takes up to 8
    groups), bounded by reward.timeout_s per prompt of it: a hung call costs itself and the prompts
    after it in its chunk, not the ones before it nor the eval."""
    import time

    def slow(prompts: list[Any], completions: list[str], answer: list[str], **kw: Any) -> list[float]:
        if answer == ["3"]:
            time.sleep(0.6)  # (real seconds: longer than its chunk's 8 x 0.05 s)
        return [1.0]

    row = _evaluate(tmp_path, slow, ["reward.timeout_s=0.05"], prompts=10, real=True)
    assert row["eval_accuracy"] == 5 / 10  # prompts 0-2 and 8-9; 3 (hung) to 7 count 0
    assert row["eval_error"] == ("eval prompt 3: timed out after 0.4 s waiting for the reward function on eval "
                                 "prompts 0-7 (reward.timeout_s per prompt)")


def test_an_evaluation_due_while_the_previous_one_runs_is_skipped_with_a_note(arith_dir: Path, tmp_path: Path,
                                                                             monkeypatch: Any, capsys: Any) -> None:
    """Evaluations run beside training; one due while the previous is still running is skipped (the
    run never waits for them), and the first skip says so instead of rows silently missing."""
    import json

    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.runner import train

    run = Evaluator.run

    async def slow(self: Any, step: int) -> Any:
        if step == 1:
            await asyncio.sleep(6.0)  # far longer than the train step after it
        return await run(self, step)

    monkeypatch.setattr(Evaluator, "run", slow)
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "train.batch_size=8", "rollout.n=4", "eval.size=4",
                                "train.max_steps=3", "eval.every=1", "rollout.max_new_tokens=4"])
    train(cfg, tmp_path / "run", progress_enabled=True)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["step"] for r in rows if r["kind"] == "eval"]
    assert evals[:2] == [0, 1] and 2 not in evals  # step 2's was due while step 1's ran
    err = capsys.readouterr().err
    assert err.count("[asyncflow] note: the evaluation due at step 2 is skipped: the previous one is still "
                     "running") == 1
    assert err.count("is skipped") == 1  # later skips are not reported one by one


def test_the_progress_line_shows_an_evaluation_as_soon_as_it_is_done(arith_dir: Path, tmp_path: Path,
                                                                    monkeypatch: Any) -> None:
    """A finished evaluation's accuracy reaches the progress line at the next step, not when the
    next evaluation comes due (a whole eval interval later), and the eval before training names its
    error on the console."""
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.runner import train
    from asyncflow.telemetry.progress import Progress

    shown: dict[int, float] = {}
    messages: list[str] = []
    run = Evaluator.run

    async def marked(self: Any, step: int) -> Any:
        if step == 0:
            return {"step": 0, "eval_accuracy": 0.0, "eval_error": "eval prompt 0: no answer"}
        if step == 2:
            return {"step": 2, "eval_accuracy": 0.4242}  # done at once: long before step 3 ends
        return await run(self, step)

    monkeypatch.setattr(Evaluator, "run", marked)
    monkeypatch.setattr(Progress, "update", lambda self, step, figures: shown.__setitem__(step, figures["eval"]))
    monkeypatch.setattr(Progress, "message", lambda self, text: messages.append(text))
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "train.batch_size=8", "rollout.n=4", "eval.size=4",
                                "train.max_steps=5", "eval.every=2", "rollout.max_new_tokens=4"])
    train(cfg, tmp_path / "run", progress_enabled=True)
    assert shown[1] == shown[2] == 0.0
    assert shown[3] == 0.4242  # (before: step 4's evaluation had to come due first)
    assert "[asyncflow] eval before training: accuracy=0.000 (eval_error: eval prompt 0: no answer)" in messages


def test_an_eval_row_names_the_newest_weights_its_tokens_came_from(tmp_path: Path) -> None:
    """With `swap` weight updates an evaluation runs beside training: a publication during it moves
    its later tokens to the new version. The row's `policy_version` is the version at its start; it
    now also gives `policy_version_max`, so a curve is not read as one version's score when it is not."""
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    async def main(clock: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        cfg, _ = load_config(None, ["task=arith", "rollout.max_new_tokens=64"])
        engine = SimEngine(clock, lengths=lambda rng: 50, capacity=2, seed=0, step_s=0.01)
        log = RunLog(tmp_path)
        try:
            rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)]
            evaluator = Evaluator(cfg, rows, _Tok(), lambda prompts, completions, **kw: [1.0], engine, log,
                                  Tracer(now=clock.now), clock=clock)
            quiet = await evaluator.run(step=0)
            task = asyncio.get_running_loop().create_task(evaluator.run(step=1))
            await clock.sleep(0.2)  # the first round of 2 prompts is mid-way
            await engine.load_weights(None, 1, "swap")
            return quiet, await task
        finally:
            log.close()

    quiet, moved = run_virtual(main)
    assert quiet["policy_version"] == quiet["policy_version_max"] == 0
    assert moved["policy_version"] == 0 and moved["policy_version_max"] == 1


def test_an_evaluation_beside_training_is_not_cut_short_by_staleness_cancels(tmp_path: Path) -> None:
    """A mid-run evaluation (the runner starts it after a step, beside training) on engines[0]: each
    publication's `cancel_older_than(floor)` cancelled its requests too (sync mode: at the next
    publication), and the cut-short responses were scored as the model's answers (40 of 48 here,
    at 4 of 200 tokens, with eval_errors 0)."""
    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimTrainer
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    finished: list[tuple[str, int]] = []

    class Recording(SimEngine):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            res = await super().generate(request)
            if request.uid < 0:
                finished.append((res.finish_reason, len(res.response_ids)))
            return res

    async def main(clock: Any) -> list[dict[str, Any]]:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=4", "train.batch_size=16", "train.max_steps=6", "rollout.max_batch=8",
                                    "rollout.max_new_tokens=200", "workflow.mode=sync", "eval.every=1"])
        engine = Recording(clock, lengths=lambda rng: 200, capacity=8, seed=0, step_s=0.01)
        trainer = SimTrainer(clock, token_s=1e-5, devices=1)
        log = RunLog(tmp_path)
        evaluator = Evaluator(cfg, [{"prompt": f"p{i}", "answer": "1"} for i in range(8)], _Tok(),
                              lambda prompts, completions, **c: [1.0], engine, log, Tracer(now=clock.now), clock=clock)
        evals: list[asyncio.Task[Any]] = []

        async def on_step(result: Any) -> None:
            evals.append(asyncio.create_task(evaluator.run(step=result.step)))

        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(64)], tokenizer=_SimTokenizer(), reward_fn=_reward,
            engines=[engine], trainer=trainer, loss_fn=None, clock=clock, log=log,
            tracer=Tracer(now=clock.now, max_events=0), on_step=on_step)
        try:
            await pipeline.run()
            return [await t for t in evals]
        finally:
            log.close()

    rows = run_virtual(main)
    assert len(rows) >= 3 and finished  # (an evaluation that overlapped the next publication: that is the case)
    assert all(reason != "cancelled" and n == 200 for reason, n in finished), finished
    assert all(r is None or r["eval_errors"] == 0 for r in rows)


def test_an_eval_generation_that_comes_back_cancelled_is_a_failed_prompt(tmp_path: Path) -> None:
    """Not the model's answer: its prompt fails (counted in eval_errors), never solved."""
    from asyncflow.engines.base import GenResult

    class Cancelling(_Counting):
        async def generate(self, request):  # type: ignore[no-untyped-def]
            res = await super().generate(request)
            return GenResult(res.uid, res.response_ids, res.behavior_logprobs, res.token_versions, "cancelled") \
                if request.uid == -2 else res

    row = _evaluate(tmp_path, lambda prompts, completions, **c: [1.0], [], engine_cls=Cancelling)
    assert row["eval_errors"] == 1 and "eval prompt 1: its generation was cancelled" in row["eval_error"]
    assert row["eval_accuracy"] == 5 / 6


def test_step_hooks_read_the_store_once_a_step_without_blocking_on_a_remote_store(tmp_path: Path) -> None:
    """`on_trained` starts the row's store read; a store in another process is asked with one
    awaitable call (its blocking `metrics` would hold the event loop), an in-process one at once,
    and `on_step` without an `on_trained` before it still reads the remote store the awaitable way."""
    from types import SimpleNamespace

    from asyncflow.config import load_config
    from asyncflow.step_hooks import StepHooks

    class Remote:
        def __init__(self) -> None:
            self.samples = 0.0

        async def metrics_async(self) -> dict[str, float]:
            return {"samples": self.samples}

        def metrics(self) -> dict[str, float]:
            raise AssertionError("a blocking store read on the event loop")

    async def hold(store: Any, n: float) -> None:
        if isinstance(store, Remote):
            store.samples = n
        else:  # (the in-process store: its samples are counted as they are put)
            await store.put([NewSample(g, 1, {}) for g in range(store.size(), int(n))])

    cfg, _ = load_config(None, ["task=arith"])
    hooks = StepHooks(cfg, None, engines=[], runtime=None, log=None, tracer=None, clock=None,
                      progress=None, out=tmp_path, trainer=None, hf_tok=None, fingerprint="", protect=None)

    async def main() -> list[float]:
        seen = []
        for store in (Remote(), TransferQueue()):
            hooks.pipeline = SimpleNamespace(store=store)
            await hold(store, 5.0)
            hooks.on_trained()
            await hold(store, 9.0)  # (what changes after the read started: a remote read answers it later)
            assert hooks.store_read is not None
            seen.append((await hooks.store_read)["samples"])
        hooks.pipeline = SimpleNamespace(store=Remote())
        seen.append((await hooks._read_store())["samples"])
        return seen

    assert asyncio.run(main()) == [9.0, 5.0, 0.0]
