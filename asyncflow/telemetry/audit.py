"""The sample accounting, audited: `summary.json`'s `accounting` is a balance of the run's counters
(admitted = logged by status + left in the store + lost); this recounts the statuses from the rows
actually in `samples.jsonl` and names every status where the two disagree, and `lost` recomputed
from the recount. `asyncflow report` and the soak test use it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

# the statuses a sample is logged with (`Pipeline.accounting` counts each)
LOGGED = ("trained", "reward_error", "filtered", "dropped_stale", "cancelled", "aborted")


def summary_accounting(run_dir: Path) -> dict[str, Any] | None:
    """`summary.json`'s `accounting`, or None when the run has not finished (or predates it)."""
    try:
        acc = json.loads((run_dir / "summary.json").read_text()).get("accounting")
    except (OSError, ValueError, AttributeError):
        return None
    return acc if isinstance(acc, dict) and acc else None


def audit(accounting: dict[str, Any], recount: Counter[str]) -> list[str]:
    """The disagreements between `accounting` (summary.json's) and `recount` (status -> rows in
    samples.jsonl), one line each; [] when they agree."""
    problems = []
    for status in sorted(set(LOGGED) | set(recount)):
        said, found = accounting.get(status, 0), recount.get(status, 0)
        if said != found:
            problems.append(f"{status}: summary.json counts {said}, samples.jsonl has {found}")
    admitted, live = accounting.get("admitted"), accounting.get("in_store_at_end")
    if isinstance(admitted, int) and isinstance(live, int):
        lost = admitted - sum(recount.values()) - live
        if lost != 0 or accounting.get("lost") != 0:
            problems.append(f"lost: summary.json says {accounting.get('lost')}; recounted from samples.jsonl, "
                            f"{admitted} admitted - {sum(recount.values())} logged - {live} left in the store = {lost}")
    return problems


def audit_run(run_dir: Path, recount: Counter[str]) -> list[str] | None:
    """`audit` of a run folder's summary.json against `recount`; None when there is no accounting."""
    accounting = summary_accounting(run_dir)
    return None if accounting is None else audit(accounting, recount)
