"""User-facing errors: bad input that must end the run with one clear line and exit code 2, and
run failures that are not bad input (a worker died) with one clear line and exit code 1.

Everything else (bugs, hardware faults) propagates as an ordinary exception with its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, dataset row, reward return value, CLI argument).

    The message is one line that names the key, file or row at fault. The CLI prints it and
    exits with code 2, without a traceback.
    """

    exit_code = 2
    max_chars = 2000  # a message past this is cut: it is printed as one line to a terminal or a log

    def __init__(self, message: str = "", *args: object) -> None:
        if isinstance(message, str) and len(message) > self.max_chars:
            message = f"{message[:self.max_chars]}... ({len(message) - self.max_chars} more characters cut)"
        super().__init__(message, *args)


class WaitTimeout(TimeoutError):
    """A bounded wait ran out. The message says what was waited for and for how long."""


class RunFailed(RuntimeError):
    """The run cannot go on, for a reason that is not bad input: a worker it needs died (or used up
    its restarts), or a remote stage failed.

    The message is one line naming what failed and why. The CLI prints it and exits with code 1,
    without a traceback (the cause stays chained for code that catches it).
    """

    exit_code = 1


class TrainerDied(RunFailed):
    """The trainer actor died. `step` is the train step it died in and `version` the last policy
    version it exported, when known (with checkpoints, the run can resume from the newest one)."""

    def __init__(self, message: str, *, step: int | None = None, version: int | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.version = version
