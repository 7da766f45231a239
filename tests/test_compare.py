"""Comparing groups of runs: curves by trained samples, the summary table, bad folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.errors import UserError
from asyncflow.telemetry.compare import compare, read_run


def _run(path: Path, accs: list[float], stale: float) -> Path:
    path.mkdir(parents=True)
    rows = [{"kind": "eval", "step": 0, "eval_accuracy": accs[0], "eval_reward": 0.0}]
    for step, acc in enumerate(accs[1:], 1):
        rows.append({"kind": "train", "step": step, "samples": 100 * step, "staleness_mean": stale,
                     "samples_per_s": 10.0 * step})
        rows.append({"kind": "eval", "step": step, "eval_accuracy": acc, "eval_reward": 0.0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_runs_are_read_by_samples_and_compared_against_the_first_group(tmp_path: Path) -> None:
    a = [_run(tmp_path / f"sync{i}", [0.3, 0.5, 0.6 + 0.02 * i], 0.0) for i in range(2)]
    b = [_run(tmp_path / "async0", [0.3, 0.4, 0.55], 1.5)]
    run = read_run(a[0])
    assert run.samples == [0, 100, 200] and run.accuracy == [0.3, 0.5, 0.6] and run.samples_per_s == 20.0
    png = tmp_path / "cmp.png"
    table = compare({"sync": a, "async": b}, png)
    assert png.stat().st_size > 10_000
    lines = table.splitlines()
    assert lines[2].startswith("| sync | 2 | 0.610 | 0.600, 0.620 | +0.0 | 0.00 | 20.0 |")
    assert lines[3].startswith("| async | 1 | 0.550 | 0.550 | -6.0 | 1.50 | 20.0 |")


def test_a_folder_without_metrics_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no metrics.jsonl"):
        read_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not JSON"):
        read_run(tmp_path)


def test_seeds_are_averaged_at_the_sample_counts_they_share_not_by_position(tmp_path: Path) -> None:
    """Points were matched by list position: a seed whose eval at 1,000 samples was skipped had its
    2,000-sample value averaged into the 1,000 point, and the last point was dropped."""
    from asyncflow.telemetry.compare import RunCurve, aligned

    a = RunCurve(tmp_path, samples=[0, 1000, 2000, 3000], accuracy=[0.1, 0.2, 0.4, 0.6])
    b = RunCurve(tmp_path, samples=[0, 2000, 3000], accuracy=[0.1, 0.4, 0.6])
    assert aligned([a, b]) == ([0, 2000, 3000], [[0.1, 0.1], [0.4, 0.4], [0.6, 0.6]])
    assert aligned([a, RunCurve(tmp_path, samples=[500], accuracy=[0.3])]) == ([], [])
    png = tmp_path / "apart.png"
    compare({"x": [_run(tmp_path / "r1", [0.1, 0.2], 0.0)]}, png)  # one run: its own points
    assert png.stat().st_size > 10_000
