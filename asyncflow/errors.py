"""User-facing errors: bad input that must end the run with one clear line and exit code 2.

Everything else (bugs, hardware faults) propagates as an ordinary exception with its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, dataset row, reward return value, CLI argument).

    The message is one line that names the key, file or row at fault. The CLI prints it and
    exits with code 2, without a traceback.
    """

    exit_code = 2


class WaitTimeout(TimeoutError):
    """A bounded wait ran out. The message says what was waited for and for how long."""
