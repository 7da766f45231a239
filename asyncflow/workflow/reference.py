"""The reference stage: the KL term's reference log-probs of each response as soon as it is written,
off the trainer's critical path. It waits for any written response.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncflow.compute_thread import in_own_thread
from asyncflow.engines.base import TrainBatch
from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import QueueClosed, SampleView
from asyncflow.workflow.batch import build_train_batch
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.settings import ReferenceSettings

ReferenceFn = Callable[[TrainBatch], torch.Tensor]  # a padded batch -> per-token log-probs


class ReferenceWorker:
    """The reference loop: up to a batch of responses per forward pass, in a worker thread, stored as
    each sample's `ref_logprobs` field."""

    def __init__(self, ctx: StageContext, settings: ReferenceSettings, *, ref_logprobs: ReferenceFn,
                 pad_token_id: int) -> None:
        self.ctx = ctx
        self.settings = settings
        self.ref_logprobs = ref_logprobs
        self.pad_token_id = pad_token_id

    async def run(self) -> None:
        ctx, st = self.ctx, self.settings
        while True:
            try:
                lease = await ctx.store.take("reference", st.batch_size, timeout=st.step_timeout_s,
                                             fields_extra=["prompt_ids"])
            except WaitTimeout:
                continue
            except QueueClosed:
                return
            samples = lease.samples
            start = ctx.clock.now()
            with ctx.keeper.holding(lease):
                rows = await ctx.clock.wait_for(
                    in_own_thread(self.rows_of, samples, threads=st.threads), st.step_timeout_s,
                    f"reference log-probs of {len(samples)} samples",
                )
            ctx.tracer.span("reference", f"ref log-probs x{len(samples)}", start, ctx.clock.now())
            ctx.store.complete(lease, {s.uid: {"ref_logprobs": r} for s, r in zip(samples, rows, strict=True)})

    def rows_of(self, samples: list[SampleView]) -> list[list[float]]:
        """Each response's reference log-probs (one forward pass over the padded batch)."""
        prompts = [s.fields["prompt_ids"] for s in samples]
        responses = [s.fields["response_ids"] for s in samples]
        batch = build_train_batch(prompts, responses, [[0.0] * len(r) for r in responses],
                                  torch.zeros(len(samples)), [True] * len(samples), self.pad_token_id)
        lp = self.ref_logprobs(batch)
        return [lp[i, len(p) - 1 : len(p) - 1 + len(r)].tolist()
                for i, (p, r) in enumerate(zip(prompts, responses, strict=True))]
