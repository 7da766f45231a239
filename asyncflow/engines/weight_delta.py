"""Delta weight publications: send only the rollout-dtype elements an optimizer step changed.

After a step most weights are unchanged *in the published dtype* (a bf16 element moves only when its
float32 master crosses a rounding boundary), so a publication can carry, per tensor, the flat
indices and new values of the changed elements, or the whole tensor where that is smaller, or
nothing. `DeltaEncoder` (the trainer's side) keeps the last published copy and compares each export
with it; `HeldWeights` (an engine's side) applies a publication in place and proves the result:

```
 trainer: export ─► DeltaEncoder.encode ─► Publication(seq, base, checksum, full | changes)
 engine:  HeldWeights.apply(pub, params):
            pub full, or pub.base != held checksum (a missed version, a restart) ─► load pub.full
            else write the changes in place; checksum of what was written != pub.checksum ─► load pub.full
            no full at hand (the publication crossed processes) ─► ResyncNeeded (nothing written)
```

The checksum is a sum over elements of a hash of (tensor, position, bits) modulo 2**64, so a delta
updates it from the changed elements alone: the engine reads back the elements it wrote (in the
publication's dtype) and what they held before, so a checksum match shows the engine's weights went
from the trainer's base to the trainer's new copy. A full load computes it over every element.

A publication's `full` (the trainer's copy, by reference) is valid until the next `encode`: the
trainer exports the next version only after every engine loaded the last (the workflow's order). It
is never pickled: what crosses processes is the delta alone, and the receiving side asks for a full
copy when it needs one (`ResyncNeeded`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from asyncflow.engines.weight_sync import WeightsRefused, aliases

MASK64 = 2**64 - 1
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
PUBLICATION_FILE = "publication.json"  # a weight folder's skeleton (`skeleton_json`)
DELTA_FILE = "delta.safetensors"  # a delta folder's tensors (`split`)
SPAN_BITS = 16
SPAN = 1 << SPAN_BITS  # positions per table weight cycle (`weights_table`: 256 KiB, stays in cache)
BLOCK = 64  # spans hashed per pass (bounds the temporaries: 16 MiB of int32)


class ResyncNeeded(WeightsRefused):
    """A delta that does not apply to what the engine holds (a missed version, an unknown start), or
    one whose result failed its checksum, with no full copy at hand: the caller delivers the full
    weights of publication `seq` (`Publication.full` where it is in process)."""

    def __init__(self, message: str, seq: int = 0) -> None:
        super().__init__(message)
        self.seq = seq

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:  # (crosses processes with its seq)
        return type(self), (str(self), self.seq)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a tensor's elements (same element size), contiguous."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def salt(name: str) -> int:
    """A tensor's odd multiplier in the checksum (its name's CRC, spread)."""
    return (zlib.crc32(name.encode()) * 0x9E3779B97F4A7C15 | 1) & MASK64


def weights_table(device: torch.device | str) -> torch.Tensor:
    """`SPAN` fixed pseudo-random int32 weights, one per position within a span (the same on every
    machine: a seeded generator on the CPU)."""
    g = torch.Generator().manual_seed(0x5EED)
    return torch.randint(-(2**31), 2**31 - 1, (SPAN,), dtype=torch.int32, generator=g).to(device)


def element_hash(name: str, positions: torch.Tensor, values: torch.Tensor, table: torch.Tensor) -> int:
    """The checksum's terms of the elements of tensor `name` at flat `positions` holding `values`
    (their integer bits), summed modulo 2**64: bits x the position's table weight (wrapped to 32
    bits) x an odd factor of the position's span, x the tensor's `salt`."""
    p = positions.to(torch.int64)
    term = (values * table[p & (SPAN - 1)]).to(torch.int64) * ((p >> SPAN_BITS) * 2 + 1)
    return (int(term.sum()) * salt(name)) & MASK64


def tensor_checksum(name: str, t: torch.Tensor, table: torch.Tensor) -> int:
    """The checksum's terms of a whole tensor: `element_hash` over every position, a block of spans
    at a time (one product with the table per element; bounded temporaries)."""
    flat = bits(t)
    n, total = flat.numel(), 0
    whole = n // SPAN * SPAN
    rows = flat[:whole].view(-1, SPAN)
    for r0 in range(0, rows.shape[0], BLOCK):
        block = rows[r0 : r0 + BLOCK]
        sums = (block * table).sum(dim=1, dtype=torch.int64)  # (int32 products wrap, as in element_hash)
        factors = torch.arange(r0, r0 + block.shape[0], dtype=torch.int64, device=block.device) * 2 + 1
        total += int((sums * factors).sum())
    if whole < n:
        total += int((flat[whole:] * table[: n - whole]).sum(dtype=torch.int64)) * (whole // SPAN * 2 + 1)
    return (total * salt(name)) & MASK64


def state_checksum(state: dict[str, torch.Tensor], dtype_of: dict[str, torch.dtype] | None = None) -> int:
    """The checksum of a state dict (a tied weight counted once, under its first name); each tensor
    cast to `dtype_of[name]` first where given (an engine whose dtype is not the published one)."""
    same = aliases(state)
    tables: dict[torch.device, torch.Tensor] = {}
    total = 0
    for k, v in state.items():
        if k in same:
            continue
        if dtype_of is not None and k in dtype_of and v.dtype != dtype_of[k]:
            v = v.to(dtype_of[k])
        if v.device not in tables:
            tables[v.device] = weights_table(v.device)
        total += tensor_checksum(k, v, tables[v.device])
    return total & MASK64


@dataclass
class Change:
    """New values of one tensor: at flat `indices` (sparse), or the whole tensor (`indices` None)."""

    values: torch.Tensor  # flat, in the published dtype
    indices: torch.Tensor | None = None  # int32 (int64 past 2**31 elements)

    @property
    def nbytes(self) -> int:
        n = self.values.numel() * self.values.element_size()
        return n if self.indices is None else n + self.indices.numel() * self.indices.element_size()


@dataclass
class Publication:
    """One published version of the weights, full or as a delta from the one before.

    `seq`: the encoder's count (1: its first); `base`: the checksum of the state a delta applies to
    (None: a full publication); `checksum`: of the state after it. `tensors`: a full publication's
    state dict; `changes`: a delta's changed tensors (a tied weight under its first name; `same`
    maps the other names to it). `full`: the complete state after it, in process only."""

    seq: int
    base: int | None
    checksum: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    changes: dict[str, Change] = field(default_factory=dict)
    same: dict[str, str] = field(default_factory=dict)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # every tensor's published dtype
    changed_elements: int = 0
    total_elements: int = 0
    full: dict[str, torch.Tensor] | None = None

    @property
    def is_delta(self) -> bool:
        return self.base is not None

    @property
    def nbytes(self) -> int:
        """Tensor bytes the publication moves (a tied weight once)."""
        if self.is_delta:
            return sum(c.nbytes for c in self.changes.values())
        return sum(v.numel() * v.element_size() for k, v in self.tensors.items() if k not in self.same)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The complete weights of this version: a full publication's own, else the in-process
        `full`; `ResyncNeeded` where neither is at hand."""
        if not self.is_delta:
            return self.tensors
        if self.full is None:
            raise ResyncNeeded(f"weight publication {self.seq}: the delta does not apply to the weights held and "
                               "no full copy came with it; the full weights of this version are needed", self.seq)
        return self.full

    def as_full(self) -> Publication:
        """This version as a full publication (same seq and checksum): what an engine that cannot
        apply the delta loads."""
        if not self.is_delta:
            return self
        return replace(self, base=None, tensors=self.full_state(), changes={}, full=None)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "full": None}  # (never crosses processes: only the delta does)


_VALUES, _INDICES = "#delta.values", "#delta.indices"  # (suffixes no state-dict name holds)


def split(pub: Publication) -> tuple[dict[str, torch.Tensor], Publication]:
    """A publication as a flat dict of its tensors (what a byte transport moves: a tied weight
    once) and its skeleton (everything else); `join` puts them back together."""
    skeleton = replace(pub, tensors={}, changes={}, full=None)
    if not pub.is_delta:
        return {k: v for k, v in pub.tensors.items() if k not in pub.same}, skeleton
    flat: dict[str, torch.Tensor] = {}
    for k, c in pub.changes.items():
        flat[k + _VALUES] = c.values
        if c.indices is not None:
            flat[k + _INDICES] = c.indices
    return flat, skeleton


def join(skeleton: Publication, flat: dict[str, torch.Tensor]) -> Publication:
    """The publication `split` took apart."""
    if not skeleton.is_delta:
        tensors = dict(flat)
        tensors.update({alias: tensors[target] for alias, target in skeleton.same.items() if target in tensors})
        return replace(skeleton, tensors=tensors)
    changes = {k.removesuffix(_VALUES): Change(v, flat.get(k.removesuffix(_VALUES) + _INDICES))
               for k, v in flat.items() if k.endswith(_VALUES)}
    return replace(skeleton, changes=changes)


def skeleton_json(pub: Publication) -> str:
    """A publication's skeleton as JSON (a weight folder's `publication.json`)."""
    return json.dumps({"seq": pub.seq, "base": pub.base, "checksum": pub.checksum, "same": pub.same,
                       "dtypes": {k: str(v).removeprefix("torch.") for k, v in pub.dtypes.items()},
                       "changed_elements": pub.changed_elements, "total_elements": pub.total_elements})


def skeleton_from_json(text: str) -> Publication:
    """The skeleton `skeleton_json` wrote; ValueError where it is not one."""
    try:
        d = json.loads(text)
        return Publication(int(d["seq"]), None if d["base"] is None else int(d["base"]), int(d["checksum"]),
                           same={str(k): str(v) for k, v in d["same"].items()},
                           dtypes={str(k): getattr(torch, v) for k, v in d["dtypes"].items()},
                           changed_elements=int(d["changed_elements"]), total_elements=int(d["total_elements"]))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a weight publication's skeleton ({type(exc).__name__}: {exc})") from None


class DeltaEncoder:
    """The trainer's side: the last published copy, and each new export as a delta from it."""

    def __init__(self) -> None:
        self.shadow: dict[str, torch.Tensor] | None = None
        self.checksum = 0
        self.seq = 0

    def encode(self, state: dict[str, torch.Tensor], *, full: bool = False) -> Publication:
        """`state` (an export in the published dtype) as the next publication: full the first time,
        when `full`, or when the names, shapes or dtypes changed; else a delta."""
        self.seq += 1
        same = aliases(state)
        dtypes = {k: v.dtype for k, v in state.items()}
        total = sum(v.numel() for k, v in state.items() if k not in same)
        if full or not self._fits(state):
            self.shadow = {k: v.detach().to("cpu", copy=True) for k, v in state.items() if k not in same}
            self.shadow.update({k: self.shadow[t] for k, t in same.items()})
            self.checksum = state_checksum(self.shadow)
            return Publication(self.seq, None, self.checksum, tensors=self.shadow, same=same, dtypes=dtypes,
                               changed_elements=total, total_elements=total, full=self.shadow)
        assert self.shadow is not None
        base, checksum, changes, changed = self.checksum, self.checksum, {}, 0
        table = weights_table("cpu")
        for k, v in state.items():
            if k in same:
                continue
            change, delta_sum, n = encode_tensor(k, v, self.shadow[k], table)
            if change is not None:
                changes[k] = change
                checksum += delta_sum
                changed += n
        self.checksum = checksum & MASK64
        return Publication(self.seq, base, self.checksum, changes=changes, same=same, dtypes=dtypes,
                           changed_elements=changed, total_elements=total, full=self.shadow)

    def _fits(self, state: dict[str, torch.Tensor]) -> bool:
        shadow = self.shadow
        return shadow is not None and shadow.keys() == state.keys() and all(
            shadow[k].shape == v.shape and shadow[k].dtype == v.dtype for k, v in state.items())


def encode_tensor(name: str, new: torch.Tensor, shadow: torch.Tensor,
                  table: torch.Tensor) -> tuple[Change | None, int, int]:
    """The change from `shadow` to `new` (None: equal bit for bit), the checksum's difference, and
    the changed element count; `shadow` is updated to `new`. Sparse (indices + values) while that
    is smaller than the whole tensor."""
    flat_new = new.detach().cpu().contiguous().reshape(-1)
    a, b = bits(flat_new), bits(shadow)
    idx = (a != b).nonzero().reshape(-1)  # (one pass for the mask, one for the indices)
    n = idx.numel()
    if n == 0:
        return None, 0, 0
    new_bits = a[idx]
    delta = element_hash(name, idx, new_bits, table) - element_hash(name, idx, b[idx], table)
    index_dtype = torch.int32 if a.numel() < 2**31 else torch.int64
    cost_sparse = n * (flat_new.element_size() + torch.empty((), dtype=index_dtype).element_size())
    if cost_sparse < flat_new.numel() * flat_new.element_size():
        change = Change(new_bits.view(flat_new.dtype), idx.to(index_dtype))
        b[idx] = new_bits  # (the shadow's own memory: `bits` is a view of it)
    else:
        change = Change(flat_new.clone())
        b.copy_(a)
    return change, delta, n


class HeldWeights:
    """An engine's side: the checksum of the publication it holds (None: unknown, e.g. the model
    folder it started from), and for an adapter its last published tensors (`mirror`), which a
    delta updates before they are merged."""

    def __init__(self) -> None:
        self.checksum: int | None = None
        self.mirror: dict[str, torch.Tensor] | None = None

    def forget(self) -> None:
        """The engine's weights changed another way (a plain state dict, a failed load)."""
        self.checksum, self.mirror = None, None

    def applies(self, pub: Publication) -> bool:
        return pub.is_delta and self.checksum is not None and pub.base == self.checksum

    def write_delta(self, pub: Publication, params: dict[str, torch.Tensor]) -> bool:
        """Write a delta's changes into `params` in place (the engine's tensors, or the `mirror`);
        True when the result's checksum is the publication's. Refused before any write
        (`WeightsRefused`) where a changed tensor is missing or of another shape."""
        bad = [k for k, c in pub.changes.items()
               if k not in params or (c.indices is None and params[k].numel() != c.values.numel())]
        if bad:
            raise WeightsRefused(f"weight publication {pub.seq}: the delta does not fit tensors {bad[:3]}")
        checksum = self.checksum or 0
        tables: dict[torch.device, torch.Tensor] = {}
        for k, c in pub.changes.items():
            device = params[k].device
            if device not in tables:
                tables[device] = weights_table(device)
            checksum += write_change(k, c, params[k], pub.dtypes[k], tables[device])
            for alias, target in pub.same.items():  # (an engine whose copy of a tied weight is its own tensor)
                if target == k and alias in params and params[alias].data_ptr() != params[k].data_ptr():
                    params[alias].copy_(params[k])
        self.checksum = checksum & MASK64
        return self.checksum == pub.checksum

    def verify_full(self, pub: Publication, params: dict[str, torch.Tensor]) -> bool:
        """After a full load of `pub`: the checksum of `params` (in the published dtypes) is its."""
        names = {k: v for k, v in params.items() if k in pub.dtypes}
        self.checksum = state_checksum(names, pub.dtypes)
        return self.checksum == pub.checksum


class HeldParams(dict[str, torch.Tensor]):
    """An engine's tensors by state-dict name, handed to a fill (a broadcast received in place),
    with the record of the publication they hold, which a delta received that way updates."""

    def __init__(self, params: dict[str, torch.Tensor], held: HeldWeights) -> None:
        super().__init__(params)
        self.held = held


def write_change(name: str, change: Change, target: torch.Tensor, dtype: torch.dtype, table: torch.Tensor) -> int:
    """Write one tensor's change into `target` (any device and dtype); the checksum's difference,
    from what `target` held and holds after, read back in the published `dtype`."""
    flat = target.view(-1)
    values = change.values.to(flat.device)
    if change.indices is None:
        before = tensor_checksum(name, flat.to(dtype), table)
        flat.copy_(values)
        return tensor_checksum(name, flat.to(dtype), table) - before
    idx = change.indices.to(flat.device, torch.int64)
    old = bits(flat[idx].to(dtype))
    flat[idx] = values.to(flat.dtype)
    new = bits(flat[idx].to(dtype))
    return element_hash(name, idx, new, table) - element_hash(name, idx, old, table)
