"""`bench store --set` and `bench pipeline --set` values: a bad one ends with exit code 2 and one line
naming the key, before any measurement or simulation runs (no traceback, no hang, no wrong numbers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncflow.bench.pipeline import parse_spec
from asyncflow.cli import main
from asyncflow.errors import UserError


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("samples=abc", "--set samples: expected an integer, got 'abc'"),
        ("repeats=x", "--set repeats: expected an integer, got 'x'"),
        ("repeats=0", "--set repeats: must be >= 1, got 0"),
        ("samples=0", "--set samples: must be >= 1, got 0"),
        ("samples=-5", "--set samples: must be >= 1, got -5"),
        ("transferqueue=yes", "--set transferqueue: expected true or false, got 'yes'"),
        ("readahead=-1", "--set readahead: must be >= 0, got -1"),
    ],
)
def test_bad_bench_store_values_are_one_line_naming_the_key(setting: str, needle: str,
                                                           one_line_error: Any) -> None:
    err = one_line_error(["bench", "store", "--set", "placements=local", "--set", setting])
    assert f"bench store {needle}" in err


def test_bench_store_takes_good_values_and_false_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "store", "--set", "placements=local", "--set", "samples=16", "--set", "repeats=1",
            "--set", "transferqueue=FALSE"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["placement=local", "mode=sequential"],
                                                   ["placement=local", "mode=streaming"]]


S = ["--set", "profiles=rlvr", "--set", "devices=2", "--set", "steps=3", "--set", "prompts_per_device=1",
     "--set", "n=2"]


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("step_s=0", "--set step_s: must be > 0, got 0.0"),
        ("step_s=-0.03", "--set step_s: must be > 0, got -0.03"),
        ("step_s=nan", "--set step_s: expected a finite number, got 'nan'"),
        ("train_token_s=0", "--set train_token_s: must be > 0"),
        ("train_token_s=inf", "--set train_token_s: expected a finite number"),
        ("switch_s=-1", "--set switch_s: must be >= 0, got -1.0"),
        ("weight_sync_s=-0.5", "--set weight_sync_s: must be >= 0"),
        ("warmup_steps=-1", "--set warmup_steps: must be >= 0, got -1"),
        ("max_staleness=-1", "--set max_staleness: must be >= 0, got -1"),
        ("seed=-1", "--set seed: must be >= 0, got -1"),
    ],
)
def test_bad_bench_pipeline_numbers_are_one_line_naming_the_key(setting: str, needle: str,
                                                               one_line_error: Any) -> None:
    with pytest.raises(UserError, match=needle.split(": ", 1)[1]):  # refused up front (unchecked, nan would hang)
        parse_spec(S[1::2] + [setting])
    err = one_line_error(["bench", "pipeline", *S, "--set", "modes=sync,async", "--set", setting])
    assert f"bench pipeline {needle}" in err
    assert "workflow." not in err  # the key the user typed, not the config key it becomes


def test_bench_pipeline_trace_must_be_a_folder_it_can_make(tmp_path: Path, one_line_error: Any) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    err = one_line_error(["bench", "pipeline", *S, "--set", f"trace={afile}"])
    assert f"bench pipeline --set trace: {afile} is a file, not a folder" in err
    err = one_line_error(["bench", "pipeline", *S, "--set", f"trace={afile}/sub"])
    assert f"bench pipeline --set trace: {afile}/sub lies under {afile}, which is a file" in err
    # a folder it may not make or write: refused before the rows (a traceback after the first one)
    err = one_line_error(["bench", "pipeline", *S, "--set", "trace=/proc/asyncflow-trace"])
    assert "bench pipeline --set trace: cannot create /proc/asyncflow-trace" in err


def test_a_pipeline_row_too_large_for_the_trainer_is_refused_before_any_row(one_line_error: Any) -> None:
    """It was found at its own row, under a key the user never set (train.batch_size), and the rows
    before it were lost."""
    from asyncflow.bench.pipeline import run_pipeline

    argv = ["--set", "profiles=rlvr", "--set", "devices=2,8192", "--set", "modes=async", "--set", "steps=3"]
    err = one_line_error(["bench", "pipeline", "--json", *argv])
    assert "bench pipeline --set devices: 8192 x prompts_per_device 32 x n 8 = 2097152 samples a step" in err
    rows: list[Any] = []
    with pytest.raises(UserError, match="above the 1048576 train.batch_size allows"):
        run_pipeline(argv[1::2], report=rows.append)
    assert rows == []  # refused before the first row ran


def test_e2e_steady_rate_is_null_with_too_few_steps_and_store_warm_up_covers_its_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`steady_samples_per_s` was NaN under 4 steps (the last line was then not JSON). The Ray warm-up
    put whole batches rounded down (64 of samples=100) while its consumer waited for 100: 120 s, then
    a crash."""
    import asyncflow.bench.store as store_mod
    from asyncflow.bench.e2e import _steady
    from asyncflow.bench.store1 import Store1Spec

    assert _steady([{"kind": "train", "samples": 8, "time_s": 1.0}] * 3) is None
    assert _steady([{"kind": "train", "samples": 8 * i, "time_s": float(i)} for i in range(1, 9)]) == 8.0
    # a run's busy fraction weights each step's by the time it covers (a short step counted as a long one)
    from asyncflow.bench.e2e import _mean

    rows = [{"kind": "eval"}, {"kind": "train", "time_s": 1.0, "rollout_busy_frac": 0.0},
            {"kind": "train", "time_s": 4.0, "rollout_busy_frac": 1.0}]
    assert _mean(rows, "rollout_busy_frac") == 0.75 and _mean([], "rollout_busy_frac") == 0.0
    put: list[int] = []
    monkeypatch.setattr(store_mod, "produce", lambda store, batches: put.append(sum(len(b["idx"]) for b in batches)))
    for samples, limit in ((100, 100), (4096, 256), (300, 256), (40, 40)):
        store_mod._Producer(Store1Spec(samples=samples)).run(None, limit)
        assert put[-1] == limit, (samples, put[-1])  # every sample its consumer then waits for
    store_mod._Producer(Store1Spec(samples=100)).run(None)
    assert put[-1] == 100
