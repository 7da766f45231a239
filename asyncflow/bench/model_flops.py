"""A train step's useful FLOPs on a decoder-only transformer, and this machine's GEMM peak for the
model's own shapes: the two halves of the `bench model` workload's MFU.

Useful FLOPs count the matmuls the step needs, forward and backward (x3), on the real (unpadded)
tokens: every projection and MLP matmul of every layer on every token; attention's two products over
the causal half of each sequence; the output head on the trained (response) tokens only, the only
ones whose log-probs the loss reads. What the implementation adds is not counted: padding, the head's
recomputation in backward (asyncflow.engines.head_logprobs), elementwise work.

The peak is the FLOP-weighted throughput of the same matmuls measured here, in the run's dtype and
thread count, at the number of tokens one micro-batch holds: (total FLOPs of the mix) / (total
seconds), each shape timed on its own (best of a few).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Shape:
    """The dimensions of a Llama-family decoder that its FLOPs depend on."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> Shape:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(int(config.hidden_size), int(config.num_hidden_layers), int(config.intermediate_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim), int(config.vocab_size))

    def gemms(self, tokens: int, head_tokens: int) -> list[tuple[int, int, int, int]]:
        """(M, K, N, count) of each forward matmul of a pass over `tokens` tokens (the head over `head_tokens`)."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = [(tokens, h, q, 1), (tokens, h, kv, 2), (tokens, q, h, 1), (tokens, h, i, 2), (tokens, i, h, 1)]
        return [(m, k, n, c * self.layers) for m, k, n, c in per_layer] + [(head_tokens, h, self.vocab, 1)]


def train_flops(shape: Shape, lengths: list[int], trained_tokens: int) -> float:
    """Useful FLOPs of one train step (forward + backward) over sequences of `lengths` real tokens, of
    which `trained_tokens` are trained (module docstring)."""
    tokens = sum(lengths)
    matmuls = sum(2 * m * k * n * c for m, k, n, c in shape.gemms(tokens, trained_tokens))
    attention = sum(2 * 2 * shape.heads * shape.head_dim * s * (s + 1) // 2 for s in lengths) * shape.layers
    return 3.0 * (matmuls + attention)


def gemm_peak(shape: Shape, tokens: int, head_tokens: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """FLOP/s of the model's forward matmuls at `tokens` (and the head at `head_tokens`) rows, in
    `dtype`, on this thread's torch threads: the mix's FLOPs over its measured seconds."""
    flops = seconds = 0.0
    for m, k, n, count in shape.gemms(tokens, max(1, head_tokens)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.mm(a, b)  # (warm: the kernel's first call allocates and tunes)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        flops += 2.0 * m * k * n * count
        seconds += best * count
    return flops / seconds
