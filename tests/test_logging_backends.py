"""TensorBoard and W&B sinks: every metric row's numbers arrive, indexed by step; missing packages refused."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.errors import UserError
from asyncflow.telemetry.runlog import RunLog, make_sinks, scalars


def test_scalars_keep_numbers_only() -> None:
    row = {"kind": "train", "step": 3, "loss": 0.5, "samples": 12, "mismatch_kl": None, "ok": True, "bad": float("nan")}
    assert scalars(row) == {"train/loss": 0.5, "train/samples": 12.0}


def test_tensorboard_sink_writes_every_train_and_eval_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=True, wandb_project=None, config={}))
    for step in (1, 2):
        log.metric({"kind": "train", "step": step, "reward_mean": 0.25 * step})
    log.metric({"kind": "eval", "step": 2, "eval_accuracy": 0.75})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/reward_mean")] == [(1, 0.25), (2, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(2, 0.75)]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # the jsonl is unchanged


def test_a_resumed_runs_tensorboard_drops_the_redone_steps(tmp_path: Path) -> None:
    """A resume from the step-2 checkpoint redoes step 3: its first points (and anything later) are
    purged from the event files, as metrics.jsonl is cut; they were drawn twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=True, wandb_project=None, config={}))
    for step in (1, 2, 3, 4):
        log.metric({"kind": "train", "step": step, "reward_mean": 0.1 * step})
    log.close()
    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=True, wandb_project=None, config={}, resume_step=2))
    for step in (3, 4):
        log.metric({"kind": "train", "step": step, "reward_mean": 0.5 * step})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("train/reward_mean")] == \
        [(1, 0.1), (2, 0.2), (3, 1.5), (4, 2.0)]


def test_a_resume_that_evaluates_its_checkpoint_step_again_draws_that_evaluation_once(tmp_path: Path) -> None:
    """An evaluation begins after its step's checkpoint, so a resume from there runs it again: its
    first point survived the purge (from the next step on) and it was drawn twice at that step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=True, wandb_project=None, config={}))
    rows = [{"kind": "train", "step": 1, "reward_mean": 0.1}, {"kind": "train", "step": 2, "reward_mean": 0.2},
            {"kind": "eval", "step": 2, "eval_accuracy": 0.5}, {"kind": "train", "step": 3, "reward_mean": 0.3}]
    for row in rows:
        log.metric(row)
    log.close()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))  # (cut to the checkpoint)
    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=True, wandb_project=None, config={}, resume_step=2,
                                            redo_eval=True))
    log.metric({"kind": "eval", "step": 2, "eval_accuracy": 0.6})
    log.metric({"kind": "train", "step": 3, "reward_mean": 0.7})
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("eval/accuracy")] == [(2, 0.6)]
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("train/reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.7)]


def test_wandb_sink_logs_through_the_wandb_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, Any]] = []

    class FakeRun:  # a test double of wandb's Run (wandb is not installed here)
        def define_metric(self, name: str, step_metric: str | None = None) -> None:
            calls.append(("define_metric", (name, step_metric)))

        def log(self, data: dict[str, float], step: int | None = None) -> None:
            calls.append(("log", (data, step)))

        def finish(self) -> None:
            calls.append(("finish", None))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = RunLog(tmp_path, sinks=make_sinks(tmp_path, tensorboard=False, wandb_project="proj", config={"seed": 1}))
    log.metric({"kind": "train", "step": 4, "loss": 1.5})
    log.metric({"kind": "eval", "step": 2, "eval_accuracy": 0.5})  # an eval that ended after step 4
    log.close()
    init = calls[0][1]
    assert calls[0][0] == "init" and init["project"] == "proj" and init["config"] == {"seed": 1}
    assert ("define_metric", ("*", "step")) in calls
    logs = [c[1] for c in calls if c[0] == "log"]  # placed by their own step (the eval landed at W&B's step 4)
    assert logs == [({"step": 4, "train/loss": 1.5}, None), ({"step": 2, "eval/accuracy": 0.5}, None)]
    assert calls[-1] == ("finish", None)
    # a resumed run goes on in the same W&B run (each resume opened a second one of the same name)
    calls.clear()
    make_sinks(tmp_path, tensorboard=False, wandb_project="proj", config={}, resume_step=4)[0].close()
    assert calls[0][1]["id"] == init["id"] and init["resume"] == calls[0][1]["resume"] == "allow"
    assert (tmp_path / "wandb_id").read_text().strip() == init["id"]


def test_backends_whose_package_is_missing_are_refused_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    with pytest.raises(UserError, match="logging.wandb: the wandb package is not installed"):
        load_config(None, ["task=arith", "logging.wandb=true"])
    with pytest.raises(UserError, match="logging.tensorboard: the tensorboard package is not installed"):
        load_config(None, ["task=arith", "logging.tensorboard=true"])


def test_metric_rows_are_strict_json_with_non_finite_numbers_as_null(tmp_path: Path) -> None:
    """A skipped non-finite step logs a NaN or inf grad_norm: written bare, the file was not JSON
    (JavaScript's JSON.parse, Go and serde refused it)."""
    log = RunLog(tmp_path)
    log.metric({"kind": "train", "step": 3, "grad_norm": float("nan"), "loss": float("-inf"), "lr": 1e-5,
                "nested": {"x": [float("inf"), 1.5]}})
    log.close()
    text = (tmp_path / "metrics.jsonl").read_text()

    def refuse(name: str) -> None:
        raise ValueError(name)

    row = json.loads(text, parse_constant=refuse)  # (what a strict reader does with NaN / Infinity)
    assert row == {"kind": "train", "step": 3, "grad_norm": None, "loss": None, "lr": 1e-5, "nested": {"x": [None, 1.5]}}


def test_samples_lines_are_exactly_json_dumps_of_each_row() -> None:
    from asyncflow.telemetry.jsonl import json_line as _json_line

    rows = [
        {"uid": 1, "prompt": "Ünïcode \u2603 \"quoted\" \\ back", "reward": 0.1 + 0.2, "error": None},
        {"prompt": [{"role": "user", "content": "hi"}], "reward": float("nan"), "ok": True, "big": 10**30},
        {"nested": {"a": [1, 2.5, None, "x"]}, "neg": -0.0, "inf": float("inf")},
    ]
    for row in rows:
        assert _json_line(row) == json.dumps(row) + "\n"
    with pytest.raises(TypeError):
        _json_line({"bad": object()})


def test_a_sample_line_is_exactly_json_dumps_of_its_row() -> None:
    import numpy as np

    from asyncflow.telemetry.jsonl import json_value, sample_line

    keys = ("uid", "group_id", "prompt", "response", "reward", "behavior_version", "trained_version", "status",
            "error")
    cases = [
        ((1, 0, "Ünïcode \u2603 \"quoted\" \\ back", "ok\n", 0.1 + 0.2, 3, 4, "trained", None), None),
        ((10**30, -2, [{"role": "user", "content": "hi"}], None, None, None, None, "reward_error", "boom \u00e9"), None),
        ((5, 6, {"nested": [1, 2.5, None]}, "", True, 0, None, "filtered", None), {"turns": 3, "generated_tokens": 17}),
        ((7, 8, 12, "", np.float64(0.5), 1, 2, "trained", None), {"agent_calls": [{"a": 1}], "agent_calls_dropped": 0}),
        ((9, 9, -0.0, "", 1e300, 2, 2, "cancelled", "x"), {"turns": None}),
    ]
    for values, extra in cases:
        row = {**dict(zip(keys, values, strict=True)), **(extra or {})}
        assert sample_line(*values, extra) == json.dumps(row) + "\n", row
    for v in (float("nan"), float("inf"), -float("inf"), False, 2**70, "\x00", [1, "a"], np.float64(0.25)):
        assert json_value(v) == json.dumps(v)


def test_a_run_cut_in_its_first_evaluation_closes_its_sinks_and_engines(
        arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or an engine failing) in the step-0 evaluation left the metric sinks open (a W&B run
    shown "running" for good, TensorBoard's last events unflushed) and the engines unclosed: only the
    training part of the run closed them."""
    from asyncflow.engines.hf import HFEngine
    from asyncflow.evaluation import Evaluator
    from asyncflow.runner import train
    from asyncflow.telemetry import runlog

    closed: list[str] = []

    class Sink(runlog.MetricSink):
        def write(self, row: dict[str, Any]) -> None:
            pass

        def close(self) -> None:
            closed.append("sink")

    async def interrupted(self: Any, step: int) -> dict[str, Any]:
        raise KeyboardInterrupt

    real_close = HFEngine.close

    async def engine_close(self: Any) -> None:
        closed.append("engine")
        await real_close(self)

    monkeypatch.setattr(runlog, "make_sinks", lambda *a, **kw: [Sink()])
    monkeypatch.setattr(Evaluator, "run", interrupted)
    monkeypatch.setattr(HFEngine, "close", engine_close)
    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "train.batch_size=8", "rollout.n=4", "eval.size=8",
                                "logging.progress=false"])
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path / "run", progress_enabled=False)
    assert closed == ["engine", "sink"]
    assert not (tmp_path / "run" / "config.yaml").exists()  # (a fresh run cut before its first step leaves no run)
