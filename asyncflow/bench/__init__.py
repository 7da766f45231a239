"""Benchmark workloads (`asyncflow bench WORKLOAD`); see docs/performance.md for measured numbers."""

from __future__ import annotations

import json

from asyncflow.errors import UserError


def run_bench(workload: str, *, as_json: bool, overrides: list[str]) -> int:
    """Run one workload; with `as_json` the last line printed is `{"workload": ..., "rows": [...]}`."""
    if workload == "e2e":
        from asyncflow.bench.e2e import run_e2e

        rows = run_e2e(overrides)
    else:
        raise UserError(f"bench {workload}: not available in this version (only e2e is)")
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if as_json:
        print(json.dumps({"workload": workload.upper() if workload != "e2e" else "E2E", "rows": rows}))
    return 0
