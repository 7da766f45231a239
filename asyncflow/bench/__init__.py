"""Benchmark workloads (`asyncflow bench WORKLOAD`); see docs/performance.md for measured numbers."""

from __future__ import annotations

import json
import sys
from typing import Any

from asyncflow.errors import UserError

_NAMES = {"store": "STORE-1", "pipeline": "PIPE", "e2e": "E2E", "serve": "SERVE-LOAD", "weights": "weights",
          "model": "model"}


def _progress(row: dict[str, Any]) -> None:
    """One line per finished row on stderr (long workloads), so the JSON stays the last stdout line."""
    print("[asyncflow] " + "  ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)


def run_bench(workload: str, *, as_json: bool, overrides: list[str]) -> int:
    """Run one workload; with `as_json` the last line printed is `{"workload": ..., "rows": [...]}`."""
    if workload == "e2e":
        from asyncflow.bench.e2e import run_e2e

        rows = run_e2e(overrides)
    elif workload == "pipeline":
        from asyncflow.bench.pipeline import run_pipeline

        rows = run_pipeline(overrides, report=_progress)
    elif workload == "store":
        from asyncflow.bench.store import run_store

        rows = run_store(overrides)
    elif workload == "serve":
        from asyncflow.bench.serve_load import run_serve_load

        rows = run_serve_load(overrides)
    elif workload == "weights":
        from asyncflow.bench.weights import run_weights

        rows = run_weights(overrides, report=_progress)
    elif workload == "model":
        from asyncflow.bench.model import run_model

        rows = run_model(overrides, report=_progress)
    else:
        raise UserError(f"bench {workload}: unknown workload; use store, pipeline, e2e, serve, weights, model")
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if as_json:
        print(json.dumps({"workload": _NAMES[workload], "rows": rows}))
    return 0
