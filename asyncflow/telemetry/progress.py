"""Live progress: a tqdm bar on a terminal, plain log lines (at most every few seconds) otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class Progress:
    """Shows train steps with the key figures of the latest step."""

    def __init__(self, total: int, *, enabled: bool = True, desc: str = "train", stream: TextIO | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._bar: Any = None
        self._last_line = 0.0
        self._first: tuple[int, float] | None = None  # (step, time) of the first update: ETA excludes set-up
        if enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True)

    def update(self, step: int, figures: dict[str, Any]) -> None:
        """Step `step` finished with `figures` (short name -> value)."""
        if not self.enabled:
            return
        text = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        if self._bar is not None:
            if self._first is None:  # the rate and ETA count from the first step seen, not from the bar's
                self._first = (step, time.monotonic())  # creation (set-up) nor from 0 (a resumed run's
                self._bar.reset(total=self.total)        # earlier steps: 95/100 at 47 it/s for 5 it/s)
                self._bar.initial = self._bar.n = self._bar.last_print_n = step
            else:
                self._bar.update(step - self._bar.n)
            self._bar.set_postfix_str(text, refresh=True)
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        if now - self._last_line >= 2.0 or step >= self.total:
            self._last_line = now
            first_step, first_time = self._first
            rate = (now - first_time) / max(step - first_step, 1)
            eta = f" eta={rate * (self.total - step):.0f}s" if step > first_step else ""
            print(f"[asyncflow] step {step}/{self.total} {text}{eta}", file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line that does not disturb the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)
