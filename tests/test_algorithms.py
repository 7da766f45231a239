"""Advantages and losses against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncflow.algorithms.advantages import (
    compute_dr_grpo_advantages,
    compute_grpo_advantages,
    make_advantage_fn,
)
from asyncflow.algorithms.losses import PPOSettings, kl_k3, make_loss_fn, ppo_clip_loss


def test_grpo_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])
    valid = torch.ones(6, dtype=torch.bool)
    adv = compute_grpo_advantages(rewards, groups, valid, eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected)


def test_all_equal_rewards_give_zero_advantage() -> None:
    adv = compute_grpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
    assert adv.abs().max() == 0


def test_dr_grpo_does_not_divide_by_std() -> None:
    adv = compute_dr_grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, dtype=torch.bool))
    assert adv.tolist() == [1.0, -1.0]


def test_invalid_samples_are_left_out_of_group_statistics() -> None:
    rewards = torch.tensor([1.0, 0.0, 123.0])
    valid = torch.tensor([True, True, False])
    adv = compute_dr_grpo_advantages(rewards, torch.tensor([0, 0, 0]), valid)
    assert adv.tolist() == [0.5, -0.5, 0.0]
    assert make_advantage_fn("grpo") is compute_grpo_advantages
    with pytest.raises(ValueError, match="unknown advantage"):
        make_advantage_fn("nope")


def test_ppo_clip_uses_separate_low_and_high_clip() -> None:
    old = torch.zeros(1, 4)
    # ratios 1.5 and 0.5 with positive and negative advantage
    new = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    mask = torch.ones(1, 4)
    settings = PPOSettings(clip_low=0.2, clip_high=0.3)
    loss_pos, m = ppo_clip_loss(new, old, torch.tensor([1.0]), mask, 4, settings)
    # A>0: min(r*A, clip(r)*A) -> 1.3 and 0.5 -> loss -(1.3+0.5+1.3+0.5)/4
    assert float(loss_pos) == pytest.approx(-(1.3 + 0.5 + 1.3 + 0.5) / 4)
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    loss_neg, _ = ppo_clip_loss(new, old, torch.tensor([-1.0]), mask, 4, settings)
    # A<0: max(-r*A, -clip(r)*A) = max(r, clip(r)) -> 1.5 and 0.8
    assert float(loss_neg) == pytest.approx((1.5 + 0.8 + 1.5 + 0.8) / 4)


def test_token_mean_is_normalised_by_the_whole_batch_token_count() -> None:
    lp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 1.0])
    whole, _ = ppo_clip_loss(lp, lp, adv, mask, 4, PPOSettings())
    first, _ = ppo_clip_loss(lp[:1], lp[:1], adv[:1], mask[:1], 4, PPOSettings())
    second, _ = ppo_clip_loss(lp[1:], lp[1:], adv[1:], mask[1:], 4, PPOSettings())
    assert float(whole) == pytest.approx(-1.0)
    assert float(first + second) == pytest.approx(float(whole))


def test_empty_mask_gives_zero_loss_not_nan() -> None:
    lp = torch.zeros(1, 3)
    loss, _ = ppo_clip_loss(lp, lp, torch.tensor([1.0]), torch.zeros(1, 3), 0, PPOSettings())
    assert float(loss) == 0.0


def test_k3_kl_is_zero_at_equality_and_positive_elsewhere() -> None:
    assert float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0
    value = float(kl_k3(torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))))
    assert value == pytest.approx(0.5 - math.log(0.5) - 1)
    lp, ref = torch.zeros(1, 2), torch.full((1, 2), math.log(0.5))
    with_kl, m = ppo_clip_loss(lp, lp, torch.zeros(1), torch.ones(1, 2), 2, PPOSettings(kl_coef=0.1), ref)
    assert float(with_kl) == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1))
    assert "kl" in m
    with pytest.raises(ValueError, match="unknown policy loss"):
        make_loss_fn("nope", PPOSettings())
