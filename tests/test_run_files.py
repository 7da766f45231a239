"""The run folder's files are safe to read and whole when written: a checkpoint's pickles load with
`weights_only=True` (a malicious one is refused, unexecuted), and `final/`, `summary.json` and a
resume's `config.yaml` are replaced atomically (a write cut short leaves the old version)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.atomic_files import write_dir_atomic, write_text_atomic
from asyncflow.checkpoint import load_safely, log_offsets, restore_rng


class _Payload:
    """A pickle whose loading would run code: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_store_or_rng_pickle_is_refused_in_one_line_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    ckpt = tmp_path / "step_2"
    ckpt.mkdir()
    torch.save({"format": 1, "samples": [], "groups": [], "next_uid": 0, "x": _Payload(marker)}, ckpt / "store.pt")
    torch.save({"torch": torch.get_rng_state(), "python": _Payload(marker)}, ckpt / "rng.pt")
    with pytest.raises(ValueError) as err:
        load_safely(ckpt / "store.pt")
    assert "\n" not in str(err.value) and "store.pt holds objects a checkpoint never contains" in str(err.value)
    assert "posix.system" in str(err.value) and "refused, not loaded" in str(err.value)
    with pytest.raises(ValueError, match=r"rng.pt holds objects a checkpoint never contains"):
        restore_rng(ckpt)
    assert not marker.exists()


def test_what_a_checkpoint_holds_still_loads_with_weights_only(tmp_path: Path) -> None:
    import random

    state = {"format": 1, "next_uid": 3, "samples": [{"uid": 1, "fields": {"prompt_ids": [1, 2], "reward": 0.5,
                                                                            "text": "x", "v": None}}]}
    torch.save(state, tmp_path / "store.pt")
    assert load_safely(tmp_path / "store.pt") == state
    random.seed(5)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp_path / "rng.pt")
    expected = random.random()
    random.seed(9)
    restore_rng(tmp_path)
    assert random.random() == expected


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "summary.json"
    write_text_atomic(path, '{"steps": 1}')
    real_fsync = os.fsync

    def crash(fd: int) -> None:  # the disk fills (or the process dies) after half the bytes were written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(path, '{"steps": 2, "long": "' + "x" * 100_000 + '"}')
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert path.read_text() == '{"steps": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left
    write_text_atomic(path, '{"steps": 2}')
    assert path.read_text() == '{"steps": 2}'


def test_final_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "final"

    def writes(version: str, fail: bool = False) -> Any:
        def fill(folder: Path) -> None:
            (folder / "config.json").write_text(version)
            if fail:  # the save dies after the first file (out of memory, Ctrl-C, a full disk)
                raise KeyboardInterrupt
            (folder / "model.safetensors").write_text(version * 3)
        return fill

    write_dir_atomic(final, writes("a"))
    with pytest.raises(KeyboardInterrupt):
        write_dir_atomic(final, writes("b", fail=True))
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "a", "model.safetensors": "aaa"}
    write_dir_atomic(final, writes("c"))
    assert {p.name: p.read_text() for p in final.iterdir()} == {"config.json": "c", "model.safetensors": "ccc"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_log_offsets_flush_the_logs_they_measure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "samples.jsonl").write_text("{}\n{}\n")
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.fstat(fd).st_size)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert log_offsets(tmp_path) == {"metrics.jsonl": 3, "samples.jsonl": 6}
    assert synced == [3, 6]
