"""`asyncflow report`: figures from a run folder, busy fractions from the trace, comparisons, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncflow.cli import main
from asyncflow.errors import UserError
from asyncflow.telemetry.report import busy_fractions, load_run, write_report


def _run(path: Path, rate: float) -> Path:
    path.mkdir(parents=True)
    rows = [{"kind": "eval", "step": 0, "eval_accuracy": 0.2, "eval_reward": 0.2}]
    for step in range(1, 5):
        rows.append({"kind": "train", "step": step, "samples": 10 * step, "time_s": 10 * step / rate,
                     "samples_per_s": rate, "reward_mean": 0.1 * step, "staleness_mean": 0.5})
    rows.append({"kind": "eval", "step": 4, "eval_accuracy": 0.6, "eval_reward": 0.6})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [{"uid": i, "status": "trained", "behavior_version": 0, "trained_version": i % 3} for i in range(6)]
    samples.append({"uid": 9, "status": "dropped_stale", "behavior_version": 0, "trained_version": None})
    (path / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    meta = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}}
            for t, n in ((1, "trainer"), (2, "rollout/0"))]
    spans = [
        {"ph": "X", "name": "wait for batch", "pid": 1, "tid": 1, "ts": 0, "dur": 2e6},  # a wait: not busy
        {"ph": "X", "name": "train step 1", "pid": 1, "tid": 1, "ts": 2e6, "dur": 3e6},
        {"ph": "X", "name": "generating", "pid": 1, "tid": 2, "ts": 0, "dur": 6e6},
        {"ph": "X", "name": "generating", "pid": 1, "tid": 2, "ts": 4e6, "dur": 6e6},  # overlaps: counted once
    ]
    (path / "trace.json").write_text(json.dumps({"traceEvents": meta + spans}))
    return path


def test_report_of_one_run_has_the_figures_and_busy_fractions(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "async", rate=4.0)
    run = load_run(run_dir)
    assert busy_fractions(run) == pytest.approx({"rollout/0": 1.0, "trainer": 0.3})  # wall = 10 s
    assert dict(run.staleness) == {0: 2, 1: 2, 2: 2} and run.status["dropped_stale"] == 1
    png, md = write_report([run_dir])
    assert png == run_dir / "report.png" and png.stat().st_size > 20_000
    text = md.read_text()
    assert "| async | 4 | 40 | 10.0 | 4.00 | 0.200 -> 0.600 | 0.400 | 1.00 / 2 | 1 / 0 / 0 |" in text
    assert "rollout/0 1.00, trainer 0.30" in text


def test_several_runs_are_compared_in_one_picture(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "sync", rate=2.0), _run(tmp_path / "async", rate=3.0)
    assert main(["report", str(a), str(b)]) == 0
    text = (a / "summary.md").read_text()
    assert "Throughput relative to sync: sync 1.00x, async 1.50x" in text
    assert not (b / "report.png").exists()


def test_bad_run_folders_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "not a run folder" in err and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no train rows yet$"):
        write_report([tmp_path / "empty"])
    (tmp_path / "empty" / "failed.json").write_text('{"status": "failed", "error": "reward.fn: the first 4 calls failed"}')
    with pytest.raises(UserError) as info:  # a run kept after it failed says why it has none
        write_report([tmp_path / "empty"])
    assert str(info.value) == (f"{tmp_path / 'empty'}: metrics.jsonl has no train rows (the run failed before its first "
                               "train step: reward.fn: the first 4 calls failed; samples.jsonl holds each recorded "
                               "sample's error)")


def test_a_run_cut_short_mid_line_is_reported_up_to_its_last_whole_row(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that crashed (or is still writing) can end in half a line; `report` refused the whole
    run ("line 6 is not JSON"). The torn row is left out with a note; a bad line before the end is
    still an error, and so is a torn line followed by more lines."""
    run_dir = _run(tmp_path / "crashed", rate=4.0)
    for name in ("metrics.jsonl", "samples.jsonl"):
        (run_dir / name).write_bytes((run_dir / name).read_bytes()[:-9])
    monkeypatch.chdir(run_dir)
    assert main(["report", "."]) == 0
    err = capsys.readouterr().err
    assert "metrics.jsonl: line 6 is cut short" in err and "samples.jsonl: line 7 is cut short" in err
    text = (run_dir / "summary.md").read_text()
    assert "| crashed | 4 | 40 |" in text  # "." is labelled with the folder's name, not ""
    assert "0.200 -> 0.200" in text  # the last eval row was the torn one
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('\n{"kind": "eval"}\n')
    with pytest.raises(UserError, match="metrics.jsonl: line 6 is not JSON"):
        load_run(run_dir)


def test_a_cut_short_or_capped_trace_is_a_note_and_an_unwritable_folder_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace cut short (a run killed while writing it) refused the whole run although every curve
    comes from metrics.jsonl; a trace that hit its cap said nothing of the spans it dropped; a folder
    the report cannot write was a 32-line traceback."""
    run_dir = _run(tmp_path / "cut", rate=4.0)
    trace = run_dir / "trace.json"
    trace.write_bytes(trace.read_bytes()[:-40])
    assert main(["report", str(run_dir)]) == 0
    assert "trace.json: not valid JSON (cut short?); the timeline and busy fractions are left out" in \
        capsys.readouterr().err
    assert load_run(run_dir).spans == {}
    doc = json.loads(json.dumps({"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "trainer"}},
        {"ph": "X", "name": "train step 1", "pid": 1, "tid": 1, "ts": 0, "dur": 9.5e6}],
        "otherData": {"dropped_spans": 90, "max_events": 2}}))
    trace.write_text(json.dumps(doc))
    assert load_run(run_dir).notes == [f"{trace}: 90 later spans were dropped at the trace's cap; the timeline and "
                                       "busy fractions cover the first 10 s of the run only"]

    def read_only(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("asyncflow.telemetry.report.plot_report", read_only)
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[-1].startswith("asyncflow: error: ")  # (after the note)
    assert f"{run_dir / 'report.png'}: cannot be written (Permission denied)" in err.splitlines()[-1]


def test_the_tracer_writes_its_file_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncflow.telemetry.runlog import Tracer

    tracer = Tracer()
    tracer.span("trainer", "step", 0.0, 1.0)
    tracer.write(tmp_path / "trace.json")
    before = (tmp_path / "trace.json").read_text()
    tracer.span("trainer", "step 2", 1.0, 2.0)
    monkeypatch.setattr("os.replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        tracer.write(tmp_path / "trace.json")
    assert (tmp_path / "trace.json").read_text() == before  # the old file stands, whole


def test_the_run_trace_streams_as_a_chrome_array_that_a_kill_leaves_readable(tmp_path: Path) -> None:
    """trace.json is written as spans end (`[`, an event per line); before `close` it has no `]`,
    as a killed run's, and reads as Perfetto reads it; after it, it is one JSON array."""
    import asyncflow.telemetry.runlog as runlog
    from asyncflow.telemetry.runlog import Tracer, parse_trace

    run_dir = _run(tmp_path / "streamed", rate=4.0)
    path = run_dir / "trace.json"
    tracer = Tracer(now=lambda: 0.0, path=path)
    for i in range(runlog.TRACE_FLUSH_EVENTS + 5):  # (one flush by count; the 5 after it still buffered)
        tracer.span("trainer" if i % 2 else "rollout/0", f"train step {i}", 0.0, 1.0, samples=i)
    text = path.read_text()
    events = json.loads(text + "]")  # as Perfetto reads a trace without its closing bracket
    assert {e["args"]["name"] for e in events if e["name"] == "thread_name"} == {"trainer", "rollout/0"}
    assert parse_trace(text + ',\n{"ph": "X", "na')[0] == events  # (a cut last line is left out)
    run = load_run(run_dir)
    assert set(run.spans) == {"trainer", "rollout/0"}
    assert any("cut short (the run was killed?)" in n for n in run.notes)
    tracer.close()
    events = json.loads(path.read_text())
    assert sum(e["ph"] == "X" for e in events) == runlog.TRACE_FLUSH_EVENTS + 5
    assert load_run(run_dir).notes == []


def test_an_in_memory_trace_over_its_cap_says_so(tmp_path: Path) -> None:
    from asyncflow.telemetry.runlog import Tracer

    run_dir = _run(tmp_path / "capped", rate=4.0)
    tracer = Tracer(now=lambda: 0.0, max_events=2)
    for i in range(5):
        tracer.span("trainer", f"train step {i}", float(i), i + 1.0)
    tracer.write(run_dir / "trace.json")
    assert load_run(run_dir).notes == [f"{run_dir / 'trace.json'}: 3 later spans were dropped at the trace's cap; "
                                       "the timeline and busy fractions cover the first 2 s of the run only"]


def test_without_samples_jsonl_the_staleness_comes_from_the_train_rows(tmp_path: Path) -> None:
    """It showed "0.00 / 0" (no trained samples read) although metrics.jsonl has it."""
    run_dir = _run(tmp_path / "nosamples", rate=4.0)
    (run_dir / "samples.jsonl").unlink()
    _, md = write_report([run_dir])
    assert "| nosamples | 4 | 40 | 10.0 | 4.00 | 0.200 -> 0.600 | 0.400 | 0.50 / n/a | 0 / 0 / 0 |" in md.read_text()


def test_non_finite_values_are_gaps_or_one_line_errors_not_tracebacks(tmp_path: Path) -> None:
    """A NaN staleness_max failed `int(max(...))`, an infinite time_s or trace `ts` failed the axis
    limits: tracebacks, exit 1. A NaN optional value is now a gap; a required one is one line."""
    run_dir = _run(tmp_path / "nan", rate=4.0)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r["kind"] == "train":
            r["staleness_max"] = float("nan")
    rows[2]["reward_mean"] = float("nan")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "samples.jsonl").unlink()
    write_report([run_dir])
    assert "| nan | 4 |" in (run_dir / "summary.md").read_text()
    rows[3]["time_s"] = float("inf")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"metrics.jsonl: line 4: 'time_s' must be a finite number, got inf"):
        load_run(run_dir)


def test_the_report_audits_summary_accounting_against_samples_jsonl(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`accounting.lost` is a balance of counters: a samples.jsonl missing a trained row still
    balanced. The report recounts the statuses from the rows and names the disagreement."""
    run_dir = _run(tmp_path / "run", rate=4.0)
    acc = {"admitted": 12, "trained": 6, "reward_error": 0, "filtered": 0, "dropped_stale": 1, "cancelled": 0,
           "in_store_at_end": 5, "lost": 0}
    (run_dir / "summary.json").write_text(json.dumps({"steps": 4, "accounting": acc}))
    assert main(["report", str(run_dir)]) == 0
    assert "[asyncflow] accounting: run: agree (7 rows in samples.jsonl)" in capsys.readouterr().out
    assert "- run: agree (7 rows in samples.jsonl)" in (run_dir / "summary.md").read_text()

    lines = (run_dir / "samples.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "samples.jsonl").write_text("".join(lines[1:]))  # a trained row removed
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    expected = ("run: DISAGREE: trained: summary.json counts 6, samples.jsonl has 5; lost: summary.json says 0; "
                "recounted from samples.jsonl, 12 admitted - 6 logged - 5 left in the store = 1")
    assert f"[asyncflow] accounting: {expected}" in out
    assert f"- {expected}" in (run_dir / "summary.md").read_text()

    (run_dir / "summary.json").unlink()  # a run still going: nothing to audit against
    assert load_run(run_dir).audit is None
    assert main(["report", str(run_dir)]) == 0
    assert "accounting" not in capsys.readouterr().out
    assert "run: not audited (no summary.json" in (run_dir / "summary.md").read_text()


def test_the_report_replaces_planted_symlinks_instead_of_writing_through_them(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", rate=2.0)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("summary.md", "report.png"):
        (run_dir / name).symlink_to(victim)
    write_report([run_dir])
    assert victim.read_text() == "keep me"
    assert not (run_dir / "summary.md").is_symlink() and not (run_dir / "report.png").is_symlink()
    assert (run_dir / "summary.md").read_text().startswith("# asyncflow report")
    assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []  # (no temp file left)


def test_control_characters_from_run_files_are_escaped_in_the_summary_and_the_notes(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", rate=2.0)
    doc = json.loads((run_dir / "trace.json").read_text())
    doc["traceEvents"][0]["args"]["name"] = "trainer\x1b[2J\x1b]0;pwned\x07"
    (run_dir / "trace.json").write_text(json.dumps(doc))
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "train", "step": 5, "samples": 50, "note": "\x1b[31m')  # (cut short: a note names it)
    notes: list[str] = []
    _png, md = write_report([run_dir], log=notes.append)
    text = md.read_text()
    assert "\x1b" not in text and "\x07" not in text and "trainer\\x1b[2J\\x1b]0;pwned\\x07" in text
    assert notes and all("\x1b" not in n for n in notes)


def test_a_trace_nested_past_the_recursion_limit_is_a_note_not_a_traceback(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "run", rate=2.0)
    (run_dir / "trace.json").write_text("[" * 100_000 + "]" * 100_000)
    notes: list[str] = []
    write_report([run_dir], log=notes.append)
    assert any("trace.json" in n for n in notes)
    (run_dir / "metrics.jsonl").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000 + "\n")
    with pytest.raises(UserError, match=r"metrics.jsonl: line 1 is JSON nested too deep to read$"):
        load_run(run_dir)
