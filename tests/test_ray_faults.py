"""Faults on the Ray runtime: a rollout or reward actor killed mid-run is restarted and the run
completes with every sample accounted for once; a dead trainer, or an actor death with no restart
left, ends the run with one clear line. Each is one short arith run on the session's Ray (the last
test, of the CLI's exit code, needs none)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from asyncflow.errors import RunFailed, TrainerDied

pytestmark = pytest.mark.ray

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arith_ray.yaml"
STEPS = 6
BATCH = 16
N = 4


def _settings(arith_dir: Path, *extra: str) -> list[str]:
    """A tiny async run (staleness 1) on one rollout and one reward actor, each its own restartable
    actor (not colocated); a broken recovery shows up as a step timeout after 2 minutes, not 30."""
    return [
        f"model.path={arith_dir}", f"train.max_steps={STEPS}", f"train.batch_size={BATCH}", f"rollout.n={N}",
        "eval.every=0", "eval.size=8", "logging.progress=false", "workflow.weight_update=abort",
        "workflow.step_timeout_s=120", "runtime.rollout_cpus=0.5", "runtime.train_cpus=0.5",
        "runtime.colocate=false", *extra,
    ]


def _config(arith_dir: Path, *extra: str) -> Any:
    from asyncflow.config import load_config

    cfg, _ = load_config(EXAMPLE, _settings(arith_dir, *extra))
    return cfg


def _trained_steps(out: Path) -> int:
    """The last train step in metrics.jsonl (read while the run writes it: whole lines only)."""
    try:
        lines = (out / "metrics.jsonl").read_text().split("\n")[:-1]
    except FileNotFoundError:
        return 0
    rows = [json.loads(line) for line in lines if line.strip()]
    return max((r["step"] for r in rows if r.get("kind") == "train"), default=0)


class _Watch:
    """Keeps the run's `RayWorkers` (through `RayWorkers.start`) and, at shutdown, what the test
    checks in the actors before they are killed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, ray: Any) -> None:
        from asyncflow.runtime.ray_runtime import RayWorkers

        self.workers: Any = None
        self.at_end: dict[str, Any] = {}
        start, shutdown = RayWorkers.start.__func__, RayWorkers.shutdown  # type: ignore[attr-defined]

        def start_and_keep(cls: Any, *args: Any, **kwargs: Any) -> Any:
            self.workers = start(cls, *args, **kwargs)
            return self.workers

        def look_then_shutdown(workers: Any) -> None:
            try:
                actor = workers.rollout_actors[0]
                self.at_end["run_versions"], self.at_end["engine_version"] = ray.get(
                    actor.__ray_call__.remote(lambda w: (list(w.run_versions), w.engine.version)), timeout=30)
                self.at_end["owners"] = ray.get(workers.store.handle.__ray_call__.remote(lambda c: list(c.owners)),
                                                timeout=30)
            except Exception as exc:  # recorded: the test's asserts say what was missing
                self.at_end["error"] = repr(exc)
            shutdown(workers)

        monkeypatch.setattr(RayWorkers, "start", classmethod(start_and_keep))
        monkeypatch.setattr(RayWorkers, "shutdown", look_then_shutdown)


def _killer(ray: Any, watch: _Watch, out: Path, role: str, *, after_step: int, restart: bool,
            while_leased: str | None = None) -> tuple[threading.Thread, dict[str, Any]]:
    """A thread that kills the run's actor `role` (by its Ray name) once `after_step` steps are
    trained and, if `while_leased` names a store stage, while that stage has samples out on lease."""
    info: dict[str, Any] = {}

    def run() -> None:
        deadline = time.monotonic() + 240
        while (watch.workers is None or _trained_steps(out) < after_step) and time.monotonic() < deadline:
            time.sleep(0.1)
        if time.monotonic() >= deadline:
            info["error"] = f"step {after_step} was not reached"
            return
        prefix = watch.workers.prefix
        info["named"] = sorted(n for n in ray.util.list_named_actors() if n.startswith(prefix))
        handle = ray.get_actor(f"{prefix}-{role}")
        if hasattr(handle, "pid"):
            info["pid"] = ray.get(handle.pid.remote(), timeout=30)
        if while_leased is not None:
            if not _kill_while_leased(ray, ray.get_actor(f"{prefix}-store"), while_leased, info["pid"], deadline):
                info["error"] = f"{role} never held a lease of {while_leased!r} before the deadline"
                return
        else:
            ray.kill(handle, no_restart=not restart)
        info["killed_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, info


def _kill_while_leased(ray: Any, store: Any, stage: str, pid: int, deadline: float) -> bool:
    """SIGKILL the actor process `pid` while it holds leases of `stage`: stopped (SIGSTOP) first, so
    the leases the store counts cannot be finished and given back between the count and the kill;
    let go again (SIGCONT) when it held none. Ray restarts the process as after any crash."""
    while time.monotonic() < deadline:
        if ray.get(store.in_flight.remote(stage), timeout=30) > 0:
            os.kill(pid, signal.SIGSTOP)
            if ray.get(store.in_flight.remote(stage), timeout=30) > 0:
                os.kill(pid, signal.SIGKILL)
                return True
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)
    return False


def _check_samples(out: Path) -> list[dict[str, Any]]:
    """No sample logged twice; the trained ones are whole groups, `BATCH` per step."""
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    uids = Counter(s["uid"] for s in samples)
    assert not [u for u, k in uids.items() if k > 1], "a sample was logged twice"
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == STEPS * BATCH
    sizes = Counter(s["group_id"] for s in trained)
    assert set(sizes.values()) == {N}, f"incomplete trained groups: {sizes}"
    return trained


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["object_store", "collective"])
def test_a_killed_rollout_actor_is_restarted_and_the_run_completes(ray_session, arith_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch, capsys,
                                                                    weight_sync: str) -> None:
    """With `collective` weight sync, the restarted actor takes its first version from the object
    store and the broadcast group is built again with it for the later ones."""
    from asyncflow.runner import train
    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    ray = ray_session
    watch = _Watch(monkeypatch, ray)
    # the store's own check for dead lease owners (every 2 s) is slowed to once an hour: only the
    # driver's release after the restart can give the dead process's leases back before their deadline
    create = RayTransferQueue.create.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(RayTransferQueue, "create",
                        classmethod(lambda cls, *a, **k: create(cls, *a, **{**k, "owner_check_s": 3600.0})))
    out = tmp_path / "run"
    thread, info = _killer(ray, watch, out, "rollout-0", after_step=2, restart=True, while_leased="rollout")
    summary = train(_config(arith_dir, f"runtime.weight_sync={weight_sync}"), out, progress_enabled=True)
    thread.join(timeout=30)
    assert "killed_at" in info, info
    if weight_sync == "collective":  # a group before the death and one built again with the restarted actor
        sync = summary["weight_sync"]  # (versions published while it was down reach it as the latest, below)
        assert sync["path"] == "collective" and sync["groups_built"] >= 2 and sync["broadcast"] >= 2, sync
    else:
        assert summary["weight_sync"] == {"path": "object_store"}
    prefix = watch.workers.prefix
    assert re.fullmatch(r"asyncflow-[0-9a-f]{8}", prefix)
    assert info["named"] == sorted(f"{prefix}-{r}" for r in ("rollout-0", "reward-0", "trainer", "feeder", "store"))

    assert summary["samples"] == STEPS * BATCH
    assert watch.workers.restarts == {"rollout/0": 1, "reward/0": 0}
    assert watch.workers.pids["rollout/0"] != info["pid"]  # a new process
    _check_samples(out)

    err = capsys.readouterr().err
    lines = re.findall(r"\[asyncflow\] ray: rollout/0 died \((.+?)\); restarted \(1 of 3\) in [\d.]+ s; (\d+) lease\(s\) "
                       r"returned to the queue; loaded policy version (\d+) before any request", err)
    assert len(lines) == 1, err
    _, returned, loaded = lines[0]
    assert int(returned) >= 1  # it was killed while it held leases: they went back at once
    assert int(loaded) >= 2  # killed after step 2: version 2 or later was published
    # the restarted process got those weights before its loop started, and the later ones after
    assert "error" not in watch.at_end, watch.at_end
    assert watch.at_end["run_versions"] == [int(loaded)]
    assert watch.at_end["engine_version"] == STEPS == watch.workers.engines[0].version
    # it registered again as the owner of its leases (the restart released the dead process's)
    assert watch.workers.rollout_actors[0]._actor_id.hex() in watch.at_end["owners"]


@pytest.mark.slow
def test_a_killed_reward_actor_is_restarted_and_the_run_completes(ray_session, arith_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from asyncflow.runner import train

    ray = ray_session
    watch = _Watch(monkeypatch, ray)
    out = tmp_path / "run"
    thread, info = _killer(ray, watch, out, "reward-0", after_step=2, restart=True)
    summary = train(_config(arith_dir), out, progress_enabled=True)
    thread.join(timeout=30)
    assert "killed_at" in info, info
    assert summary["samples"] == STEPS * BATCH
    assert watch.workers.restarts == {"rollout/0": 0, "reward/0": 1}
    assert watch.workers.pids["reward/0"] != info["pid"]
    trained = _check_samples(out)
    assert all(s["reward"] is not None for s in trained)
    err = capsys.readouterr().err
    assert len(re.findall(r"\[asyncflow\] ray: reward/0 died \(.+?\); restarted \(1 of 3\) in [\d.]+ s; \d+ "
                          r"lease\(s\) returned to the queue\n", err)) == 1, err


@pytest.mark.slow
def test_a_rollout_actor_killed_in_an_evaluation_outside_the_stages_is_restarted(
        ray_session, arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The step-0 evaluation runs before the stages (and their supervisors) start, the final one after
    they end: a rollout actor that died there ended the run, with restarts left (in the final one, a
    fully trained run without final/). The evaluation's requests now bring it back themselves."""
    from asyncflow.evaluation import Evaluator
    from asyncflow.runner import train

    ray = ray_session
    watch = _Watch(monkeypatch, ray)
    run = Evaluator.run
    killed: list[int] = []

    async def kill_first(self: Any, step: int) -> Any:
        if step in (0, STEPS):  # before the stages and after them
            actor = watch.workers.rollout_actors[0]
            killed.append(ray.get(actor.pid.remote(), timeout=30))
            ray.kill(actor, no_restart=False)
        return await run(self, step)

    monkeypatch.setattr(Evaluator, "run", kill_first)
    out = tmp_path / "run"
    summary = train(_config(arith_dir), out, progress_enabled=True)
    assert len(killed) == 2 and summary["samples"] == STEPS * BATCH
    assert watch.workers.restarts == {"rollout/0": 2, "reward/0": 0}
    assert (out / "final" / "model.safetensors").is_file()
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [0, STEPS]
    err = capsys.readouterr().err
    assert len(re.findall(r"\[asyncflow\] ray: rollout/0 died \(.+?\); restarted \([12] of 3\)", err)) == 2, err
    _check_samples(out)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "fsdp"])
def test_a_dead_trainer_ends_the_run_with_one_line_and_exit_code_1(ray_session, arith_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, capsys,
                                                                   engine: str) -> None:
    """fsdp: rank 1 of 2 rank actors is killed; the run ends the same way, and resumes from the
    checkpoint the FSDP ranks wrote (their optimizer state included). torch: colocated (the hub's
    store state and feeder position are what the checkpoint holds and the resume restores)."""
    from asyncflow.cli import main

    ray = ray_session
    watch = _Watch(monkeypatch, ray)
    out = tmp_path / "run"
    # killed once step 2 is logged: the step-1 checkpoint is complete by then (step 2 starts after it),
    # whether the kill lands while step 2's checkpoint is written or in step 3
    role = "trainer" if engine == "torch" else "trainer-rank-1"
    thread, info = _killer(ray, watch, out, role, after_step=2, restart=False)
    args = ["train", str(EXAMPLE), "--out", str(out)]
    extra = ["train.engine=fsdp", "train.world_size=2"] if engine == "fsdp" else ["runtime.colocate=true"]
    for setting in _settings(arith_dir, "train.max_steps=20", "checkpoint.every=1", *extra):
        args += ["--set", setting]
    rc = main(args)
    thread.join(timeout=30)
    assert "killed_at" in info, info
    assert rc == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("asyncflow: error:")]
    assert len(errors) == 1, err
    prefix = watch.workers.prefix
    cause = r"ActorDiedError: killed by ray.kill" if engine == "torch" else r"RankDied: .*FSDP worker rank 1 died.*"
    m = re.fullmatch(rf"asyncflow: error: the trainer actor \({prefix}-trainer\) died (in|after) train step \d+, "
                     rf"while .+; the last policy version it exported is \d+ \({cause}\); "
                     rf"it can go on from {re.escape(str(out))}/checkpoints/step_(\d+) \(step (\d+)\): run the same "
                     r"command with --set checkpoint.resume=auto", errors[0])
    assert m and m.group(2) == m.group(3), errors[0]
    assert not any(line.startswith("Traceback") for line in err.splitlines())
    assert 2 <= _trained_steps(out) < 20
    assert not (out / "final").exists()
    # ... and it does: the same command with resume=auto finishes the run, every step logged once
    assert main([*args, "--set", "checkpoint.resume=auto"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 21))
    assert json.loads((out / "summary.json").read_text())["accounting"]["lost"] == 0
    # samples.jsonl too: the resume cut it back once its actors had opened it (O_APPEND: they then
    # write at the cut-back end), so the redone steps' samples appear once
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert not [u for u, k in Counter(s["uid"] for s in samples).items() if k > 1], "a sample was logged twice"
    assert sum(s["status"] == "trained" for s in samples) == 20 * BATCH


def _run_killed_after_step_1(ray: Any, monkeypatch: pytest.MonkeyPatch, arith_dir: Path, out: Path, role: str,
                             *settings: str) -> tuple[RunFailed, dict[str, Any], _Watch]:
    """A 20-step run whose actor `role` is killed (Ray may restart it) once step 1 is trained; the
    run's error, what the killer saw, and the run's workers."""
    from asyncflow.runner import train

    watch = _Watch(monkeypatch, ray)
    thread, info = _killer(ray, watch, out, role, after_step=1, restart=True)
    with pytest.raises(RunFailed) as caught:
        train(_config(arith_dir, *settings, "train.max_steps=20"), out, progress_enabled=False)
    thread.join(timeout=30)
    assert "killed_at" in info, info
    assert _trained_steps(out) < 20
    return caught.value, info, watch


@pytest.mark.slow
def test_with_max_restarts_0_a_killed_rollout_actor_ends_the_run(ray_session, arith_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    error, _, watch = _run_killed_after_step_1(ray_session, monkeypatch, arith_dir, tmp_path / "run", "rollout-0",
                                               "runtime.max_restarts=0")
    assert not isinstance(error, TrainerDied)
    prefix = watch.workers.prefix
    assert str(error) == (f"the rollout/0 actor ({prefix}-rollout-0) died (ActorDiedError: killed by ray.kill); "
                          "runtime.max_restarts=0 allows no restart; no checkpoint was written (set "
                          "checkpoint.every to make runs resumable)")
    assert watch.workers.restarts == {"rollout/0": 0, "reward/0": 0}


@pytest.mark.slow
def test_a_killed_colocated_hub_ends_the_run_in_one_line_naming_it(ray_session, arith_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`runtime.colocate`: the hub (rollout 0, the store, the feeder, the reward worker) holds the
    store, so it is never restarted (max_restarts 3 notwithstanding): its death ends the run."""
    error, info, watch = _run_killed_after_step_1(ray_session, monkeypatch, arith_dir, tmp_path / "run", "store",
                                                  "runtime.colocate=true")
    prefix = watch.workers.prefix
    assert info["named"] == sorted(f"{prefix}-{r}" for r in ("store", "trainer"))  # (the hub is named as the store)
    assert str(error) == (f"the rollout/0, store controller and feeder actor ({prefix}-store) died (ActorDiedError: "
                          "killed by ray.kill); no checkpoint was written (set checkpoint.every to make runs resumable)")
    assert watch.workers.restarts == {"rollout/0": 0}


def test_the_cli_prints_a_run_failure_as_one_line_with_exit_code_1(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import asyncflow.cli as cli

    def fail(args: Any) -> int:
        raise TrainerDied("the trainer actor (x) died in train step 3\nsecond line", step=3, version=2)

    monkeypatch.setattr(cli, "_dispatch", fail)
    assert cli.main(["demo"]) == 1
    assert capsys.readouterr().err == "asyncflow: error: the trainer actor (x) died in train step 3 second line\n"
