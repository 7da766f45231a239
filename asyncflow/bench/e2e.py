"""E2E: the `arith` task with its real model on this machine, sync vs async on the same cores.

Both modes train the same number of samples with the same settings; they differ only in
`workflow.mode`. Reported per mode: trained samples/s over the whole run, in steady state (after the
first quarter of the steps, so start-up and the first step's fill are excluded), and the greedy eval
accuracy after training.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from asyncflow.config import load_config
from asyncflow.config_schema import colocated

# Rollout-dominated settings: 8 continuous-batching slots per engine (as on a memory-bound GPU)
# make generation ~60% of a sync step on this machine (measured: rollout_busy_frac 0.62 vs
# train_busy_frac 0.35 in sync mode), as in real RLVR where rollout is > 70% of a step.
E2E_SETTINGS = ["logging.progress=false", "eval.every=0", "rollout.max_batch=8", "train.max_steps=100"]


def _steady(rows: list[dict[str, Any]]) -> float | None:
    """Samples/s from a quarter of the way in to the end; None (JSON null) with under 4 steps (it was
    NaN, which the last line's JSON then held: not JSON)."""
    train = [r for r in rows if r.get("kind") == "train"]
    if len(train) < 4:
        return None
    a = train[len(train) // 4]
    b = train[-1]
    return (b["samples"] - a["samples"]) / max(b["time_s"] - a["time_s"], 1e-9)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    """The run's value of a per-step fraction (each train row's covers the wall time since the row
    before): the rows' mean weighted by the time each covers (an unweighted mean over-counted short
    steps; 0.596 against 0.643 in one 100-step run)."""
    train = [r for r in rows if r.get("kind") == "train"]
    total = weighted = 0.0
    before = 0.0
    for r in train:
        span = max(r["time_s"] - before, 0.0)
        before = r["time_s"]
        total += span
        weighted += r[key] * span
    return weighted / total if total > 0 else 0.0


def run_e2e(overrides: list[str]) -> list[dict[str, Any]]:
    """Run sync then async; one row per mode."""
    from asyncflow.errors import UserError
    from asyncflow.runner import train

    for item in overrides:
        if item.partition("=")[0].strip() == "workflow.mode":
            raise UserError(f"bench e2e --set {item}: e2e runs both modes, sync then async; workflow.mode is its own")
    # both configs are checked before either run starts (a bad --set fails in seconds, not after the sync run)
    configs = {mode: load_config(None, ["task=arith", *E2E_SETTINGS, *overrides, f"workflow.mode={mode}"])[0]
               for mode in ("sync", "async")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncflow-e2e-") as tmp:
        for mode, cfg in configs.items():
            out = Path(tmp) / mode
            summary = train(cfg, out, progress_enabled=False)
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            rows.append(
                {
                    "mode": mode,
                    "runtime": cfg.runtime.kind,
                    # (ray: rollout actor 0 also the store, feeder and reward workers; null in process)
                    "colocate": colocated(cfg) if cfg.runtime.kind == "ray" else None,
                    "rollout_workers": cfg.rollout.workers,
                    "train_workers": cfg.train.world_size if cfg.train.engine == "fsdp" else 1,
                    "samples": summary["samples"],
                    "seconds": round(summary["train_seconds"], 3),
                    "samples_per_s": round(summary["samples_per_s"], 2),
                    "steady_samples_per_s": None if (steady := _steady(metrics)) is None else round(steady, 2),
                    "eval_accuracy": summary["eval_accuracy_after"],
                    "rollout_busy_frac": round(_mean(metrics, "rollout_busy_frac"), 3),
                    "train_busy_frac": round(_mean(metrics, "train_busy_frac"), 3),
                }
            )
    return rows
