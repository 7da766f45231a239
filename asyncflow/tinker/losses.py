"""Tinker's built-in losses, per datum, as pure tensor code.

Each takes `lp` (the current model's log-prob of each target token, [N], differentiable), the datum's
`loss_fn_inputs` and the call's `loss_fn_config`, and returns the datum's loss, summed over its tokens
(Tinker sums over tokens and datums and never normalizes). With q = the sampling log-probs
(`logprobs`), A = `advantages` and r = exp(lp - q):

    cross_entropy        -sum(weights * lp)
    importance_sampling  -sum(r * A)
    ppo                  -sum(min(r * A, clip(r, lo, hi) * A))        lo, hi default 0.8, 1.2
    cispo                -sum(stopgrad(clip(r, lo, hi)) * lp * A)
    dro                  -sum(lp * A - beta / 2 * (lp - q)^2)         beta from loss_fn_config
    gspo                 -sum(min(s_t * A, clip(s_t, lo, hi) * A))    s_t = exp(sg(L) + lp - sg(lp)), with
                         L = mean(lp - q) over the tokens that `sequence_ratio_mask` marks (GSPO-token)
    stable_reinforce     -sum_S(sg(min(w, 1)) * A * lp) + kl_coeff * sum_S(w - 1 - log w)
                         over the sampled targets S, w = exp(lp - q_rec), q_rec the sampler's recorded
                         log-prob (`stability.add_stability_inputs`); kl_coeff default 0
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from asyncflow.errors import UserError
from asyncflow.tinker.stability import RECORDED_LOGPROBS, SAMPLED

CLIP_LOW, CLIP_HIGH = 0.8, 1.2  # ppo / cispo thresholds where loss_fn_config does not set them


def _input(inputs: Mapping[str, np.ndarray], key: str, loss: str, like: torch.Tensor) -> torch.Tensor:
    if key not in inputs:
        raise UserError(f"forward_backward: loss_fn {loss!r} needs loss_fn_inputs[{key!r}]")
    value = torch.tensor(np.asarray(inputs[key], dtype=np.float32), device=like.device).reshape(like.shape)  # (a copy: wire arrays are read-only)
    return value.to(like.device)


def _ratio(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = _input(inputs, "logprobs", loss, lp)
    return torch.exp(lp - q), _input(inputs, "advantages", loss, lp)


def _clip(config: Mapping[str, float]) -> tuple[float, float]:
    return float(config.get("clip_low_threshold", CLIP_LOW)), float(config.get("clip_high_threshold", CLIP_HIGH))


def cross_entropy(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    weights = _input(inputs, "weights", "cross_entropy", lp) if "weights" in inputs else torch.ones_like(lp)
    return -(weights * lp).sum()


def importance_sampling(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(lp, inputs, "importance_sampling")
    return -(ratio * adv).sum()


def ppo(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(lp, inputs, "ppo")
    low, high = _clip(config)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()


def cispo(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    ratio, adv = _ratio(lp, inputs, "cispo")
    low, high = _clip(config)
    return -(ratio.clamp(low, high).detach() * lp * adv).sum()


def dro(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    if "beta" not in config:
        raise UserError("forward_backward: loss_fn 'dro' needs loss_fn_config['beta']")
    q = _input(inputs, "logprobs", "dro", lp)
    adv = _input(inputs, "advantages", "dro", lp)
    return -(lp * adv - 0.5 * float(config["beta"]) * (lp - q) ** 2).sum()


def gspo(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    q = _input(inputs, "logprobs", "gspo", lp)
    adv = _input(inputs, "advantages", "gspo", lp)
    in_ratio = _input(inputs, "sequence_ratio_mask", "gspo", lp) != 0
    if not bool(in_ratio.any()):
        raise UserError("forward_backward: loss_fn 'gspo': a datum's sequence_ratio_mask marks no token")
    log_ratio = (lp.detach() - q)[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())  # (the sequence ratio's value, each token's own gradient)
    low, high = _clip(config)
    return -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv).sum()


def stable_reinforce(lp: torch.Tensor, inputs: Mapping[str, np.ndarray], config: Mapping[str, float]) -> torch.Tensor:
    adv = _input(inputs, "advantages", "stable_reinforce", lp)
    sampled = _input(inputs, SAMPLED, "stable_reinforce", lp) != 0  # (set from the datum's provenance)
    log_w = (lp - _input(inputs, RECORDED_LOGPROBS, "stable_reinforce", lp))[sampled]
    w = torch.exp(log_w)
    policy = -(w.detach().clamp(max=1.0) * adv[sampled] * lp[sampled]).sum()
    return policy + float(config.get("kl_coeff", 0.0)) * (w - 1.0 - log_w).sum()


LossFn = Callable[[torch.Tensor, Mapping[str, np.ndarray], Mapping[str, float]], torch.Tensor]
LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling,
                             "ppo": ppo, "cispo": cispo, "dro": dro, "gspo": gspo, "stable_reinforce": stable_reinforce}


def loss_fn(name: str) -> LossFn:
    """The built-in loss called `name`; another name is a `UserError` listing the supported ones."""
    if name not in LOSSES:
        raise UserError(f"forward_backward: loss_fn {name!r} is not supported (supported: {', '.join(LOSSES)})")
    return LOSSES[name]
