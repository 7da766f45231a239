"""Which attention kernel a pass on the CPU runs: eager for short sequences, SDPA for long ones.

Measured on this project's 2-core CPU (bf16, SmolLM2-135M's 9 query / 3 key-value heads of 64), one
layer's forward and backward: at 87 tokens x 32 rows eager (matmul, softmax, matmul) takes 14.5 ms and
SDPA's flash kernel 47.5 ms; at 256 x 16 they are level (79 / 70 ms); at 512 x 8 SDPA wins (115 / 273
ms), and eager's scores grow with the length squared. A decode step (one query per row) runs eager at
any context length: 108 against 174 ms a step for 64 rows. So a pass picks by its length: eager up to
`EAGER_MAX_TOKENS` keys per query row when it has more than one query, always for one query. Only
models that run one of the two (transformers' `sdpa` or `eager`) are switched, and only on the CPU
(GPUs have fused kernels for both).
"""

from __future__ import annotations

from typing import Any

import torch

EAGER_MAX_TOKENS = 256
_SWITCHABLE = ("sdpa", "eager")


def pick_attention(model: Any, device: torch.device, queries: int, keys: int) -> None:
    """Set `model`'s attention implementation for a pass of `queries` new tokens per row over `keys`
    positions (the cache included)."""
    if device.type != "cpu":
        return
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current not in _SWITCHABLE:
        return
    want = "eager" if queries == 1 or keys <= EAGER_MAX_TOKENS else "sdpa"
    if want != current:
        model.set_attn_implementation(want)
