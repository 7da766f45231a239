"""Drawing the next token from a decode step's logits: top-k / top-p truncation, one draw per row,
and the top alternatives a request asks for. Pure tensor code (the HF engine's decode loop calls it)."""

from __future__ import annotations

import torch

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's rule: logits / t overflows)


def truncate_logits(logits: torch.Tensor, top_p: list[float], top_k: list[int]) -> torch.Tensor:
    """Per row, set to -inf every logit outside the `top_k` most likely (0: off) and outside the
    smallest set whose probability reaches `top_p` (1: off). The log-softmax of the result is the
    distribution actually sampled from, so reported log-probs are of that (truncated) distribution."""
    if all(p >= 1.0 for p in top_p) and all(k <= 0 for k in top_k):
        return logits
    out = logits.clone()
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).expand_as(logits)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(-1)
    p = torch.tensor(top_p, dtype=logits.dtype, device=logits.device).unsqueeze(-1)
    outside_k = ranks >= k
    # the nucleus is measured on the top-k distribution (top-k applied first, as in transformers and vLLM)
    probs = torch.softmax(sorted_logits.masked_fill(outside_k, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # probability of the tokens ranked above this one
    drop_sorted = outside_k | (before >= p)  # the top token is always kept (before = 0 < p)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return out.masked_fill(drop, float("-inf"))


def sample_tokens(probs: torch.Tensor, shared: torch.Generator, own: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocabulary], drawn from it by the inverse of its cumulative
    sum at a uniform draw: one number per row, from `shared`, or from the row's own generator where
    `own` gives one (a seeded request: its draws do not depend on the batch it runs in). On the CPU
    `torch.multinomial` (or exponential noise over the vocabulary) took ~60 ms a step for 64 rows at a
    49,152-token vocabulary: half a decode step; the cumulative sum takes 1.5 ms."""
    cdf = probs.cumsum(-1)
    u = torch.rand((probs.shape[0], 1), generator=shared, device=probs.device)
    for i, gen in enumerate(own):
        if gen is not None:
            u[i] = torch.rand(1, generator=gen, device=probs.device)
    # (scaled by each row's total, which float32 rounding leaves a hair off 1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def top_alternatives(logp: torch.Tensor, counts: list[int]) -> list[list[tuple[int, float]] | None]:
    """Per row, its `counts[i]` most likely tokens under `logp` (the distribution sampled from) as
    (id, log-prob), tokens outside the top-p/top-k truncation (-inf) left out; None where 0 asked."""
    most = max(counts, default=0)
    if most <= 0:
        return [None] * len(counts)
    values, ids = logp.topk(min(most, logp.shape[-1]), dim=-1)
    values_l, ids_l = values.tolist(), ids.tolist()
    return [[(t, v) for t, v in zip(ids_l[i][:k], values_l[i][:k], strict=True) if v != float("-inf")] if k > 0
            else None for i, k in enumerate(counts)]
