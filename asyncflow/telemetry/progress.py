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
        self.t0 = time.monotonic()
        if enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, file=self.stream, dynamic_ncols=True)

    def update(self, step: int, figures: dict[str, Any]) -> None:
        """Step `step` finished with `figures` (short name -> value)."""
        if not self.enabled:
            return
        text = " ".join(f"{k}={_fmt(v)}" for k, v in figures.items())
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(text, refresh=True)
            return
        now = time.monotonic()
        if now - self._last_line >= 2.0 or step >= self.total:
            self._last_line = now
            eta = (now - self.t0) / max(step, 1) * (self.total - step)
            print(f"[asyncflow] step {step}/{self.total} {text} eta={eta:.0f}s", file=self.stream, flush=True)

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
