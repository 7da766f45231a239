"""A state dict that crosses Ray's object store as raw byte arrays, so it is copied once on the way.

Ray stores NumPy arrays out of band (pickle protocol 5): `ray.put` copies their bytes into shared
memory once, and a reader gets read-only views of that memory with no copy. A torch tensor pickles
through `torch.save` into an in-band byte string instead: one extra copy on the way in and one more in
every reader. `SharedState` pickles as the tensors' bytes as NumPy arrays plus (name, dtype, shape),
and unpickles as a plain `dict[str, torch.Tensor]` of views of those bytes:

    trainer: export ─► SharedState ─► (Ray) one copy into shared memory
    engine:  views of shared memory ─► load_state_dict copies them into the parameters (one copy)

A weight `Publication` (asyncflow.engines.weight_delta) travels the same way: its tensors (a delta's
indices and values) as byte arrays, the rest pickled.

The views are read-only memory (do not write into them); they keep the object pinned while alive.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from asyncflow.engines.weight_delta import Publication, join, split
from asyncflow.engines.weight_sync import aliases


class SharedState:
    """Wraps a state dict for the trip; what arrives is the dict itself (`unpack_state`)."""

    def __init__(self, state: dict[str, torch.Tensor] | Publication) -> None:
        self.state = state

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if isinstance(self.state, Publication):  # (its tensors the same way, its skeleton pickled)
            flat, skeleton = split(self.state)
            return unpack_publication, (skeleton, *pack_state(flat))
        return unpack_state, pack_state(self.state)


def pack_state(state: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str, tuple[int, ...], int]], list[Any]]:
    """(name, dtype, shape, array index) per tensor and the byte arrays (a tied weight's bytes once;
    its names all view them)."""
    same = aliases(state)
    specs: list[tuple[str, str, tuple[int, ...], int]] = []
    arrays: list[Any] = []
    index: dict[str, int] = {}
    for name, t in state.items():
        if name not in same:
            flat = t.detach().cpu().contiguous().reshape(-1)  # (no copy for the CPU tensors an export holds)
            index[name] = len(arrays)
            arrays.append(flat.view(torch.uint8).numpy())
        specs.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), index[same.get(name, name)]))
    return specs, arrays


def unpack_publication(skeleton: Publication, specs: list[tuple[str, str, tuple[int, ...], int]],
                       arrays: list[Any]) -> Publication:
    """The publication, its tensors views of their byte arrays."""
    return join(skeleton, unpack_state(specs, arrays))


def unpack_state(specs: list[tuple[str, str, tuple[int, ...], int]], arrays: list[Any]) -> dict[str, torch.Tensor]:
    """The state dict, each tensor a view of its byte array (read-only memory when Ray stored it)."""
    out = {}
    with warnings.catch_warnings():  # (torch warns that a read-only array gives a tensor it may not write)
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, i in specs:
            out[name] = torch.from_numpy(arrays[i]).view(getattr(torch, dtype)).view(shape)
    return out
