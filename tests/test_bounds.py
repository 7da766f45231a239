"""Every wait and every message is bounded: huge timeouts, alias bombs, a stuck turn barrier, a stuck
episode player."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.errors import UserError, WaitTimeout

BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        + "".join(f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
        + "model: *i\n")


@pytest.mark.parametrize("key", ["reward.timeout_s", "rollout.request_timeout_s", "rollout.env_timeout_s",
                                 "workflow.step_timeout_s", "workflow.lease_timeout_s"])
def test_a_huge_timeout_is_refused_naming_its_key(key: str) -> None:
    with pytest.raises(UserError, match=rf"^{key}: 1e\+308 is above the maximum 604800") as err:
        load_config(None, ["task=arith", f"{key}=1e308"])
    assert "\n" not in str(err.value)


def test_a_week_is_still_a_timeout() -> None:
    assert load_config(None, ["task=arith", "reward.timeout_s=604800"])[0].reward.timeout_s == 604800


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 400
    start = time.monotonic()
    with pytest.raises(UserError, match="aliases expand to over") as err:
        load_config(path)
    assert time.monotonic() - start < 30 and len(str(err.value)) < 300 and "\n" not in str(err.value)


def test_the_cli_prints_the_alias_bomb_error_as_one_short_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    done = subprocess.run([sys.executable, "-m", "asyncflow", "train", str(path), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-500:]
    assert len(done.stderr) < 400 and len(done.stderr.strip().splitlines()) == 1, done.stderr[:500]
    assert "aliases expand to over" in done.stderr


@pytest.mark.parametrize("text, message", [
    ("train: " + "[" * 3000 + "]" * 3000 + "\n", "nested over 64 levels deep"),  # (past Python's recursion limit)
    ("train: " + "[" * 70 + "]" * 70 + "\n", "line 1: nested over 64 levels deep"),
    ("train: {batch_size: " + "9" * 5001 + "}\n", "a value YAML cannot read: Exceeds the limit"),
    ("train: &x {extra: *x}\n", "line 1: a YAML alias refers to a section that holds it"),
    ("a: &x [1, [2, *x]]\n", "a YAML alias refers to a section that holds it"),
])
def test_a_config_nested_without_end_or_holding_a_huge_number_is_one_line_and_exit_2(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as err:
        load_config(path)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300
    done = subprocess.run([sys.executable, "-m", "asyncflow", "config", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-500:]


def test_an_alias_used_twice_is_not_a_cycle(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("x-common: &c {lr: 1.0e-5}\ntrain: {<<: *c, batch_size: 16}\n")
    with pytest.raises(UserError, match="x-common") as err:  # (the unknown top-level key, not the alias)
        load_config(path)
    assert "alias" not in str(err.value)


def test_a_nested_value_in_a_message_is_shown_short(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: [&b [" + ", ".join(["'x'"] * 50) + "], *b, *b, *b, *b, *b, *b, *b]\n")
    with pytest.raises(UserError, match=r"^model: expected a mapping, got \[\[") as err:
        load_config(path)
    assert len(str(err.value)) < 300


def test_a_user_error_message_is_capped() -> None:
    assert len(str(UserError("x" * 10**6))) < 2100


def test_a_turn_barrier_wait_ends_at_its_timeout() -> None:
    from asyncflow.virtual_loop import run_virtual
    from asyncflow.workflow.episode import TurnBarrier

    async def main(clock: Any) -> float:
        barrier = TurnBarrier(2, 5.0)  # the second episode never arrives nor leaves
        start = clock.now()
        with pytest.raises(WaitTimeout, match="turn barrier"):
            await barrier.party().wait()
        return clock.now() - start

    assert run_virtual(main) == pytest.approx(5.0)


def test_playing_calc_episodes_ends_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.tasks import calc

    class Stuck:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def reset(self, row: Any, seed: int) -> str:
            await asyncio.sleep(3600)
            return ""

    monkeypatch.setattr(calc, "CalculatorEnv", Stuck)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="playing 1 episodes took over 0.5 s"):
        calc.play_episodes(None, None, [{"prompt": "1+1=", "answer": "2"}], timeout_s=0.5)
    assert time.monotonic() - start < 30
