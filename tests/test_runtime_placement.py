"""Thread placement per mode, and the progress display's plain-line fallback."""

from __future__ import annotations

import io
import os

import pytest

from asyncflow.config import load_config
from asyncflow.runner import torch_threads
from asyncflow.telemetry.progress import Progress


def test_async_splits_the_cores_and_sync_uses_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    assert torch_threads(load_config(None, ["task=arith", "workflow.mode=sync"])[0]) == cores
    assert torch_threads(load_config(None, ["task=arith", "workflow.mode=async"])[0]) == max(1, cores // 2)
    assert torch_threads(load_config(None, ["task=arith", "runtime.torch_threads=3"])[0]) == 3
    # the cores the process may use (taskset, a container's cpuset), not the machine's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert torch_threads(load_config(None, ["task=arith", "workflow.mode=sync"])[0]) == 3
    assert torch_threads(load_config(None, ["task=arith", "workflow.mode=async"])[0]) == 1


def test_progress_prints_plain_lines_with_eta_when_not_a_terminal() -> None:
    stream = io.StringIO()
    progress = Progress(10, stream=stream)
    progress.update(1, {"reward": 0.5})
    progress.update(10, {"reward": 0.75})
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[asyncflow] step 1/10 reward=0.5"
    assert lines[-1].startswith("[asyncflow] step 10/10 reward=0.75 eta=0s")
    quiet = io.StringIO()
    Progress(10, enabled=False, stream=quiet).update(1, {"x": 1})
    assert quiet.getvalue() == ""


def test_the_terminal_bar_rates_only_the_steps_it_saw_run() -> None:
    """The bar's rate counted every step before a resume (and set-up time): resumed at 90 of 100 at
    ~5 steps/s, it showed 47 it/s and an ETA of 0."""
    import time

    class _Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = _Tty()
    progress = Progress(100, stream=stream)
    time.sleep(0.3)  # set-up: not part of the rate
    progress.update(91, {"x": 1})
    for step in range(92, 96):
        time.sleep(0.05)
        progress.update(step, {"x": 1})
    rate = progress._bar.format_dict["rate"] or (progress._bar.n - progress._bar.initial) / progress._bar.format_dict[
        "elapsed"]
    progress.close()
    assert progress._bar.n == 95 and 1 <= rate <= 60, rate  # ~20/s (4 steps in ~0.2 s); it read 190-920
