"""`runtime.weight_sync_delta`: a `TrainEngine` whose exports are publications, full or delta.

It wraps the trainer named by `train.engine`: every call goes to that engine, and each
`export_weights` result (a state dict in the published dtype) is encoded by a `DeltaEncoder`
(asyncflow.engines.weight_delta) against the last one. The first export is full; later ones carry
only the elements that changed. `published_full(seq)` hands out the complete weights of the last
publication, for an engine that cannot apply its delta in another process (a restarted Ray actor).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncflow.engines.base import LossFn, TrainBatch, TrainEngine
from asyncflow.engines.weight_delta import DeltaEncoder, Publication


class DeltaTrainEngine(TrainEngine):
    """`inner`, publishing deltas (`export_weights` returns a `Publication`)."""

    def __init__(self, inner: TrainEngine) -> None:
        self.inner = inner
        self.encoder = DeltaEncoder()
        self.export_blocks = True  # (the comparison with the last copy is a pass over the weights)
        self.last: Publication | None = None

    def logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self.inner.logprobs(batch, temperature)

    def train_step(self, batch: TrainBatch, loss_fn: LossFn, temperature: float, *,
                   proximal: bool = False) -> dict[str, float]:
        return self.inner.train_step(batch, loss_fn, temperature, proximal=proximal)

    def export_weights(self) -> Publication:  # type: ignore[override]
        state = self.inner.export_weights()
        if not isinstance(state, dict):
            raise TypeError(f"runtime.weight_sync_delta needs a trainer whose export is a state dict in this process "
                            f"({type(self.inner).__name__} exported a {type(state).__name__})")
        self.last = self.encoder.encode(state)
        self.last_export_bytes = self.last.nbytes
        return self.last

    def published_full(self, seq: int | None) -> Publication | None:
        """Publication `seq` (None: the last) as a full one, while it is the last one (None: a newer
        one was encoded since, which the caller then loads)."""
        last = self.last
        return last.as_full() if last is not None and seq in (None, last.seq) else None

    def reuse_export_memory(self) -> None:
        self.inner.reuse_export_memory()  # (the encoder copies each export into its own memory)

    def save(self, path: str, *, with_optimizer: bool) -> None:
        self.inner.save(path, with_optimizer=with_optimizer)

    def reference_logprobs(self, batch: TrainBatch, temperature: float) -> torch.Tensor:
        return self.inner.reference_logprobs(batch, temperature)

    def load_optimizer(self, path: str) -> None:
        self.inner.load_optimizer(path)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # (the inner engine's own attributes: `model`, `dtype`, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
