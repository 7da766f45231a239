"""The run folder (`--out`): refusing one that already holds a run or cannot become a folder, claiming
and locking it once the run is built, removing what a run that never trained made, and saying where
a failed run can go on from."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import write_text_atomic
from asyncflow.config import Config, dump_yaml
from asyncflow.errors import UserError

RUN_MARKERS = ("config.yaml", "metrics.jsonl")


def check_folder_path(path: Path, key: str) -> None:
    """Refuse a folder path that is a file, or that lies under one (mkdir would fail there only after
    minutes of work, with a traceback)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{key}: {path} is a file, not a folder")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{key}: {path} lies under {parent}, which is a file")
            return


def check_out_dir(out: Path, cfg: Config) -> Any:
    """Refuse an --out folder that already holds a run (resume is explicit), or that is a file.
    With `checkpoint.resume: auto`, the checkpoint to continue from (None: start fresh)."""
    check_folder_path(out, "--out")
    if out.exists() and any((out / m).exists() for m in RUN_MARKERS):
        if cfg.checkpoint.resume == "auto":
            from asyncflow.checkpoint import find_resume

            return find_resume(out, cfg)
        from asyncflow.checkpoint import complete_checkpoints

        if complete_checkpoints(out):
            raise UserError(f"--out: {out} already holds a run; choose another folder or set checkpoint.resume=auto "
                            "to go on from its newest checkpoint")
        raise UserError(f"--out: {out} already holds a run (with no complete checkpoint to go on from); choose "
                        "another folder")
    return None


class RunFolder:
    """The run folder, written only once the run is built, so that bad input found while building it
    (an unreachable server, a model the engine cannot load) never leaves a half-made run that a
    retry would refuse, and a resume that fails to build has not yet cut the logs back.

    `open()` (idempotent) cuts a resumed run's logs back to its checkpoint and writes `config.yaml`;
    a fresh run claims the folder by creating `config.yaml` exclusively, so two runs started at once
    into one folder cannot both write there. `abandon()`: a fresh run that ends with bad input before
    its first train step removes the files it made (there is nothing in them to keep). The folder is
    locked for the run (`_lock`); `close()` releases it."""

    def __init__(self, out: Path, cfg: Config, resume: Any) -> None:
        self.out, self.cfg, self.resume = out, cfg, resume
        self.opened = False
        self._created_dir = False
        self._lock_fd: int | None = None

    def open(self) -> Path:
        if self.opened:
            return self.out
        out = self.out
        if self.resume is not None:
            from asyncflow.checkpoint import cut_logs

            self._lock()
            cut_logs(out, self.resume.state["logs"])
            # an earlier segment's totals (and its mark of a finished run) no longer describe the folder
            (out / "summary.json").unlink(missing_ok=True)
            write_text_atomic(out / "config.yaml", dump_yaml(self.cfg))  # (cut short, the next resume is refused)
        else:
            self._created_dir = not out.exists()
            try:
                out.mkdir(parents=True, exist_ok=True)
                self._lock()
                with (out / "config.yaml").open("x") as fh:
                    fh.write(dump_yaml(self.cfg))
            except FileExistsError:
                self.close()
                raise UserError(f"--out: another run started in {out} meanwhile; choose another folder") from None
            except OSError as exc:
                raise UserError(f"--out: cannot create {out}: {exc.strerror or exc}") from None
        self.opened = True
        return out

    def _lock(self) -> None:
        """Hold `RUN_DIR/.lock` for the whole run, fresh or resumed: a second process resuming a run
        that is still going (or two resumes at once) is refused before it cuts any log. Without it
        both trained on, duplicating steps and samples in the logs, or one deleted the other's
        checkpoint. The lock is the kernel's (flock): a process that dies releases it."""
        try:
            import fcntl
        except ImportError:  # (not on Windows)
            return
        fd = os.open(self.out / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            if self._created_dir:
                with contextlib.suppress(OSError):
                    self.out.rmdir()
            raise UserError(f"--out: another asyncflow process is running in {self.out}; wait for it to end or "
                            "choose another folder") from None
        self._lock_fd = fd

    def close(self) -> None:
        """Release the folder's lock (the run is over)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def abandon(self) -> None:
        if not self.opened or self.resume is not None:
            return
        metrics = self.out / "metrics.jsonl"
        try:
            if metrics.is_file() and '"kind": "train"' in metrics.read_text():
                return  # it trained: what it logged is kept
            for name in ("config.yaml", "metrics.jsonl", "samples.jsonl", "trace.json", "wandb_id", ".lock"):
                (self.out / name).unlink(missing_ok=True)
            for name in ("tensorboard", "wandb"):  # the sinks' folders (they kept the folder, and a retry
                shutil.rmtree(self.out / name, ignore_errors=True)  # added a second event file beside)
            if self._created_dir and not any(self.out.iterdir()):
                self.out.rmdir()
        except OSError:
            pass  # best effort: the error being raised is the one to show


def resume_hint(out: Path) -> str:
    """What a failed run's message adds: the checkpoint it can go on from, and how (or that there is none)."""
    from asyncflow.checkpoint import complete_checkpoints

    found = complete_checkpoints(out)
    if not found:
        return "no checkpoint was written (set checkpoint.every to make runs resumable)"
    return (f"it can go on from {found[-1][1]} (step {found[-1][0]}): run the same command with "
            f"--set checkpoint.resume=auto")
