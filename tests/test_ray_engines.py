"""Every rollout engine kind and black-box agents on the Ray rollout actors: `rollout.engine: openai`
against real `asyncflow serve` processes (one per rollout actor), `rollout.agent` with its endpoint in
the actor, and the weight-folder writer the actors share (each version written once)."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def _serve(model_dir: Path) -> tuple[subprocess.Popen[str], str]:
    """An `asyncflow serve` process on a free loopback port, and its URL."""
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow", "serve", str(model_dir), "--port", "0",
                             "--max-batch", "64"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    try:
        line = lines.get(timeout=120)
    except queue.Empty:
        proc.kill()
        raise AssertionError("asyncflow serve did not say where it listens within 120 s") from None
    assert "listening on http://127.0.0.1:" in line, line
    return proc, line.split("listening on ")[1].split()[0]


@pytest.fixture()
def two_servers(arith_dir: Path) -> Iterator[list[str]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        urls = []
        for _ in range(2):
            proc, url = _serve(arith_dir)
            procs.append(proc)
            urls.append(url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=60)


def _version(url: str) -> int:
    with urllib.request.urlopen(f"{url}/admin/version", timeout=30) as resp:
        return int(json.loads(resp.read())["version"])


def _run(arith_dir: Path, out: Path, sets: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    from asyncflow.config import load_config
    from asyncflow.runner import train

    cfg, _ = load_config(None, ["task=arith", f"model.path={arith_dir}", "runtime.kind=ray", "runtime.rollout_cpus=0",
                                "runtime.train_cpus=0.5", "runtime.reward_cpus=0", "logging.progress=false",
                                "train.max_steps=3", "train.batch_size=16", "rollout.n=4", "eval.every=0", *sets])
    summary = train(cfg, out, progress_enabled=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return summary, [r for r in rows if r["kind"] == "train"], samples


def test_openai_engine_on_ray_drives_one_server_per_rollout_actor(ray_session, arith_dir: Path, tmp_path: Path,
                                                                 two_servers: list[str]) -> None:
    urls = two_servers
    out = tmp_path / "run"
    summary, steps, samples = _run(arith_dir, out, [
        "rollout.engine=openai", f"rollout.server_urls=[{urls[0]}, {urls[1]}]", "rollout.max_new_tokens=4",
        "eval.size=8", "rollout.request_timeout_s=120", "rollout.sync_timeout_s=120"])
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert summary["samples"] == 48 and summary["accounting"]["lost"] == 0
    assert json.loads((out / "summary.json").read_text())["accounting"]["lost"] == 0
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 48 and max(s["behavior_version"] for s in trained) >= 1  # later steps used synced weights
    assert [_version(u) for u in urls] == [3, 3]  # both servers hold the last published weights
    folder = out / "weight_sync" / "v000003"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    # written once, by one actor, for both: one writer session stamped it (the run's actor prefix)
    session, version = (folder / ".asyncflow-writer").read_text().split()
    assert session.startswith("asyncflow-") and version == "3"


AGENT_MODULE = '''
import asyncio, json, os, urllib.request

PIDS = {pids!r}  # each episode's process id, one a line

def _post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["choices"][0]

async def solve(base_url, row, seed):
    """Two plain-HTTP calls to the loopback endpoint of the process it runs in."""
    assert base_url.startswith("http://127.0.0.1:"), base_url
    c1 = await asyncio.to_thread(_post, base_url + "/completions", {"prompt": row["prompt"], "max_tokens": 6})
    await asyncio.to_thread(_post, base_url + "/completions", {"prompt": row["prompt"] + c1["text"] + " ?",
                                                               "max_tokens": 2})
    with open(PIDS, "a") as f:
        f.write(f"{os.getpid()}\\n")
    return float(c1["text"].strip() == str(row["answer"]))
'''


def test_black_box_agent_episodes_run_in_the_ray_rollout_actor(ray_session, arith_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent file lies in the driver's working directory (not Ray's) and is named relative to it:
    the actors load it by the path the driver resolved, and each episode's endpoint is on loopback
    in the rollout actor's process."""
    import os

    pids = tmp_path / "pids.txt"
    (tmp_path / "ray_http_agent.py").write_text(AGENT_MODULE.replace("{pids!r}", repr(str(pids))))
    monkeypatch.chdir(tmp_path)
    summary, steps, samples = _run(arith_dir, tmp_path / "run", [
        "rollout.agent=ray_http_agent.py:solve", "eval.size=4"])
    assert [r["policy_version"] for r in steps] == [1, 2, 3]
    assert summary["samples"] == 48 and summary["accounting"]["lost"] == 0
    trained = [s for s in samples if s["status"] == "trained"]
    assert len(trained) == 48 and all(s["agent_calls"] == 2 and s["agent_calls_dropped"] == 0 for s in trained)
    ran_in = set(map(int, pids.read_text().split())) if pids.exists() else set()
    assert ran_in - {os.getpid()}, "no agent episode ran in a rollout actor"


def test_server_engines_weight_folder_is_written_once_per_version_and_session(tmp_path: Path) -> None:
    """Writers of one session (the rollout actors of one run) share each version's folder; a writer of
    another session (a resumed run, a reused sync_dir) writes its own weights over it."""
    import asyncio

    import torch

    from asyncflow.engines.server_sync import WeightFolderWriter

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    a, b = (WeightFolderWriter(tmp_path / "sync", tmp_path / "model", in_place=False, session="s1") for _ in "ab")

    async def both(state: dict[str, torch.Tensor]) -> list[Path]:
        return list(await asyncio.gather(a.folder_for(state, 1), b.folder_for(state, 1)))

    first, second = asyncio.run(both({"w": torch.zeros(2)}))
    assert first == second == tmp_path / "sync" / "v000001"
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert asyncio.run(b.folder_for({"w": torch.ones(2)}, 1)) == first  # (cached per writer, too)
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    other = WeightFolderWriter(tmp_path / "sync", tmp_path / "model", in_place=False, session="s2")
    asyncio.run(other.folder_for({"w": torch.ones(2)}, 1))
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(first / "model.safetensors"))["w"], torch.ones(2))
    assert (first / ".asyncflow-writer").read_text() == "s2 1"
