"""The stall watchdog in a real `asyncflow train` (marked slow): a reward function that hangs after
the first checkpoint ends the run with one line naming the reward stage and how to go on (exit 1),
with the stacks in stall/; the same command with checkpoint.resume=auto then finishes the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HANGING_REWARD = '''
import asyncio
import os
from pathlib import Path

from asyncflow.tasks.arith import reward_fn as arith


async def reward_fn(prompts, completions, answer, **kw):
    flag = os.environ.get("HANG_AFTER")
    if flag and Path(flag).exists():  # the planted hang: once the first checkpoint is written
        await asyncio.Event().wait()
    return arith(prompts, completions, answer, **kw)
'''


def test_a_hung_reward_function_stops_the_run_and_a_resume_finishes_it(arith_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "hang_reward.py").write_text(HANGING_REWARD)
    (tmp_path / "c.yaml").write_text("task: arith\n")
    out = tmp_path / "run"
    settings = ["train.batch_size=32", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=32", "eval.every=0",
                "logging.progress=false", f"model.path={arith_dir}", "train.max_steps=4", "checkpoint.every=1",
                "reward.fn=hang_reward:reward_fn", "reward.timeout_s=100000", "workflow.stall_timeout_s=15"]
    cmd = [sys.executable, "-m", "asyncflow", "train", str(tmp_path / "c.yaml"),
           *[a for kv in settings for a in ("--set", kv)], "--out", str(out)]
    env = {**os.environ, "HANG_AFTER": str(out / "checkpoints" / "step_1" / "state.json")}
    stalled = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert stalled.returncode == 1, stalled.stderr[-3000:]
    last = stalled.stderr.strip().splitlines()[-1]
    assert last.startswith("asyncflow: error: stalled: no sample changed state for ")
    assert "stage reward holds" in last and "--set checkpoint.resume=auto" in last
    stacks = (out / "stall" / "driver.txt").read_text()
    assert "in reward_fn\n" in stacks and "hang_reward.py" in stacks
    counts = json.loads((out / "stall" / "store.json").read_text())["counts"]
    assert counts["reward"]["taken"] > 0
    assert "stalled" in json.loads((out / "failed.json").read_text())["error"]

    del env["HANG_AFTER"]
    resumed = subprocess.run([*cmd, "--set", "checkpoint.resume=auto"], env=env, capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"][-1] == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["lost"] == 0 and summary["samples"] == 4 * 32
    assert (out / "final" / "model.safetensors").is_file()
