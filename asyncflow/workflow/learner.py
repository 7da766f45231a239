"""The optimizer step the trainer stage runs on each batch: the `Learner` protocol, and `EngineLearner`,
the one a run uses (advantages, the padded batch and the train engine's optimizer steps). A stand-in
(PIPE's simulated trainer) implements `Learner` and is given to `build_pipeline`."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch

from asyncflow.algorithms.advantages import distill_advantages, make_advantage_fn, overlong_penalty
from asyncflow.algorithms.losses import NEEDS_PROXIMAL
from asyncflow.compute_thread import in_own_thread
from asyncflow.engines.base import LossFn, TrainBatch, TrainEngine
from asyncflow.transfer_queue import SampleView
from asyncflow.workflow.batch import build_train_batch, generated_count
from asyncflow.workflow.settings import LearnerSettings


class Learner(Protocol):
    """One train step on a batch of samples."""

    async def step(self, samples: list[SampleView], valid: list[bool], rewards: list[float],
                   version: int) -> tuple[dict[str, Any], int]:
        """Train on `samples` (`valid[i]`: sample i has a reward, `rewards[i]`; the others train with
        reward 0, masked out) with the weights of policy `version`; returns the step's metrics and
        the number of trained tokens."""
        ...


def aligned(samples: list[SampleView], field: str, like: torch.Tensor) -> torch.Tensor:
    """The samples' per-response-token `field` (reference or teacher log-probs) placed as a padded
    batch's response columns are (`like`'s shape; 0 elsewhere)."""
    out = torch.zeros_like(like)
    for i, s in enumerate(samples):
        start = len(s.fields["prompt_ids"]) - 1
        values = s.fields[field]
        out[i, start : start + len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


def current_version_mask(samples: list[SampleView], version: int, response_mask: torch.Tensor) -> torch.Tensor:
    """The trained tokens of the responses whose every token `version` generated: after a `swap`
    mid-response the later tokens are the new version's, but their prefix's KV cache was computed
    under the old weights, so their log-probs are not the trainer's either."""
    same = torch.zeros_like(response_mask)
    for i, s in enumerate(samples):
        versions = s.fields["token_versions"]
        # (one array comparison: a Python loop per token held the GIL ~0.4 us a token, every step)
        ids = np.fromiter(versions, dtype=np.int64, count=len(versions))
        if len(ids) and bool((ids == version).all()):
            p = len(s.fields["prompt_ids"])
            same[i, p - 1 : p - 1 + len(ids)] = 1.0
    return same * response_mask


def mismatch_kl(metrics: dict[str, Any]) -> float | None:
    """The train/inference mismatch from a train step's sums (`TrainEngine.train_step`), taken out of
    `metrics`: the mean k3 of KL(behavior || trainer) over the tokens of responses the trainer's own
    version generated wholly; None (null in metrics.jsonl) when the batch holds none."""
    total = metrics.pop("mismatch_kl_sum", 0.0)
    tokens = metrics.pop("mismatch_tokens", 0.0)
    return total / tokens if tokens else None


class EngineLearner:
    """The train engine's step: advantages over the batch, the padded batch, then the engine's
    optimizer steps in a worker thread."""

    def __init__(self, settings: LearnerSettings, trainer: TrainEngine, loss_fn: LossFn, *, pad_token_id: int,
                 with_reference: bool) -> None:
        """`with_reference`: the samples carry `ref_logprobs` (the reference stage's), for the KL term."""
        self.settings = settings
        self.trainer = trainer
        self.loss_fn = loss_fn
        self.pad_token_id = pad_token_id
        self.with_reference = with_reference
        self.advantage_fn = make_advantage_fn(settings.advantage)
        self.needs_proximal = settings.loss in NEEDS_PROXIMAL

    async def step(self, samples: list[SampleView], valid: list[bool], rewards: list[float],
                   version: int) -> tuple[dict[str, Any], int]:
        batch, extra = self.make_batch(samples, valid, rewards)
        metrics = await in_own_thread(self.compute_step, batch, self.settings.temperature, samples, version,
                                      threads=self.settings.threads)
        metrics.update(extra)
        return metrics, int(batch.response_mask.sum())

    def make_batch(self, samples: list[SampleView], valid: list[bool],
                   rewards: list[float]) -> tuple[TrainBatch, dict[str, Any]]:
        """The padded batch: rewards (plus the over-long penalty, if on) -> advantages over the whole
        batch; reference log-probs from the samples' `ref_logprobs` field (the reference stage)."""
        valid_t = torch.tensor(valid)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        algo = self.settings
        extra: dict[str, Any] = {}
        if algo.overlong_buffer > 0:
            lengths = torch.tensor([generated_count(s) for s in samples])
            penalty = overlong_penalty(lengths, algo.max_generated_tokens, algo.overlong_buffer, algo.overlong_penalty)
            reward_t = reward_t + torch.where(valid_t, penalty, torch.zeros_like(penalty))
            extra["overlong_penalty_mean"] = float(penalty[valid_t].mean()) if any(valid) else 0.0
        adv = self.advantage_fn(reward_t, torch.tensor([s.group_id for s in samples]), valid_t)
        batch = build_train_batch(
            [s.fields["prompt_ids"] for s in samples],
            [s.fields["response_ids"] for s in samples],
            [s.fields["behavior_logprobs"] for s in samples],
            adv,
            valid,
            self.pad_token_id,
            [s.fields.get("loss_mask") for s in samples],
        )
        if self.with_reference:
            batch.ref_logprobs = aligned(samples, "ref_logprobs", batch.behavior_logprobs)
        if algo.distill:
            teacher = aligned(samples, "teacher_logprobs", batch.behavior_logprobs)
            mask = batch.response_mask
            batch.advantages = distill_advantages(adv, batch.behavior_logprobs, teacher, mask, algo.distill_coef,
                                                  algo.reward_coef)
            tokens = float(mask.sum())
            # the reverse KL per trained token, estimated on the sampled tokens (k1: log mu - log teacher)
            extra["distill_reverse_kl"] = float(((batch.behavior_logprobs - teacher) * mask).sum()) / max(tokens, 1.0)
        return batch, extra

    def compute_step(self, batch: TrainBatch, temperature: float, samples: list[SampleView],
                     version: int) -> dict[str, Any]:
        """Runs in a worker thread: the optimizer steps. Their first passes, on the weights before the
        update, also give decoupled PPO's proximal log-probs and `mismatch_kl`: behavior log-probs
        against the trainer's, on the responses that `version` (the trainer's) generated wholly
        (elsewhere the two policies differ by design)."""
        same = current_version_mask(samples, version, batch.response_mask)
        batch.mismatch_mask = same if bool(same.any()) else None
        metrics: dict[str, Any] = dict(self.trainer.train_step(batch, self.loss_fn, temperature,
                                                               proximal=self.needs_proximal))
        metrics["mismatch_kl"] = mismatch_kl(metrics)
        return metrics
