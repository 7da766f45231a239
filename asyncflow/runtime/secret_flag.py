"""`python -m asyncflow.runtime.secret_flag VAR FLAG MODULE [ARGS...]` runs `python -m MODULE ARGS...
FLAG <value of VAR>`, with VAR taken out of the environment first.

For a server that takes its key only as a flag (SGLang's `--api-key`): a command line is readable by
every local user (`ps`, /proc/PID/cmdline), an environment only by the process's owner. The value
reaches the module through the `sys.argv` built here; the process's own command line, the one `ps`
shows, never holds it. Bad use is one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import MutableMapping

SECRET_FLAG_MODULE = "asyncflow.runtime.secret_flag"


def module_argv(argv: list[str], env: MutableMapping[str, str]) -> tuple[str, list[str]]:
    """The module to run and the `sys.argv` it gets; VAR is removed from `env`. A missing or empty
    VAR, or too few arguments, is a `ValueError` (one line)."""
    if len(argv) < 3:
        raise ValueError("usage: python -m asyncflow.runtime.secret_flag VAR FLAG MODULE [ARGS...]")
    var, flag, module, *rest = argv
    value = env.pop(var, "").strip()
    if not value:
        raise ValueError(f"{var} is not set or empty (it holds the value of {flag} for {module})")
    return module, [module, *rest, flag, value]


def main() -> None:
    try:
        module, sys.argv = module_argv(sys.argv[1:], os.environ)
    except ValueError as exc:
        print(f"secret_flag: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
