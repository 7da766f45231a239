"""OpenEnv environments as asyncflow environments (`rollout.env: openenv:...`): environments written in
OpenEnv's own API, in process and behind a local server the run starts; a server that dies or hangs
fails only its episodes; `asyncflow train` logs the rewards the environment itself gives."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from engine_doubles import ScriptedEngine

from asyncflow.clock import RealClock
from asyncflow.envs import make_env_factory
from asyncflow.errors import UserError
from asyncflow.user_code import load_attr
from asyncflow.workflow.episode import EpisodeSettings, run_episode

pytest.importorskip("openenv.core")
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CALC = ROOT / "examples/openenv/calc_env.py"
HERE = Path(__file__).resolve()
SETTINGS = EpisodeSettings(max_new_tokens=64, temperature=1.0, request_timeout_s=60.0, env_timeout_s=30.0)


class MoveAction(Action):
    dx: int
    dy: int


class GridObservation(Observation):
    position: list[int] = [0, 0]
    note: str = ""


class GridEnvironment(Environment[MoveAction, GridObservation, State]):
    """A structured action (two ints): reach (2, 1) from (0, 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = [0, 0]

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GridObservation:
        self.pos = [0, 0]
        return GridObservation(position=self.pos, note="reach 2,1")

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GridObservation:
        self.pos = [self.pos[0] + action.dx, self.pos[1] + action.dy]
        done = self.pos == [2, 1]
        return GridObservation(position=self.pos, note="", done=done, reward=1.0 if done else 0.0)

    @property
    def state(self) -> State:
        return State()


class HangingEnvironment(GridEnvironment):
    """A step that never returns in time (served, it holds a server thread)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GridObservation:
        time.sleep(30)
        return super().step(action)


class CountingEnvironment(GridEnvironment):
    """Counts its live instances (reset to close), the most at once in `peak`."""

    live = 0
    peak = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GridObservation:
        type(self).live += 1
        type(self).peak = max(type(self).peak, type(self).live)
        return super().reset(seed, episode_id)

    def close(self) -> None:
        type(self).live -= 1


class ConcurrentCountingEnvironment(CountingEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    live = 0
    peak = 0


class ThreadBoundEnvironment(GridEnvironment):
    """Declares that every call must come from one thread; records the threads it was called on."""

    REQUIRES_SINGLE_THREAD_EXECUTOR = True
    threads: list[int] = []

    def __init__(self) -> None:
        super().__init__()
        self.threads.append(threading.get_ident())

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GridObservation:
        self.threads.append(threading.get_ident())
        return super().reset(seed, episode_id)

    def step(self, action: MoveAction, timeout_s: float | None = None, **kwargs: Any) -> GridObservation:
        self.threads.append(threading.get_ident())
        return super().step(action)

    def close(self) -> None:
        self.threads.append(threading.get_ident())


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from asyncflow.tokenizer import Tokenizer

    return Tokenizer.of(AutoTokenizer.from_pretrained(smollm2_dir), smollm2_dir)


def _char_ids(tok: Any, text: str) -> list[int]:
    """`text` one token per character: ids that re-encoding the text would not give (the trap)."""
    ids = [tok.hf.encode(c, add_special_tokens=False)[0] for c in text]
    assert tok.hf.decode(ids) == text and tok.hf.encode(text, add_special_tokens=False) != ids
    return ids


def _episode(factory: Any, tok: Any, texts: list[str], row: dict[str, Any], before: Any = None,
             settings: EpisodeSettings = SETTINGS) -> tuple[dict[str, Any], list[list[int]]]:
    turns = [[*_char_ids(tok, t), tok.eos_token_id] for t in texts]

    async def main() -> dict[str, Any]:
        result = await run_episode(env=factory(RealClock()), engine=ScriptedEngine(turns, before=before), clock=RealClock(), tok=tok,
                                   uid=1, prompt_ids=tok.encode(row["prompt"]), row=row, seed=5, settings=settings)
        return result.fields

    return asyncio.run(main()), turns


def _generated(fields: dict[str, Any]) -> list[list[int]]:
    ids, mask = list(fields["response_ids"]), [int(m) for m in fields["loss_mask"]]
    runs: list[list[int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            runs.append([])
        if m:
            runs[-1].append(ids[i])
    return runs


CALC_ROW = {"prompt": "37*48=", "answer": "1776"}


def test_in_process_episode_trains_the_generated_ids_and_maps_text_both_ways(tok: Any) -> None:
    factory = make_env_factory(f"openenv:{CALC}:CalcToolEnvironment", max_turns=3)
    fields, turns = _episode(factory, tok, ["<calc>37*48</calc>", "<answer>1776</answer>"], CALC_ROW)
    assert fields["reward_error"] is None and fields["reward"] == 1.0 and fields["finish_reason"] == "stop"
    assert _generated(fields) == turns  # the ids generated, not the decoded text re-encoded
    assert "<result>1776</result>" in tok.hf.decode(list(fields["response_ids"]))
    # a structured action is read as JSON; one that is not valid is answered with its error, not an episode error
    grid = make_env_factory(f"openenv:{HERE}:GridEnvironment", max_turns=4)
    fields, _ = _episode(grid, tok, ['{"dx": 1, "dy": 1}', "right", '{"dx": 1}', '{"dx": 1, "dy": 0}'],
                         {"prompt": "go"})
    text = tok.hf.decode(list(fields["response_ids"]))
    assert fields["reward"] == 1.0 and fields["turns"] == 4
    assert '"position": [1, 1]' in text and "invalid action: the action must be a JSON object" in text
    assert "invalid action: dy: Field required" in text
    with pytest.raises(UserError, match="rollout.env: .* not an openenv.core.Environment subclass"):
        make_env_factory(f"openenv:{HERE}:MoveAction")


@pytest.mark.parametrize("cls", [CountingEnvironment, ConcurrentCountingEnvironment])
def test_episodes_run_as_concurrently_as_the_environment_declares(cls: type) -> None:
    factory = make_env_factory(f"openenv:{HERE}:{cls.__name__}", max_turns=2)

    async def episode() -> float:
        env = factory(RealClock())
        try:
            await env.reset({"prompt": "go"}, 0)
            await asyncio.sleep(0.05)
            return (await env.step('{"dx": 2, "dy": 1}')).reward
        finally:
            await env.close()

    async def main() -> list[float]:
        return await asyncio.gather(*(episode() for _ in range(3)))

    assert asyncio.run(main()) == [1.0] * 3
    played = load_attr(f"{HERE}:{cls.__name__}", "test")  # (the class the factory loaded from this file)
    assert played.peak == (3 if cls.SUPPORTS_CONCURRENT_SESSIONS else 1) and played.live == 0


def test_an_environment_bound_to_one_thread_is_called_from_one_thread_off_the_loop() -> None:
    factory = make_env_factory(f"openenv:{HERE}:ThreadBoundEnvironment", max_turns=3)

    async def main() -> float:
        env = factory(RealClock())
        try:
            await env.reset({"prompt": "go"}, 0)
            await env.step('{"dx": 1, "dy": 0}')
            return (await env.step('{"dx": 1, "dy": 1}')).reward
        finally:
            await env.close()

    assert asyncio.run(main()) == 1.0
    threads = load_attr(f"{HERE}:ThreadBoundEnvironment", "test").threads
    assert len(threads) == 5 and len(set(threads)) == 1 and threads[0] != threading.get_ident()


def test_a_local_server_that_dies_fails_only_its_episode_and_is_started_again(tok: Any) -> None:
    factory = make_env_factory(f"openenv+server:{CALC}:app", max_turns=3)
    try:
        fields, turns = _episode(factory, tok, ["<calc>37*48</calc>", "<answer>1776</answer>"], CALC_ROW)
        assert fields["reward"] == 1.0 and _generated(fields) == turns
        first = factory.server.pid
        assert first is not None

        def kill_before_turn_2(call: int) -> None:
            if call == 1:
                os.kill(first, signal.SIGKILL)
                while factory.server.pid is not None:
                    time.sleep(0.01)

        fields, _ = _episode(factory, tok, ["<calc>37*48</calc>", "<answer>1776</answer>"], CALC_ROW,
                             before=kill_before_turn_2)
        assert fields["reward"] is None and "failed in step 2" in fields["reward_error"]
        fields, _ = _episode(factory, tok, ["<answer>1776</answer>"], CALC_ROW)  # a new server, the next episode
        assert fields["reward"] == 1.0 and factory.server.pid not in (None, first)
    finally:
        factory.server.stop()


def test_a_hung_server_step_ends_its_episode_at_the_env_timeout(tok: Any) -> None:
    factory = make_env_factory(f"openenv+server:{HERE}:HangingEnvironment", max_turns=2)
    settings = EpisodeSettings(max_new_tokens=64, temperature=1.0, request_timeout_s=60.0, env_timeout_s=2.0)
    try:
        asyncio.run(factory.server.url())  # (started: the server's start is not the step under test)
        start = time.monotonic()
        fields, _ = _episode(factory, tok, ['{"dx": 2, "dy": 1}'], {"prompt": "go"}, settings=settings)
        assert fields["reward"] is None and "hung: step 1 took longer than 2 s" in fields["reward_error"]
        assert time.monotonic() - start < 25  # (the step sleeps 30 s: the episode did not wait for it)
    finally:
        factory.server.stop()


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _library_reward(response: str, prompt: str) -> float:
    """The environment's own reward for the same turns: replayed through its reset/step."""
    sys.path.insert(0, str(CALC.parent))
    try:
        import calc_env
    finally:
        sys.path.remove(str(CALC.parent))
    a, b = (int(x) for x in prompt.rstrip("=").split("*"))
    env = calc_env.CalcToolEnvironment()
    env.reset(seed=0, answer=str(a * b))
    total = 0.0
    for action in re.split(r"<result>.*?</result>", response):
        obs = env.step(calc_env.CalcAction(message=action))
        total += float(obs.reward or 0.0)
        if obs.done:
            break
    return total


@pytest.mark.slow
def test_asyncflow_train_runs_an_openenv_env_and_logs_its_own_rewards(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "asyncflow", "train", str(ROOT / "examples/openenv/config.yaml"), "--out", str(out),
           "--set", "train.max_steps=2", "--set", "train.batch_size=16", "--set", "rollout.n=4", "--set", "eval.size=8",
           "--set", "logging.progress=false"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["lost"] == 0 and summary["accounting"]["trained"] == 32
    samples = _rows(out / "samples.jsonl")
    assert {s["status"] for s in samples} == {"trained"} and any(s["turns"] == 2 for s in samples)
    for s in samples:
        assert s["reward"] == _library_reward(s["response"], s["prompt"]), s


@pytest.mark.ray
@pytest.mark.slow
def test_openenv_server_per_rollout_actor_on_ray(ray_session, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(ROOT / "examples/openenv/config.yaml", [
        f"rollout.env=openenv+server:{CALC}:CalcToolEnvironment", "runtime.kind=ray", "rollout.workers=2",
        "train.max_steps=2", "train.batch_size=16", "rollout.n=4", "eval.size=8", "logging.progress=false",
        "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5"])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == 32 and summary["reward_errors"] == 0
    saved = json.loads((out / "summary.json").read_text())
    assert saved["accounting"]["lost"] == 0
    assert len([a for a in saved["actors"] if a["role"] == "rollout"]) == 2
