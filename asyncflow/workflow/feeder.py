"""The feeder stage: admits prompts into the store as `n` samples each, while the staleness gate
gives credit. It waits for credit (freed by a publication or a dropped group) and for room in the store.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

from asyncflow.tokenizer import Tokenizer
from asyncflow.transfer_queue import NewSample, QueueClosed
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.gate import StalenessGate
from asyncflow.workflow.settings import FeederSettings

FEED_BURST = 32  # most prompts the feeder admits in one store put


def row_order(n_rows: int, seed: int, shuffle: bool) -> Iterator[int]:
    """The prompt stream: row indices, epoch after epoch (each shuffled with `shuffle`)."""
    rng = random.Random(seed)
    while True:
        idx = list(range(n_rows))
        if shuffle:
            rng.shuffle(idx)
        yield from idx


class Feeder:
    """The feeder loop and its position in the prompt stream."""

    def __init__(self, ctx: StageContext, settings: FeederSettings, *, rows: list[dict[str, Any]], tok: Tokenizer,
                 gate: StalenessGate) -> None:
        """`rows`: the prompt rows (a Ray actor's list is filled before `run`)."""
        self.ctx = ctx
        self.settings = settings
        self.rows = rows
        self.tok = tok
        self.gate = gate
        self.next_group = 0  # the next group id: also how many prompts have been drawn
        self.order: Iterator[int] | None = None  # the stream, from `next_group` on (made at the first draw)

    def restore(self, next_group: int, version: int, admitted: int) -> None:
        """Resume at draw `next_group` of the prompt stream, with the gate at `version` and
        `admitted` groups counted against it (see `asyncflow/checkpoint.py`)."""
        self.next_group = next_group
        self.order = None
        self.gate.restore(version, admitted)

    def _stream(self) -> Iterator[int]:
        if self.order is None:
            s = self.settings
            self.order = row_order(len(self.rows), s.seed, s.shuffle)
            for _ in range(self.next_group):
                next(self.order)
        return self.order

    async def run(self) -> None:
        """Admit prompts as `n` single-sample requests each, while the staleness gate allows: every
        prompt the credit allows at that moment (up to `FEED_BURST`) in one store put. A publication
        frees a whole step's credit at once; one put per prompt cost a gate check, a put call and its
        wake-ups per prompt. With affinity routing, one prompt per put: each goes to the worker that
        is least loaded once the previous one has been counted."""
        s, gate, store = self.settings, self.gate, self.ctx.store
        order = self._stream()
        while not gate.closed:
            if not await gate.wait_for_credit(s.step_timeout_s):
                continue  # the trainer is slow; credit comes with the next publication
            burst = 1 if s.affinity else max(1, min(gate.credit(), FEED_BURST))
            samples: list[NewSample] = []
            for group_id in range(self.next_group, self.next_group + burst):
                row_index = next(order)
                fields = {"prompt_ids": self.tok.prompt_ids(self.rows[row_index][s.prompt_key]), "row": row_index}
                if s.affinity:
                    fields[f"to/{await self._least_loaded_worker()}"] = True
                # one NewSample (and one fields dict) for the group's n samples: the store reads it and
                # copies the fields for each sample it admits, and assigns each its own uid
                samples += [NewSample(group_id, s.n, fields, priority=float(group_id))] * s.n
            gate.admit(burst)
            try:
                await store.put(samples, timeout=s.step_timeout_s)
            except QueueClosed:
                return
            self.next_group += burst
            # neither wait above yields while there is credit and room: without this the feeder kept the
            # loop to itself for as long as a huge batch's admission took (no rollout, no Ctrl-C)
            await asyncio.sleep(0)

    async def _least_loaded_worker(self) -> int:
        """The rollout worker with the fewest samples queued for it or in flight (affinity routing);
        a store in another process is asked without blocking the event loop (`metrics_async`)."""
        m = await self.ctx.store.metrics_async()
        return min(range(len(self.settings.rollout_stages)),
                   key=lambda i: m.get(f"depth/rollout/{i}", 0.0) + m.get(f"leased/rollout/{i}", 0.0))
