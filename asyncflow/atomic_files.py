"""Files and folders written whole (the run folder's files, prepared model folders): a crash (or a full
disk) while one is written leaves the previous version, or none, never a truncated one. Each is written
beside its target (same file system), flushed to the disk, then renamed over it; the folder's entry is
flushed too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
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
    """Replace `path` with `text`: a new temp file (`replace_file`), fsync, rename, fsync of the folder."""

    def write(tmp: Path) -> None:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    replace_file(path, write)
    fsync_path(path.parent)


def is_temporary(path: Path) -> bool:
    """Whether `path` is a temp file `replace_file` is writing (a listing skips it)."""
    return path.name.startswith(".") and ".tmp" in path.name


def replace_file(path: Path, write: Callable[[Path], object]) -> None:
    """Replace `path` with what `write(tmp)` writes into a new file beside it, created exclusively
    under a fresh name: a symlink planted at `path` or at a temp name is replaced, never followed.
    The temp name ends in `path`'s suffix, for writers that read the format from it."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o644)  # (mkstemp's 0600 would hide a report from the run folder's other readers)
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


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


def create_dir_atomic(path: Path, fill: Callable[[Path], None]) -> bool:
    """Create folder `path` whole: `fill(folder)` writes into a fresh temp folder beside it
    (`.NAME.tmp-XXXXXXXX`, unique, so concurrent builders never share one), which is flushed and renamed
    onto `path`. `path` is therefore absent, an empty folder, or complete; a failure in `fill` removes
    the temp folder (a killed process leaves it, hidden, beside `path`). `path` must be absent or
    empty; returns False, discarding this copy, when another process filled it meanwhile."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:  # (not tempfile.mkdtemp: its folder is private, 0700, and the renamed one must not be)
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
        with contextlib.suppress(FileExistsError):
            tmp.mkdir()
            break
    try:
        fill(tmp)
        for f in sorted(tmp.rglob("*"), reverse=True):  # (files before the folders holding them)
            fsync_path(f)
        fsync_path(tmp)
        try:
            os.replace(tmp, path)  # (a rename onto an empty folder replaces it; onto a full one fails)
        except OSError:
            if not (path.is_dir() and any(path.iterdir())):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return False
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(path.parent)
    return True
