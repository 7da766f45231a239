"""Stateless pieces of the FSDP engine (asyncflow.engines.fsdp_train): how a batch is split over the
ranks (one `Share` of rows per rank, balanced by tokens, the same number of passes on every rank) and
which blocks of a model are sharded one by one."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from asyncflow.engines.base import TrainBatch
from asyncflow.transfer_queue.samplers import balance_equal_counts


@dataclass
class Share:
    """One rank's rows of one mini-batch (or of a log-prob batch) and how many passes every rank runs."""

    rows: TrainBatch | None  # None: this rank has no rows; it still runs `passes` dummy passes
    passes: int
    micro_batch_size: int
    index: list[int] = dataclasses.field(default_factory=list)  # the rows' positions in the split batch


def make_shares(batch: TrainBatch, world_size: int, micro_batch_size: int | None) -> list[Share]:
    """Split `batch` by rank: as many rows each as `split_sequential` gives, chosen so every rank gets about
    the same number of tokens (`balance_equal_counts`: a rank with the long rows would make the others
    wait at every collective); every rank runs as many passes as the rank with the most micro-batches."""
    parts = balance_equal_counts(batch.attention_mask.sum(-1).tolist(), world_size)
    micro = micro_batch_size or max(len(p) for p in parts)
    passes = max(math.ceil(len(p) / micro) for p in parts)
    return [Share(batch.select(p) if p else None, passes, micro, p) for p in parts]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one: the modules of the classes the model names in
    `_no_split_modules` (transformers' own list of its blocks: `Qwen2DecoderLayer`, GPT-2's `GPT2Block`
    in `transformer.h`, Bloom's, Falcon's), else those of a ModuleList named `layers`. Without them
    only the root is sharded and the whole model is gathered at once (no memory saved)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    # the outermost ones (a block listed inside another is sharded with it)
    blocks = [m for n, m in found if not any(n.startswith(f"{other}.") for other, _ in found)]
    if blocks:
        return blocks
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []
