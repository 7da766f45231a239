"""Files and folders of the run folder that are replaced whole: a crash (or a full disk) while one is
written leaves the previous version, never a truncated one. Each is written beside its target
(same file system), flushed to the disk, then renamed over it; the folder's entry is flushed too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's data (or a folder's entries) to the disk; best effort where a file system
    cannot (some network file systems refuse a directory fsync)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: temp file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def write_dir_atomic(path: Path, fill: Callable[[Path], None]) -> None:
    """Replace folder `path` with what `fill(folder)` writes into a fresh temp folder beside it. A
    failure in `fill` leaves `path` as it was. (Two renames, as a non-empty folder cannot be renamed
    over: the old one is moved aside first, so a crash between them leaves it as `.NAME.old`.)"""
    tmp, old = path.with_name(f".{path.name}.partial"), path.with_name(f".{path.name}.old")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        for f in sorted(tmp.rglob("*"), reverse=True):  # (files before the folders holding them)
            fsync_path(f)
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_path(path.parent)
    shutil.rmtree(old, ignore_errors=True)
