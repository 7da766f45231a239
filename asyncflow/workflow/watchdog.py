"""The stall watchdog: ends a run in which no sample has changed state for `workflow.stall_timeout_s`.

Every wait of a stage is bounded on its own; this is the view across the pipeline. It reads the
store's `changes` counter (every put, write, take and lease end) and the engines' computing seconds
(where an engine in this process reports them) every tenth of the timeout; when neither has moved
for the whole timeout it writes, into the run folder's `stall/`, every
process's stacks (this one's threads and asyncio tasks, and each Ray actor's), the store's counts
per state, and which stage it blames, then ends the run with `StallDetected` (one line, exit 1; a
resume goes on from the last checkpoint).

Which stage: a weight publication still loading is the trainer's; a trainer not collecting a batch
is in its train step; else the first stage (rollout, reward, reference, in that order) holding
samples it took and has not finished; else the stage with samples ready that it does not take;
else the trainer waits for a batch that nothing produces (the feeder and its staleness gate).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

from asyncflow.clock import Clock
from asyncflow.errors import RunFailed, WaitTimeout
from asyncflow.stacks import all_tasks, process_stacks, task_frames, waiting_in
from asyncflow.transfer_queue import StoreClient

STALL_DIR = "stall"
REMOTE_STACKS_TIMEOUT_S = 60.0  # gathering every actor's stacks (each actor's own bound is the runtime's)

# the modules whose frames mark a task as working for a stage (its request, episode or call tasks)
_STAGE_FILES = {"rollout": ("rollout.py", "episode.py", "flight.py"), "reward": ("reward.py",),
                "reference": ("reference.py",)}

RemoteStacks = Callable[[], Awaitable[dict[str, str]]]


class StallDetected(RunFailed):
    """No sample changed state for `workflow.stall_timeout_s`; the message names the stage blamed."""


def blame(metrics: Mapping[str, float], tasks: Mapping[str, list[FrameType]],
          stages: Sequence[str]) -> tuple[str, str]:
    """(stage, what it waits on) of a stalled pipeline, from the store's counts and this process's
    tasks' frames by task name. `stages`: the store's stage names, rollout first."""
    for name, frames in tasks.items():
        if name.startswith("trainer: publish"):  # (each engine's load is a task of the publication's gather)
            loads = [f for f in tasks.values() if any(fr.f_code.co_name == "load_weights" for fr in f)]
            return "train", (f"is loading weights into the engines ({name[9:]}), waiting in "
                             f"{waiting_in(loads[0] if loads else frames)}")
    trainer = tasks.get("trainer")
    if trainer and not any("collect" in f.f_code.co_name or "unless_failed" in f.f_code.co_name for f in trainer):
        return "train", f"is in a train step, waiting in {waiting_in(trainer)}"
    upstream = [s for s in stages if s != "train"]
    for stage in upstream:
        held = int(metrics.get(f"leased/{stage}", 0))
        if held:
            return stage, f"holds {held} sample(s) it took and has not finished{_where(stage, tasks)}"
    for stage in upstream:
        ready = int(metrics.get(f"depth/{stage}", 0))
        if ready:
            return stage, f"takes none of the {ready} sample(s) ready for it{_where(stage, tasks)}"
    ready = int(metrics.get("depth/train", 0))
    return "train", (f"waits for a batch with {ready} sample(s) ready for it and none coming: the feeder admits "
                     "no prompts (the staleness gate waits for a publication)")


def _where(stage: str, tasks: Mapping[str, list[FrameType]]) -> str:
    """Where this process's tasks working for `stage` wait (none: the stage runs elsewhere)."""
    files = _STAGE_FILES.get(stage.split("/")[0], ())
    chains = [f for f in tasks.values() if any(fr.f_code.co_filename.endswith(files) for fr in f)]
    if not chains:
        return ""
    return f", waiting in {waiting_in(max(chains, key=len))}"


class StallWatchdog:
    """Watches the store's progress counter; on a stall, dumps and raises `StallDetected`."""

    def __init__(self, store: StoreClient, clock: Clock, timeout_s: float, *, folder: Path,
                 stages: Sequence[str], busy: Callable[[], float] = lambda: 0.0,
                 remote_stacks: RemoteStacks | None = None) -> None:
        """`folder`: the run folder (`stall/` goes in it). `stages`: the store's stage names. `busy`:
        the engines' computing seconds so far (a multi-turn episode generates for long before its
        sample changes state). `remote_stacks`: every other process's stack dump by name (Ray actors)."""
        self.store = store
        self.busy = busy
        self.clock = clock
        self.timeout_s = timeout_s
        self.folder = folder
        self.stages = list(stages)
        self.remote_stacks = remote_stacks

    async def run(self) -> None:
        """Until cancelled (the run ended) or a stall, which raises `StallDetected`."""
        period = self.timeout_s / 10
        last = (-1.0, -1.0)
        since = self.clock.now()
        while True:
            await self.clock.sleep(period)
            metrics = await self.store.metrics_async()
            now = self.clock.now()
            progress = (metrics["changes"], self.busy())
            if progress != last:
                last, since = progress, now
            elif now - since >= self.timeout_s:
                raise await self.report(metrics, now - since)

    async def report(self, metrics: dict[str, float], idle_s: float) -> StallDetected:
        """Write `stall/` and return the error that ends the run."""
        loop = asyncio.get_running_loop()
        tasks = {t.get_name(): task_frames(t) for t in all_tasks(loop) if t is not asyncio.current_task()}
        stage, what = blame(metrics, tasks, self.stages)
        out = self.folder / STALL_DIR
        out.mkdir(parents=True, exist_ok=True)
        (out / "driver.txt").write_text(process_stacks(loop, "driver: the trainer's process"))
        remote = await self._remote()
        for name, text in remote.items():
            (out / f"{name.replace('/', '-')}.txt").write_text(text)
        line = (f"stalled: no sample changed state for {idle_s:.0f} s (workflow.stall_timeout_s="
                f"{self.timeout_s:g}); stage {stage} {what}; stacks and store counts in {out}")
        (out / "store.json").write_text(json.dumps({"stage": stage, "waiting": what, "idle_s": idle_s,
                                                    "counts": _counts(metrics, self.stages), "metrics": metrics},
                                                   indent=1))
        return StallDetected(line)

    async def _remote(self) -> dict[str, str]:
        if self.remote_stacks is None:
            return {}
        try:
            return await self.clock.wait_for(self.remote_stacks(), REMOTE_STACKS_TIMEOUT_S, "the actors' stacks")
        except WaitTimeout as exc:
            return {"remote": f"{exc}\n"}


def _counts(metrics: Mapping[str, float], stages: Sequence[str]) -> dict[str, dict[str, int]]:
    """Samples per state, by stage: ready for it (not taken), taken by it (leased, not finished)."""
    return {s: {"ready": int(metrics.get(f"depth/{s}", 0)), "taken": int(metrics.get(f"leased/{s}", 0))}
            for s in stages}
