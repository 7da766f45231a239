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


def test_bench_pipeline_accepts_the_edge_values(tmp_path: Path) -> None:
    spec = parse_spec(["step_s=1e-3", "train_token_s=2e-4", "switch_s=0", "weight_sync_s=0", "warmup_steps=0",
                       "max_staleness=0", "seed=0", f"trace={tmp_path}", "devices=2,8", "modes=async",
                       "profiles=agentic"])
    assert (spec.step_s, spec.switch_s, spec.warmup_steps, spec.max_staleness) == (1e-3, 0.0, 0, 0)
    assert (spec.devices, spec.modes, spec.profiles, spec.trace) == ("2,8", "async", "agentic", str(tmp_path))
    assert parse_spec([f"trace={tmp_path / 'new' / 'folder'}"]).trace  # made after the run


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        # e2e runs both modes itself: a workflow.mode of the user's was silently replaced
        ("workflow.mode=sync", "bench e2e --set workflow.mode=sync: e2e runs both modes"),
        # a setting the sync run cannot take: refused before either run starts, naming the key
        ("workflow.max_staleness=2", "workflow.max_staleness: 2 contradicts workflow.mode=sync"),
    ],
)
def test_bad_bench_e2e_settings_fail_before_either_run(setting: str, needle: str,
                                                       one_line_error: Any) -> None:
    err = one_line_error(["bench", "e2e", "--set", setting])
    assert needle in err
