"""safetensors files written and read without a second copy of the weights in memory.

`safetensors.torch.save_file` first turns every tensor into a byte string (the whole state copied in
memory), then writes; `load_file` reads every tensor into new memory, which a model's
`load_state_dict` then copies again. Here a file is written tensor by tensor straight from each
tensor's memory (one copy: into the page cache), and read as views of a read-only memory map (no
copy: the engine's `load_state_dict` copies from the page cache into its parameters). The format is
safetensors' own (an 8-byte little-endian header length, the JSON header, the tensors' bytes in
header order), so either library reads what the other wrote.

A file that already exists is overwritten in place: on a memory file system (/dev/shm) its pages
stay allocated, where a new file's are allocated (and a freed one's released) on every write: ~2.5x
the write itself. A writer may reuse a file only while no reader maps it: `map_file` holds a shared
`flock` on the file for as long as any view of its map lives, and `try_lock_exclusive` tells a
writer whether one does.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
_BY_NAME = {v: k for k, v in DTYPES.items()}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's data (a CPU contiguous copy first only where it is not one)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def write_file(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write `state` to `path` as safetensors, one tensor at a time from its own memory (over an
    existing file in place; the caller makes sure no reader maps it: `try_lock_exclusive`)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    # widest elements first (stable): every tensor then starts aligned to its element size
    order = sorted(state, key=lambda k: -state[k].element_size())
    offset = 0
    for name in order:
        t = state[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"safetensors: {name} has dtype {t.dtype}, which this writer does not handle")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the tensors start 8-byte aligned, as safetensors writes them)
    with open(path, "r+b" if Path(path).is_file() else "wb") as f:  # (no truncation first: pages reused)
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(_bytes_of(state[name]).numpy().data)
        f.truncate()


class FileReplaced(OSError):
    """The file a path named was taken for rewriting before it could be read (`map_file`)."""


_NO_LOCKS = (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP)  # a file system without flock


def try_lock_exclusive(f: Any) -> bool:
    """Take an exclusive `flock` on open file `f` if no reader holds its shared one (`map_file`);
    False when one does or the file system has no locks. Released when `f` is closed."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if isinstance(exc, BlockingIOError) or exc.errno in _NO_LOCKS:
            return False
        raise
    return True


def _lock_shared(f: Any, path: Path) -> None:
    """A shared lock on `f`, opened from `path`, which must still name it once locked: a writer
    renames a file's folder away before it rewrites the file (FileReplaced otherwise)."""
    try:
        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise FileReplaced(f"{path} is being rewritten for a newer version") from None
    except OSError as exc:
        if exc.errno not in _NO_LOCKS:  # (no locks there: no writer reuses files there either)
            raise
    try:
        now, held = os.stat(path), os.fstat(f.fileno())
    except FileNotFoundError:
        raise FileReplaced(f"{path} was removed while it was opened") from None
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        raise FileReplaced(f"{path} was replaced while it was opened")


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a read-only memory map of it (no copy; pages are
    read on first touch). The map holds a shared lock on the file for as long as any view of it lives
    (it shares the locked descriptor), so no writer reuses the file meanwhile. A malformed file raises
    ValueError; one a writer took for a newer version before it was locked, FileReplaced."""
    with open(path, "rb") as f:
        _lock_shared(f, path)
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise ValueError(f"{path}: header of {size} bytes is implausible")
        header = json.loads(f.read(size))
        start = 8 + size
        total = os.fstat(f.fileno()).st_size - start
        # (mapped from the locked file: the map's own duplicate of its descriptor keeps the lock)
        data = np.memmap(f, dtype=np.uint8, mode="r", offset=start, shape=(total,)) if total > 0 else np.zeros(0, np.uint8)
    out = {}
    with warnings.catch_warnings():  # (torch warns that a read-only array gives a tensor it may not write)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(data)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _BY_NAME.get(entry.get("dtype"))
            begin, end = entry.get("data_offsets", (0, -1))
            if dtype is None or not 0 <= begin <= end <= total:
                raise ValueError(f"{path}: tensor {name} has a bad dtype or byte range ({entry})")
            raw = flat[begin:end]
            if begin % max(torch.empty((), dtype=dtype).element_size(), 1):
                raw = raw.clone()  # (a writer that did not align this tensor: viewed through an aligned copy)
            out[name] = raw.view(dtype).view(tuple(entry["shape"]))
    return out
