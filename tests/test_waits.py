"""Every wait of the workflow ends, with a message saying what it waited for (issue 8).

The real pipeline (store, scheduler, gate, trainer loop) on a virtual clock, with simulated engines
that hang where a test needs them to: generation that never returns, a weight load that never
finishes, a reward function that sleeps past its limit, a trainer starved of samples. Virtual time
makes each timeout instant. Hung environment steps, agents and FSDP workers are covered in
test_envs.py, test_episode.py, test_agent_proxy.py and test_fsdp.py; Ray waits in test_ray*.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow.errors import WaitTimeout


def _run(tmp_path: Path, overrides: list[str], *, engine_cls: Any = None, reward: Any = None, real: bool = False,
         env_factory: Any = None) -> None:
    """`real`: on the wall clock (a wait on a real thread cannot time out in virtual time, which
    stands still while the loop waits for the thread)."""
    from asyncflow.bench.pipeline import _reward, _SimTokenizer, sim_pipeline
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    cls = engine_cls or SimEngine

    async def main(clock: Any) -> None:
        cfg, _ = load_config(None, ["task=arith", "rollout.n=4", "train.batch_size=16", "train.max_steps=3", "rollout.workers=2",
                                    "rollout.max_batch=8", "rollout.max_new_tokens=20", *overrides])
        engines = [cls(clock, lengths=lambda rng: rng.randint(1, 20), capacity=8, seed=i) for i in range(2)]
        log = RunLog(tmp_path)
        trainer = SimTrainer(clock, token_s=1e-3, devices=1)
        pipeline = sim_pipeline(
            cfg, rows=[{"prompt": i} for i in range(64)], tokenizer=_SimTokenizer(), reward_fn=reward or _reward,
            engines=engines, trainer=trainer, loss_fn=None, clock=clock, log=log, tracer=Tracer(now=clock.now),
            env_factory=env_factory)
        try:
            await pipeline.run()
        finally:
            log.close()

    if real:
        from asyncflow.clock import RealClock

        asyncio.run(main(RealClock()))
    else:
        run_virtual(main)


def _never_on_uid(uid: int) -> Any:
    from asyncflow.engines.sim import SimEngine

    class Hangs(SimEngine):
        def start_generate(self, request):  # type: ignore[no-untyped-def]
            if request.uid == uid:
                return asyncio.get_running_loop().create_future()  # never resolved
            return super().start_generate(request)

    return Hangs


def test_a_generation_that_never_returns_fails_the_run_naming_the_sample(tmp_path: Path) -> None:
    with pytest.raises(WaitTimeout, match=r"timed out after 5 s waiting for generation of sample 5$"):
        _run(tmp_path, ["rollout.request_timeout_s=5"], engine_cls=_never_on_uid(5))


def test_a_weight_load_that_never_finishes_fails_the_run_naming_the_version(tmp_path: Path) -> None:
    from asyncflow.engines.sim import SimEngine

    class LoadHangs(SimEngine):
        async def load_weights(self, state, version, mode):  # type: ignore[no-untyped-def]
            await asyncio.get_running_loop().create_future()

    with pytest.raises(WaitTimeout, match=r"weight sync of version 1"):
        _run(tmp_path, ["workflow.step_timeout_s=30"], engine_cls=LoadHangs)


def test_a_trainer_starved_of_samples_fails_naming_what_it_waited_for(tmp_path: Path) -> None:
    """Every generation hangs and its own limit is longer: the trainer's wait for a batch ends first."""
    from asyncflow.engines.sim import SimEngine

    class AllHang(SimEngine):
        def start_generate(self, request):  # type: ignore[no-untyped-def]
            return asyncio.get_running_loop().create_future()

    with pytest.raises(WaitTimeout, match=r"timed out after 30 s waiting for a training batch from stage 'train': "
                                          r"0 of 4 groups; .*\(workflow.step_timeout_s"):
        _run(tmp_path, ["workflow.step_timeout_s=30", "rollout.request_timeout_s=1000"], engine_cls=AllHang)


def test_a_reward_call_past_its_limit_marks_its_group_and_the_run_goes_on(tmp_path: Path) -> None:
    """The first reward call sleeps past `reward.timeout_s` (wall clock): the samples of the groups
    scored in that call end as reward_error with the message, and the run still trains all its steps."""
    from asyncflow.bench.pipeline import _reward

    calls: list[int] = []

    def slow_once(prompts: list[Any], completions: list[Any], **kw: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)
        return _reward(prompts, completions, **kw)

    _run(tmp_path, ["reward.timeout_s=0.5"], reward=slow_once, real=True)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["status"] == "reward_error"]
    assert failed and all("timed out after 0.5 s waiting for reward function on group(s)" in r["error"] for r in failed)
    assert sum(r["status"] == "trained" for r in rows) == 3 * 16


def test_an_async_reward_call_that_swallows_its_cancellation_still_ends_at_its_limit(tmp_path: Path) -> None:
    """A judge client whose retry loop has a bare `except:` swallows the timeout's cancellation. The
    first call does so forever, the second for 50 retries then returns: both groups end as reward_error
    at `reward.timeout_s` and the run trains all its steps (awaited in place, the first wait never
    ended and the second's late result was taken as a score)."""
    from asyncflow.bench.pipeline import _reward

    calls: list[int] = []

    async def stubborn(prompts: list[Any], completions: list[Any], **kw: Any) -> Any:
        calls.append(1)
        n = len(calls)
        tries = 0
        while n <= 2 and (n == 1 or tries < 50):
            tries += 1
            try:  # noqa: SIM105  (the bug this survives: cancellation caught with the rest)
                await asyncio.sleep(1.0)
                raise ConnectionError("judge unavailable")
            except (Exception, asyncio.CancelledError):  # (not GeneratorExit: closed at exit, it ends)
                pass
        return _reward(prompts, completions, **kw)

    _run(tmp_path, ["reward.timeout_s=5", "reward.concurrency=2"], reward=stubborn)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r["status"] == "reward_error"]
    assert len({r["group_id"] for r in failed}) == 2 and len(failed) == 8
    assert all(r["error"].startswith("timed out after 5.0 virtual s waiting for reward function on group(s)")
               for r in failed)
    assert sum(r["status"] == "trained" for r in rows) == 3 * 16


def _stubborn_env(hang_on: set[int], raise_on: set[int]) -> Any:
    """Environments that answer in one step, except: the episodes numbered in `hang_on` swallow every
    cancellation of their step (a retry loop with a bare `except:`), those in `raise_on` raise
    CancelledError themselves (awaiting a task they had cancelled)."""
    from asyncflow.envs import Env, EnvStep

    made: list[int] = []

    class Stubborn(Env):
        name = "stubborn"
        max_turns = 2

        def __init__(self, clock: Any) -> None:
            made.append(1)
            self.number, self.clock = len(made), clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            return ""

        async def step(self, action: str) -> EnvStep:
            if self.number in raise_on:
                helper = asyncio.ensure_future(asyncio.sleep(1.0))
                helper.cancel()
                await helper  # (raises CancelledError in this task, which nobody cancelled)
            while self.number in hang_on:
                try:  # noqa: SIM105  (the bug this survives: cancellation caught with the rest)
                    await self.clock.sleep(1.0)
                except (Exception, asyncio.CancelledError):  # (not GeneratorExit: closed at exit, it ends)
                    pass
            return EnvStep("", reward=1.0, done=True)

    return Stubborn


def test_an_environment_that_swallows_its_cancellation_or_raises_it_ends_its_episode(tmp_path: Path) -> None:
    """Awaited in place, a step that swallowed the cancellation of its timeout ran for good, and its
    episode, lease and group with it; a CancelledError the environment raised itself ended the
    episode's task unreported (no reward_error, no ack: the lease expired, the run stalled). Both now
    end their episode as reward_error, and the run trains all its steps."""
    _run(tmp_path, ["rollout.env=calculator", "rollout.env_timeout_s=0.5", "rollout.max_turns=2"],  # (its factory:)
         env_factory=_stubborn_env({3}, {6}))
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    failed = sorted((r for r in rows if r["status"] == "reward_error"), key=lambda r: r["error"])
    assert len(failed) == 2, [r["error"] for r in failed]
    assert failed[0]["error"] == ("environment 'stubborn' failed in step 1: CancelledError raised by the environment "
                                  "itself (e.g. it awaited a task it had cancelled)")
    assert failed[1]["error"].startswith("environment hung: environment 'stubborn' step 1 did not end within 0.5 "
                                         "virtual s after its timeout of 0.5 virtual s: it ignores cancellation")
    assert sum(r["status"] == "trained" for r in rows) == 3 * 16 - 2  # (their groups trained without them)


def test_an_environment_that_changes_its_row_changes_no_other_episode_s(tmp_path: Path) -> None:
    """Episodes were given the dataset's row itself: an environment that popped a column took it
    from its group's other episodes (and every later epoch)."""
    from asyncflow.envs import Env, EnvStep

    seen: list[bool] = []

    class Pops(Env):
        name = "pops"
        max_turns = 1

        def __init__(self, clock: Any) -> None:
            pass

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            seen.append(row.pop("prompt", None) is not None)
            return ""

        async def step(self, action: str) -> EnvStep:
            return EnvStep("", reward=1.0, done=True)

    _run(tmp_path, ["rollout.env=calculator", "rollout.max_turns=1"], env_factory=Pops)
    assert len(seen) >= 3 * 16 and all(seen)


def test_an_agent_that_swallows_its_cancellation_ends_at_its_limit() -> None:
    from asyncflow.clock import RealClock
    from asyncflow.workflow.agent import run_agent_episode
    from asyncflow.workflow.agent_proxy import AgentProxy, RecorderSettings

    async def stubborn(base_url: str, row: dict[str, Any], seed: int) -> float:
        while True:
            try:  # noqa: SIM105
                await asyncio.sleep(0.01)
            except (Exception, asyncio.CancelledError):  # (not GeneratorExit)
                pass

    async def raises(base_url: str, row: dict[str, Any], seed: int) -> float:
        helper = asyncio.ensure_future(asyncio.sleep(1.0))
        helper.cancel()
        await helper
        return 1.0

    async def main() -> list[Any]:
        proxy = AgentProxy()
        await proxy.start()
        try:
            return [await run_agent_episode(agent=agent, proxy=proxy, engine=None, clock=RealClock(), tok=None,  # type: ignore[arg-type]
                                            uid=5, row={}, seed=0, settings=RecorderSettings(8, 1.0, 1.0, 60.0, 4),
                                            timeout_s=0.3)
                    for agent in (stubborn, raises)]
        finally:
            await proxy.close()

    start = time.monotonic()
    hung, raised = asyncio.run(main())
    assert time.monotonic() - start < 10
    assert hung.fields["reward_error"] == "agent hung: episode 5 took longer than rollout.agent_timeout_s=0.3 s"
    assert raised.fields["reward_error"].startswith("agent failed: CancelledError raised by the agent itself")


def test_wait_detached_ends_at_its_deadline_on_the_real_clock() -> None:
    """The evaluation's bound (`RealClock`): a coroutine that never lets itself be cancelled."""
    from asyncflow.clock import RealClock, wait_detached

    async def forever() -> None:
        while True:
            try:  # noqa: SIM105  (the bug this survives: not contextlib.suppress)
                await asyncio.sleep(0.01)
            except (Exception, asyncio.CancelledError):  # (not GeneratorExit: closed at exit, it ends)
                pass

    async def main() -> float:
        start = time.monotonic()
        with pytest.raises(WaitTimeout, match="waiting for the stubborn call"):
            await wait_detached(RealClock(), forever(), 0.2, "the stubborn call")
        return time.monotonic() - start

    assert asyncio.run(main(), debug=False) < 5


def test_an_eval_whose_generation_never_returns_records_the_timeout(tmp_path: Path) -> None:
    """Greedy eval generation is bounded like rollout requests (rollout.request_timeout_s per round
    of the engine's batch): an engine that never answers fails the eval row with the reason, and the
    run goes on (it used to wait forever)."""
    from asyncflow.config import load_config
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    class Tok:
        hf = staticmethod(lambda text: {"input_ids": [5, 6]})

        def completions(self, ids: Any, conversational: bool) -> list[str]:
            return ["" for _ in ids]

    hangs = _never_on_uid(-3)  # eval requests have negative uids; the third never ends

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=arith", "rollout.request_timeout_s=7"])
        engine = hangs(clock, lengths=lambda rng: 3, capacity=2, seed=0)
        log = RunLog(tmp_path)
        try:
            evaluator = Evaluator(cfg, [{"prompt": str(i), "answer": "1"} for i in range(4)], Tok(),
                                  lambda prompts, completions, **kw: [1.0] * len(prompts), engine, log,
                                  Tracer(now=clock.now), clock=clock)
            return await evaluator.run(step=0)
        finally:
            log.close()

    row = run_virtual(main)
    assert row["eval_accuracy"] == 0.0
    assert row["eval_error"].startswith("timed out after 14.0 virtual s waiting for greedy generation of the 4 eval")


def test_an_eval_episode_whose_environment_swallows_its_cancellation_is_abandoned(tmp_path: Path) -> None:
    """Evaluation awaited each environment call in place: one that swallowed the cancellation of its
    timeout hung the evaluation, and the run, for good."""
    from asyncflow.config import load_config
    from asyncflow.engines.sim import SimEngine
    from asyncflow.evaluation import Evaluator
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.virtual_loop import run_virtual

    class Tok:
        hf = staticmethod(lambda text: {"input_ids": [5, 6]})
        eos_token_id = 1

        def encode(self, text: str) -> list[int]:
            return [7] * len(text)

        def decode(self, ids: Any) -> str:
            return "x" * len(ids)

    async def main(clock: Any) -> dict[str, Any]:
        cfg, _ = load_config(None, ["task=arith", "rollout.env=calculator", "rollout.env_timeout_s=2", "rollout.max_turns=2"])
        log = RunLog(tmp_path)
        try:
            evaluator = Evaluator(cfg, [{"prompt": str(i), "answer": "1"} for i in range(4)], Tok(), None,  # type: ignore[arg-type]
                                  SimEngine(clock, lengths=lambda rng: 3, capacity=4, seed=0), log,
                                  Tracer(now=clock.now), env_factory=_stubborn_env({2}, {3}), clock=clock)
            return await evaluator.run(step=0)
        finally:
            log.close()

    row = run_virtual(main)
    assert row["eval_accuracy"] == 0.5 and row["eval_errors"] == 2
    assert row["eval_error"].startswith("environment hung: environment 'stubborn' step 1 did not end within 2.0 virtual "
                                        "s after its timeout")


def test_a_reward_outage_after_the_first_calls_ends_the_run_at_the_batch_deadline(tmp_path: Path) -> None:
    """The verifier works for its first 40 calls, then every call fails: each group is discarded and
    refilled, so every take succeeds. The bound is on the whole batch (the run used to go on for
    ever, scoring and discarding the dataset in a loop)."""
    from asyncflow.bench.pipeline import _reward

    calls: list[int] = []

    def goes_down(prompts: list[Any], completions: list[Any], **kw: Any) -> Any:
        calls.append(1)
        if len(calls) > 40:
            raise RuntimeError("verifier down")
        return _reward(prompts, completions, **kw)

    with pytest.raises(WaitTimeout, match=r"timed out after 300 s waiting for a training batch from stage 'train': [0-3] of 4 groups; "
                                          r"meanwhile [1-9]\d* groups failed every reward call"):
        _run(tmp_path, ["workflow.step_timeout_s=300", "train.max_steps=50"], reward=goes_down)
    assert len(calls) > 100  # it went on past the first calls (fail-fast did not end it) until the deadline


class _Tok:
    eos_token_id = 1

    def encode(self, text: str) -> list[int]:
        return [7] * len(text)

    def decode(self, ids: Any) -> str:
        return "x"


class _Engine:
    version = 0

    async def generate(self, req: Any) -> Any:
        from asyncflow.engines.base import GenResult

        return GenResult(req.uid, [7, 7], [0.0, 0.0], [0, 0], "stop")


def test_a_cancelled_guarded_episode_still_closes_its_environment() -> None:
    """Cancelling the caller (the run ending, Ctrl-C, an evaluation cut short) abandoned each guarded
    episode at once: its `finally: env.close()` never completed (a container, a sandbox left behind)."""
    from asyncflow.clock import RealClock, SweptClock, run_guarded
    from asyncflow.envs import Env, EnvStep
    from asyncflow.workflow.episode import EpisodeSettings, run_episode

    closed: list[int] = []

    class Slow(Env):
        name = "slow"

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            return ""

        async def step(self, action: str) -> EnvStep:
            await asyncio.sleep(60)  # a long step that lets itself be cancelled
            return EnvStep("", 1.0, True)

        async def close(self) -> None:
            await asyncio.sleep(0.05)  # (stopping a container)
            closed.append(1)

    async def main() -> None:
        swept = SweptClock(RealClock())
        episodes = [run_guarded(swept, run_episode(env=Slow(), engine=_Engine(), clock=swept, tok=_Tok(), uid=-1,  # type: ignore[arg-type]
                                                   prompt_ids=[5], row={}, seed=0,
                                                   settings=EpisodeSettings(8, 0.0, 30.0, 120.0)),
                                lambda m: None, 5.0) for _ in range(4)]
        try:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*episodes), 0.2)
        finally:
            swept.close()

    asyncio.run(main())
    assert closed == [1, 1, 1, 1]


def test_a_timeout_the_environment_turns_into_its_own_error_is_a_timeout_and_taken_back() -> None:
    """A client library that turns the timeout's cancellation into its own error left the task's
    cancel count at 1, so a CancelledError the environment raised itself later (close awaiting a
    helper it had cancelled) was read as the run's: the episode's task ended unreported."""
    from asyncflow.clock import RealClock, SweptClock, run_guarded
    from asyncflow.envs.base import Env, EnvError, EnvStep, env_call

    class Wrapping(Env):
        name = "wrapping"

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            return ""

        async def step(self, action: str) -> EnvStep:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                raise ConnectionError("request aborted") from None
            return EnvStep("", 1.0, True)

        async def close(self) -> None:
            helper = asyncio.ensure_future(asyncio.sleep(1.0))
            helper.cancel()
            await helper

    async def episode(clock: Any) -> list[str]:
        env, errors = Wrapping(), []
        for call, what in ((env.step("x"), "step 1"), (env.close(), "close")):
            try:
                await env_call(clock, call, 0.2, env, what)
            except EnvError as exc:
                errors.append(str(exc))
        return errors

    async def main() -> Any:
        swept = SweptClock(RealClock())
        try:
            return await run_guarded(swept, episode(swept), lambda m: m, 5.0)
        finally:
            swept.close()

    assert asyncio.run(main()) == [
        "environment 'wrapping' hung: step 1 took longer than 0.2 s",
        "environment 'wrapping' failed in close: CancelledError raised by the environment itself (e.g. it awaited a "
        "task it had cancelled)"]


def test_an_abandoned_episode_that_comes_back_neither_works_nor_keeps_the_clock_alive() -> None:
    """An environment that swallows cancellation for a while, then lets go: after its episode was
    abandoned it played on (generating for nobody), and its next wait restarted a sweeper of a
    closed clock that never stopped. A barrier party made to leave still counted when it arrived."""
    from asyncflow.clock import Abandoned, SweptClock, run_guarded
    from asyncflow.virtual_loop import run_virtual
    from asyncflow.workflow.episode import TurnBarrier

    later: list[str] = []

    async def episode(clock: Any) -> str:
        async def stubborn_step() -> None:
            for _ in range(20):  # swallows 20 s of cancels, then ends
                try:  # noqa: SIM105
                    await clock.clock.sleep(1.0)
                except (Exception, asyncio.CancelledError):  # (not GeneratorExit)
                    pass

        await clock.wait_for(stubborn_step(), 1.0, "step 1")
        try:
            await clock.wait_for(asyncio.sleep(0), 1.0, "generation of turn 2")
        except Abandoned:
            later.append("refused")
            raise
        later.append("played on")
        return "done"

    async def main(vclock: Any) -> tuple[str, list[str]]:
        swept = SweptClock(vclock)
        result = await run_guarded(swept, episode(swept), lambda m: f"abandoned: {m}", 5.0)
        swept.close()
        await vclock.sleep(100)
        alive = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return result, alive

    result, alive = run_virtual(main)
    assert result.startswith("abandoned: step 1 did not end within 1.0 virtual s after its timeout")
    assert later == ["refused"] and alive == []

    async def barrier() -> tuple[bool, bool]:
        b = TurnBarrier(3, 60.0)
        gone, live1, live2 = b.party(), b.party(), b.party()
        gone.leave()
        first = asyncio.ensure_future(live1.wait())
        await asyncio.sleep(0)
        await gone.wait()  # (it counted, and released the turn before live2 arrived)
        await asyncio.sleep(0)
        early = first.done()
        await live2.wait()
        await asyncio.sleep(0)
        return early, first.done()

    assert asyncio.run(barrier()) == (False, True)


def test_a_turn_barrier_run_waits_for_its_episodes_to_close_their_environments(tmp_path: Path) -> None:
    """The stages' stop bound (60 s) was shorter than an episode's grace to close its environment
    (env_timeout_s + 1 s): a turn-barrier run whose environments take 70 s to close ended with
    "stages did not stop within 60 s" although training had finished."""
    from asyncflow.envs import Env, EnvStep

    closed: list[int] = []

    def factory(clock: Any) -> Env:
        class SlowClose(Env):
            name = "slowclose"
            max_turns = 2

            async def reset(self, row: dict[str, Any], seed: int) -> str:
                return ""

            async def step(self, action: str) -> EnvStep:
                await clock.sleep(1.0)
                return EnvStep("", reward=1.0, done=True)

            async def close(self) -> None:
                await clock.sleep(70.0)  # (stopping a sandbox: under env_timeout_s)
                closed.append(1)

        return SlowClose()

    _run(tmp_path, ["rollout.env=calculator", "rollout.turn_barrier=true", "rollout.env_timeout_s=120",
                    "rollout.max_turns=2", "workflow.max_staleness=2", "workflow.redundancy=1"], env_factory=factory)
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sum(r["status"] == "trained" for r in rows) == 3 * 16 and len(closed) >= 3 * 16


def test_an_abandoned_episode_that_comes_back_still_closes_its_environment() -> None:
    from asyncflow.clock import SweptClock, run_guarded
    from asyncflow.envs import Env, EnvStep
    from asyncflow.virtual_loop import run_virtual
    from asyncflow.workflow.episode import EpisodeSettings, run_episode

    events: list[str] = []

    async def main(vclock: Any) -> str:
        class Stubborn(Env):
            name = "stubborn"
            max_turns = 1

            async def reset(self, row: dict[str, Any], seed: int) -> str:
                return ""

            async def step(self, action: str) -> EnvStep:
                for _ in range(20):  # swallows 20 s of cancels, then ends
                    try:  # noqa: SIM105
                        await vclock.sleep(1.0)
                    except (Exception, asyncio.CancelledError):  # (not GeneratorExit)
                        pass
                events.append("step returned")
                return EnvStep("", 1.0, True)

            async def close(self) -> None:
                events.append("close ran")

        swept = SweptClock(vclock)
        result = await run_guarded(swept, run_episode(env=Stubborn(), engine=_Engine(), clock=swept, tok=_Tok(),  # type: ignore[arg-type]
                                                      uid=-1, prompt_ids=[5], row={}, seed=0,
                                                      settings=EpisodeSettings(8, 0.0, 30.0, 1.0)),
                                   lambda m: m, 2.0)
        await vclock.sleep(60)
        swept.close()
        return str(result)

    assert run_virtual(main).startswith("environment 'stubborn' step 1 did not end within 1.0 virtual s")
    assert events == ["step returned", "close ran"]
