"""The stall watchdog on the Ray runtime: a planted hang (a reward function in a reward actor; a call
inside the trainer actor; the driver's load of a version into a rollout actor) ends the run with one
line naming the stage, and stall/ holds the driver's and every actor's stacks, the planted function
among them. Three short arith runs on the session's Ray (an environment step and an engine request
that hang are tests/test_watchdog.py's, on the local runtime)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from asyncflow.workflow.watchdog import StallDetected

pytestmark = pytest.mark.ray

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arith_ray.yaml"

HANGING_REWARD = '''
import asyncio
import os

from asyncflow.tasks.arith import reward_fn as arith

CALLS = [0]


async def reward_fn(prompts, completions, answer, **kw):
    CALLS[0] += 1
    if os.getpid() != DRIVER and CALLS[0] > 6:  # the planted hang: the actor's 7th call (the driver evaluates)
        await asyncio.Event().wait()
    return arith(prompts, completions, answer, **kw)
'''

def _stall(arith_dir: Path, out: Path, *extra: str) -> str:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(EXAMPLE, [
        f"model.path={arith_dir}", "train.max_steps=6", "train.batch_size=16", "rollout.n=4", "eval.every=0",
        "eval.size=8", "logging.progress=false", "workflow.step_timeout_s=600", "runtime.rollout_cpus=0.5",
        "runtime.train_cpus=0.5", "workflow.stall_timeout_s=10", *extra])
    with pytest.raises(StallDetected) as info:
        train(cfg, out, progress_enabled=False)
    line = str(info.value)
    assert "\n" not in line and line.startswith("stalled: no sample changed state for ")
    return line


def test_a_hung_reward_actor_is_named_and_its_stacks_dumped(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "hang_reward.py").write_text(f"DRIVER = {os.getpid()}\n{HANGING_REWARD}")
    out = tmp_path / "run"
    line = _stall(arith_dir, out, f"reward.fn={tmp_path / 'hang_reward.py'}:reward_fn", "reward.timeout_s=100000",
                  "runtime.colocate=false")
    assert "stage reward holds" in line, line
    stall = out / "stall"
    assert {"driver.txt", "rollout-0.txt", "reward-0.txt", "trainer.txt", "feeder.txt", "store.txt",
            "store.json"} <= {p.name for p in stall.iterdir()}
    assert (stall / "trainer.txt").read_text().startswith("=== trainer actor (pid ")  # (its own concurrency group)
    reward = (stall / "reward-0.txt").read_text()
    assert "== asyncio tasks" in reward and "in reward_fn\n" in reward and "hang_reward.py" in reward
    assert json.loads((stall / "store.json").read_text())["counts"]["reward"]["taken"] > 0


def test_a_hung_trainer_actor_call_is_named_and_the_actor_still_dumps_its_stacks(
        ray_session, arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted hang: the second train step is a call that blocks inside the trainer actor (a load
    from a named pipe nobody writes). Its calls run one at a time, yet it answers the dump beside it."""
    from asyncflow.runtime.ray_remote import RemoteTrainEngine

    fifo_dir = tmp_path / "never_written"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "optimizer.pt")
    real_step = RemoteTrainEngine.train_step
    calls = [0]

    def second_step_hangs(self: RemoteTrainEngine, *args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == 2:
            import ray

            ray.get(self.handle.load_optimizer.remote(str(fifo_dir)))  # (fails once the pipe is closed)
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(RemoteTrainEngine, "train_step", second_step_hangs)
    out = tmp_path / "run"

    def release_once_dumped() -> None:
        """End the load (an empty pipe) once stall/ is written, so the shutdown's calls into the
        trainer actor, queued behind it, are answered now rather than at their timeout."""
        deadline = time.monotonic() + 600
        while not all((out / "stall" / n).exists() for n in ("trainer.txt", "store.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        with open(fifo_dir / "optimizer.pt", "wb"):
            pass

    threading.Thread(target=release_once_dumped, daemon=True).start()
    line = _stall(arith_dir, out)
    assert "stage train is in a train step" in line, line
    trainer = (out / "stall" / "trainer.txt").read_text()
    assert trainer.startswith("=== trainer actor (pid ") and "in load_optimizer\n" in trainer, trainer[-3000:]


def test_a_weight_load_that_never_ends_is_named_with_the_publication(
        ray_session, arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted hang: the driver's load of version 2 into the rollout actor never returns."""
    import asyncio

    from asyncflow.runtime.ray_remote import RemoteEngine

    real_load = RemoteEngine.load_weights

    async def version_2_never_loads(self: RemoteEngine, state: object, version: int, mode: object) -> float:
        if version == 2:
            await asyncio.Event().wait()
        return await real_load(self, state, version, mode)

    monkeypatch.setattr(RemoteEngine, "load_weights", version_2_never_loads)
    out = tmp_path / "run"
    line = _stall(arith_dir, out)
    assert "stage train is loading weights into the engines (publish v2)" in line, line
    assert "in version_2_never_loads\n" in (out / "stall" / "driver.txt").read_text()
    assert "rollout-0.txt" in {p.name for p in (out / "stall").iterdir()}
