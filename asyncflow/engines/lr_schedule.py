"""The learning-rate schedule (`train.lr_schedule`, `train.warmup_ratio`, `train.min_lr_ratio`).

Applied per optimizer step, as TRL (transformers' `Trainer`) does: optimizer step `i` (counted from 0
over the whole run, `train.max_steps x train.mini_batches` of them) uses `lr x factor(i)`, with the
factors of transformers' `get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup` (`cosine_with_min_lr` when `min_lr_ratio` > 0), step for step;
their warmup starts from 0, so the first optimizer step of a warmup has lr 0.

The position is counted in train steps (every train step has `mini_batches` optimizer-step slots,
a skipped step's included), so it is a function of the run's step alone. It travels in the optimizer
state (`optimizer.pt`, each param group's `SCHEDULE_KEY`), so a resumed run continues the schedule.
Plain Python: the FSDP driver computes each step's rates here and sends them to every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SCHEDULE_KEY = "asyncflow_train_steps"  # train steps taken, in each optimizer param group


@dataclass(frozen=True)
class LrSchedule:
    """`lr` scaled per optimizer step. `total_steps`: the run's optimizer steps."""

    lr: float
    kind: str = "constant"  # constant | linear | cosine
    warmup_ratio: float = 0.0
    total_steps: int = 1
    min_lr_ratio: float = 0.0  # cosine: the floor, as a fraction of lr
    mini_batches: int = 1  # optimizer steps per train step

    @property
    def warmup_steps(self) -> int:
        """Optimizer steps of warmup: ceil(ratio x total), as transformers counts `warmup_ratio`."""
        return math.ceil(self.total_steps * self.warmup_ratio)

    def factor(self, i: int) -> float:
        """The multiplier of `lr` for optimizer step `i` (from 0)."""
        warmup, total = self.warmup_steps, self.total_steps
        if i < warmup:
            return i / max(1, warmup)
        if self.kind == "constant":
            return 1.0
        if self.kind == "linear":
            return max(0.0, (total - i) / max(1, total - warmup))
        progress = (i - warmup) / max(1, total - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return max(0.0, cosine * (1.0 - self.min_lr_ratio) + self.min_lr_ratio)

    def rates(self, train_steps_done: int) -> list[float]:
        """The lr of each optimizer step of the next train step."""
        first = train_steps_done * self.mini_batches
        return [self.lr * self.factor(first + k) for k in range(self.mini_batches)]


def set_lr(optimizer: Any, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def mark_steps(optimizer: Any, train_steps_done: int) -> None:
    """Record the schedule's position in the optimizer state (saved with it)."""
    for group in optimizer.param_groups:
        group[SCHEDULE_KEY] = train_steps_done


def expect_keys_of(optimizer: Any, saved: dict[str, Any]) -> None:
    """Give `optimizer`'s groups the position key exactly when the `saved` state's have it (torch's
    distributed `set_optimizer_state_dict` maps the saved keys through the current ones)."""
    has = SCHEDULE_KEY in saved["param_groups"][0]
    for group in optimizer.param_groups:
        if has:
            group[SCHEDULE_KEY] = 0
        else:
            group.pop(SCHEDULE_KEY, None)


def restored_steps(optimizer: Any, mini_batches: int) -> int:
    """The position a loaded optimizer state records; a checkpoint written before it was recorded:
    AdamW's own count of the steps it applied (the same unless a step was skipped) / mini_batches."""
    group = optimizer.param_groups[0]
    if SCHEDULE_KEY in group:
        return int(group[SCHEDULE_KEY])
    counts = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
    return int(max(counts, default=0.0)) // max(1, mini_batches)
