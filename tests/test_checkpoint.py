"""Checkpoint and resume: a resumed run neither skips nor repeats prompts, counts steps right, restores
the optimizer and the store's in-flight samples, and survives a crash mid-step (marked slow; CI runs them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.config import load_config
from asyncflow.errors import UserError
from asyncflow.runner import train

pytestmark = pytest.mark.slow

SMALL = ["train.batch_size=32", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=32", "eval.every=2",
         "logging.progress=false"]


def _train(arith_dir: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    cfg, _ = load_config(None, ["task=arith", *SMALL, f"model.path={arith_dir}", *extra])
    return train(cfg, out, progress_enabled=False)


def _rows(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _trained_groups(out: Path) -> dict[int, str]:
    """group id -> prompt of every trained sample; fails if a group's samples disagree on the prompt."""
    groups: dict[int, str] = {}
    for r in _rows(out, "samples.jsonl"):
        if r["status"] == "trained":
            assert groups.setdefault(r["group_id"], r["prompt"]) == r["prompt"]
    return groups


def _check_run_logs(out: Path, steps: int, batch: int) -> None:
    """Every step logged once and in order, cumulative counts right, no sample logged twice."""
    train_rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    assert [r["samples"] for r in train_rows] == [batch * s for s in range(1, steps + 1)]
    assert [r["policy_version"] for r in train_rows] == list(range(1, steps + 1))
    samples = _rows(out, "samples.jsonl")
    uids = [r["uid"] for r in samples]
    assert len(uids) == len(set(uids)), "a sample was logged twice"
    trained = [r for r in samples if r["status"] == "trained"]
    assert len(trained) == steps * batch
    per_version: dict[int, int] = {}
    for r in trained:
        per_version[r["trained_version"]] = per_version.get(r["trained_version"], 0) + 1
    assert per_version == {v: batch for v in range(steps)}


def test_resume_continues_exactly_where_the_checkpoint_left_off(arith_dir: Path, tmp_path: Path) -> None:
    """Sync: an uninterrupted 4-step run and 2 steps + resume to 4 train the same prompts under the same
    group ids; the resumed run's logs count every step and sample once; the optimizer state carries over."""
    full, res = tmp_path / "full", tmp_path / "resumed"
    _train(arith_dir, full, ["workflow.mode=sync", "train.max_steps=4"])
    _train(arith_dir, res, ["workflow.mode=sync", "train.max_steps=2", "checkpoint.every=1"])
    first = _trained_groups(res)
    assert sorted(first) == list(range(16))
    ckpt = res / "checkpoints" / "step_2"
    for name in ("config.json", "model.safetensors", "optimizer.pt", "store.pt", "rng.pt", "state.json",
                 "tokenizer.json"):
        assert (ckpt / name).is_file(), name
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["step"], state["version"]) == (2, 2)
    # sync mode: step 3's prompts were admitted as soon as version 2 was loaded; they are in flight
    in_flight = torch.load(ckpt / "store.pt", weights_only=True)
    assert {d["group_id"] for d in in_flight["samples"]} <= set(range(16, 24))
    assert state["next_group_id"] == 1 + max([15, *(d["group_id"] for d in in_flight["samples"])])

    summary = _train(arith_dir, res, ["workflow.mode=sync", "train.max_steps=4", "checkpoint.every=1",
                                      "checkpoint.resume=auto"])
    assert summary["samples"] == 128
    _check_run_logs(res, 4, 32)
    assert _trained_groups(res) == _trained_groups(full)  # same prompts, same group ids: none skipped or repeated
    assert sorted(p.name for p in (res / "checkpoints").iterdir()) == ["step_3", "step_4"]  # checkpoint.keep=2
    # AdamW's step count continued from the checkpoint (a fresh optimizer would be at 2 here)
    opt = torch.load(res / "checkpoints" / "step_4" / "optimizer.pt", weights_only=True)
    assert {int(s["step"]) for s in opt["state"].values()} == {4}
    evals = [r["step"] for r in _rows(res, "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [0, 2, 4]  # the step-2 evaluation, cut with the first run's tail, was run again


CRASHING_REWARD = '''
import os
from pathlib import Path
from asyncflow.tasks.arith import reward_fn as arith

def reward_fn(prompts, completions, answer, **kw):
    after = os.environ.get("CRASH_AFTER")
    if after and Path(after).exists():
        os._exit(17)  # the whole process dies mid-step, as on a power loss or an OOM kill
    return arith(prompts, completions, answer, **kw)
'''


def test_a_crash_mid_run_resumes_without_losing_or_repeating_anything(arith_dir: Path, tmp_path: Path) -> None:
    """Async (max_staleness 1): the process dies at the first reward call after the checkpoint of
    step 3 is complete (groups 40-47 are admitted only once version 4 is out, so there is one), with
    samples in flight; `checkpoint.resume=auto` finishes the run: steps 1..6 logged once, 6 x 32
    samples trained, no sample logged twice, and exactly the groups (and prompts) of an uninterrupted run."""
    (tmp_path / "crash_reward.py").write_text(CRASHING_REWARD)
    (tmp_path / "c.yaml").write_text("task: arith\n")
    out, full = tmp_path / "run", tmp_path / "full"
    base = [*SMALL, f"model.path={arith_dir}", "workflow.mode=async", "workflow.max_staleness=1",
            "train.max_steps=6", "checkpoint.every=3", "reward.fn=crash_reward:reward_fn"]
    env = {**os.environ, "CRASH_AFTER": str(out / "checkpoints" / "step_3" / "state.json")}
    cmd = [sys.executable, "-m", "asyncflow", "train", str(tmp_path / "c.yaml"),
           *[a for kv in base for a in ("--set", kv)], "--out", str(out)]
    crashed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert crashed.returncode == 17, crashed.stderr[-2000:]
    steps_before = [r["step"] for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    assert steps_before[-1] >= 3 and (out / "checkpoints" / "step_3" / "state.json").is_file()
    assert not (out / "final").exists()
    in_flight = torch.load(out / "checkpoints" / "step_3" / "store.pt", weights_only=True)["samples"]
    assert in_flight, "the checkpoint should hold samples admitted ahead of the trainer"

    del env["CRASH_AFTER"]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().endswith(  # (it has a checkpoint: resuming is offered)
        "already holds a run; choose another folder or set checkpoint.resume=auto to go on from its newest checkpoint")
    resumed = subprocess.run([*cmd, "--set", "checkpoint.resume=auto"], env=env, capture_output=True, text=True,
                             timeout=600, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _check_run_logs(out, 6, 32)
    groups = _trained_groups(out)
    assert sorted(groups) == list(range(48))
    acc = json.loads((out / "summary.json").read_text())["accounting"]
    statuses: dict[str, int] = {}
    for r in _rows(out, "samples.jsonl"):
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    assert acc["lost"] == 0 and acc["trained"] == 192
    assert {k: acc[k] for k in statuses} == statuses  # the cumulative counts agree with samples.jsonl
    assert acc["admitted"] == sum(statuses.values()) + acc["in_store_at_end"]
    assert (out / "final" / "model.safetensors").is_file()
    _train(arith_dir, full, ["workflow.mode=async", "workflow.max_staleness=1", "train.max_steps=6"])
    assert groups == _trained_groups(full)


def test_resume_refuses_what_it_cannot_continue(arith_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    _train(arith_dir, out, ["train.max_steps=1"])
    with pytest.raises(UserError, match="no complete checkpoint"):
        _train(arith_dir, out, ["train.max_steps=2", "checkpoint.resume=auto"])
    # finished, and no checkpoint: raising max_steps (what the line said) cannot help
    with pytest.raises(UserError, match=r"finished at step 1 .* no checkpoint to continue from .* new --out$"):
        _train(arith_dir, out, ["train.max_steps=1", "checkpoint.resume=auto"])
    out2 = tmp_path / "run2"
    _train(arith_dir, out2, ["train.max_steps=1", "checkpoint.every=1"])
    with pytest.raises(UserError, match="nothing left to train"):
        _train(arith_dir, out2, ["train.max_steps=1", "checkpoint.resume=auto"])
    with pytest.raises(UserError, match=r"checkpoint.resume: seed is 5 but the run .* used 0"):
        _train(arith_dir, out2, ["train.max_steps=2", "checkpoint.resume=auto", "seed=5"])
    with pytest.raises(UserError, match="rollout.n is 8"):
        _train(arith_dir, out2, ["train.max_steps=2", "checkpoint.resume=auto", "rollout.n=8"])
    # nothing was changed by the refusals: the run still resumes
    assert _train(arith_dir, out2, ["train.max_steps=2", "checkpoint.resume=auto"])["samples"] == 64
    # resume=auto on a new folder just starts
    assert _train(arith_dir, tmp_path / "new", ["train.max_steps=1", "checkpoint.resume=auto"])["samples"] == 32
    # a finished run whose max_steps is not a multiple of checkpoint.every: its newest checkpoint (step 2)
    # is older than its end (step 3); re-running the command redid step 3 and replaced final/
    out3 = tmp_path / "run3"
    _train(arith_dir, out3, ["train.max_steps=3", "checkpoint.every=2"])
    final = (out3 / "final" / "model.safetensors").read_bytes()
    with pytest.raises(UserError, match=r"the run in .* finished at step 3 \(its summary.json\).*nothing left"):
        _train(arith_dir, out3, ["train.max_steps=3", "checkpoint.every=2", "checkpoint.resume=auto"])
    assert (out3 / "final" / "model.safetensors").read_bytes() == final
    # a checkpoint write cut short leaves a partial folder; the next checkpoint written removes every one
    partial = out3 / "checkpoints" / ".step_9.partial"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"x" * 100)
    summary = _train(arith_dir, out3, ["train.max_steps=4", "checkpoint.every=2", "checkpoint.resume=auto"])
    assert summary["steps"] == 4 and json.loads((out3 / "summary.json").read_text())["steps"] == 4
    assert not partial.exists() and sorted(p.name for p in (out3 / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_a_run_that_died_after_its_last_checkpoint_is_finished_by_a_resume(arith_dir: Path, tmp_path: Path) -> None:
    """The newest checkpoint is at train.max_steps but the run died before final/ and summary.json
    (say, in its final evaluation): a resume with the same max_steps finishes it (final evaluation,
    final/, summary.json) without training a step; it used to say "nothing left to train"."""
    out = tmp_path / "run"
    done = _train(arith_dir, out, ["train.max_steps=2", "checkpoint.every=2"])
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()  # what a death after the step-2 checkpoint leaves
    summary = _train(arith_dir, out, ["train.max_steps=2", "checkpoint.every=2", "checkpoint.resume=auto"])
    assert summary["steps"] == 2 and summary["samples"] == done["samples"] == 64
    assert (out / "final" / "model.safetensors").is_file() and json.loads((out / "summary.json").read_text())["steps"] == 2
    _check_run_logs(out, 2, 32)
    evals = [r["step"] for r in _rows(out, "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [0, 2]  # the final evaluation once (the step-2 one is the final one, as in a run that did not die)
    assert summary["accounting"]["lost"] == 0
    with pytest.raises(UserError, match=r"finished at step 2 \(its summary.json\)"):  # and now it is finished
        _train(arith_dir, out, ["train.max_steps=2", "checkpoint.every=2", "checkpoint.resume=auto"])


def test_a_resume_that_fails_to_build_changes_nothing_in_the_run(arith_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad input found while a resumed run is being built (here: its rollout engine cannot be made)
    leaves the folder as it was: the logs are cut back to the checkpoint and config.yaml rewritten
    only once the run is built (they used to be changed first, losing the logged steps after it)."""
    out = tmp_path / "run"
    _train(arith_dir, out, ["train.max_steps=3", "checkpoint.every=2"])
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "samples.jsonl", "config.yaml")}
    assert b'"step": 3' in before["metrics.jsonl"]  # a step after the checkpoint, which a resume cuts

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise UserError("rollout.engine: cannot be made here")

    monkeypatch.setattr("asyncflow.runtime.local.make_inference_engine", no_engine)
    with pytest.raises(UserError, match="cannot be made here"):
        _train(arith_dir, out, ["train.max_steps=4", "checkpoint.resume=auto"])
    assert {name: (out / name).read_bytes() for name in before} == before

    # the Ray runtime likewise: its actors are given the folder, but a resume cuts the logs only once
    # they have started (here they cannot: no cluster is needed to see the folder left alone)
    def no_actors(*args: Any, **kwargs: Any) -> Any:
        raise UserError("runtime.kind: the actors cannot start here")

    monkeypatch.setattr("asyncflow.runtime.ray_runtime.RayWorkers.start", no_actors)
    with pytest.raises(UserError, match="the actors cannot start here"):
        _train(arith_dir, out, ["train.max_steps=4", "checkpoint.resume=auto", "runtime.kind=ray"])
    assert {name: (out / name).read_bytes() for name in before} == before


ALWAYS_FAILS = '''
def reward_fn(prompts, completions, **kw):
    raise ValueError("judge down")
'''


class _Payload:
    """A pickle whose loading would run code (it creates `marker`)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_damaged_or_changed_resume_is_refused_before_anything_is_written(
        arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a review found a resume would do wrong (each refused with one line, the run left as it was,
    or now done right):
    - a damaged checkpoint file ended in a traceback (store.pt: after the logs were cut);
    - a changed eval.size re-carved the held-out rows, so saved samples were scored against other
      prompts; train.engine or rollout.affinity changes could not work;
    - a second process could resume a run that was still going (logs duplicated);
    - the fail-fast rule was off after a resume (restored counts), so an always-failing reward ran on;
    - train.lr given at resume was replaced by the saved optimizer's;
    - an evaluation still running at a checkpoint was lost to the resume."""
    import asyncio
    import fcntl
    import shutil

    from asyncflow.evaluation import Evaluator

    slow_eval = Evaluator.run

    async def eval_slowly_at_step_1(self: Any, step: int) -> Any:
        if step == 1:
            await asyncio.sleep(3.0)
        return await slow_eval(self, step)

    monkeypatch.setattr(Evaluator, "run", eval_slowly_at_step_1)
    data = [f"dataset.path={arith_dir / 'train.jsonl'}"]
    out = tmp_path / "run"
    _train(arith_dir, out, [*data, "train.max_steps=3", "checkpoint.every=2", "eval.every=1"])
    monkeypatch.setattr(Evaluator, "run", slow_eval)
    state = json.loads((out / "checkpoints" / "step_2" / "state.json").read_text())
    assert [r["step"] for r in state["eval_history"]][:2] == [0, 1]  # the slow step-1 evaluation waited for
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "samples.jsonl", "config.yaml")}
    resume = [*data, "train.max_steps=4", "checkpoint.every=2", "eval.every=1", "checkpoint.resume=auto"]

    for damage, needle in [
        (lambda c: (c / "store.pt").write_text("garbage"), r"store.pt cannot be read"),
        # loads, but is not the store's state (it failed the resume with a traceback, logs already cut)
        (lambda c: torch.save([1, 2], c / "store.pt"), r"store.pt cannot be loaded .*got list"),
        (lambda c: torch.save({**torch.load(c / "store.pt", weights_only=True), "samples": None}, c / "store.pt"),
         r"store.pt cannot be loaded .*groups and samples must be lists"),
        (lambda c: torch.save({**(st := torch.load(c / "store.pt", weights_only=True)),
                               "samples": [{**d, "group_id": -5} for d in st["samples"]]}, c / "store.pt"),
         r"store.pt cannot be loaded .*a sample entry is not"),
        (lambda c: (c / "rng.pt").write_text("garbage"), r"rng.pt cannot be read"),
        # someone else's run folder: a pickle that would run code on loading is refused, unexecuted
        (lambda c: torch.save({**torch.load(c / "store.pt", weights_only=True), "x": _Payload(tmp_path / "ran")},
                              c / "store.pt"), r"store.pt cannot be loaded .*posix.system.*refused, not loaded"),
        (lambda c: torch.save({"torch": torch.get_rng_state(), "python": _Payload(tmp_path / "ran")}, c / "rng.pt"),
         r"rng.pt holds objects a checkpoint never contains .*refused, not loaded"),
        (lambda c: (c / "optimizer.pt").unlink(), r"has no optimizer.pt"),
        (lambda c: (c / "model.safetensors").write_text("garbage"), r"model.safetensors is corrupt"),
        (lambda c: (c / "state.json").write_text(json.dumps({**state, "logs": None})), r"'logs' is None"),
    ]:
        copy = tmp_path / "copy"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(out, copy)
        damage(copy / "checkpoints" / "step_2")
        with pytest.raises(UserError, match=r"^checkpoint.resume: .*" + needle + r".*remove .*step_2 to resume from "
                                            "the one before"):
            _train(arith_dir, copy, resume)
        assert (copy / "metrics.jsonl").read_bytes() == before["metrics.jsonl"]
    assert not (tmp_path / "ran").exists()
    for change, needle in [("eval.size=64", "the training rows differ from the run's"),
                           ("train.engine=fsdp", "train.engine is 'fsdp'"),
                           ("rollout.affinity=true", "rollout.affinity is True")]:
        with pytest.raises(UserError, match=needle):
            _train(arith_dir, out, [*resume, change])
    fd = os.open(out / ".lock", os.O_RDWR)  # as a run still going holds it
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UserError, match=r"^--out: another asyncflow process is running in"):
            _train(arith_dir, out, resume)
    finally:
        os.close(fd)
    assert {name: (out / name).read_bytes() for name in before} == before

    (tmp_path / "failing_reward.py").write_text(ALWAYS_FAILS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"^reward.fn: the first 4 reward calls all failed.*the run folder .* is kept"):
        _train(arith_dir, out, [*resume, "reward.fn=failing_reward:reward_fn", "reward.fail_fast_calls=4"])
    assert json.loads((out / "failed.json").read_text())["status"] == "failed"

    _train(arith_dir, out, [*resume, "train.lr=0.5"])
    assert not (out / "failed.json").exists()  # (the resume that finished it is not marked failed)
    opt = torch.load(out / "checkpoints" / "step_4" / "optimizer.pt", weights_only=True)
    assert {g["lr"] for g in opt["param_groups"]} == {0.5}


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_sigterm_ends_a_run_as_ctrl_c_does(arith_dir: Path, tmp_path: Path, sigint_ignored: bool) -> None:
    """SIGTERM (kill, a scheduler's preemption, docker stop) killed the process at once: no
    trace.json, no line saying where the run can go on from, sinks never closed. `sigint_ignored`:
    started as a script's `cmd &` is (SIGINT ignored), where SIGTERM, once sent on as a SIGINT, did nothing."""
    import signal
    import time

    out = tmp_path / "run"
    config = Path(__file__).resolve().parent.parent / "examples" / "arith_async.yaml"
    argv = [sys.executable, "-m", "asyncflow", "train", str(config), "--out", str(out), "--set", f"model.path={arith_dir}",
            "--set", "train.max_steps=500", "--set", "checkpoint.every=1", "--set", "eval.every=0",
            *[x for s in SMALL for x in ("--set", s)]]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and '"kind": "train"' in metrics.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "checkpoint.resume=auto" in err and "Traceback" not in err
    trace = json.loads((out / "trace.json").read_text())  # (complete: ended with its `]`)
    assert any(e.get("ph") == "X" for e in trace)


def test_a_run_killed_mid_way_keeps_its_trace(arith_dir: Path, tmp_path: Path) -> None:
    """trace.json was held in memory and written at the end (a killed run had none, a long one capped
    its spans): it is streamed as a Chrome JSON array, so a SIGKILL leaves the spans up to the last
    flush, which Perfetto (a missing `]` is allowed) and `asyncflow report` read."""
    import signal
    import time

    from asyncflow.cli import main

    out = tmp_path / "run"
    config = Path(__file__).resolve().parent.parent / "examples" / "arith_async.yaml"
    argv = [sys.executable, "-m", "asyncflow", "train", str(config), "--out", str(out), "--set", f"model.path={arith_dir}",
            "--set", "train.max_steps=500", "--set", "eval.every=0", *[x for s in SMALL for x in ("--set", s)]]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:  # until two steps' spans are on disk
            trace = out / "trace.json"
            if trace.is_file() and trace.read_text().count('"train step') >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (out / "trace.json").read_text()
    assert not text.rstrip().endswith("]")  # (killed: never ended)
    events = json.loads(text.rstrip().rstrip(",") + "]")  # as Perfetto reads it
    assert {e["args"]["name"] for e in events if e.get("name") == "thread_name"} >= {"trainer"}
    assert sum(1 for e in events if e.get("ph") == "X" and e["name"].startswith("train step")) >= 2
    assert main(["report", str(out)]) == 0
    assert (out / "report.png").is_file()
