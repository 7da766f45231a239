"""Advantage estimators: pure tensor functions over a whole batch (computed at batch assembly).

Computing advantages where the batch is assembled, not per group as rewards arrive, lets batch-level
normalisation and filters see the whole batch. Samples whose reward failed (`valid` False) get
advantage 0 and are left out of their group's statistics.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AdvantageFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and (unbiased) std of the valid rewards of its group, computed in float64.
    The std is exactly 0 for a group whose valid rewards are all equal: the float32 mean of equal
    values can be one rounding step off, and the std of ~1e-7 that leaves, divided by itself in
    GRPO, gave every sample of such a group the same sizeable advantage (e.g. +0.1 for 16 x 0.9)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    r64 = rewards.to(torch.float64)
    w = valid.to(torch.float64)
    r = torch.where(valid, r64, torch.zeros_like(r64))
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, w)
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, r)
    mean = total / count.clamp(min=1)
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, w * (r - mean[inverse]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    inf = torch.full_like(r64, float("inf"))
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, torch.where(valid, r64, inf), "amin")
    hi = torch.full((n_groups,), -float("inf"), dtype=torch.float64).scatter_reduce(
        0, inverse, torch.where(valid, r64, -inf), "amax")
    std = torch.where(hi > lo, std, torch.zeros_like(std))
    return mean[inverse], std[inverse]


def compute_grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps). A group whose rewards are all equal gets 0."""
    mean, std = _group_stats(rewards, group_ids, valid)
    centred = rewards.to(torch.float64) - mean
    adv = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred)).to(rewards.dtype)
    return torch.where(valid, adv, torch.zeros_like(adv))


def compute_dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Dr.GRPO: r - group mean, without the std division (which up-weights easy and hard groups)."""
    mean, _ = _group_stats(rewards, group_ids, valid)
    return torch.where(valid, (rewards.to(torch.float64) - mean).to(rewards.dtype), torch.zeros_like(rewards))


def compute_rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the *other* valid rewards of its group, = n/(n-1) (r_i - mean).
    A sample alone in its group (n = 1) has no baseline and gets 0."""
    mean, _ = _group_stats(rewards, group_ids, valid)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype).index_add_(0, inverse, valid.to(rewards.dtype))[inverse]
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return torch.where(valid, (scale * (rewards.to(torch.float64) - mean)).to(rewards.dtype), torch.zeros_like(rewards))


def compute_reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: the rewards normalised over the whole batch, (r - batch mean) / (batch std + eps),
    no per-group baseline. Batch statistics use the valid samples; a batch whose rewards are all
    equal gets 0."""
    del group_ids
    r = rewards[valid]
    if r.numel() < 2:
        return torch.zeros_like(rewards)
    if float(r.max()) == float(r.min()):  # (not std == 0: float rounding leaves ~1e-7, see _group_stats)
        return torch.zeros_like(rewards)
    r64 = r.to(torch.float64)
    mean, std = r64.mean(), r64.std()
    return torch.where(valid, ((rewards.to(torch.float64) - mean) / (std + eps)).to(rewards.dtype),
                       torch.zeros_like(rewards))


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft over-long punishment, added to the reward before advantages: 0 up to
    `max_length - buffer` generated tokens, then falling linearly to `-penalty` at `max_length`."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.to(torch.float32) - (max_length - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer


def distill_advantages(advantages: torch.Tensor, behavior_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       mask: torch.Tensor, coef: float, reward_coef: float) -> torch.Tensor:
    """On-policy distillation's per-token advantages [B, T]: `reward_coef` x the sequence's advantage
    (`advantages` [B]) minus `coef` x the sampled token's reverse KL, log mu - log teacher (the policy
    that sampled it against the teacher: a one-sample estimate of KL(mu || teacher) at that position).
    0 off `mask`. Taken at the behavior log-probs, so the advantage is fixed when the batch is built,
    whatever the loss then does with ratios."""
    reverse_kl = (behavior_logprobs - teacher_logprobs) * mask
    return (reward_coef * advantages.unsqueeze(-1) * mask - coef * reverse_kl).to(torch.float32)


ADVANTAGES: dict[str, AdvantageFn] = {
    "grpo": compute_grpo_advantages,
    "dr_grpo": compute_dr_grpo_advantages,
    "rloo": compute_rloo_advantages,
    "reinforce_pp": compute_reinforce_pp_advantages,
}


def make_advantage_fn(name: str) -> AdvantageFn:
    """The advantage estimator registered under `name`."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; known: {', '.join(ADVANTAGES)}") from None
