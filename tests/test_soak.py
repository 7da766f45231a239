"""Soak: many steps on Ray with workers killed during the run — nothing lost, nothing counted twice.

Marked `soak` (and `ray`); CI runs it as part of the test command. The run reports where every
admitted sample went (`summary.json` -> `accounting`) and the test reconciles that with
`samples.jsonl` and `metrics.jsonl`, then resumes the finished run on Ray from its last checkpoint
for a few more steps and reconciles again.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.runner import train
from asyncflow.telemetry.audit import audit

pytestmark = [pytest.mark.ray, pytest.mark.soak, pytest.mark.slow]

STEPS, BATCH, N = 60, 64, 4
SETTINGS = [
    "runtime.kind=ray", "rollout.workers=2", "runtime.rollout_cpus=0.5", "runtime.reward_workers=1",
    "runtime.max_restarts=3", "runtime.colocate=false",  # (every rollout and reward actor restartable)
    "workflow.mode=async", "workflow.max_staleness=2", f"train.batch_size={BATCH}", f"rollout.n={N}",
    "rollout.max_new_tokens=8", "eval.every=0", "eval.size=16", "checkpoint.every=20", "logging.progress=false",
]
# (not before train step, actor): rollout-0 twice. Each kill waits until the previous restart is done
# (the `restarts` metric counts it), so every death is a restart of its own.
KILLS = ((4, "rollout-0"), (8, "reward-0"), (12, "rollout-0"))


def _rows(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _progress(out: Path) -> tuple[int, int]:
    """(last train step logged, actor restarts so far)."""
    try:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return 0, 0
    rows = [r for r in rows if r.get("kind") == "train"]
    return (rows[-1]["step"], rows[-1]["restarts"]) if rows else (0, 0)


def _killer(ray: Any, out: Path, killed: list[tuple[int, str, int]], errors: list[str]) -> None:
    """Kill each actor of KILLS once the run has logged that step (Ray restarts it: no_restart=False)."""
    last = 0
    for k, (after, role) in enumerate(KILLS):
        deadline = time.monotonic() + 300
        while True:
            step, restarts = _progress(out)
            if step >= max(after, last + 4) and restarts == k:
                break
            if time.monotonic() > deadline:
                errors.append(f"kill {k + 1}: step {after} with {k} restarts not reached within 300 s")
                return
            time.sleep(0.05)
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("asyncflow-") and a["name"].endswith(f"-{role}")]
        if len(names) != 1:
            errors.append(f"expected one live {role} actor, found {names}")
            return
        ray.kill(ray.get_actor(names[0]), no_restart=False)
        last = _progress(out)[0]
        killed.append((after, role, last))


def _reconcile(out: Path, steps: int) -> dict[str, int]:
    """The run's counts agree with its logs; returns the accounting."""
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["accounting"]
    samples = _rows(out, "samples.jsonl")
    uids = [r["uid"] for r in samples]
    assert len(uids) == len(set(uids)), "a sample was logged twice"
    statuses: dict[str, int] = {}
    for r in samples:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    assert acc["lost"] == 0, acc
    assert acc["trained"] == steps * BATCH == summary["samples"]
    assert audit(acc, Counter(statuses)) == []  # the counters' balance agrees with the rows logged, status by status
    assert acc["admitted"] == sum(statuses.values()) + acc["in_store_at_end"]
    train_rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    assert train_rows[-1]["samples"] == steps * BATCH
    per_version: dict[int, int] = {}
    groups: dict[int, int] = {}
    for r in samples:
        if r["status"] == "trained":
            per_version[r["trained_version"]] = per_version.get(r["trained_version"], 0) + 1
            groups[r["group_id"]] = groups.get(r["group_id"], 0) + 1
            assert r["trained_version"] - r["behavior_version"] <= 2  # max_staleness held through the restarts
    assert per_version == {v: BATCH for v in range(steps)}
    assert set(groups.values()) == {N}  # whole groups, each trained once
    return dict(acc)


def test_soak_on_ray_with_workers_killed_three_times(ray_session, arith_dir: Path, tmp_path: Path) -> None:
    ray = ray_session
    out = tmp_path / "soak"
    killed: list[tuple[int, str, int]] = []
    errors: list[str] = []
    thread = threading.Thread(target=_killer, args=(ray, out, killed, errors), daemon=True)
    thread.start()
    cfg, _ = load_config(None, ["task=arith", *SETTINGS, f"model.path={arith_dir}", f"train.max_steps={STEPS}"])
    summary = train(cfg, out, progress_enabled=False)
    thread.join(timeout=30)
    assert not errors, errors
    assert [k[:2] for k in killed] == list(KILLS)
    assert all(at < STEPS for _, _, at in killed), killed  # every kill hit the run while it was going
    assert summary["restarts"] == {"rollout/0": 2, "reward/0": 1}
    acc = _reconcile(out, STEPS)
    print(f"\nsoak: {STEPS} steps, kills {killed}, accounting {acc}")

    # resume the finished run on Ray from its newest checkpoint (the last step's) for 4 more steps
    cfg, _ = load_config(None, ["task=arith", *SETTINGS, f"model.path={arith_dir}", f"train.max_steps={STEPS + 4}",
                                "checkpoint.resume=auto"])
    train(cfg, out, progress_enabled=False)
    acc2 = _reconcile(out, STEPS + 4)
    assert acc2["admitted"] >= acc["admitted"]
    print(f"soak resumed to {STEPS + 4} steps: accounting {acc2}")
