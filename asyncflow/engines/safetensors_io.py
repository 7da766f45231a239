"""safetensors files written and read without a second copy of the weights in memory.

`safetensors.torch.save_file` first turns every tensor into a byte string (the whole state copied in
memory), then writes; `load_file` reads every tensor into new memory, which a model's
`load_state_dict` then copies again. Here a file is written tensor by tensor straight from each
tensor's memory (one copy: into the page cache), and read as views of a read-only memory map (no
copy: the engine's `load_state_dict` copies from the page cache into its parameters). The format is
safetensors' own (an 8-byte little-endian header length, the JSON header, the tensors' bytes in
header order), so either library reads what the other wrote.
"""

from __future__ import annotations

import json
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
    """Write `state` to `path` as safetensors, one tensor at a time from its own memory."""
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
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            f.write(_bytes_of(state[name]).numpy().data)


def map_file(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of a read-only memory map of it (no copy; pages are
    read on first touch). A malformed file raises ValueError."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors header")
        (size,) = struct.unpack("<Q", head)
        if size > 100 * 2**20:
            raise ValueError(f"{path}: header of {size} bytes is implausible")
        header = json.loads(f.read(size))
    start = 8 + size
    total = Path(path).stat().st_size - start
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(total,)) if total > 0 else np.zeros(0, np.uint8)
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
