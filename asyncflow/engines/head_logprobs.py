"""Log-probs of the chosen tokens through a causal LM's output head, without full-vocabulary tensors.

A train pass needs log p(token) only at the trained positions (the response tokens), yet a model's
forward returns logits for every position: batch x length x vocabulary floats, 0.5 GB at 32 x 80 x
49,152 and 20 GB at 64 x 512 x 151,936, then as much again for their log-softmax and its gradient.
Here the model runs as usual up to its last hidden states; its output head is then applied only to
the positions asked for, a chunk of tokens at a time (`chunk_tokens`, sized so one chunk's logits
stay near `CHUNK_BYTES`). The autograd function keeps the hidden states and each token's log-sum-exp,
and in backward recomputes each chunk's logits to form the gradient: one more head matmul per chunk,
and a peak that grows with the chunk, not the batch.

How the head is reached: for the duration of one pass its `forward` is replaced on the instance, so
the model's own forward (and FSDP's hooks around it, and PEFT's wrappers) run unchanged and the
head's parameters are whatever they are inside that forward (FSDP: unsharded). A model that changes
the logits after its head (soft-capping, logit scaling) returns something other than what the head
gave it; that is detected on the pass and the model falls back to the full-logits path for good.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

CHUNK_BYTES = 128 * 2**20  # float32 logits of one chunk of tokens
_FALLBACK = "_asyncflow_full_logits"  # set on a model whose head's output is post-processed


def right_pad(rows: list[list[int]], pad_id: int = 0, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one id tensor [len(rows), width] (default: the longest row's), right-padded with
    `pad_id`, and its attention mask (1 on each row's tokens)."""
    width = max(len(r) for r in rows) if width is None else width
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk: their float32 logits take about `CHUNK_BYTES`."""
    return max(16, CHUNK_BYTES // (4 * vocab))


def _compute_dtype(weight: torch.Tensor, hidden: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmuls run in: autocast's where it is on (CPU bf16 passes over float32
    master weights), else the lower of the two inputs' (FSDP's mixed precision casts both)."""
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype if weight.element_size() <= hidden.element_size() else hidden.dtype


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T * inv_temp)[target] per row of `hidden`, chunk by chunk; also the
    entropy of each row's distribution (an output without gradient)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                inv_temp: float) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(weight, hidden)
        n, chunk = hidden.shape[0], chunk_tokens(weight.shape[0])
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        with torch.autocast(weight.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                z = torch.mm(hidden[s:e].to(dtype), w.t()).float()
                if inv_temp != 1.0:
                    z.mul_(inv_temp)
                lse[s:e] = torch.logsumexp(z, dim=-1)
                z.sub_(lse[s:e, None])  # log-softmax, in place
                logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1)
                entropy[s:e] = -(z.exp().mul_(z)).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.inv_temp, ctx.dtype = inv_temp, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, _grad_entropy: Any) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        dtype, inv_temp = ctx.dtype, ctx.inv_temp
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        n, chunk = hidden.shape[0], chunk_tokens(weight.shape[0])
        with torch.autocast(weight.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                h = hidden[s:e].to(dtype)
                z = torch.mm(h, w.t()).float()
                if inv_temp != 1.0:
                    z.mul_(inv_temp)
                g = grad_logp[s:e].float()
                # d logp / d logits = (onehot(target) - softmax) * inv_temp
                d = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
                d.scatter_add_(1, targets[s:e, None], g[:, None])
                if inv_temp != 1.0:
                    d.mul_(inv_temp)
                d_low = d.to(dtype)
                if grad_h is not None:
                    grad_h[s:e] = torch.mm(d_low, w).to(grad_h.dtype)
                if grad_w is not None:
                    grad_w.add_(torch.mm(d_low.t(), h).float())
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None)


def _plain_logprobs(logits: torch.Tensor, targets: torch.Tensor, inv_temp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from full logits [N, V] (models whose head output is post-processed)."""
    z = torch.log_softmax(logits.float() * inv_temp, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1)
    with torch.no_grad():
        entropy = -(z.exp() * z).sum(-1)
    return logp, entropy


@contextlib.contextmanager
def _head_replaced(head: torch.nn.Module, forward: Any) -> Iterator[None]:
    head.forward = forward  # (an instance attribute: nn.Module.__call__ looks it up first)
    try:
        yield
    finally:
        del head.forward


def token_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, mask: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [B, L-1] of each next token where `mask` [B, L-1] is non-zero (0 elsewhere), under
    logits / temperature, and the entropy of those positions' distributions (no gradient)."""
    b, length = input_ids.shape
    rows, cols = mask.nonzero(as_tuple=True)
    flat = rows * length + cols  # the hidden state at position t predicts token t + 1
    targets = input_ids[rows, cols + 1]
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    call = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                use_cache=False)  # (no KV cache to build; gradient checkpointing refuses one)
    head = model.get_output_embeddings()
    fused = head is not None and type(head) is torch.nn.Linear and head.bias is None and not getattr(model, _FALLBACK, False)
    picked: list[tuple[torch.Tensor, torch.Tensor]] = []
    if fused:
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)
            picked.append(ChunkedTokenLogprobs.apply(h, head.weight, targets, inv_temp))
            return picked[-1][0]

        with _head_replaced(head, forward):
            out = model(**call).logits
        if out is picked[0][0]:
            logp, entropy = picked[0]
            return _dense(logp, rows, cols, mask), _dense(entropy, rows, cols, mask)
        setattr(model, _FALLBACK, True)  # its forward changes the logits after the head: never fused again
    logits = model(**call).logits
    logp, entropy = _plain_logprobs(logits.reshape(-1, logits.shape[-1]).index_select(0, flat), targets, inv_temp)
    return _dense(logp, rows, cols, mask), _dense(entropy, rows, cols, mask)


def _dense(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`values` of the (rows, cols) positions in a float32 [B, L-1] tensor, 0 elsewhere (differentiable)."""
    out = torch.zeros(like.shape, dtype=torch.float32, device=values.device)
    return out.index_put((rows, cols), values.float())
