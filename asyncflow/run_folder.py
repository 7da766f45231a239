"""The run folder (`--out`): refusing one that already holds a run or cannot become a folder, claiming
and locking it once the run is built, removing what a run that recorded nothing made, marking a
failed run's folder, and saying where a failed run can go on from."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import write_text_atomic
from asyncflow.config import Config, dump_yaml
from asyncflow.errors import UserError

RUN_MARKERS = ("config.yaml", "metrics.jsonl")
FAILED_FILE = "failed.json"  # a run that ended without finishing and kept its folder: {"status", "error"}


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
    into one folder cannot both write there. `abandon()`: a fresh run that ends before it recorded
    anything (bad input found late) removes the files it made (there is nothing in them to keep);
    any other run that ends without finishing is kept and marked failed. The folder is locked for
    the run (`_lock`); `close()` releases it."""

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
            # an earlier segment's totals (and its mark of a finished run), or its failure, no longer
            # describe the folder
            (out / "summary.json").unlink(missing_ok=True)
            (out / FAILED_FILE).unlink(missing_ok=True)
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

    def abandon(self, error: str) -> bool:
        """The run ended without finishing (`error`: why, one line). A fresh run that recorded nothing
        (no train step, no sample) removes the files it made and returns False; any other keeps its
        folder, marked failed (`failed.json` holds the error), and returns True."""
        if not self.opened:
            return False
        if self.resume is not None or self._recorded():
            with contextlib.suppress(OSError):  # (best effort: the error being raised is the one to show)
                write_text_atomic(self.out / FAILED_FILE, json.dumps({"status": "failed", "error": error}, indent=1))
            return True
        self._remove_made()
        return False

    def _recorded(self) -> bool:
        """Whether the run logged a train step or a sample (a reward error, a dropped sample)."""
        metrics, samples = self.out / "metrics.jsonl", self.out / "samples.jsonl"
        try:
            return (metrics.is_file() and '"kind": "train"' in metrics.read_text()) or (
                samples.is_file() and samples.stat().st_size > 0)
        except OSError:
            return True  # (unreadable: not known to be empty, so not removed)

    def _remove_made(self) -> None:
        try:
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
