"""Advantages, losses and aggregation against hand-computed values on small tensors."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncflow.algorithms.advantages import (
    compute_dr_grpo_advantages,
    compute_grpo_advantages,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    make_advantage_fn,
    overlong_penalty,
)
from asyncflow.algorithms.losses import (
    AGG_NAMES,
    LOSS_NAMES,
    LossSettings,
    aggregate,
    kl_estimate,
    kl_k3,
    make_loss_fn,
    policy_loss,
    ppo_clip_loss,
)
from asyncflow.engines.base import Norm, TrainBatch

ONE = torch.ones(1, dtype=torch.bool)


def _loss(
    name: str,
    lp: torch.Tensor,
    blp: torch.Tensor,
    adv: list[float],
    mask: torch.Tensor | None = None,
    prox: torch.Tensor | None = None,
    **kw: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Loss, metrics and d loss / d lp for one call of `policy_loss` (token-mean unless `agg` given)."""
    lp = lp.clone().requires_grad_(True)
    mask = torch.ones_like(lp) if mask is None else mask
    per = mask.sum(-1)
    norm = Norm(tokens=float(per.sum()), seqs=float((per > 0).sum()))
    ref = kw.pop("ref", None)
    settings = LossSettings(loss=name, **kw)  # type: ignore[arg-type]
    loss, metrics = policy_loss(lp, blp, torch.tensor(adv), mask, norm, settings, proximal_logprobs=prox,
                                ref_logprobs=ref)  # type: ignore[arg-type]
    loss.backward()
    assert lp.grad is not None
    return loss.detach(), metrics, lp.grad


def L(*probs: float) -> torch.Tensor:
    """Log of a [1, T] row of probabilities (or ratios)."""
    return torch.log(torch.tensor([list(probs)]))


# ---------------------------------------------------------------------------------------------------
# advantages


def test_grpo_advantages_normalise_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    groups = torch.tensor([7, 7, 7, 7, 3, 3])
    adv = compute_grpo_advantages(rewards, groups, torch.ones(6, dtype=torch.bool), eps=0.0)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    assert adv.tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0.0, 0.0])


def test_all_equal_rewards_give_zero_advantage_for_every_estimator() -> None:
    for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
        adv = make_advantage_fn(name)(torch.ones(4), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
        assert adv.abs().max() == 0, name


def test_equal_rewards_that_float32_cannot_average_exactly_still_give_zero_advantage() -> None:
    """The float32 mean of 16 x 0.9 (or 7 x 0.1) is a rounding step off; GRPO's std of that residue,
    divided into it, gave the whole group one sizeable advantage (+0.106 for 16 x 0.9)."""
    for value, n in ((0.9, 16), (0.1, 7), (1 - 0.1, 8)):
        rewards = torch.full((n,), value)
        for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp"):
            adv = make_advantage_fn(name)(rewards, torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool))
            assert adv.abs().max() == 0, (name, value, n)
    # a group of equal valid rewards stays at 0 beside an invalid sample with another reward
    adv = compute_grpo_advantages(torch.tensor([0.9, 0.9, 0.9, 5.0]), torch.zeros(4, dtype=torch.long),
                                  torch.tensor([True, True, True, False]))
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_dr_grpo_does_not_divide_by_std() -> None:
    adv = compute_dr_grpo_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, dtype=torch.bool))
    assert adv.tolist() == [1.0, -1.0]


def test_rloo_subtracts_the_mean_of_the_other_samples() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 9.0])
    groups = torch.tensor([0, 0, 0, 1, 2])  # group 2 has one sample: no baseline
    adv = compute_rloo_advantages(rewards, groups, torch.ones(5, dtype=torch.bool))
    assert adv.tolist() == pytest.approx([1.0 - 0.0, 0.0 - 0.5, 0.0 - 0.5, 0.0, 0.0])
    # an invalid sample is neither scored nor part of the others' baseline
    adv = compute_rloo_advantages(torch.tensor([1.0, 0.0, 7.0]), torch.tensor([0, 0, 0]), torch.tensor([True, True, False]))
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0])


def test_reinforce_pp_normalises_over_the_whole_batch() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 100.0])
    valid = torch.tensor([True, True, True, True, False])
    adv = compute_reinforce_pp_advantages(rewards, torch.tensor([0, 0, 1, 1, 1]), valid, eps=0.0)
    mean, std = 0.75, math.sqrt(0.75 * 0.25 * 4 / 3)  # unbiased over the four valid rewards
    assert adv.tolist() == pytest.approx([(1 - mean) / std, (0 - mean) / std, (1 - mean) / std, (1 - mean) / std, 0.0])
    # groups do not matter (no group baseline): group 1's two 1.0 rewards are still positive
    assert adv[2] > 0 and adv[3] > 0


def test_invalid_samples_are_left_out_of_group_statistics() -> None:
    adv = compute_dr_grpo_advantages(torch.tensor([1.0, 0.0, 123.0]), torch.tensor([0, 0, 0]), torch.tensor([True, True, False]))
    assert adv.tolist() == [0.5, -0.5, 0.0]
    assert make_advantage_fn("grpo") is compute_grpo_advantages
    with pytest.raises(ValueError, match="unknown advantage"):
        make_advantage_fn("nope")


def test_overlong_penalty_is_linear_inside_the_buffer() -> None:
    lengths = torch.tensor([10, 12, 14, 16, 20])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 16, 0, 1.0).tolist() == [0.0] * 5


# ---------------------------------------------------------------------------------------------------
# losses, one by one


def test_ppo_clip_uses_separate_low_and_high_clip_and_dual_clip() -> None:
    old = torch.zeros(1, 4)
    new = L(1.5, 0.5, 1.5, 0.5)
    s = LossSettings(clip_low=0.2, clip_high=0.3)
    loss_pos, m = ppo_clip_loss(new, old, torch.tensor([1.0]), torch.ones(1, 4), 4, s)
    # A>0: max(-rA, -clip(r)A) -> -1.3 and -0.5
    assert float(loss_pos) == pytest.approx(-(1.3 + 0.5 + 1.3 + 0.5) / 4)
    assert float(m["clip_frac"]) == pytest.approx(0.5) and float(m["clip_frac_high"]) == pytest.approx(0.5)
    loss_neg, m = ppo_clip_loss(new, old, torch.tensor([-1.0]), torch.ones(1, 4), 4, s)
    assert float(loss_neg) == pytest.approx((1.5 + 0.8 + 1.5 + 0.8) / 4)  # max(r, clip(r))
    assert float(m["clip_frac_low"]) == pytest.approx(0.5)
    # dual clip c=3: a negative-advantage token with ratio 5 costs at most 3|A|, with no gradient
    loss, m, grad = _loss("ppo", L(5.0, 1.1), torch.zeros(1, 2), [-1.0], dual_clip=3.0)
    assert float(loss) == pytest.approx((3.0 + 1.1) / 2)
    assert float(m["dual_clip_frac"]) == pytest.approx(0.5)
    assert grad[0].tolist() == pytest.approx([0.0, 1.1 / 2])


def test_decoupled_ppo_clips_against_proximal_and_weights_by_proximal_over_behavior() -> None:
    prox = L(0.5, 0.5)
    behavior = L(0.25, 0.5)  # weights 2 and 1
    # current == proximal: the clipped ratio is exactly 1, the weight does the off-policy correction
    loss, m, grad = _loss("decoupled_ppo", prox, behavior, [1.0], prox=prox, is_cap=3.0)
    assert float(loss) == pytest.approx(-(2.0 + 1.0) / 2)
    assert grad[0].tolist() == pytest.approx([-2.0 / 2, -1.0 / 2])
    assert float(m["ratio_mean"]) == pytest.approx(1.0) and float(m["clip_frac"]) == 0.0
    assert float(m["is_weight_max"]) == pytest.approx(2.0)
    # truncated at is_cap
    loss, m, _ = _loss("decoupled_ppo", prox, behavior, [1.0], prox=prox, is_cap=1.5)
    assert float(loss) == pytest.approx(-(1.5 + 1.0) / 2) and float(m["is_trunc_frac"]) == pytest.approx(0.5)
    # sequence level: the product of the token weights (2 x 1), on every token
    loss, _, _ = _loss("decoupled_ppo", prox, L(0.25, 0.25), [1.0], prox=prox, is_level="sequence", is_cap=10.0)
    assert float(loss) == pytest.approx(-4.0)
    loss, _, _ = _loss("decoupled_ppo", prox, L(0.25, 0.25), [1.0], prox=prox, is_level="geometric", is_cap=10.0)
    assert float(loss) == pytest.approx(-2.0)
    # clipping applies to current/proximal: current 1.5x the proximal, A>0, clip_high .28
    _, m, grad = _loss("decoupled_ppo", L(0.75, 0.5), prox, [1.0], prox=prox)
    assert float(m["clip_frac"]) == pytest.approx(0.5) and grad[0, 0] == 0.0
    with pytest.raises(ValueError, match="proximal"):
        _loss("decoupled_ppo", prox, behavior, [1.0])


def test_tis_truncates_and_mis_masks_the_importance_weight() -> None:
    lp = L(0.6, 0.3, 0.2)
    behavior = L(0.2, 0.2, 0.5)  # ratios 3, 1.5, 0.4
    loss, m, grad = _loss("tis", lp, behavior, [2.0], is_cap=2.0)
    weights = [2.0, 1.5, 0.4]  # 3 truncated to 2
    assert float(loss) == pytest.approx(-sum(w * 2.0 * float(x) for w, x in zip(weights, lp[0], strict=True)) / 3)
    assert grad[0].tolist() == pytest.approx([-w * 2.0 / 3 for w in weights])
    assert float(m["is_trunc_frac"]) == pytest.approx(1 / 3)
    _, m, grad = _loss("mis", lp, behavior, [2.0], is_cap=2.0)
    assert grad[0].tolist() == pytest.approx([0.0, -1.5 * 2.0 / 3, 0.0])  # 3 > cap and 0.4 < 1/cap: masked
    assert float(m["is_mask_frac"]) == pytest.approx(2 / 3)
    # sequence level: product 3 x 1.5 x 0.4 = 1.8 on every token (within the cap)
    _, _, grad = _loss("tis", lp, behavior, [1.0], is_level="sequence", is_cap=2.0)
    assert grad[0].tolist() == pytest.approx([-1.8 / 3] * 3)


def test_m2po_masks_the_fewest_largest_second_moment_tokens() -> None:
    behavior = L(0.5, 0.4, 0.3, 0.2, 0.1)
    log_r = torch.tensor([[0.5, -0.3, 0.1, 0.0, 3.0]])  # (log r)^2: 0.25, 0.09, 0.01, 0, (9: not trained)
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    # mean over the 4 trained tokens 0.35 / 4 = 0.0875 > 0.04; without the 0.25 one: 0.10 / 3 <= 0.04
    loss, m, grad = _loss("m2po", behavior + log_r, behavior, [2.0], mask=mask)
    kept = [0.0, math.exp(-0.3), math.exp(0.1), 1.0, 0.0]  # the ratio r on kept tokens, 0 on masked ones
    assert grad[0].tolist() == pytest.approx([-r * 2.0 / 4 for r in kept])  # d(-r A)/d log pi = -r A
    assert float(loss) == pytest.approx(-sum(kept) * 2.0 / 4)
    assert float(m["m2"]) == pytest.approx(0.0875) and float(m["m2_kept"]) == pytest.approx(0.10 / 4)
    assert float(m["m2_mask_frac"]) == pytest.approx(0.25)
    # a tighter bound drops the next largest too (0.01 / 2 <= 0.02); a looser one drops nothing
    _, m, grad = _loss("m2po", behavior + log_r, behavior, [2.0], mask=mask, m2_threshold=0.02)
    assert grad[0].tolist() == pytest.approx([0.0, 0.0, -math.exp(0.1) * 2.0 / 4, -2.0 / 4, 0.0])
    _, m, _ = _loss("m2po", behavior + log_r, behavior, [2.0], mask=mask, m2_threshold=0.1)
    assert float(m["m2_mask_frac"]) == 0.0


def test_icepop_masks_ratios_outside_its_window() -> None:
    lp, behavior = L(0.6, 0.4, 0.2, 0.3, 0.5), L(0.1, 0.1, 0.5, 0.5, 0.5)  # ratios 6, 4, 0.4, 0.6, 1
    loss, m, grad = _loss("icepop", lp, behavior, [-1.0])  # window [0.5, 5]
    kept = [0.0, 4.0, 0.0, 0.6, 1.0]
    assert grad[0].tolist() == pytest.approx([r / 5 for r in kept])  # -r A / 5 with A = -1
    assert float(loss) == pytest.approx(5.6 / 5)
    assert float(m["is_mask_frac"]) == pytest.approx(2 / 5)
    assert float(m["is_mask_frac_low"]) == pytest.approx(1 / 5) and float(m["is_mask_frac_high"]) == pytest.approx(1 / 5)
    _, _, grad = _loss("icepop", lp, behavior, [-1.0], icepop_low=0.3, icepop_high=10.0)  # everything kept
    assert grad[0].tolist() == pytest.approx([6 / 5, 4 / 5, 0.4 / 5, 0.6 / 5, 1 / 5])


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    lp, behavior = L(0.6, 0.25), L(0.4, 0.25)  # ratios 1.5, 1
    _, m, grad = _loss("cispo", lp, behavior, [1.0])
    assert grad[0].tolist() == pytest.approx([-1.28 / 2, -1.0 / 2])  # weight clipped to 1 + clip_high, not zeroed
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    _, _, ppo_grad = _loss("ppo", lp, behavior, [1.0])
    assert ppo_grad[0, 0] == 0.0  # PPO drops the same token's gradient


def test_topr_uses_full_weight_for_positive_and_tapered_for_negative_advantages() -> None:
    lp, behavior = L(0.6, 0.2), L(0.4, 0.4)  # ratios 1.5, 0.5
    _, _, grad = _loss("topr", lp, behavior, [1.0])
    assert grad[0].tolist() == pytest.approx([-1.0 / 2, -1.0 / 2])  # A >= 0: plain -A log pi
    _, m, grad = _loss("topr", lp, behavior, [-1.0])
    assert grad[0].tolist() == pytest.approx([1.0 / 2, 0.5 / 2])  # A < 0: weight clip(r, 0, 1)
    assert float(m["is_trunc_frac"]) == pytest.approx(0.5)


def test_gspo_uses_the_sequence_ratio_on_every_token() -> None:
    lp, behavior = L(0.55, 0.22), L(0.5, 0.2)  # token ratios 1.1, 1.1 -> sequence ratio 1.1
    loss, m, grad = _loss("gspo", lp, behavior, [1.0])
    assert float(loss) == pytest.approx(-1.1)
    assert grad[0].tolist() == pytest.approx([-1.1 / 2, -1.1 / 2])
    assert float(m["ratio_mean"]) == pytest.approx(1.1)
    # token ratios 2 and 0.5 multiply to a sequence ratio of 1: nothing is clipped, unlike per token
    _, m, _ = _loss("gspo", L(0.4, 0.1), L(0.2, 0.2), [1.0])
    assert float(m["clip_frac"]) == 0.0 and float(m["ratio_mean"]) == pytest.approx(1.0)
    _, m, _ = _loss("ppo", L(0.4, 0.1), L(0.2, 0.2), [1.0])
    assert float(m["clip_frac"]) == pytest.approx(0.5)


def test_reinforce_is_minus_advantage_times_log_prob() -> None:
    lp = L(0.5, 0.25)
    loss, _, grad = _loss("reinforce", lp, torch.zeros(1, 2), [2.0])
    assert float(loss) == pytest.approx(-2.0 * (math.log(0.5) + math.log(0.25)) / 2)
    assert grad[0].tolist() == pytest.approx([-1.0, -1.0])


def test_kl_estimators_and_the_kl_term() -> None:
    lp, ref = torch.tensor(math.log(0.5)), torch.tensor(math.log(0.25))
    d = math.log(2.0)
    assert float(kl_estimate(lp, ref, "k1")) == pytest.approx(d)
    assert float(kl_estimate(lp, ref, "k2")) == pytest.approx(d * d / 2)
    assert float(kl_k3(lp, ref)) == pytest.approx(0.5 - math.log(0.5) - 1)
    assert float(kl_k3(torch.tensor(0.3), torch.tensor(0.3))) == 0.0
    lp2, ref2 = torch.zeros(1, 2), torch.full((1, 2), math.log(0.5))
    with_kl, m = ppo_clip_loss(lp2, lp2, torch.zeros(1), torch.ones(1, 2), 2, LossSettings(kl_coef=0.1), ref2)
    assert float(with_kl) == pytest.approx(0.1 * (0.5 - math.log(0.5) - 1)) and "kl" in m
    with pytest.raises(ValueError, match="unknown KL"):
        kl_estimate(lp, ref, "k9")


# ---------------------------------------------------------------------------------------------------
# aggregation, empty masks, extreme ratios


def test_aggregation_modes_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # row 3: no trained token
    norm = Norm(tokens=4.0, seqs=2.0)
    assert float(aggregate(x, mask, norm, "token_mean")) == pytest.approx(10 / 4)
    assert float(aggregate(x, mask, norm, "seq_mean_token_sum")) == pytest.approx((6 + 4) / 2)
    assert float(aggregate(x, mask, norm, "seq_mean_token_mean")) == pytest.approx((2 + 4) / 2)
    assert float(aggregate(x, mask, norm, "dr_grpo", norm_length=8)) == pytest.approx(10 / (2 * 8))
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(x, mask, norm, "nope")


@pytest.mark.parametrize("agg", AGG_NAMES)
@pytest.mark.parametrize("loss", [n for n in LOSS_NAMES if n != "m2po"])  # m2po's mask is per micro-batch (by design)
def test_micro_batch_contributions_add_up_to_the_whole_batch(loss: str, agg: str) -> None:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g) * 2
    blp = lp + (torch.rand(3, 5, generator=g) - 0.5)
    prox = lp + (torch.rand(3, 5, generator=g) - 0.5) * 0.2
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0])
    s = LossSettings(loss=loss, agg=agg, norm_length=6.0, dual_clip=3.0 if loss in ("ppo", "decoupled_ppo") else 0.0)
    norm = Norm(tokens=float(mask.sum()), seqs=2.0)
    whole, _ = policy_loss(lp, blp, adv, mask, norm, s, proximal_logprobs=prox)
    parts = [policy_loss(lp[i : i + 1], blp[i : i + 1], adv[i : i + 1], mask[i : i + 1], norm, s, prox[i : i + 1])[0]
             for i in range(3)]
    assert float(sum(parts)) == pytest.approx(float(whole), abs=1e-6)
    assert math.isfinite(float(whole))


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_empty_mask_gives_zero_loss_and_zero_gradient_not_nan(loss: str) -> None:
    for agg in AGG_NAMES:
        lp = torch.zeros(1, 3, requires_grad=True)
        mask = torch.zeros(1, 3)
        out, m = policy_loss(lp, torch.zeros(1, 3), torch.ones(1), mask, Norm(0.0, 0.0),
                             LossSettings(loss=loss, agg=agg), proximal_logprobs=torch.zeros(1, 3))
        out.backward()
        assert float(out.detach()) == 0.0 and lp.grad is not None and lp.grad.abs().max() == 0.0
        assert all(math.isfinite(float(v)) for v in m.values())


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_extreme_ratios_stay_finite(loss: str) -> None:
    lp = torch.tensor([[-0.01, -60.0, -0.5]])
    blp = torch.tensor([[-60.0, -0.01, -0.5]])  # ratios e^60, e^-60, 1
    for adv in ([1.0], [-1.0]):
        out, m, grad = _loss(loss, lp, blp, adv, prox=blp + 1.0)
        assert math.isfinite(float(out)) and torch.isfinite(grad).all(), (loss, adv)
    if loss == "tis":
        assert float(m["is_weight_max"]) == pytest.approx(2.0)
    if loss == "mis":
        assert float(m["is_mask_frac"]) == pytest.approx(2 / 3)


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_log_ratios_past_exps_range_stay_finite(loss: str) -> None:
    """e^95 is inf in float32: unclamped, ppo's clipped branch had a NaN gradient and its loss was inf."""
    lp = torch.tensor([[-0.01, -95.5, -0.5]])
    blp = torch.tensor([[-95.5, -0.01, -0.5]])
    for adv in ([1.0], [-1.0]):
        out, m, grad = _loss(loss, lp, blp, adv, prox=blp.clone())
        assert math.isfinite(float(out)) and torch.isfinite(grad).all(), (loss, adv)
        assert all(math.isfinite(float(v)) for v in m.values()), (loss, adv, m)


def test_the_kl_term_ignores_positions_outside_the_mask_even_when_they_diverge() -> None:
    lp = torch.tensor([[-95.0, -0.5, -0.5]])  # a prompt position where the policy is 95 nats below the reference
    ref = torch.tensor([[0.0, -0.4, -0.6]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out, m, grad = _loss("ppo", lp, lp.clone(), [1.0], mask=mask, kl_coef=0.1, ref=ref)
    assert math.isfinite(float(out)) and torch.isfinite(grad).all() and float(grad[0, 0]) == 0.0
    k3 = lambda d: math.exp(-d) + d - 1  # noqa: E731
    assert float(m["kl"]) == pytest.approx((k3(-0.1) + k3(0.1)) / 2, rel=1e-5)


def test_the_k3_term_stays_finite_for_a_trained_token_far_below_the_reference() -> None:
    """A trained token whose log pi is ~93 nats below log ref: exp(-d) overflowed, the loss was inf
    and its gradient -inf (the step skipped). As verl's low_var_kl: the log ratio is clamped to +-20
    and the estimate to at most 10 (clamped input alone left ~4.9e8 from one token)."""
    lp = torch.tensor([[-93.0, -0.5]])
    ref = torch.tensor([[0.0, -0.5]])
    out, m, grad = _loss("ppo", lp, lp.clone(), [1.0], mask=torch.ones(1, 2), kl_coef=0.1, ref=ref)
    assert math.isfinite(float(out)) and torch.isfinite(grad).all()
    assert float(m["kl"]) == pytest.approx(10.0 / 2)
    assert float(kl_k3(torch.tensor(-20.0), torch.tensor(0.0))) == 10.0  # e^20 - 21 ~ 4.9e8 unclamped
    assert float(kl_k3(torch.tensor(-2.5), torch.tensor(0.0))) == pytest.approx(math.exp(2.5) - 3.5)  # 8.68: kept
    lp = torch.tensor(-4.0, requires_grad=True)  # past the clamp the token's KL gradient is 0, not e^4 - 1
    kl_k3(lp, torch.tensor(0.0)).backward()
    assert lp.grad is not None and float(lp.grad) == 0.0


def test_make_loss_fn_reads_the_batch_fields_and_refuses_unknown_names() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    batch = TrainBatch(
        input_ids=torch.zeros(1, 4, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.long),
        response_mask=torch.tensor([[0.0, 1.0, 1.0]]), advantages=torch.tensor([1.0]),
        behavior_logprobs=torch.log(torch.tensor([[1.0, 0.25, 0.5]])), proximal_logprobs=lp.clone(),
    )
    out, _ = make_loss_fn(LossSettings(loss="decoupled_ppo", is_cap=5.0))(lp, batch, batch.norm())
    assert float(out) == pytest.approx(-(2.0 + 1.0) / 2)  # weights prox/behavior on the two masked-in tokens
    assert batch.norm() == Norm(tokens=2.0, seqs=1.0)
    assert batch.select([0]).proximal_logprobs is not None
    with pytest.raises(ValueError, match="unknown policy loss"):
        make_loss_fn(LossSettings(loss="nope"))


# ---------------------------------------------------------------------------------------------------
# the train engine: micro-batch invariance and when the clip becomes active


def _engine_batch(model: torch.nn.Module, seed: int = 0) -> TrainBatch:
    from asyncflow.engines.torch_train import token_logprobs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 32, (6, 9), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    attn[4, 5:] = 0
    mask = torch.zeros(6, 8)
    for i, end in enumerate([8, 6, 8, 8, 4, 8]):
        mask[i, 2:end] = 1.0
    batch = TrainBatch(ids, attn, mask, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), torch.zeros(6, 8))
    with torch.no_grad():
        batch.behavior_logprobs = token_logprobs(model, batch, 1.0)[0] * mask  # type: ignore[arg-type]
    return batch


@pytest.mark.parametrize("agg", AGG_NAMES)
def test_loss_and_gradients_do_not_depend_on_micro_batch_size(tiny_model: torch.nn.Module, agg: str) -> None:
    from asyncflow.engines.torch_train import TorchTrainEngine

    batch = _engine_batch(tiny_model)
    batch.behavior_logprobs = batch.behavior_logprobs + 0.3 * batch.response_mask  # off-policy: ratios != 1
    results = []
    for micro in (None, 1, 4):
        engine = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0, micro_batch_size=micro)
        metrics = engine._optimizer_step(batch, make_loss_fn(LossSettings(loss="tis", agg=agg, norm_length=8.0)), 1.0, 0.0)
        grads = torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.grad is not None])
        results.append((metrics, grads))
    (m0, g0), *rest = results
    for m, g in rest:
        assert m["loss"] == pytest.approx(m0["loss"], rel=1e-4, abs=1e-6)
        assert m["is_weight_mean"] == pytest.approx(m0["is_weight_mean"], rel=1e-5)
        assert m["is_weight_max"] == pytest.approx(m0["is_weight_max"], rel=1e-5)
        assert torch.allclose(g, g0, rtol=1e-4, atol=1e-7)


def test_a_micro_batch_without_trained_tokens_does_not_put_a_1_into_the_max_and_min(tiny_model: torch.nn.Module) -> None:
    """Rows 0-1 have no trained tokens (reward errors): their micro-batch must not contribute a neutral
    1.0 to is_weight_max/min while every real weight is 0.61."""
    from asyncflow.engines.torch_train import TorchTrainEngine

    batch = _engine_batch(tiny_model)
    batch.response_mask[:2] = 0.0
    batch.behavior_logprobs = (batch.behavior_logprobs - math.log(0.61)) * batch.response_mask  # every ratio 0.61
    engine = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0, micro_batch_size=2)
    m = engine._optimizer_step(batch, make_loss_fn(LossSettings(loss="tis")), 1.0, 0.0)
    assert m["is_weight_max"] == pytest.approx(0.61, rel=1e-4) and m["is_weight_min"] == pytest.approx(0.61, rel=1e-4)


@pytest.mark.parametrize("loss", ["ppo", "decoupled_ppo"])
def test_the_clip_becomes_active_only_with_several_mini_batches(tiny_model: torch.nn.Module, loss: str) -> None:
    """On-policy data (behavior = the trainer's own log-probs): with one optimizer step per batch the
    ratio is 1 and the clip never acts; with mini_batches > 1 the later mini-batches see a policy that
    has moved, and the clip engages."""
    from asyncflow.engines.torch_train import TorchTrainEngine

    batch = _engine_batch(tiny_model)
    batch.proximal_logprobs = batch.behavior_logprobs.clone()
    fn = make_loss_fn(LossSettings(loss=loss))
    one = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.05, mini_batches=1).train_step(batch, fn, 1.0)
    assert one["clip_frac"] == 0.0 and one["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    three = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.05, mini_batches=3).train_step(batch, fn, 1.0)
    assert three["clip_frac"] > 0.0 and three["ratio_max"] > 1.28


# ---------------------------------------------------------------------------------------------------
# topr's sequence form, decoupled_ppo's masking mode, the KL estimators' directions


def test_topr_sequence_level_tapers_by_the_trajectory_ratio() -> None:
    lp, behavior = L(0.6, 0.2), L(0.4, 0.4)  # token ratios 1.5, 0.5 -> trajectory ratio 0.75
    _, m, grad = _loss("topr", lp, behavior, [-1.0], is_level="sequence")
    assert grad[0].tolist() == pytest.approx([0.75 / 2, 0.75 / 2])  # A < 0: one weight, the trajectory's
    assert float(m["is_trunc_frac"]) == 0.0
    lp, behavior = L(0.6, 0.36), L(0.4, 0.4)  # ratios 1.5, 0.9 -> 1.35, clipped to 1
    _, m, grad = _loss("topr", lp, behavior, [-1.0], is_level="sequence")
    assert grad[0].tolist() == pytest.approx([0.5, 0.5])
    assert float(m["is_trunc_frac"]) == 1.0
    _, _, grad = _loss("topr", lp, behavior, [-1.0])  # the token form (default) tapers each token
    assert grad[0].tolist() == pytest.approx([0.5, 0.45])
    _, _, grad = _loss("topr", lp, behavior, [2.0], is_level="sequence")  # A >= 0: weight 1 either way
    assert grad[0].tolist() == pytest.approx([-1.0, -1.0])


def test_decoupled_ppo_masks_over_cap_weights_in_mask_mode() -> None:
    prox, behavior = L(0.6, 0.3), L(0.2, 0.2)  # proximal/behavior weights 3 and 1.5; cap 2; current = proximal
    loss, m, grad = _loss("decoupled_ppo", prox, behavior, [1.0], prox=prox, is_cap=2.0)
    assert float(loss) == pytest.approx(-(2.0 + 1.5) / 2)  # truncate (default): min(w, 2)
    assert float(m["is_trunc_frac"]) == pytest.approx(0.5)
    loss, m, grad = _loss("decoupled_ppo", prox, behavior, [1.0], prox=prox, is_cap=2.0, is_mode="mask")
    assert float(loss) == pytest.approx(-(0.0 + 1.5) / 2)  # mask: the over-cap token's weight is 0 ...
    assert grad[0].tolist() == pytest.approx([0.0, -1.5 / 2])  # ... and so is its gradient; still counted in the mean
    assert float(m["is_mask_frac"]) == pytest.approx(0.5) and "is_trunc_frac" not in m
    with pytest.raises(ValueError, match="is_mode"):
        make_loss_fn(LossSettings(loss="decoupled_ppo", is_mode="drop"))


def test_kl_terms_expected_gradients_name_the_right_direction() -> None:
    """Exact expectation over a 4-token vocabulary (tokens drawn from pi, differentiated through
    log pi): k2's gradient is that of KL(pi || ref), k3's that of KL(ref || pi), k1's is 0."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.1], dtype=torch.float64)
    log_ref = torch.log_softmax(torch.tensor([-0.5, 0.4, 0.2, -1.0], dtype=torch.float64), -1)

    def grad(f: object) -> torch.Tensor:
        t = theta.clone().requires_grad_(True)
        logp = torch.log_softmax(t, -1)
        f(logp).backward()  # type: ignore[operator]
        assert t.grad is not None
        return t.grad

    def expected(est: str) -> object:  # E_pi[k(x)] with pi's sampling weights held fixed
        return lambda logp: (logp.exp().detach() * kl_estimate(logp, log_ref, est)).sum()

    forward = grad(lambda logp: (logp.exp() * (logp - log_ref)).sum())  # KL(pi || ref)
    reverse = grad(lambda logp: (log_ref.exp() * (log_ref - logp)).sum())  # KL(ref || pi)
    torch.testing.assert_close(grad(expected("k2")), forward)
    torch.testing.assert_close(grad(expected("k3")), reverse)
    torch.testing.assert_close(grad(expected("k1")), torch.zeros(4, dtype=torch.float64))
    assert not torch.allclose(forward, reverse)


def test_decoupled_ppo_with_one_mini_batch_is_tis_with_the_proximal_weight(tiny_model: torch.nn.Module) -> None:
    """With train.mini_batches 1, decoupled_ppo's only optimizer step sees pi_theta = pi_prox: its clip
    never acts and its gradient is tis's, -min(pi_prox / mu, is_cap) A grad log pi (no trust region)."""
    from asyncflow.engines.torch_train import TorchTrainEngine

    batch = _engine_batch(tiny_model)
    g = torch.Generator().manual_seed(1)
    batch.behavior_logprobs = batch.behavior_logprobs + (torch.rand(6, 8, generator=g) - 0.5) * 2 * batch.response_mask
    grads = {}
    for loss in ("decoupled_ppo", "tis"):
        engine = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0)
        batch.proximal_logprobs = engine.logprobs(batch, 1.0) if loss == "decoupled_ppo" else None
        m = engine._optimizer_step(batch, make_loss_fn(LossSettings(loss=loss)), 1.0, 0.0)
        assert m["is_trunc_frac"] > 0.0  # some weights above the cap: the truncation is exercised
        grads[loss] = torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.grad is not None])
        if loss == "decoupled_ppo":
            assert m["clip_frac"] == 0.0 and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert torch.allclose(grads["decoupled_ppo"], grads["tis"], rtol=1e-4, atol=1e-7)
