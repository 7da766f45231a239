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

# Rollout-dominated settings: long sampled responses (`max_new_tokens` large, and EOS late at T=1.2)
# make generation the larger part of a sync step, as in real RLVR.
E2E_SETTINGS = ["logging.progress=false", "eval.every=0"]


def _steady(rows: list[dict[str, Any]]) -> float:
    train = [r for r in rows if r.get("kind") == "train"]
    if len(train) < 4:
        return float("nan")
    a = train[len(train) // 4]
    b = train[-1]
    return (b["samples"] - a["samples"]) / max(b["time_s"] - a["time_s"], 1e-9)


def run_e2e(overrides: list[str]) -> list[dict[str, Any]]:
    """Run sync then async; one row per mode."""
    from asyncflow.runner import train

    rows = []
    with tempfile.TemporaryDirectory(prefix="asyncflow-e2e-") as tmp:
        for mode in ("sync", "async"):
            cfg, _ = load_config(None, [*E2E_SETTINGS, *overrides, f"workflow.mode={mode}"])
            out = Path(tmp) / mode
            summary = train(cfg, out, progress_enabled=False)
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            rows.append(
                {
                    "mode": mode,
                    "runtime": cfg.runtime.kind,
                    "rollout_workers": cfg.rollout.workers,
                    "train_workers": 1,
                    "samples": summary["samples"],
                    "seconds": round(summary["train_seconds"], 3),
                    "samples_per_s": round(summary["samples_per_s"], 2),
                    "steady_samples_per_s": round(_steady(metrics), 2),
                    "eval_accuracy": summary["eval_accuracy_after"],
                }
            )
    return rows
