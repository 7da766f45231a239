"""Stages that score each response with another model as soon as it is written, off the trainer's
critical path: the KL term's reference (`ref_logprobs`) and the distillation teacher
(`teacher_logprobs`). Each waits for any written response.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import cast

import torch

from asyncflow.compute_thread import in_own_thread
from asyncflow.engines.base import TrainBatch
from asyncflow.errors import WaitTimeout
from asyncflow.transfer_queue import QueueClosed, SampleView
from asyncflow.workflow.batch import build_train_batch
from asyncflow.workflow.context import StageContext
from asyncflow.workflow.settings import ReferenceSettings

# a padded batch -> per-token log-probs [B, L-1]: blocking (a model pass, run in a worker thread) or
# a coroutine function (a server's)
ReferenceFn = Callable[[TrainBatch], torch.Tensor] | Callable[[TrainBatch], Awaitable[torch.Tensor]]


class ReferenceWorker:
    """A scoring loop: up to a batch of responses per pass, stored as each sample's `field` (stage
    `stage`): `reference` / `ref_logprobs` (the KL term), `teacher` / `teacher_logprobs` (distillation)."""

    def __init__(self, ctx: StageContext, settings: ReferenceSettings, *, ref_logprobs: ReferenceFn,
                 pad_token_id: int, stage: str = "reference", field: str = "ref_logprobs") -> None:
        self.ctx = ctx
        self.settings = settings
        self.ref_logprobs = ref_logprobs
        self.pad_token_id = pad_token_id
        self.stage = stage
        self.field = field
        self.is_async = inspect.iscoroutinefunction(ref_logprobs) or inspect.iscoroutinefunction(
            type(ref_logprobs).__call__)  # (a server teacher: an object with an async __call__)

    async def run(self) -> None:
        ctx, st = self.ctx, self.settings
        while True:
            try:
                lease = await ctx.store.take(self.stage, st.batch_size, timeout=st.step_timeout_s,
                                             fields_extra=["prompt_ids"])
            except WaitTimeout:
                continue
            except QueueClosed:
                return
            samples = lease.samples
            start = ctx.clock.now()
            with ctx.keeper.holding(lease):
                rows = await ctx.clock.wait_for(self.score(samples), st.step_timeout_s,
                                                f"{self.stage} log-probs of {len(samples)} samples")
            ctx.tracer.span(self.stage, f"{self.stage} log-probs x{len(samples)}", start, ctx.clock.now())
            ctx.store.complete(lease, {s.uid: {self.field: r} for s, r in zip(samples, rows, strict=True)})

    async def score(self, samples: list[SampleView]) -> list[list[float]]:
        """Each response's log-probs (one pass over the padded batch)."""
        if self.is_async:
            return self.rows_of(samples, await cast(Awaitable[torch.Tensor], self.ref_logprobs(self.batch_of(samples))))
        return await in_own_thread(
            lambda: self.rows_of(samples, cast(torch.Tensor, self.ref_logprobs(self.batch_of(samples)))),
            threads=self.settings.threads)

    def batch_of(self, samples: list[SampleView]) -> TrainBatch:
        responses = [s.fields["response_ids"] for s in samples]
        return build_train_batch([s.fields["prompt_ids"] for s in samples], responses,
                                 [[0.0] * len(r) for r in responses], torch.zeros(len(samples)),
                                 [True] * len(samples), self.pad_token_id)

    @staticmethod
    def rows_of(samples: list[SampleView], lp: torch.Tensor) -> list[list[float]]:
        """Each response's slice of the batch's log-probs."""
        out = []
        for i, s in enumerate(samples):
            start = len(s.fields["prompt_ids"]) - 1
            out.append(lp[i, start : start + len(s.fields["response_ids"])].tolist())
        return out
