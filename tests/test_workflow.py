"""End-to-end runs of the real pipeline on a tiny prepared model (marked slow; CI runs them)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncflow.config import load_config
from asyncflow.errors import UserError
from asyncflow.runner import train

pytestmark = pytest.mark.slow

ARITH_YAML = Path(__file__).resolve().parent.parent / "examples" / "arith_async.yaml"
SMALL = [
    "train.max_steps=4", "train.batch_size=32", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=64",
    "eval.every=2", "logging.progress=false",
]


def _run(arith_dir: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    cfg, _ = load_config(None, ["task=arith", *SMALL, f"model.path={arith_dir}", *extra])
    return train(cfg, out, progress_enabled=False)


def _rows(out: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.mark.parametrize(
    ("mode", "update"), [("async", "swap"), ("sync", "swap"), ("async", "drain"), ("async", "abort")]
)
def test_short_run_writes_the_run_folder_and_respects_staleness(
    arith_dir: Path, tmp_path: Path, mode: str, update: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncflow.engines.torch_train import TorchTrainEngine

    export = TorchTrainEngine.export_weights
    exported_on: list[bool] = []  # whether each weight export ran on the event loop's thread

    def recorded(self: Any) -> Any:
        exported_on.append(threading.current_thread() is threading.main_thread())
        return export(self)

    monkeypatch.setattr(TorchTrainEngine, "export_weights", recorded)
    out = tmp_path / mode
    summary = _run(arith_dir, out, [f"workflow.mode={mode}", f"workflow.weight_update={update}"])
    # a publication's full copy of the weights held the event loop (rollout, evaluation) for its length
    assert len(exported_on) >= 4 and not any(exported_on[-4:])
    for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "trace.json", "final/config.json"):
        assert (out / name).exists(), name
    metrics = _rows(out, "metrics.jsonl")
    train_rows = [r for r in metrics if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    required = {"step", "policy_version", "samples", "tokens", "time_s", "samples_per_s", "reward_mean", "staleness_mean",
                "staleness_max", "loss", "kl", "entropy", "grad_norm", "weight_sync_s", "rollout_busy_frac",
                "train_busy_frac", "dropped_stale", "reward_errors"}
    for r in train_rows:
        assert required <= set(r)
        assert r["staleness_max"] <= (0 if mode == "sync" else 1)
        assert r["policy_version"] == r["step"]
        if mode == "sync":  # every token is the trainer's own version: the same policy on both sides
            assert r["mismatch_kl"] is not None and -1e-6 < r["mismatch_kl"] < 1e-3  # (rounding: a hair below 0)
    assert train_rows[-1]["samples"] == 4 * 32 == summary["samples"]
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 4 and {"eval_reward", "eval_accuracy"} <= set(evals[0])
    samples = _rows(out, "samples.jsonl")
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 128 and len({s["uid"] for s in trained}) == 128
    for s in trained:
        assert 0 <= s["trained_version"] - s["behavior_version"] <= (0 if mode == "sync" else 1)
        assert set(s) == {"uid", "group_id", "prompt", "response", "reward", "behavior_version", "trained_version",
                          "status", "error"}
    trace = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert {"trainer", "reward", "weight sync", "rollout/0"} <= names
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(str(out / "final"))
    AutoTokenizer.from_pretrained(str(out / "final"))


def test_max_new_tokens_past_the_model_s_positions_is_refused_before_the_run(arith_dir: Path, tmp_path: Path) -> None:
    """The arith model has 32 positions: asking for more new tokens than a prompt leaves is bad input
    (one line, no run folder), not an index error in the middle of the run."""
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"^rollout\.max_new_tokens: \d+ prompt\(s\) leave less room than 30 new tokens "
                                        r"in the model's 32 positions; the longest has \d+ tokens \(\S+train.jsonl, "
                                        r"line \d+: '"):
        _run(arith_dir, out, ["rollout.max_new_tokens=30"])
    assert not out.exists()


def test_an_inference_server_error_ends_the_run_with_one_line_not_a_traceback(arith_dir: Path, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """rollout.engine=openai: a server that refuses a call (here the first evaluation's) is an outside
    failure: RunFailed (one line at the CLI, exit 1) saying where the run can go on from."""
    from asyncflow.engines.http_client import HTTPError
    from asyncflow.errors import RunFailed
    from asyncflow.evaluation import Evaluator

    async def refused(self: Any, step: int) -> Any:
        raise HTTPError(400, "POST http://127.0.0.1:1/v1/completions: HTTP 400: prompt too long")

    monkeypatch.setattr(Evaluator, "run", refused)
    with pytest.raises(RunFailed, match=r"^inference server error: POST http://127\.0\.0\.1:1/v1/completions: HTTP 400: "
                                        r"prompt too long; no checkpoint was written"):
        _run(arith_dir, tmp_path / "run", [])


def test_existing_run_folder_is_refused(arith_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="already holds a run"):
        _run(arith_dir, out, [])


def _write_reward_module(tmp_path: Path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(body)


def test_failing_reward_calls_mark_their_samples_and_are_kept_out_of_the_loss(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_reward_module(
        tmp_path,
        "flaky_rewards",
        "calls = 0\n"
        "def score(prompts, completions, answer, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls % 3 == 0:\n"
        "        raise ValueError('flaky verifier')\n"
        "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(arith_dir, out, ["reward.fn=flaky_rewards:score", "eval.every=0"])
    samples = _rows(out, "samples.jsonl")
    errors = [s for s in samples if s["status"] == "reward_error"]
    assert errors and all("flaky verifier" in s["error"] for s in errors)
    assert all(s["trained_version"] is None for s in errors)
    assert summary["samples"] == 128  # failed groups were replaced, every step still trained a full batch
    assert _rows(out, "metrics.jsonl")[-2]["reward_errors"] == len(errors)


def test_async_reward_function_is_awaited_concurrently_and_a_hung_call_is_cancelled(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `async def` judge runs on the event loop: several groups at once (up to reward.concurrency),
    and a call past reward.timeout_s is cancelled (not left running in a thread) and marks its group."""
    _write_reward_module(
        tmp_path,
        "async_judge",
        "import asyncio\n"
        "calls = active = peak = cancelled = 0\n"
        "async def judge(prompts, completions, answer, **kw):\n"
        "    global calls, active, peak, cancelled\n"
        "    if len(completions) != 4:  # the eval set's call (eval.size prompts), not a group\n"
        "        return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
        "    calls += 1\n"
        "    n = calls\n"
        "    active += 1\n"
        "    peak = max(peak, active)\n"
        "    try:\n"
        "        await asyncio.sleep(3600 if n == 6 else 0.2)\n"
        "        return [float(c.strip() == a) for c, a in zip(completions, answer)]\n"
        "    except asyncio.CancelledError:\n"
        "        cancelled += 1\n"
        "        raise\n"
        "    finally:\n"
        "        active -= 1\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(arith_dir, out, ["reward.fn=async_judge:judge", "reward.timeout_s=1", "reward.concurrency=3"])
    judge = sys.modules["async_judge"]
    assert summary["samples"] == 128
    assert 2 <= judge.peak <= 3  # groups overlapped, never more than reward.concurrency
    assert judge.cancelled == 1 and judge.active == 0
    samples = _rows(out, "samples.jsonl")
    errors = [s for s in samples if s["status"] == "reward_error"]
    assert len(errors) == 4 and len({s["group_id"] for s in errors}) == 1
    assert errors[0]["error"] == f"timed out after 1.0 s waiting for reward function on group(s) [{errors[0]['group_id']}]"
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 128 and all(s["reward"] in (0.0, 1.0) for s in trained)
    evals = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(0.0 <= r["eval_reward"] <= 1.0 for r in evals)


def test_reward_function_that_always_fails_stops_the_run_with_exit_2(arith_dir: Path, tmp_path: Path) -> None:
    """The error names the line that raised in the user's file; the run folder is kept, marked failed,
    with the failed samples' errors in samples.jsonl (it was deleted: no train step had run)."""
    _write_reward_module(tmp_path, "broken_rewards", "def score(prompts, completions, **kw):\n    raise RuntimeError('boom')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "asyncflow", "train", str(ARITH_YAML), "--out", "run", "--set", f"model.path={arith_dir}",
         "--set", "reward.fn=broken_rewards:score", "--set", "reward.fail_fast_calls=4", *sum((["--set", s] for s in SMALL), [])],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    error = "reward function raised RuntimeError at broken_rewards.py:2: boom"
    assert last == (f"asyncflow: error: reward.fn: the first 4 reward calls all failed; last error: {error}; the "
                    "run folder run is kept, marked failed (failed.json), with each recorded sample's error in "
                    "samples.jsonl")
    assert "Traceback" not in proc.stderr
    assert "the run failed" not in proc.stderr  # bad input is not something to resume from
    run = tmp_path / "run"
    assert json.loads((run / "failed.json").read_text()) == {
        "status": "failed", "error": f"reward.fn: the first 4 reward calls all failed; last error: {error}"}
    samples = _rows(run, "samples.jsonl")
    assert samples and {(s["status"], s["error"]) for s in samples} == {("reward_error", error)}
    assert len(samples) % 4 == 0 and not any(r["kind"] == "train" for r in _rows(run, "metrics.jsonl"))


def test_train_says_up_front_that_it_cannot_be_resumed_and_ends_naming_its_report(arith_dir: Path, tmp_path: Path) -> None:
    """A run without checkpoints says so before it starts; every field of its progress line is
    explained in `train --help`; its last lines are the commands that show it."""
    import contextlib
    import io
    import re

    from asyncflow.cli import main

    sets = [*SMALL, "train.max_steps=2", "eval.every=0", "logging.progress=true", f"model.path={arith_dir}"]
    proc = subprocess.run([sys.executable, "-m", "asyncflow", "train", str(ARITH_YAML), "--out", "run",
                           *sum((["--set", s] for s in sets), [])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr.splitlines()
    assert err[0] == "[asyncflow] no checkpoints (checkpoint.every: 0): this run cannot be resumed"
    steps = [line for line in err if line.startswith("[asyncflow] step ")]
    fields = {name for line in steps for name in re.findall(r" ([a-z_/]+)=", line)}
    assert steps and {"samples/s", "reward", "stale", "eval", "in_store", "eta"} <= fields
    usage = io.StringIO()
    with contextlib.redirect_stdout(usage), pytest.raises(SystemExit):
        main(["train", "--help"])
    explained = {line.split()[0] for line in usage.getvalue().splitlines() if line.startswith("  ")}
    assert fields <= explained, fields - explained
    assert proc.stdout.splitlines()[-2:] == ["[asyncflow] charts and summary: asyncflow report run",
                                             "[asyncflow] stages and workers over time: asyncflow trace run"]


def test_bring_your_own_model_dataset_and_reward(arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (arith_dir / "train.jsonl").read_text().splitlines()[:400]]
    table = pa.table({"question": [r["prompt"] for r in rows], "solution": [r["answer"] for r in rows],
                      "level": [r["level"] for r in rows]})
    pq.write_table(table, tmp_path / "data.parquet")
    _write_reward_module(
        tmp_path,
        "byo_rewards",
        "seen = set()\n"
        "def score(prompts, completions, completion_ids, solution, level, **kw):\n"
        "    seen.update(kw)\n"
        "    assert len(completion_ids) == len(completions) == len(solution) == len(level)\n"
        "    return [1.0 if c.strip() == s else 0.0 for c, s in zip(completions, solution)]\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(
        arith_dir, out,
        ["task=null", f"dataset.path={tmp_path / 'data.parquet'}", "dataset.prompt_key=question",
         "dataset.label_key=solution", "reward.fn=byo_rewards:score", "train.lr=0.001"],
    )
    assert summary["samples"] == 128
    evals = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "eval"]
    assert evals[0]["eval_size"] == len({r["prompt"] for r in rows}) // 10  # 10% of the distinct prompts, held out


def test_kl_to_the_frozen_reference_is_logged_when_enabled(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a reward that varies within groups even for the barely-trained test model, so the policy moves
    _write_reward_module(
        tmp_path, "digit_rewards", "def score(prompts, completions, **kw):\n    return [float(c[:1] in '13579') for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "kl"
    _run(arith_dir, out, ["algorithm.kl_coef=0.05", "train.lr=0.01", "eval.every=0", "reward.fn=digit_rewards:score"])
    train_rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    assert train_rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains from the reference weights
    assert train_rows[-1]["kl"] > 0  # later steps have moved away from it


def test_dynamic_sampling_filters_equal_reward_groups_and_refills(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # prompts with an even sum: every completion gets 1.0 (a group with no signal); others: by length
    _write_reward_module(
        tmp_path,
        "half_flat_rewards",
        "def score(prompts, completions, answer, **kw):\n"
        "    return [1.0 if int(a) % 2 == 0 else float(len(c) % 3) for a, c in zip(answer, completions)]\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(arith_dir, out, ["reward.fn=half_flat_rewards:score", "algorithm.filter_groups=true"])
    assert summary["samples"] == 4 * 32 and summary["filtered"] > 0
    samples = _rows(out, "samples.jsonl")
    filtered = [s for s in samples if s["status"] == "filtered"]
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(filtered) == summary["filtered"] and len(trained) == 128
    by_group: dict[int, list[float]] = {}
    for s in filtered:
        by_group.setdefault(s["group_id"], []).append(s["reward"])
    assert all(len(set(r)) == 1 and len(r) == 4 for r in by_group.values())  # whole groups, equal rewards
    trained_groups: dict[int, list[float]] = {}
    for s in trained:
        trained_groups.setdefault(s["group_id"], []).append(s["reward"])
    last = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"][-1]
    # equal-reward groups are trained only past a step's filter budget (the model converges on this
    # reward, so late steps may exhaust it), and each one is counted
    flat = {g for g, r in trained_groups.items() if len(set(r)) == 1}
    assert len(flat) == last["filter_overflow"] < len(trained_groups)
    assert last["filtered"] == summary["filtered"]
    assert last["response_len/filtered"] > 0 and last["response_len/trained"] > 0


def test_dynamic_sampling_cannot_stall_a_run_where_no_group_varies(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_reward_module(tmp_path, "flat_rewards", "def score(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(arith_dir, out, ["reward.fn=flat_rewards:score", "algorithm.filter_groups=true",
                                    "algorithm.filter_max_groups_per_step=2", "eval.every=0"])
    assert summary["samples"] == 4 * 32
    last = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["filtered"] == 4 * 2 * 4  # 2 groups of 4 samples filtered per step, 4 steps
    assert last["filter_overflow"] == 4 * 8  # the other 8 groups of each step trained anyway


def test_cancelled_generations_drop_their_group_and_free_its_admission_slot(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import concurrent.futures as cf
    import dataclasses

    from asyncflow.engines.hf import HFEngine

    original = HFEngine.submit

    def sometimes_cancelled(self, request):  # as if the request could no longer meet max_staleness
        fut = original(self, request)
        if request.uid < 0 or request.uid % 7 != 3:  # eval requests have negative uids
            return fut
        out: cf.Future = cf.Future()  # (`submit` is under both `generate` and `start_generate`)

        def relay(f: cf.Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result(dataclasses.replace(f.result(), finish_reason="cancelled"))

        fut.add_done_callback(relay)
        return out

    monkeypatch.setattr(HFEngine, "submit", sometimes_cancelled)
    out = tmp_path / "run"
    # ~1 in 7 samples cancelled: most steps lose groups; without freeing their slots the gate would
    # run out of credit and the trainer would wait for groups that are never admitted
    summary = _run(arith_dir, out, ["eval.every=0", "workflow.step_timeout_s=60"])
    assert summary["samples"] == 4 * 32
    samples = _rows(out, "samples.jsonl")
    cancelled = [s for s in samples if s["status"] == "cancelled"]
    assert cancelled and all(s["uid"] % 7 == 3 and s["trained_version"] is None for s in cancelled)
    lost_groups = {s["group_id"] for s in cancelled}
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 128 and not lost_groups & {s["group_id"] for s in trained}
    last = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["cancelled"] == len(cancelled)


def _reward_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("reward-")}


def test_redundant_rollouts_train_the_first_groups_and_end_the_rest_cleanly(arith_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    before = _reward_threads()
    summary = _run(arith_dir, out, ["workflow.mode=sync", "workflow.redundancy=0.5", "eval.every=0"])
    assert summary["samples"] == 4 * 32
    for _ in range(100):  # the run's (idle) reward threads, the evaluation's too, end once it is over
        if not _reward_threads() - before:
            break
        time.sleep(0.05)
    assert not _reward_threads() - before
    samples = _rows(out, "samples.jsonl")
    trained = [s for s in samples if s["status"] == "trained"]
    extra = [s for s in samples if s["status"] in ("cancelled", "dropped_stale")]
    assert len(trained) == 128 and all(s["trained_version"] == s["behavior_version"] for s in trained)  # sync
    assert extra, "the redundant groups were neither cancelled nor dropped"
    assert not {s["group_id"] for s in extra} & {s["group_id"] for s in trained}  # whole groups only
    last = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"][-1]
    assert last["cancelled"] + last["dropped_stale"] == len(extra)
    assert last["staleness_max"] == 0 and last["response_len/trained"] > 0


def test_multi_turn_episodes_train_only_generated_tokens_and_interleave(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_reward_module(
        tmp_path,
        "count_env",
        "from asyncflow.envs import Env, EnvStep\n"
        "class CountEnv(Env):\n"
        "    name = 'count'\n"
        "    max_turns = 3\n"
        "    def __init__(self, clock):\n"
        "        self.clock, self.turn = clock, 0\n"
        "    async def reset(self, row, seed):\n"
        "        self.delay = 0.02 if seed % 2 else 0.4  # fast and slow environments (slow >> a generation)\n"
        "        return ''\n"
        "    async def step(self, action):\n"
        "        self.turn += 1\n"
        "        await self.clock.sleep(self.delay)  # a slow environment: other episodes run meanwhile\n"
        "        if self.turn == 2:\n"
        "            return EnvStep('', reward=float(len(action) % 2), done=True)\n"
        "        return EnvStep('1+1=')\n"
        "def make(clock):\n"
        "    return CountEnv(clock)\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    summary = _run(arith_dir, out, ["rollout.env=count_env:make", "eval.every=0"])
    assert summary["samples"] == 4 * 32
    trained = [s for s in _rows(out, "samples.jsonl") if s["status"] == "trained"]
    assert len(trained) == 128 and all(s["turns"] == 2 and s["reward"] in (0.0, 1.0) for s in trained)
    assert all("1+1=" in s["response"] for s in trained)  # the env's text sits between the two turns
    last = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"][-1]
    # trained tokens are exactly the generated ones: the env's 4 tokens per episode are masked out
    assert last["tokens"] == sum(s["generated_tokens"] for s in trained)
    assert all(len(s["response"]) >= s["generated_tokens"] for s in trained)
    trace = json.loads((out / "trace.json").read_text())
    tid = next(e["tid"] for e in trace if e.get("name") == "thread_name" and e["args"]["name"] == "env/0")
    spans: dict[str, list[float]] = {}
    for e in trace:
        if e.get("ph") == "X" and e["tid"] == tid:
            ep = e["name"].split()[1]
            spans.setdefault(ep, []).extend([e["ts"], e["ts"] + e["dur"]])
    windows = sorted((min(v), max(v)) for v in spans.values() if len(v) == 4)
    # environment-level asynchrony: an episode's two env steps enclose steps of other episodes
    assert any(b[0] < a[1] for a, b in zip(windows, windows[1:], strict=False))
    assert _turn_two_waited_for_turn_one(trace, tid) is False

    # the batch-synchronous baseline: every turn-2 step starts after the batch's turn-1 steps ended
    out = tmp_path / "barrier"
    summary = _run(arith_dir, out, ["rollout.env=count_env:make", "eval.every=0", "rollout.turn_barrier=true"])
    assert summary["samples"] == 128
    trace = json.loads((out / "trace.json").read_text())
    tid = next(e["tid"] for e in trace if e.get("name") == "thread_name" and e["args"]["name"] == "env/0")
    assert _turn_two_waited_for_turn_one(trace, tid) is True


def _turn_two_waited_for_turn_one(trace: list[dict[str, Any]], tid: int) -> bool:
    """True if no env step 2 started while an env step 1 that began before it was still running."""
    spans = [(e["ts"], e["ts"] + e["dur"], e["name"].endswith("step 2")) for e in trace if e.get("ph") == "X" and e["tid"] == tid]
    ones = [(a, b) for a, b, two in spans if not two]
    return all(b <= a2 for a2, _, two in spans if two for a, b in ones if a < a2)


LOSS_KEYS = {
    "ppo": {"clip_frac", "ratio_mean"}, "decoupled_ppo": {"clip_frac", "is_weight_mean", "is_trunc_frac"},
    "tis": {"is_weight_mean", "is_trunc_frac"}, "mis": {"is_weight_mean", "is_mask_frac"},
    "cispo": {"clip_frac", "ratio_mean"}, "topr": {"is_trunc_frac"}, "gspo": {"clip_frac", "ratio_max"},
    "reinforce": set(), "m2po": {"m2", "m2_mask_frac", "ratio_max"}, "icepop": {"is_mask_frac", "ratio_mean"},
}


VARIED_REWARD = "def score(prompts, completions, **kw):\n    return [float(len(c) % 2) for c in completions]\n"


@pytest.mark.parametrize("loss", list(LOSS_KEYS))
def test_every_policy_loss_trains_on_arith(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loss: str
) -> None:
    # a reward that varies within groups, so every step has a learning signal on the quick model
    _write_reward_module(tmp_path, "varied_rewards", VARIED_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / loss
    summary = _run(arith_dir, out, [f"algorithm.loss={loss}", "train.max_steps=2", "train.mini_batches=2",
                                    "eval.every=0", "eval.size=16",
                                    f"workflow.max_staleness={0 if loss == 'reinforce' else 2}",  # (on-policy only)
                                    "reward.fn=varied_rewards:score"])
    assert summary["samples"] == 2 * 32
    rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    for r in rows:
        assert LOSS_KEYS[loss] | {"loss", "pg_loss", "entropy", "grad_norm"} <= set(r), sorted(r)
        assert all(isinstance(r[k], float) and r[k] == r[k] for k in ("loss", "pg_loss", "entropy", "grad_norm"))
    assert any(r["grad_norm"] > 0 for r in rows)  # the loss produced a gradient


def test_decoupled_ppo_proximal_log_probs_are_the_trainers_before_its_step(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one mini-batch the only optimizer step starts from pi_prox: the ratio pi_theta / pi_prox is 1
    on every token. A recompute from other weights (an older or already-updated policy) breaks that."""
    _write_reward_module(tmp_path, "varied_rewards", VARIED_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "dppo"
    _run(arith_dir, out, ["algorithm.loss=decoupled_ppo", "train.max_steps=4", "train.mini_batches=1", "eval.every=0",
                          "eval.size=16", "workflow.max_staleness=2", "reward.fn=varied_rewards:score"])
    rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    for r in rows:
        assert r["ratio_max"] == pytest.approx(1.0, abs=1e-4) and r["ratio_min"] == pytest.approx(1.0, abs=1e-4)
        assert r["clip_frac"] == 0.0
    assert any(r["staleness_mean"] > 0 and r["is_weight_max"] != pytest.approx(1.0, abs=1e-4) for r in rows)


def test_kl_to_the_reference_comes_from_its_own_stage(
    arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_reward_module(tmp_path, "varied_rewards", VARIED_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "kl"
    _run(arith_dir, out, ["reward.fn=varied_rewards:score", "algorithm.kl_coef=0.1", "algorithm.kl_estimator=k1", "eval.every=0", "eval.size=16",
                          "train.max_steps=3", "algorithm.overlong_buffer=2", "algorithm.advantage=rloo",
                          "logging.tensorboard=true"])
    assert any((out / "tensorboard").iterdir())  # the run's metric rows also went to TensorBoard
    rows = [r for r in _rows(out, "metrics.jsonl") if r["kind"] == "train"]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the reference weights themselves
    assert any(abs(r["kl"]) > 0 for r in rows[1:])  # the policy has moved away from the reference
    assert all(r["overlong_penalty_mean"] <= 0 for r in rows)
    trace = json.loads((out / "trace.json").read_text())
    tid = next(e["tid"] for e in trace if e.get("name") == "thread_name" and e["args"]["name"] == "reference")
    assert any(e.get("ph") == "X" and e["tid"] == tid for e in trace)


def test_eval_patience_stops_the_run_once_the_eval_curve_is_flat(arith_dir: Path, tmp_path: Path) -> None:
    """No evaluation can beat the one before by more than 1.0, so the first one during training ends
    the run: at the step after it, with its final evaluation at that step and every sample accounted."""
    out = tmp_path / "early"
    summary = _run(arith_dir, out, ["train.max_steps=40", "eval.every=1", "eval.patience=1", "eval.min_delta=1.0"])
    steps = summary["steps"]
    assert 2 <= steps < 40
    metrics = _rows(out, "metrics.jsonl")
    assert [r["step"] for r in metrics if r["kind"] == "train"] == list(range(1, steps + 1))
    evals = [r for r in metrics if r["kind"] == "eval"]
    assert evals[-1]["step"] == steps and summary["eval_accuracy_after"] == evals[-1]["eval_accuracy"]
    assert summary["samples"] == steps * 32 and summary["accounting"]["lost"] == 0


def test_eval_flattened_compares_the_last_evaluations_with_the_best_before_them() -> None:
    from asyncflow.evaluation import eval_flattened

    assert not eval_flattened([0.5, 0.9], 2, 0.01)  # not yet two evaluations after the first
    assert not eval_flattened([0.5, 0.9, 0.95], 2, 0.01)  # 0.95 beats 0.5 by more than 0.01
    assert eval_flattened([0.5, 0.9, 0.905, 0.9], 2, 0.01)  # best of the last two 0.905 <= 0.9 + 0.01
    assert not eval_flattened([0.5, 0.9, 0.905, 0.92], 2, 0.01)
    assert eval_flattened([0.5, 1.0, 1.0, 1.0], 2, 0.0)  # a perfect score cannot be beaten
    assert not eval_flattened([0.5, 0.5, 0.5], 0, 0.01)  # patience 0: never
