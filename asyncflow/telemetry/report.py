"""`asyncflow report RUN_DIR [RUN_DIR ...]`: one picture and one page per run, or a comparison.

Reads what a run folder already holds (`metrics.jsonl`, `samples.jsonl`, `trace.json`) and writes
`report.png` and `summary.md` into the first folder. The picture: reward and eval accuracy over
trained samples and over time, throughput, the staleness histogram, the busy fraction of every
trace track, and a timeline strip of the (first) run's trace. Several runs share each panel, so
sync and async side by side are one picture.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import replace_file, write_text_atomic
from asyncflow.errors import UserError
from asyncflow.telemetry.audit import audit_run
from asyncflow.telemetry.runlog import DROPPED, parse_trace

WAIT_PREFIXES = ("wait",)  # trace spans that are waiting, not work


@dataclass
class RunData:
    """One run folder, parsed."""

    path: Path
    label: str
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    staleness: Counter[int] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)  # what was left out while reading (a cut-short last line)
    status: Counter[str] = field(default_factory=Counter)
    spans: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # track -> (start, end) s
    # summary.json's accounting against samples.jsonl's statuses (`telemetry/audit.py`): the
    # disagreements ([] when none), None when the run has no summary.json (not finished)
    audit: list[str] | None = None

    @property
    def wall_s(self) -> float:
        ends = [e for spans in self.spans.values() for _, e in spans]
        return max(ends, default=0.0) or (self.train[-1]["time_s"] if self.train else 0.0)


def _read_text(path: Path) -> str:
    """A run file's text; unreadable or non-UTF-8 content is a `UserError` naming the file."""
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _numbered_rows(path: Path, notes: list[str] | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line, read line by line (a long run's samples.jsonl
    is hundreds of MB); a line that is not a JSON object is a `UserError`. A last line that is cut
    short (no line end, not JSON: a run that crashed or is still writing) is skipped, with a note in
    `notes` when given."""
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    with fh:
        for i, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}: line {i} is not UTF-8 text (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except RecursionError:
                raise UserError(f"{path}: line {i} is JSON nested too deep to read") from None
            except json.JSONDecodeError:
                if not raw.endswith(b"\n") and fh.read(1) == b"":
                    if notes is not None:
                        notes.append(f"{path}: line {i} is cut short (a run that crashed or is still writing); "
                                     "left out")
                    return
                raise UserError(f"{path}: line {i} is not JSON") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}: line {i} is not a JSON object")
            yield i, row


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` with control characters (terminal escapes among them) shown as `\\xNN`: run files are
    written by models and plugins, and what they hold must not drive the reader's terminal."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a malformed line is a `UserError` naming file and line."""
    return [row for _, row in _numbered_rows(path)]


def _optional_number(row: dict[str, Any], key: str, where: str) -> float | None:
    """`row[key]` as a number, None when missing or null; any other type is a `UserError` naming
    `where` (file and line or event) and the key."""
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"{where}: {key!r} must be a number, got {value!r}")
    if not math.isfinite(value):  # (a NaN reward is a gap, as a missing one)
        return None
    return value


def _number(row: dict[str, Any], key: str, where: str) -> float:
    """`row[key]` as a finite number; missing is a `UserError` too (an infinite `time_s` or `ts`
    failed the drawing with a traceback: axis limits cannot be inf)."""
    value = _optional_number(row, key, where)
    if value is None:
        raise UserError(f"{where}: missing {key!r}" if row.get(key) is None else
                        f"{where}: {key!r} must be a finite number, got {row[key]!r}")
    return value


def _version(row: dict[str, Any], key: str, where: str) -> int:
    """`row[key]` as a policy version: an integer (a whole float such as 2.0 is taken too)."""
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and not value.is_integer()):
        raise UserError(f"{where}: {key!r} must be an integer, got {value!r}")
    return int(value)


def _add_metrics(run: RunData, path: Path) -> None:
    """Train and eval rows, with the keys the report draws checked: a train row needs `step`, `samples`
    and `time_s` (its place on every axis); `reward_mean` may be missing (drawn as a gap) and
    `samples_per_s` is derived when missing. An eval row without `eval_accuracy` has nothing to draw
    and is left out. Other kinds of rows are not read."""
    for i, r in _numbered_rows(path, run.notes):
        where = f"{path}: line {i}"
        if r.get("kind") == "train":
            step, samples, time_s = (_number(r, k, where) for k in ("step", "samples", "time_s"))
            reward = _optional_number(r, "reward_mean", where)
            rate = _optional_number(r, "samples_per_s", where)
            if rate is None:
                rate = samples / time_s if time_s > 0 else 0.0
            run.train.append({**r, "step": step, "samples": samples, "time_s": time_s, "samples_per_s": rate,
                              "reward_mean": math.nan if reward is None else reward})
        elif r.get("kind") == "eval":
            step = _number(r, "step", where)
            if _optional_number(r, "eval_accuracy", where) is not None:
                run.evals.append({**r, "step": step})


def _add_samples(run: RunData, path: Path) -> None:
    """Status counts and the staleness (trained minus behaviour version) of trained samples."""
    for i, s in _numbered_rows(path, run.notes):
        run.status[str(s.get("status"))] += 1
        if s.get("status") == "trained" and s.get("trained_version") is not None:
            where = f"{path}: line {i}"
            run.staleness[_version(s, "trained_version", where) - _version(s, "behavior_version", where)] += 1


def _add_trace(run: RunData, path: Path) -> None:
    """Work spans per track from a Chrome trace (an event array, possibly without its closing `]` when
    the run was killed, or an object with `traceEvents` as older runs wrote)."""
    try:
        doc, cut = parse_trace(_read_text(path))
    except ValueError:
        run.notes.append(f"{path}: not valid JSON (cut short?); the timeline and busy fractions are left out")
        return
    if cut:
        run.notes.append(f"{path}: cut short (the run was killed?); read up to its last whole event")
    events = doc.get("traceEvents", []) if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise UserError(f"{path}: not a Chrome trace (expected a traceEvents list)")
    other = doc.get("otherData") if isinstance(doc, dict) else None
    dropped = other.get("dropped_spans") if isinstance(other, dict) else None
    for e in events if isinstance(doc, list) else []:  # (an in-memory trace that hit its cap says so last)
        if isinstance(e, dict) and e.get("name") == DROPPED and isinstance(e.get("args"), dict):
            dropped = e["args"].get("dropped_spans")
    names: dict[int | str, str] = {}
    spans: list[tuple[int | str, float, float]] = []  # (tid, start, end) in s
    for i, e in enumerate(events):
        where = f"{path}: event {i}"
        if not isinstance(e, dict):
            raise UserError(f"{where} is not a JSON object")
        ph, name = e.get("ph"), e.get("name")
        if ph not in ("M", "X") or (ph == "M" and name != "thread_name") or str(name).startswith(WAIT_PREFIXES):
            continue
        tid = e.get("tid")
        if tid is None:
            raise UserError(f"{where}: missing 'tid'")
        if isinstance(tid, bool) or not isinstance(tid, (int, str)):
            raise UserError(f"{where}: 'tid' must be a number or string, got {tid!r}")
        if ph == "M":
            args = e.get("args")
            if not isinstance(args, dict) or "name" not in args:
                raise UserError(f"{where}: a thread_name event needs args.name")
            names[tid] = printable(str(args["name"]))  # (shown in the picture and summary.md)
        else:
            start = _number(e, "ts", where) / 1e6
            spans.append((tid, start, start + _number(e, "dur", where) / 1e6))
    for tid, start, end in spans:
        run.spans.setdefault(names.get(tid, str(tid)), []).append((start, end))
    if isinstance(dropped, int) and dropped > 0:  # the run's trace reached its cap: later spans were not kept
        kept = max((e for _, _, e in spans), default=0.0)
        run.notes.append(f"{path}: {dropped} later spans were dropped at the trace's cap; the timeline and busy "
                         f"fractions cover the first {kept:.0f} s of the run only")


def load_run(path: str | Path, label: str | None = None) -> RunData:
    """Parse a run folder; a folder without `metrics.jsonl`, or a file in it of the wrong shape, is
    refused with one line naming the file (and line or event)."""
    p = Path(path)
    if not (p / "metrics.jsonl").is_file():
        raise UserError(f"{p}: not a run folder (no metrics.jsonl)")
    run = RunData(p, label or p.name)
    _add_metrics(run, p / "metrics.jsonl")
    if (p / "samples.jsonl").is_file():
        _add_samples(run, p / "samples.jsonl")
    run.audit = audit_run(p, run.status)
    if (p / "trace.json").is_file():
        _add_trace(run, p / "trace.json")
    return run


def _union_seconds(spans: list[tuple[float, float]]) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return total


def busy_fractions(run: RunData) -> dict[str, float]:
    """Per trace track: the share of the run's wall time covered by its (non-wait) spans."""
    wall = run.wall_s
    if wall <= 0:
        return {}
    return {track: min(_union_seconds(spans) / wall, 1.0) for track, spans in sorted(run.spans.items())}


def _figures(run: RunData) -> dict[str, Any]:
    last = run.train[-1] if run.train else {}
    trained = sum(run.staleness.values())
    return {
        "steps": last.get("step", 0),
        "samples": last.get("samples", 0),
        "time_s": last.get("time_s", 0.0),
        "samples_per_s": last.get("samples_per_s", 0.0),
        "eval_first": run.evals[0]["eval_accuracy"] if run.evals else None,
        "eval_last": run.evals[-1]["eval_accuracy"] if run.evals else None,
        "reward_last": last["reward_mean"] if last and not math.isnan(last["reward_mean"]) else None,
        # from samples.jsonl; without it, from the train rows (per-step means weighted by step size)
        "staleness_mean": sum(k * n for k, n in run.staleness.items()) / trained if trained else _step_mean(run),
        "staleness_max": max(run.staleness) if trained else _step_max(run),
        "status": dict(run.status),
    }


def _step_mean(run: RunData) -> float | None:
    """Staleness mean over the train rows' `staleness_mean`, each weighted by its step's samples."""
    total = weight = 0.0
    before = 0.0
    for r in run.train:
        n = r["samples"] - before
        before = r["samples"]
        if isinstance(r.get("staleness_mean"), (int, float)) and math.isfinite(r["staleness_mean"]) and n > 0:
            total, weight = total + r["staleness_mean"] * n, weight + n
    return total / weight if weight else None


def _step_max(run: RunData) -> int | None:
    values = [r["staleness_max"] for r in run.train
              if isinstance(r.get("staleness_max"), (int, float)) and math.isfinite(r["staleness_max"])]
    return int(max(values)) if values else None


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "n/a" if v is None else format(v, spec)


def summary_markdown(runs: list[RunData]) -> str:
    """The key figures of each run; with several runs, the speed-up of each over the first."""
    lines = ["# asyncflow report", ""]
    figs = [_figures(r) for r in runs]
    lines += [
        "| run | steps | trained samples | s at last step | samples/s | eval accuracy (first -> last) | last reward | "
        "staleness mean / max | dropped / filtered / errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, f in zip(runs, figs, strict=True):
        st = f["status"]
        lines.append(
            f"| {r.label} | {f['steps']} | {f['samples']} | {f['time_s']:.1f} | {f['samples_per_s']:.2f} | "
            f"{_fmt(f['eval_first'])} -> {_fmt(f['eval_last'])} | {_fmt(f['reward_last'])} | "
            f"{_fmt(f['staleness_mean'], '.2f')} / {_fmt(f['staleness_max'], 'd')} | "
            f"{st.get('dropped_stale', 0) + st.get('cancelled', 0)} / {st.get('filtered', 0)} / {st.get('reward_error', 0)} |"
        )
    if len(runs) > 1 and figs[0]["samples_per_s"]:
        lines += ["", f"Throughput relative to {runs[0].label}: " + ", ".join(
            f"{r.label} {f['samples_per_s'] / figs[0]['samples_per_s']:.2f}x" for r, f in zip(runs, figs, strict=True))]
    lines += ["", "## Busy fraction per trace track (share of wall time with work on it)", ""]
    for r in runs:
        busy = busy_fractions(r)
        lines.append(f"- {r.label}: " + (", ".join(f"{t} {b:.2f}" for t, b in busy.items()) or "no trace"))
    lines += ["", "## Sample accounting (summary.json against the statuses in samples.jsonl)", ""]
    lines += [audit_line(r) for r in runs]
    lines += ["", "Picture: report.png (reward, eval accuracy, throughput, staleness, busy fractions, timeline).", ""]
    return "\n".join(lines)


def audit_line(run: RunData) -> str:
    """One line on whether `run`'s accounting and its samples.jsonl agree."""
    if run.audit is None:
        return f"- {run.label}: not audited (no summary.json: the run has not finished)"
    if not run.audit:
        return f"- {run.label}: agree ({sum(run.status.values())} rows in samples.jsonl)"
    return f"- {run.label}: DISAGREE: " + "; ".join(run.audit)


def _moving_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (train reward is noisy step to step); NaN values (a
    row without `reward_mean`) are left out of it, and a window of only NaN is NaN."""
    out, total, count = [], 0.0, 0
    for i, v in enumerate(values):
        if not math.isnan(v):
            total, count = total + v, count + 1
        if i >= window and not math.isnan(values[i - window]):
            total, count = total - values[i - window], count - 1
        out.append(total / count if count else math.nan)
    return out


def plot_report(runs: list[RunData], out_png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = runs[:3]  # timeline strips: one per run, at most three
    fig = plt.figure(figsize=(14, 10 + 2.6 * len(shown)), dpi=100)
    grid = fig.add_gridspec(3 + len(shown), 3, height_ratios=[1, 1, 1] + [0.9] * len(shown))
    ax_rs, ax_rt, ax_tp = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[0, 2])
    ax_es, ax_et, ax_st = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]), fig.add_subplot(grid[1, 2])
    ax_busy = fig.add_subplot(grid[2, :])
    colors = [f"C{i % 10}" for i in range(len(runs))]
    for run, color in zip(runs, colors, strict=True):
        _plot_curves(run, color, ax_rs, ax_rt, ax_tp, ax_es, ax_et)
    _plot_shares(runs, colors, ax_st, ax_busy)
    for i, run in enumerate(shown):
        _plot_timeline(fig.add_subplot(grid[3 + i, :]), run, colors[i])
    titles = [
        (ax_rs, "train reward vs trained samples", "samples", "reward_mean"),
        (ax_rt, "train reward vs time", "seconds", "reward_mean"),
        (ax_tp, "throughput", "seconds", "samples/s"),
        (ax_es, "eval accuracy vs trained samples", "samples", "eval_accuracy"),
        (ax_et, "eval accuracy vs time", "seconds", "eval_accuracy"),
        (ax_st, "staleness of trained samples", "versions behind", "share"),
        (ax_busy, "busy fraction per trace track", "", "share of wall time"),
    ]
    for ax, title, xl, yl in titles:
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
    for ax in (ax_rs, ax_rt, ax_tp, ax_es, ax_et, ax_st, ax_busy):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def _plot_curves(run: RunData, color: str, ax_rs: Any, ax_rt: Any, ax_tp: Any, ax_es: Any, ax_et: Any) -> None:
    """One run's lines: train reward vs samples and time, throughput, eval accuracy vs samples and time."""
    samples = [r["samples"] for r in run.train]
    times = [r["time_s"] for r in run.train]
    rewards = [r["reward_mean"] for r in run.train]
    smooth = _moving_mean(rewards, max(1, len(rewards) // 15))
    ax_rs.plot(samples, rewards, color=color, alpha=0.25, linewidth=0.8)
    ax_rs.plot(samples, smooth, color=color, label=f"{run.label} (moving mean)")
    ax_rt.plot(times, rewards, color=color, alpha=0.25, linewidth=0.8)
    ax_rt.plot(times, smooth, color=color, label=f"{run.label} (moving mean)")
    # throughput between consecutive rows (the cumulative mean hides changes)
    inst = [(b["samples"] - a["samples"]) / max(b["time_s"] - a["time_s"], 1e-9)
            for a, b in zip(run.train, run.train[1:], strict=False)]
    ax_tp.plot(times[1:], inst, color=color, alpha=0.3, linewidth=0.8)
    ax_tp.plot(times, [r["samples_per_s"] for r in run.train], color=color, label=f"{run.label} (cumulative)")
    by_step = {0: (0, 0.0), **{r["step"]: (r["samples"], r["time_s"]) for r in run.train}}
    ev = [(by_step[e["step"]], e["eval_accuracy"]) for e in run.evals if e["step"] in by_step]
    ax_es.plot([s for (s, _), _ in ev], [a for _, a in ev], color=color, marker="o", label=run.label)
    ax_et.plot([t for (_, t), _ in ev], [a for _, a in ev], color=color, marker="o", label=run.label)


def _plot_shares(runs: list[RunData], colors: list[str], ax_st: Any, ax_busy: Any) -> None:
    """Grouped bars, one bar per run: the staleness distribution and the busy fraction per trace track."""
    ks = sorted({k for r in runs for k in r.staleness})
    width = 0.8 / max(len(runs), 1)
    offsets = [(i - (len(runs) - 1) / 2) * width for i in range(len(runs))]
    for run, off, color in zip(runs, offsets, colors, strict=True):
        total = max(sum(run.staleness.values()), 1)
        ax_st.bar([k + off for k in ks], [run.staleness.get(k, 0) / total for k in ks], width, color=color,
                  label=run.label)
    ax_st.set_xticks(ks)
    tracks = sorted({t for r in runs for t in r.spans})
    for run, off, color in zip(runs, offsets, colors, strict=True):
        busy = busy_fractions(run)
        ax_busy.bar([j + off for j in range(len(tracks))], [busy.get(t, 0.0) for t in tracks], width, color=color,
                    label=run.label)
    ax_busy.set_xticks(range(len(tracks)), tracks, rotation=30, ha="right", fontsize=8)


def _plot_timeline(ax: Any, run: RunData, color: str) -> None:
    """One run's timeline strip: its work spans per trace track."""
    # a window of at most 30 s from 40% into the run: long enough to show several steps, short
    # enough that each span is visible
    wall = run.wall_s
    lo = 0.4 * wall if wall > 30 else 0.0
    hi = min(wall, lo + 30.0)
    tracks = sorted(run.spans)
    for j, track in enumerate(tracks):
        bars = [(s0, e0 - s0) for s0, e0 in run.spans[track] if e0 >= lo and s0 <= hi]
        ax.broken_barh(bars, (j - 0.4, 0.8), color=color)
    ax.set_xlim(lo, hi)
    ax.set_yticks(range(len(tracks)), tracks, fontsize=8)
    ax.set_title(f"timeline: {run.label}, {lo:.0f}-{hi:.0f} s (work spans per track; waits left out)", fontsize=10)
    ax.set_xlabel("seconds")
    ax.grid(alpha=0.3)


def _why_none(run_dir: Path) -> str:
    """Why a run folder has no train step: the failure its `failed.json` records, or it has not run one yet."""
    from asyncflow.run_folder import FAILED_FILE

    try:
        error = json.loads((run_dir / FAILED_FILE).read_text())["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return "yet"
    return f"(the run failed before its first train step: {error}; samples.jsonl holds each recorded sample's error)"


def write_report(run_dirs: list[str | Path], log: Callable[[str], None] | None = None,
                 say: Callable[[str], None] | None = None) -> tuple[Path, Path]:
    """Write `report.png` and `summary.md` into the first run folder; returns their paths. `log`
    gets a note for each thing left out while reading (a run's cut-short last line); `say` the
    accounting audit's line of each finished run."""
    if not run_dirs:
        raise UserError("report: give at least one run folder")
    labels = [Path(d).name or Path(d).resolve().name for d in run_dirs]  # ("." has no name of its own)
    if len(set(labels)) < len(labels):  # same folder names in different places: use the full paths
        labels = [str(d) for d in run_dirs]
    runs = [load_run(d, label) for d, label in zip(run_dirs, labels, strict=True)]
    if log is not None:
        for note in (n for r in runs for n in r.notes):
            log(printable(f"[asyncflow] note: {note}"))
    for r in runs:
        if not r.train:
            raise UserError(f"{r.path}: metrics.jsonl has no train rows {_why_none(r.path)}")
    if say is not None:
        for r in runs:
            if r.audit is not None:
                say(printable(f"[asyncflow] accounting: {audit_line(r)[2:]}"))
    out = runs[0].path
    png, md = out / "report.png", out / "summary.md"
    text = printable(summary_markdown(runs))
    for target, write in ((png, lambda: replace_file(png, lambda tmp: plot_report(runs, tmp))),
                          (md, lambda: write_text_atomic(md, text))):
        try:
            write()
        except OSError as exc:  # a read-only mount, another user's run, a full disk: one line, not a traceback
            raise UserError(f"{target}: cannot be written ({exc.strerror or exc}); run the report from a copy "
                            "of the folder") from None
    return png, md


__all__ = ["audit_line", "busy_fractions", "load_run", "plot_report", "summary_markdown", "write_report"]
