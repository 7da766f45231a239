"""The feeder stage: admits prompts into the store as `n` samples each, while the staleness gate
gives credit. It waits for credit (freed by a publication or a dropped group) and for room in the store.
"""

from __future__ import annotations

import asyncio

from asyncflow.transfer_queue import NewSample, QueueClosed
from asyncflow.workflow.stage_base import StageBase

FEED_BURST = 32  # most prompts the feeder admits in one store put


class FeederStage(StageBase):
    """The feeder loop and its position in the prompt stream."""

    def restore_feeder(self, next_group: int, version: int, admitted: int) -> None:
        """Resume the feeder at draw `next_group` of its prompt stream, with the gate at `version`
        and `admitted` groups counted against it (see `asyncflow/checkpoint.py`)."""
        self.next_group = next_group
        self._order = self._row_order()
        for _ in range(next_group):
            next(self._order)
        self.gate.restore(version, admitted)

    async def feeder(self) -> None:
        """Admit prompts as `n` single-sample requests each, while the staleness gate allows: every
        prompt the credit allows at that moment (up to `FEED_BURST`) in one store put. A publication
        frees a whole step's credit at once; one put per prompt cost a gate check, a put call and its
        wake-ups per prompt. With affinity routing, one prompt per put: each goes to the worker that
        is least loaded once the previous one has been counted."""
        key, n, affinity = self.cfg.dataset.prompt_key, self.n, self.cfg.rollout.affinity
        while not self.gate.closed:
            if not await self.gate.wait_for_credit(self.cfg.workflow.step_timeout_s):
                continue  # the trainer is slow; credit comes with the next publication
            burst = 1 if affinity else max(1, min(self.gate.credit(), FEED_BURST))
            samples: list[NewSample] = []
            for group_id in range(self.next_group, self.next_group + burst):
                row_index = next(self._order)
                fields = {"prompt_ids": self.tok.prompt_ids(self.rows[row_index][key]), "row": row_index}
                if affinity:
                    fields[f"to/{await self._least_loaded_worker()}"] = True
                # one NewSample (and one fields dict) for the group's n samples: the store reads it and
                # copies the fields for each sample it admits, and assigns each its own uid
                samples += [NewSample(group_id, n, fields, priority=float(group_id))] * n
            self.gate.admit(burst)
            try:
                await self.store.put(samples, timeout=self.cfg.workflow.step_timeout_s)
            except QueueClosed:
                return
            self.next_group += burst
            # neither wait above yields while there is credit and room: without this the feeder kept the
            # loop to itself for as long as a huge batch's admission took (no rollout, no Ctrl-C)
            await asyncio.sleep(0)

    async def _least_loaded_worker(self) -> int:
        """The rollout worker with the fewest samples queued for it or in flight (affinity routing);
        a store in another process is asked without blocking the event loop (`metrics_async`)."""
        m = await self.store.metrics_async()
        return min(range(len(self.rollout_stages)),
                   key=lambda i: m.get(f"depth/rollout/{i}", 0.0) + m.get(f"leased/rollout/{i}", 0.0))
