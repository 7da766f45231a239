"""Losses for data many versions old: M2PO and IcePop-style masking (docs/algorithms.md).

Both weight the policy gradient by the importance ratio r = pi_theta / mu to the behavior policy,
with no clip, and keep it bounded by masking tokens out instead:
- M2PO (Zheng et al. 2025, arXiv 2510.01161): the fewest tokens with the largest (log r)^2 are
  masked so that the kept tokens' second moment mean((log r)^2) is at most `m2_threshold`;
- IcePop (Ling team, Ring-1T; the form of INTELLECT-3, arXiv 2512.16144): a token whose r lies
  outside [icepop_low, icepop_high] is masked.
Per-token objective to minimise: -M r A, the mask M in {0, 1} taken without gradient; its gradient is
-M r A grad log pi_theta (r carries the gradient, as in the papers).
"""

from __future__ import annotations

import torch


def m2_keep_mask(log_r: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """1.0 on the tokens M2PO keeps: of the tokens under `mask`, the fewest with the largest
    (log r)^2 are dropped so that the kept tokens' mean (log r)^2 is <= `threshold`."""
    m2 = (log_r.detach() ** 2) * mask
    on = mask > 0
    values = m2[on]
    n = values.numel()
    keep = torch.zeros_like(mask)
    if n == 0:
        return keep
    ordered, order = torch.sort(values, descending=True, stable=True)
    dropped = torch.cat([ordered.new_zeros(1), torch.cumsum(ordered, 0)[:-1]])  # sum of the k largest, k = 0..n-1
    remaining = torch.arange(n, 0, -1, dtype=ordered.dtype, device=ordered.device)  # n - k tokens kept
    ok = (ordered.sum() - dropped) / remaining <= threshold
    k = int(torch.nonzero(ok)[0]) if bool(ok.any()) else n  # even the smallest alone above: drop all
    kept = torch.ones(n, dtype=mask.dtype, device=mask.device)
    kept[order[:k]] = 0.0
    keep[on] = kept
    return keep


def m2po_objective(
    log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, t: float, threshold: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """M2PO's per-token objective and metrics (`log_r` clamped and masked, with gradient; `t` tokens)."""
    keep = m2_keep_mask(log_r, mask, threshold)
    per_token = -keep * torch.exp(log_r) * adv
    m2 = log_r.detach() ** 2
    metrics = {
        "m2": (m2 * mask).sum() / t,  # before masking
        "m2_kept": (m2 * keep).sum() / t,
        "m2_mask_frac": ((1.0 - keep) * mask).sum() / t,
    }
    return per_token, metrics


def icepop_objective(
    log_r: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, t: float, low: float, high: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """IcePop's per-token objective and metrics: r kept where low <= r <= high, else 0."""
    ratio = torch.exp(log_r)
    r = ratio.detach()
    keep = ((r >= low) & (r <= high)).to(mask.dtype)
    per_token = -keep * ratio * adv
    metrics = {
        "is_mask_frac": ((1.0 - keep) * mask).sum() / t,
        "is_mask_frac_low": ((r < low).to(mask.dtype) * mask).sum() / t,
        "is_mask_frac_high": ((r > high).to(mask.dtype) * mask).sum() / t,
    }
    return per_token, metrics
