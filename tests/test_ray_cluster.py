"""A Ray cluster of several nodes on this machine (`ray.cluster_utils.Cluster`, loopback only): the
trainer and the rollout actors land on the nodes their labels name, weights travel by the collective
path, and a rollout node removed mid-run is survived (its actor restarts on the other rollout node,
its leases go back to the queue). Each run is `asyncflow train` in a process of its own that joins
the cluster as a user's driver would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "arith_ray.yaml"
STEPS = 40  # (a step takes ~0.3 s here: enough left after step 2 that the loss happens mid-run)
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # every node, the GCS and the driver stay on 127.0.0.1


@pytest.fixture(scope="module")
def cluster():
    """A head, a node labelled `trainer` and two labelled `rollout`."""
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in LOOPBACK}
    os.environ.update(LOOPBACK)  # (the nodes' processes read it; this one read it when ray was imported)
    mp = pytest.MonkeyPatch()
    mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    here = {"node_ip_address": "127.0.0.1"}  # (also where this process already runs a Ray of its own)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **here})
    try:
        nodes = {"trainer": c.add_node(num_cpus=2, resources={"trainer": 1}, **here),
                 "rollout-a": c.add_node(num_cpus=1, resources={"rollout": 1}, **here),
                 "rollout-b": c.add_node(num_cpus=1, resources={"rollout": 1}, **here)}
        c.wait_for_nodes()
        assert {n.node_ip_address for n in [c.head_node, *nodes.values()]} == {"127.0.0.1"}
        yield c, nodes
    finally:
        c.shutdown()
        mp.undo()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start(c: Any, out: Path, *settings: str) -> subprocess.Popen[str]:
    args = [sys.executable, "-m", "asyncflow", "train", str(EXAMPLE), "--out", str(out),
            "--set", f"runtime.address={c.address}", "--set", "runtime.train_resource=trainer",
            "--set", "runtime.rollout_resource=rollout", "--set", "runtime.weight_sync=collective",
            "--set", "runtime.rollout_cpus=0.5", "--set", "runtime.train_cpus=0.5", "--set", "rollout.n=4",
            "--set", "eval.every=0", "--set", "eval.size=8",
            "--set", "workflow.step_timeout_s=120"]
    for s in settings:
        args += ["--set", s]
    log = (out.parent / f"{out.name}.log").open("w")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, text=True, env={**os.environ, **LOOPBACK})


def _finish(proc: subprocess.Popen[str], out: Path, timeout_s: float = 420) -> dict[str, Any]:
    rc = proc.wait(timeout=timeout_s)
    log = (out.parent / f"{out.name}.log").read_text()
    assert rc == 0, log[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["accounting"]["lost"] == 0, summary["accounting"]
    return summary


def _node(summary: dict[str, Any], role: str, index: int = 0) -> str:
    return next(a["node_id"] for a in summary["actors"] if a["role"] == role and a["index"] == index)


def test_fsdp_ranks_and_rollout_actors_on_their_nodes_with_collective_weight_sync(cluster, tmp_path: Path) -> None:
    """The acceptance run: FSDP (world size 2, gloo) ranks on the trainer node, the rollout actor on
    a rollout node, weights broadcast from rank 0 to it, every sample accounted for."""
    c, nodes = cluster
    out = tmp_path / "run"
    summary = _finish(_start(c, out, "train.max_steps=3", "train.batch_size=16", "train.engine=fsdp",
                             "train.world_size=2"), out)
    assert summary["samples"] == 3 * 16
    ranks = [a for a in summary["actors"] if a["role"] == "trainer"]
    assert sorted(a["index"] for a in ranks) == [0, 1] and len({a["pid"] for a in ranks}) == 2
    assert {a["node_id"] for a in ranks} == {nodes["trainer"].node_id}
    assert _node(summary, "rollout") in {nodes["rollout-a"].node_id, nodes["rollout-b"].node_id}
    assert _node(summary, "store") == _node(summary, "feeder") == c.head_node.node_id  # with the driver
    sync = summary["weight_sync"]
    assert sync["path"] == "collective" and sync["backend"] == "gloo" and sync["broadcast"] == 3, sync


def _wait_for(what: str, check: Any, proc: subprocess.Popen[str], timeout_s: float = 240) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert proc.poll() is None, f"the run ended before {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_a_rollout_node_removed_mid_run_is_survived(cluster, tmp_path: Path) -> None:
    c, nodes = cluster
    out = tmp_path / "run"
    log = out.parent / f"{out.name}.log"
    proc = _start(c, out, f"train.max_steps={STEPS}", "train.batch_size=16")

    def placed() -> str | None:
        m = re.search(r"ray: nodes: .*?rollout/0@([0-9a-f]{8})", log.read_text())
        return m.group(1) if m else None

    def trained_two() -> bool:
        rows = (out / "metrics.jsonl").read_text().split("\n")[:-1] if (out / "metrics.jsonl").exists() else []
        return sum(json.loads(r).get("kind") == "train" for r in rows if r.strip()) >= 2

    first = _wait_for("the rollout actor's node in the log", placed, proc)
    lost_name = next(name for name, n in nodes.items() if n.node_id.startswith(first))
    assert lost_name.startswith("rollout-")
    _wait_for("two train steps", trained_two, proc)
    c.remove_node(nodes[lost_name])
    summary = _finish(proc, out)
    other = nodes["rollout-b" if lost_name == "rollout-a" else "rollout-a"].node_id
    assert summary["samples"] == STEPS * 16
    assert summary["restarts"].get("rollout/0") == 1, summary["restarts"]
    assert _node(summary, "rollout") == other
    assert re.search(r"ray: rollout/0 died .*; restarted \(1 of 3\)", log.read_text())
