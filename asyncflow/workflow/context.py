"""What the stages of one process share (`StageContext`): the store, the clock, the trace, the sample
log, the one lease keeper, the counters and the version board. Each shared value that changes has
a named owner: the trainer writes the version board's version, whoever is told the floor writes its
floor, and each counter has the one stage that counts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from asyncflow.clock import Clock, SweptClock
from asyncflow.telemetry.jsonl import sample_line
from asyncflow.telemetry.runlog import RunLog, Tracer
from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import SampleView, StoreClient
from asyncflow.workflow.episode import generated_tokens
from asyncflow.workflow.lease_keeper import LeaseKeeper
from asyncflow.workflow.settings import ContextSettings

CANCELLED = "cancelled: could no longer meet max_staleness"
STRAGGLER = "aborted: still generating at rollout.group_timeout_s"
ABORTED = "aborted"  # the finish_reason a straggler's sample is written with

# (sample, the version that trained it, status, error) per samples.jsonl row
LoggedSample = tuple[SampleView, "int | None", str, "str | None"]


@dataclass
class Counters:
    """Cumulative counts of what happened to samples. Counted by: rollout (`produced`, `episodes`,
    `episode_failures`), reward (`reward_calls`, `reward_call_failures`), the sample log
    (`response_*`), the trainer (the rest)."""

    produced: int = 0  # samples whose rollout (generation or episode) finished and was written
    trained: int = 0
    tokens: int = 0
    dropped_stale: int = 0
    filtered: int = 0
    filter_overflow: int = 0  # equal-reward groups trained because a step hit its filter budget
    response_tokens: dict[str, int] = field(default_factory=dict)  # by final status, for bias metrics
    response_count: dict[str, int] = field(default_factory=dict)
    reward_errors: int = 0
    cancelled: int = 0
    aborted: int = 0  # samples logged `aborted`: stragglers, and the finished samples of a group left too small
    stragglers_aborted: int = 0  # stragglers among them (requests cut at rollout.group_timeout_s)
    groups_partial: int = 0  # groups trained without their aborted stragglers
    reward_calls: int = 0  # reward calls made by this process (a resume starts them again: fail-fast)
    reward_call_failures: int = 0
    episodes: int = 0  # multi-turn episodes ended (environment or agent), and those that failed (likewise)
    episode_failures: int = 0
    train_busy_s: float = 0.0

    def restore(self, saved: dict[str, Any]) -> None:
        """A checkpoint's counts, in place. The fail-fast rule is about this process's first calls:
        restored call counts (all past the limit) turned it off, so those start again at 0."""
        fresh = {**saved, "reward_calls": 0, "reward_call_failures": 0, "episodes": 0, "episode_failures": 0}
        self.__dict__.update(type(self)(**fresh).__dict__)


class VersionBoard:
    """The trainer's policy version and the staleness floor the engines were last told
    (`cancel_older_than`): episodes older than the floor end before their next turn. One writer
    each: the trainer advances the version; the floor is set by whoever tells the engines (the
    trainer's publication in process; in a Ray rollout actor, the driver's call)."""

    def __init__(self) -> None:
        self.version = 0
        self.floor: float = -math.inf

    def advance(self) -> int:
        """The next version (an export of trained weights); returns it."""
        self.version += 1
        return self.version

    def raise_floor(self, floor: float) -> None:
        self.floor = max(self.floor, floor)


class SampleLog:
    """samples.jsonl: one row per sample that leaves the workflow (trained, or why not)."""

    def __init__(self, log: RunLog, rows: list[dict[str, Any]], tok: Tokenizer, prompt_key: str,
                 counters: Counters) -> None:
        """`rows`: the prompt rows, by the samples' `row` field (a list filled later is seen)."""
        self.log = log
        self.rows = rows
        self.tok = tok
        self.prompt_key = prompt_key
        self.counters = counters

    def write(self, items: list[LoggedSample], rewards: list[float | None] | None = None) -> None:
        """One row per item; `rewards`: the reward each was trained with, item by item (default: its
        `reward` field)."""
        rows, decode, key = self.rows, self.tok.decode, self.prompt_key
        tokens_by, count_by = self.counters.response_tokens, self.counters.response_count
        lines = []
        for i, (s, trained_version, status, error) in enumerate(items):
            f = s.fields
            resp = f.get("response_ids")
            n_resp = 0 if resp is None else len(resp)
            if n_resp:
                tokens_by[status] = tokens_by.get(status, 0) + n_resp
                count_by[status] = count_by.get(status, 0) + 1
            version = f.get("behavior_version")
            reward = f.get("reward") if rewards is None else rewards[i]
            extra = None
            if "loss_mask" in f:
                extra = {"turns": f.get("turns"), "generated_tokens": generated_tokens(f["loss_mask"])}
            if "agent_calls" in f:
                extra = {**(extra or {}), "agent_calls": f["agent_calls"], "agent_calls_dropped": f["agent_calls_dropped"]}
            lines.append(sample_line(
                s.uid, s.group_id, rows[f["row"]].get(key) if "row" in f else None,
                None if resp is None else decode(resp),
                None if reward is None or (isinstance(reward, float) and math.isnan(reward)) else reward,
                None if version is None or version < 0 else version, trained_version, status, error, extra))
        self.log.sample_lines(lines)


class StageContext:
    """One per process: what its stages share. Built by `build_pipeline` in process, by each Ray
    actor for its stage."""

    def __init__(self, store: StoreClient, clock: Clock, tracer: Tracer, log: RunLog, settings: ContextSettings, *,
                 rows: list[dict[str, Any]], tok: Tokenizer) -> None:
        """`rows`: the prompt rows (for samples.jsonl; a Ray actor's list is filled once it started)."""
        self.store = store
        self.clock = clock
        # episodes wait twice per turn (generation, environment step), an async reward function once
        # per group: one sweeping timer for all of those bounded waits instead of a timer each
        self.swept = SweptClock(clock)
        self.tracer = tracer
        self.keeper = LeaseKeeper(store, clock, settings.lease_timeout_s)
        self.counters = Counters()
        self.board = VersionBoard()
        self.samples = SampleLog(log, rows, tok, settings.prompt_key, self.counters)

    def close(self) -> None:
        """Stop the deadline sweeper and the lease keeper (each a task of its own)."""
        self.swept.close()
        self.keeper.close()
