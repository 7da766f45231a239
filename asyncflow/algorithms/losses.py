"""Policy losses: pure tensor functions over one micro-batch, normalised over the whole mini-batch.

Three policies are kept apart per token (docs/algorithms.md):
- **behavior** `mu`: the log-probs the inference engine reported when it sampled the token
  (`TrainBatch.behavior_logprobs`; a sample may mix versions after an in-flight weight update);
- **proximal** `pi_prox`: the trainer's weights before this train step's first optimizer step
  (`TrainBatch.proximal_logprobs`, recomputed only for losses that need it);
- **current** `pi_theta`: the weights being optimised (the `logprobs` argument, with gradient).

Each loss returns the *contribution* of one micro-batch: per-token terms summed and divided by a
normaliser of the whole mini-batch (`Norm`), so summing contributions over micro-batches (and,
with FSDP, over ranks) gives the mini-batch's aggregate: loss and gradients do not depend on
`micro_batch_size`. Aggregation modes (`algorithm.agg`), with m the loss mask:
- `token_mean`:          sum_i,t m x / sum_i,t m
- `seq_mean_token_sum`:  sum_i (sum_t m x) / #seqs
- `seq_mean_token_mean`: sum_i (sum_t m x / sum_t m) / #seqs
- `dr_grpo`:             sum_i,t m x / (#seqs * L), L a constant (Dr.GRPO's normaliser)
Metrics are token means (sums / the mini-batch's token count), except keys ending in `_max` /
`_min`, which the engine combines by max / min.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from asyncflow.algorithms.stale_losses import icepop_objective, m2po_objective
from asyncflow.engines.base import LossFn, Norm, TrainBatch

LOSS_NAMES = ("ppo", "decoupled_ppo", "tis", "mis", "cispo", "topr", "gspo", "reinforce", "m2po", "icepop")
AGG_NAMES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
_K3_CLAMP = 20.0  # |log pi - log ref| at most this in k3 (see kl_estimate)
_K3_MAX = 10.0  # k3's estimate at most this (verl's low_var_kl clamps it to [-10, 10])
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")  # decoupled_ppo: an over-cap proximal/behavior weight is capped, or zeroed

NEEDS_PROXIMAL = frozenset({"decoupled_ppo"})


@dataclass(frozen=True)
class LossSettings:
    """The `algorithm.*` knobs a loss reads (see `asyncflow.config.AlgorithmConfig`)."""

    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float = 0.0  # 0: off; c > 1: a negative-advantage token's loss is at most c * |A|
    is_level: str = "token"
    is_cap: float = 2.0
    is_mode: str = "truncate"
    agg: str = "token_mean"
    norm_length: float = 1.0  # dr_grpo's constant L
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    m2_threshold: float = 0.04  # m2po: the kept tokens' mean (log r)^2 at most this
    icepop_low: float = 0.5  # icepop: tokens with r outside [low, high] are masked
    icepop_high: float = 5.0


LOG_RATIO_LIMIT = 20.0  # |log ratio| is clamped here before exp (policy_loss)

# ---------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3). As loss terms
    (differentiated through log pi) their expected gradients differ: k2's is KL(pi || ref)'s, k3's
    KL(ref || pi)'s, k1's zero (docs/algorithms.md; tested).

    k1 = log pi - log ref (unbiased, can be negative); k2 = (log pi - log ref)^2 / 2;
    k3 = exp(log ref - log pi) - (log ref - log pi) - 1 (unbiased, >= 0), as verl's low_var_kl: the
    log ratio clamped to +-20 (exp(-d) overflowed ~88 nats below ref) and the estimate to at most 10
    (one token at d = -20 gave ~4.9e8, swamping the loss; past 10 that token's KL gradient is 0)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-_K3_CLAMP, _K3_CLAMP)
        return (torch.exp(-d) + d - 1).clamp(max=_K3_MAX)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token (>= 0)."""
    return kl_estimate(logprobs, ref_logprobs, "k3")


def aggregate(x: torch.Tensor, mask: torch.Tensor, norm: Norm, agg: str, norm_length: float = 1.0) -> torch.Tensor:
    """This micro-batch's share of the mini-batch aggregate of per-token `x` (see module doc)."""
    if agg == "token_mean":
        return (x * mask).sum() / max(norm.tokens, 1.0)
    if agg == "seq_mean_token_sum":
        return (x * mask).sum() / max(norm.seqs, 1.0)
    if agg == "seq_mean_token_mean":
        per_seq = (x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(norm.seqs, 1.0)
    if agg == "dr_grpo":
        return (x * mask).sum() / max(norm.seqs * norm_length, 1.0)
    raise ValueError(f"unknown aggregation {agg!r}; known: {', '.join(AGG_NAMES)}")


def log_is_weight(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Log importance weight per token from per-token log-ratios: `token` keeps them; `sequence`
    uses the whole sequence's product (sum of logs) on every token; `geometric` its geometric mean."""
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_ratio)
    if level == "geometric":
        return (total / mask.sum(-1, keepdim=True).clamp(min=1.0)).expand_as(log_ratio)
    raise ValueError(f"unknown importance-sampling level {level!r}; known: {', '.join(IS_LEVELS)}")


def _clip_objective(
    ratio: torch.Tensor, adv: torch.Tensor, s: LossSettings, mask: torch.Tensor, tokens: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's per-token clipped surrogate (to minimise) with clip-higher and optional dual clip."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    t = max(tokens, 1.0)
    low = (ratio < 1 - s.clip_low) & (adv < 0)  # the clip is active: gradient zero on these tokens
    high = (ratio > 1 + s.clip_high) & (adv > 0)
    metrics = {
        "clip_frac_low": (low.to(mask.dtype) * mask).sum().detach() / t,
        "clip_frac_high": (high.to(mask.dtype) * mask).sum().detach() / t,
    }
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    if s.dual_clip > 0:
        cap = -adv * s.dual_clip  # > 0 where adv < 0
        dual = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual, cap, per_token)
        metrics["dual_clip_frac"] = (dual.to(mask.dtype) * mask).sum().detach() / t
    return per_token, metrics


def _masked_stats(name: str, w: torch.Tensor, mask: torch.Tensor, tokens: float) -> dict[str, torch.Tensor]:
    """Token mean, max and min of `w` over the mask. Over an empty mask (a micro-batch or rank share
    of reward-error rows) max and min are left out, so combining parts takes them from the parts
    that have tokens (a neutral 1.0 used to be folded in: ratio_max 1.0 while every ratio was 0.61)."""
    w = w.detach()
    on = mask > 0
    stats = {f"{name}_mean": (w * mask).sum() / max(tokens, 1.0)}
    if bool(on.any()):
        stats[f"{name}_max"] = w[on].max()
        stats[f"{name}_min"] = w[on].min()
    return stats


# ---------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------


def policy_loss(
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    norm: Norm,
    settings: LossSettings,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss `settings.loss` for one micro-batch, plus metric sums.

    Shapes: logprobs/behavior_logprobs/proximal_logprobs/ref_logprobs/mask [B, T]; advantages [B]
    (broadcast over tokens) or [B, T] (per token: on-policy distillation). Per-token objectives to minimise, with r = pi_theta / mu, A the advantage,
    sg the stop-gradient:
    - `ppo`: max(-A r, -A clip(r, 1-cl, 1+ch)) (dual clip optional)
    - `decoupled_ppo`: w * max(-A r', -A clip(r')) with r' = pi_theta / pi_prox and
      w = sg(min(pi_prox / mu, is_cap)) at `is_level` (`is_mode: mask`: sg(w [w <= is_cap]))
    - `tis`: -sg(min(w, is_cap)) A log pi_theta, w = r at `is_level`
    - `mis`: -sg(w [1/is_cap <= w <= is_cap]) A log pi_theta (tokens/sequences outside are masked)
    - `cispo`: -sg(clip(r, 1-cl, 1+ch)) A log pi_theta
    - `topr`: -A log pi_theta where A >= 0, -sg(clip(w, 0, 1)) A log pi_theta where A < 0, w = r at `is_level`
    - `gspo`: max(-A s, -A clip(s, 1-cl, 1+ch)) with s = sg(exp(mean_t log r)) * pi_theta / sg(pi_theta)
      per token (a sequence-level ratio whose gradient flows through every token)
    - `reinforce`: -A log pi_theta (no ratio: on-policy)
    - `m2po`: -M A r, M masking the fewest largest-(log r)^2 tokens so the rest have mean (log r)^2 <=
      `m2_threshold` (taken over this micro-batch: the one loss not invariant to micro_batch_size)
    - `icepop`: -M A r, M masking tokens with r outside [icepop_low, icepop_high]
    plus `kl_coef` * KL estimate to the reference where given.
    """
    s = settings
    mask = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype)
    adv = adv if adv.dim() == 2 else adv.unsqueeze(-1).expand_as(logprobs)
    t = max(norm.tokens, 1.0)
    # current vs behavior, 0 off the mask; clamped (as verl does) so exp never overflows: past e^20 a
    # ratio's clip or cap has long taken over, but exp(89) is inf and the clipped branch's gradient NaN
    log_r = ((logprobs - behavior_logprobs) * mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    per_token, metrics = _objective(s, logprobs, behavior_logprobs, proximal_logprobs, log_r, adv, mask, t)
    loss = aggregate(per_token, mask, norm, s.agg, s.norm_length)
    metrics["pg_loss"] = loss.detach()
    if ref_logprobs is not None and s.kl_coef > 0:
        # masked before the estimate: k3's exp(-d) at a prompt or padding position could be inf, and
        # inf x 0 (the mask) is NaN in the loss and its gradient
        kl = kl_estimate(logprobs * mask, ref_logprobs * mask, s.kl_estimator)
        loss = loss + s.kl_coef * aggregate(kl, mask, norm, s.agg, s.norm_length)  # aggregation is linear
        metrics["kl"] = (kl.detach() * mask).sum() / t
    return loss, {k: v.detach() for k, v in metrics.items()}


def _objective(
    s: LossSettings,
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    log_r: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    t: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss`'s per-token objective (to minimise) for `s.loss`, and its metrics; `log_r` is the
    clamped, masked log ratio to the behavior policy, `t` the mini-batch's token count (at least 1)."""
    metrics: dict[str, torch.Tensor] = {}
    if s.loss == "ppo":
        ratio = torch.exp(log_r)
        per_token, metrics = _clip_objective(ratio, adv, s, mask, t)
        metrics.update(_masked_stats("ratio", ratio, mask, t))
    elif s.loss == "decoupled_ppo":
        per_token, metrics = _decoupled_ppo(s, logprobs, behavior_logprobs, proximal_logprobs, adv, mask, t)
    elif s.loss in ("tis", "mis"):
        per_token, metrics = _is_weighted(s, logprobs, log_r, adv, mask, t)
    elif s.loss == "cispo":
        ratio = torch.exp(log_r)
        w = ratio.clamp(1 - s.clip_low, 1 + s.clip_high)
        per_token = -w.detach() * adv * logprobs
        metrics["clip_frac"] = (((ratio < 1 - s.clip_low) | (ratio > 1 + s.clip_high)).to(mask.dtype) * mask).sum() / t
        metrics.update(_masked_stats("ratio", ratio, mask, t))
    elif s.loss == "topr":
        per_token, metrics = _topr(s, logprobs, log_r, adv, mask, t)
    elif s.loss == "gspo":
        seq_log_r = log_is_weight(log_r, mask, "geometric")  # a mean of clamped values: within the limit
        ratio = torch.exp(seq_log_r.detach() + logprobs - logprobs.detach())
        per_token, metrics = _clip_objective(ratio, adv, s, mask, t)
        metrics.update(_masked_stats("ratio", ratio, mask, t))
    elif s.loss == "reinforce":
        per_token = -adv * logprobs
    elif s.loss in ("m2po", "icepop"):
        if s.loss == "m2po":
            per_token, metrics = m2po_objective(log_r, adv, mask, t, s.m2_threshold)
        else:
            per_token, metrics = icepop_objective(log_r, adv, mask, t, s.icepop_low, s.icepop_high)
        metrics.update(_masked_stats("ratio", torch.exp(log_r), mask, t))
    else:
        raise ValueError(f"unknown policy loss {s.loss!r}; known: {', '.join(LOSS_NAMES)}")
    return per_token, metrics


def _decoupled_ppo(
    s: LossSettings,
    logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    t: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clip against the proximal policy, weighted by the capped proximal / behavior IS weight."""
    if proximal_logprobs is None:
        raise ValueError("decoupled_ppo needs proximal log-probs (TrainBatch.proximal_logprobs)")
    ratio = torch.exp(((logprobs - proximal_logprobs) * mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    per_token, metrics = _clip_objective(ratio, adv, s, mask, t)
    log_w = log_is_weight((proximal_logprobs - behavior_logprobs) * mask, mask, s.is_level)
    raw = torch.exp(log_w)
    over = raw > s.is_cap
    # truncate: min(w, cap); mask (AReaL's behav_imp_weight_cap): over-cap tokens get weight 0, while
    # the normaliser still counts them
    w = torch.where(over, torch.zeros_like(raw), raw) if s.is_mode == "mask" else raw.clamp(max=s.is_cap)
    per_token = w.detach() * per_token
    metrics.update(_masked_stats("ratio", ratio, mask, t))
    metrics.update(_masked_stats("is_weight", w, mask, t))
    frac = "is_mask_frac" if s.is_mode == "mask" else "is_trunc_frac"
    metrics[frac] = (over.to(mask.dtype) * mask).sum() / t
    return per_token, metrics


def _topr(
    s: LossSettings, logprobs: torch.Tensor, log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, t: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TOPR: weight 1 where A >= 0, sg(clip(w, 0, 1)) where A < 0, w = r at `is_level` (`sequence`:
    the trajectory ratio of the paper's bound; A is per sequence, so the split is per trajectory)."""
    log_w = log_is_weight(log_r, mask, s.is_level)
    w = torch.where(adv >= 0, torch.ones_like(log_w), torch.exp(log_w.clamp(max=0.0)))  # clip(w, 0, 1) in logs
    per_token = -w.detach() * adv * logprobs
    metrics = {"is_trunc_frac": (((adv < 0) & (log_w > 0)).to(mask.dtype) * mask).sum() / t}
    metrics.update(_masked_stats("ratio", torch.exp(log_r), mask, t))
    return per_token, metrics


def _is_weighted(
    s: LossSettings, logprobs: torch.Tensor, log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, t: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`tis` (IS weight truncated at `is_cap`) or `mis` (weight zeroed outside [1/is_cap, is_cap])."""
    metrics: dict[str, torch.Tensor] = {}
    raw = torch.exp(log_is_weight(log_r, mask, s.is_level))
    if s.loss == "tis":
        w = raw.clamp(max=s.is_cap)
        metrics["is_trunc_frac"] = ((raw > s.is_cap).to(mask.dtype) * mask).sum() / t
    else:
        keep = (raw <= s.is_cap) & (raw >= 1.0 / s.is_cap)
        w = torch.where(keep, raw, torch.zeros_like(raw))
        metrics["is_mask_frac"] = ((~keep).to(mask.dtype) * mask).sum() / t
    per_token = -w.detach() * adv * logprobs
    metrics.update(_masked_stats("is_weight", w, mask, t))
    return per_token, metrics


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    token_normalizer: float,
    settings: LossSettings,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip against `old_logprobs`, token-mean over `token_normalizer` tokens (a shorthand of
    `policy_loss` for the common case)."""
    norm = Norm(tokens=float(token_normalizer), seqs=float((mask.sum(-1) > 0).sum()))
    s = LossSettings(**{**settings.__dict__, "loss": "ppo", "agg": "token_mean"})
    return policy_loss(logprobs, old_logprobs, advantages, mask, norm, s, ref_logprobs=ref_logprobs)


def make_loss_fn(settings: LossSettings) -> LossFn:
    """A `LossFn` for the train engine: `policy_loss` with `settings` on the batch's fields."""
    if settings.loss not in LOSS_NAMES:
        raise ValueError(f"unknown policy loss {settings.loss!r}; known: {', '.join(LOSS_NAMES)}")
    if settings.agg not in AGG_NAMES:
        raise ValueError(f"unknown aggregation {settings.agg!r}; known: {', '.join(AGG_NAMES)}")
    if not (settings.is_cap >= 1.0 and math.isfinite(settings.is_cap)):
        raise ValueError(f"is_cap must be a finite number >= 1, got {settings.is_cap}")
    if settings.is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode {settings.is_mode!r}; known: {', '.join(IS_MODES)}")

    def loss_fn(logprobs: torch.Tensor, batch: TrainBatch, norm: Norm) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return policy_loss(
            logprobs,
            batch.behavior_logprobs,
            batch.advantages,
            batch.response_mask,
            norm,
            settings,
            proximal_logprobs=batch.proximal_logprobs,
            ref_logprobs=batch.ref_logprobs,
        )

    return loss_fn

