"""Policy losses: pure tensor functions, normalised by the token count of the whole batch.

Each loss returns the *contribution* of one micro-batch: per-token terms summed and divided by
`token_normalizer`, the number of trained tokens in the whole mini-batch. Summing contributions
over micro-batches therefore gives the token mean over the mini-batch, so the loss and gradients do
not depend on `micro_batch_size` (the usual bug is to average per micro-batch and again across them).
Metrics are returned the same way (sums / normaliser), so they add up across micro-batches too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncflow.engines.base import LossFn, TrainBatch


@dataclass(frozen=True)
class PPOSettings:
    """Clip range and KL weight for the PPO-clip loss."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: exp(ref - pi) - (ref - pi) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_normalizer: float,
    settings: PPOSettings,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip with separate low/high clip, optional k3 KL to a reference; token-mean aggregation.

    Shapes: logprobs/old_logprobs/mask/ref_logprobs [B, T]; advantages [B] (broadcast over tokens).
    """
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - settings.clip_low, 1 + settings.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    norm = max(float(token_normalizer), 1.0)
    metrics: dict[str, torch.Tensor] = {
        "pg_loss": (per_token * mask).sum().detach() / norm,
        "clip_frac": ((clipped > unclipped).to(mask.dtype) * mask).sum().detach() / norm,
        "ratio_mean": (ratio * mask).sum().detach() / norm,
    }
    if ref_logprobs is not None and settings.kl_coef > 0:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + settings.kl_coef * kl
        metrics["kl"] = (kl * mask).sum().detach() / norm
    loss = (per_token * mask).sum() / norm
    return loss, metrics


def make_ppo_loss(settings: PPOSettings) -> LossFn:
    """A `LossFn` for the train engine: PPO-clip against the batch's behavior log-probs."""

    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch, token_normalizer: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return ppo_clip_loss(
            logprobs,
            batch.behavior_logprobs,
            batch.advantages,
            batch.response_mask,
            token_normalizer,
            settings,
            batch.ref_logprobs,
        )

    return loss_fn


LOSSES: dict[str, Callable[[PPOSettings], LossFn]] = {"ppo": make_ppo_loss}


def make_loss_fn(name: str, settings: PPOSettings) -> LossFn:
    """The policy loss registered under `name`."""
    try:
        return LOSSES[name](settings)
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {', '.join(LOSSES)}") from None
