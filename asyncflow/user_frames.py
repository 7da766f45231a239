"""Where in a user's code an exception was raised: the `file:line` a message about a failed plugin
call (a reward function) names, so the line to fix is found without a traceback.

The user's frame is the innermost one that is neither asyncflow's nor Python's standard library's
nor an installed package's (a reward function that calls a parser which raises is named at its own
call). A plugin that is itself an installed package has no such frame: its innermost frame outside
asyncflow and the standard library is named instead.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

_ASYNCFLOW = Path(__file__).resolve().parent


def _folders(*names: str) -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple(Path(paths[n]).resolve() for n in names if n in paths)


_STDLIB = _folders("stdlib", "platstdlib")
_INSTALLED = _folders("purelib", "platlib")


def _under(path: Path, folders: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(f) for f in folders)


def raised_at(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame of `exc`'s traceback in the user's code (the file relative
    to the working directory when it lies under it); None when no frame is outside asyncflow and
    Python's own library."""
    frames = [(Path(f.filename).resolve(), f.lineno) for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith("<")]
    outside = [(p, n) for p, n in frames if not _under(p, (_ASYNCFLOW,)) and not _under(p, _STDLIB)]
    mine = [(p, n) for p, n in outside if not _under(p, _INSTALLED)] or outside
    if not mine:
        return None
    path, line = mine[-1]
    cwd = Path.cwd()
    shown = os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path)
    return f"{shown}:{line}"
