"""The trainer actor of a run that publishes deltas (`runtime.weight_sync_delta`).

A delta reaches each rollout actor through the object store (or a broadcast); an actor it does not
apply to (it restarted, missed a version, or its checksum differed) refuses it with `ResyncNeeded`,
and the driver (`asyncflow.runtime.ray_weights.StoredWeights`) has it load the full weights of that
publication, which this actor hands out from the trainer's last published copy.
"""

from __future__ import annotations

from asyncflow.engines.shared_state import SharedState
from asyncflow.runtime.ray_actors import TrainerWorker


class DeltaTrainerWorker(TrainerWorker):
    """`TrainerWorker` whose engine is a `DeltaTrainEngine`, plus the full weights on request."""

    def published_full(self, seq: int | None) -> SharedState | None:
        """Publication `seq` (None: the last) as a full one, while it is the last (None: a newer one
        was published since: the actor gets that one)."""
        full = self.engine.published_full(seq)  # type: ignore[attr-defined]
        return None if full is None else SharedState(full)
