"""A weight folder on a memory file system is written over an old version's files (their memory stays
allocated) only while no reader maps them; a reader holds a shared lock for as long as a view of its
map lives, never sees a half-written version, and old versions are still removed."""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncflow.engines import safetensors_io
from asyncflow.engines import server_sync as sync_mod
from asyncflow.engines.safetensors_io import FileReplaced, map_file, try_lock_exclusive, write_file
from asyncflow.engines.server_sync import (
    AsyncflowSync,
    SGLangSync,
    VLLMSync,
    WeightFolderWriter,
    on_memory_fs,
)
from asyncflow.openai_wire import RequestError
from asyncflow.weight_folder import read_weights


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    if not Path("/dev/shm").is_dir() or not on_memory_fs(Path("/dev/shm")):
        pytest.skip("no memory file system at /dev/shm")
    with tempfile.TemporaryDirectory(prefix="asyncflow-test-", dir="/dev/shm") as d:
        yield Path(d)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))


def _writer(root: Path, **kw: object) -> WeightFolderWriter:
    model = root / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return WeightFolderWriter(root / "sync", model, in_place=False, session="s", **kw)  # type: ignore[arg-type]


def _publish(writer: WeightFolderWriter, version: int) -> Path:
    return asyncio.run(writer.folder_for({"w": torch.full((64,), float(version), dtype=torch.bfloat16)}, version))


def _inode(folder: Path) -> int:
    return os.stat(folder / "model.safetensors").st_ino


def test_a_mapped_file_stays_locked_until_its_last_view_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_file({"a": torch.arange(8.0), "b": torch.ones(3)}, path)
    views = map_file(path)
    a = views.pop("a")
    del views
    with open(path, "r+b") as f:
        assert not try_lock_exclusive(f)  # (one view left: the map and its lock live on)
    assert torch.equal(a, torch.arange(8.0))
    del a
    with open(path, "r+b") as f:
        assert try_lock_exclusive(f)


def test_an_existing_file_is_overwritten_in_place_and_cut_to_its_new_length(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_file({"a": torch.arange(100.0)}, path)
    inode = os.stat(path).st_ino
    write_file({"a": torch.arange(5.0)}, path)
    assert os.stat(path).st_ino == inode
    assert torch.equal(map_file(path)["a"], torch.arange(5.0))
    assert os.stat(path).st_size < 100 * 4


def test_a_file_being_rewritten_or_replaced_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "w.safetensors"
    write_file({"a": torch.arange(4.0)}, path)
    with open(path, "r+b") as writer:
        assert try_lock_exclusive(writer)
        with pytest.raises(FileReplaced, match="being rewritten"):
            map_file(path)
    real = fcntl.flock

    def taken_between_open_and_lock(f: object, op: int) -> None:  # a writer renames it away first
        os.replace(path, tmp_path / "taken")
        write_file({"a": torch.zeros(4)}, path)
        real(f, op)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors_io.fcntl, "flock", taken_between_open_and_lock)
    with pytest.raises(FileReplaced, match="replaced while it was opened"):
        map_file(path)


def test_versions_reuse_the_files_of_the_one_two_before_and_old_ones_are_removed(shm_dir: Path) -> None:
    writer = _writer(shm_dir, reuse_files=True)
    assert writer.reuse_files
    folders, inodes = [], []
    for v in range(1, 6):
        folders.append(_publish(writer, v))
        inodes.append(_inode(folders[-1]))
    assert inodes[2] == inodes[4] == inodes[0] and inodes[3] == inodes[1] != inodes[0]
    assert writer.reused == 3
    assert sorted(p.name for p in (shm_dir / "sync").iterdir() if p.name.startswith(("v", ".v"))) == ["v000004", "v000005"]
    for folder, version in ((folders[3], 4), (folders[4], 5)):
        state = read_weights(folder, Tiny())
        assert torch.equal(state["w"], torch.full((64,), float(version), dtype=torch.bfloat16))
        assert (folder / ".asyncflow-writer").read_text() == f"s {version}"
        assert (folder / "config.json").is_file()


def test_a_file_a_reader_maps_is_not_reused_and_keeps_its_version(shm_dir: Path) -> None:
    writer = _writer(shm_dir, reuse_files=True)
    first = _publish(writer, 1)
    _publish(writer, 2)
    held = read_weights(first, Tiny())  # an engine still loading version 1
    third = _publish(writer, 3)
    assert writer.reused == 0 and not first.exists()  # (removed as before; the reader's map lives on)
    assert torch.equal(held["w"], torch.full((64,), 1.0, dtype=torch.bfloat16))
    del held
    fourth = _publish(writer, 4)  # version 2's file is free
    assert writer.reused == 1 and torch.equal(read_weights(fourth, Tiny())["w"], torch.full((64,), 4.0, dtype=torch.bfloat16))
    assert read_weights(third, Tiny())["w"][0] == 3


def test_a_reused_file_is_reachable_by_no_version_while_it_is_written(shm_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _writer(shm_dir, reuse_files=True)
    first, second = _publish(writer, 1), _publish(writer, 2)
    seen: list[bool] = []
    real = sync_mod.write_file

    def checking(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
        seen.append(path.parent.name.startswith(".") and not first.exists())
        with pytest.raises(RequestError) as gone:
            read_weights(first, Tiny())
        assert gone.value.status in (400, 404)
        assert not (shm_dir / "sync" / "v000003").exists()
        assert read_weights(second, Tiny())["w"][0] == 2  # (the kept version is untouched)
        real(tensors, path, metadata)

    monkeypatch.setattr(sync_mod, "write_file", checking)
    third = _publish(writer, 3)
    assert seen == [True] and writer.reused == 1
    assert read_weights(third, Tiny())["w"][0] == 3


def test_a_reader_that_opened_a_version_before_it_was_taken_gets_a_404(shm_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    writer = _writer(shm_dir, reuse_files=True)
    first = _publish(writer, 1)
    _publish(writer, 2)
    real = fcntl.flock

    def writer_takes_it_now(f: object, op: int) -> None:
        if op & fcntl.LOCK_SH:
            monkeypatch.setattr(safetensors_io.fcntl, "flock", real)
            _publish(writer, 3)
        real(f, op)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors_io.fcntl, "flock", writer_takes_it_now)
    with pytest.raises(RequestError) as err:
        read_weights(first, Tiny())
    assert err.value.status == 404 and "load a newer version" in str(err.value)
    assert writer.reused == 1


def test_only_servers_that_lock_their_reads_get_reused_files_and_never_in_place(shm_dir: Path) -> None:
    assert AsyncflowSync.locks_reads and not SGLangSync.locks_reads and not VLLMSync.locks_reads
    assert not _writer(shm_dir).reuse_files
    assert not WeightFolderWriter(shm_dir, shm_dir, in_place=True, reuse_files=True).reuse_files
    writer = _writer(shm_dir)
    folders = [_publish(writer, v) for v in range(1, 4)]
    assert writer.reused == 0 and _inode(folders[2]) != _inode(folders[1])


def test_a_linked_weights_file_is_never_written_over(shm_dir: Path) -> None:
    writer = _writer(shm_dir, reuse_files=True)
    first = _publish(writer, 1)
    _publish(writer, 2)
    keep = shm_dir / "kept.safetensors"
    os.link(first / "model.safetensors", keep)  # (e.g. someone keeping version 1's weights)
    _publish(writer, 3)
    assert writer.reused == 0 and map_file(keep)["w"][0] == 1
    (shm_dir / "elsewhere.safetensors").write_bytes(b"not yours")
    fourth = shm_dir / "sync" / "v000004"  # a folder of another session whose weights file is a link
    fourth.mkdir()
    (fourth / "model.safetensors").symlink_to(shm_dir / "elsewhere.safetensors")
    held = read_weights(shm_dir / "sync" / "v000002", Tiny())  # (version 2's file is busy: the link is next)
    _publish(writer, 4)
    assert writer.reused == 0 and held["w"][0] == 2
    assert (shm_dir / "elsewhere.safetensors").read_bytes() == b"not yours"
    assert read_weights(fourth, Tiny())["w"][0] == 4 and not (fourth / "model.safetensors").is_symlink()
