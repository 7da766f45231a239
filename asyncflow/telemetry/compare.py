"""Compare groups of runs (e.g. sync vs async, one group per setting, one run per seed).

Reads each run folder's `metrics.jsonl` and draws eval accuracy against trained samples, one line
per group (the mean over its runs, with the min-max band), next to a table of final accuracies,
staleness and throughput. Used by docs/algorithms.md (`scripts/algo_curves.py`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from asyncflow.errors import UserError
from asyncflow.telemetry.report import read_jsonl


@dataclass
class RunCurve:
    """What one run contributes: eval accuracy at trained-sample counts, and summary figures."""

    path: Path
    samples: list[int] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    staleness_mean: float = 0.0
    samples_per_s: float = 0.0

    @property
    def final(self) -> float:
        return self.accuracy[-1]


def read_run(path: str | Path) -> RunCurve:
    """Eval accuracy by trained samples (eval step s -> the samples trained by step s; step 0 -> 0)."""
    p = Path(path)
    f = p / "metrics.jsonl"
    if not f.is_file():
        raise UserError(f"{p}: no metrics.jsonl (not a run folder)")
    rows = read_jsonl(f)
    train = [r for r in rows if r.get("kind") == "train"]
    by_step = {0: 0, **{int(r["step"]): int(r["samples"]) for r in train}}
    run = RunCurve(p)
    for r in rows:
        if r.get("kind") == "eval" and int(r["step"]) in by_step:
            run.samples.append(by_step[int(r["step"])])
            run.accuracy.append(float(r["eval_accuracy"]))
    if not run.accuracy:
        raise UserError(f"{f}: no eval rows")
    if train:
        run.staleness_mean = statistics.fmean(float(r["staleness_mean"]) for r in train)
        run.samples_per_s = float(train[-1]["samples_per_s"])
    return run


def summary_table(groups: dict[str, list[RunCurve]]) -> str:
    """A markdown table: final eval accuracy per group (mean, per seed, vs the first group)."""
    names = list(groups)
    base = statistics.fmean(r.final for r in groups[names[0]])
    lines = [
        f"| setting | runs | final eval accuracy (mean) | per run | vs {names[0]} (points) | staleness mean | samples/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups.items():
        mean = statistics.fmean(r.final for r in runs)
        lines.append(
            f"| {name} | {len(runs)} | {mean:.3f} | {', '.join(f'{r.final:.3f}' for r in runs)} | "
            f"{100 * (mean - base):+.1f} | {statistics.fmean(r.staleness_mean for r in runs):.2f} | "
            f"{statistics.fmean(r.samples_per_s for r in runs):.1f} |"
        )
    return "\n".join(lines) + "\n"


def aligned(runs: list[RunCurve]) -> tuple[list[int], list[list[float]]]:
    """The trained-sample counts at which every run was evaluated, and each count's accuracies (one
    per run). Points were matched by position, so runs whose evaluations fell at different steps
    (one skipped while the previous ran) were averaged across different steps, and drawn at the
    first run's counts."""
    points = [dict(zip(r.samples, r.accuracy, strict=True)) for r in runs]
    common = sorted(set.intersection(*(set(p) for p in points)))
    return common, [[p[x] for p in points] for x in common]


def plot_groups(groups: dict[str, list[RunCurve]], out_png: str | Path, title: str = "") -> None:
    """Eval accuracy vs trained samples: each group's mean over its runs and its min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for name, runs in groups.items():
        xs, cols = aligned(runs)
        if not xs:  # no sample count every run evaluated at: each run's own curve
            for i, r in enumerate(runs):
                (line,) = ax.plot(r.samples, r.accuracy, marker="o", markersize=3, alpha=0.7,
                                  label=f"{name} (run {i + 1})")
            continue
        mean = [statistics.fmean(c) for c in cols]
        (line,) = ax.plot(xs, mean, marker="o", markersize=3, label=f"{name} (n={len(runs)})")
        if len(runs) > 1:
            ax.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("trained samples")
    ax.set_ylabel("greedy eval accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def compare(groups: dict[str, list[str | Path]], out_png: str | Path, title: str = "") -> str:
    """Read the runs, draw the picture to `out_png`, return the markdown table."""
    curves = {name: [read_run(p) for p in paths] for name, paths in groups.items()}
    for name, runs in curves.items():
        if not runs:
            raise UserError(f"group {name!r} has no runs")
    plot_groups(curves, out_png, title)
    return summary_table(curves)
