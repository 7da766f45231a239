"""The STORE-1 workload (DESIGN.md, Benchmarks): data, checksums and row format, shared by every
store implementation that is measured on it (asyncflow's in-process and Ray placements, and the
`transferqueue` package side by side), so all of them move exactly the same bytes.

4,096 samples of `prompt_ids` int64[256], `response_ids` int64[768], `behavior_logprobs`
float32[768] and `reward` float32 (11,268 payload bytes each, 46.2 MB in all); the producer puts
batches of 64; the consumer (stage `train`) takes batches of 256 until all are consumed and
verifies a per-sample checksum inside the timed window. The data is generated before the clock
starts. `sequential`: all puts, then all takes; `streaming`: producer and consumer run concurrently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FIELDS = ("prompt_ids", "response_ids", "behavior_logprobs", "reward")
PROMPT_LEN = 256
RESPONSE_LEN = 768
BYTES_PER_SAMPLE = PROMPT_LEN * 8 + RESPONSE_LEN * 8 + RESPONSE_LEN * 4 + 4


@dataclass(frozen=True)
class Store1Spec:
    """The pinned STORE-1 parameters (overridable for quick tests)."""

    samples: int = 4096
    put_batch: int = 64
    take_batch: int = 256


def make_batches(spec: Store1Spec, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The producer's batches, columnar: each field stacked over the batch, plus `idx` (int64[B])."""
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, spec.samples, spec.put_batch):
        b = min(spec.put_batch, spec.samples - start)
        out.append(
            {
                "idx": np.arange(start, start + b, dtype=np.int64),
                "prompt_ids": rng.integers(0, 150_000, size=(b, PROMPT_LEN), dtype=np.int64),
                "response_ids": rng.integers(0, 150_000, size=(b, RESPONSE_LEN), dtype=np.int64),
                "behavior_logprobs": -rng.random((b, RESPONSE_LEN), dtype=np.float32) * 5.0,
                "reward": rng.random(b, dtype=np.float32),
            }
        )
    return out


def checksum(prompt_ids: Any, response_ids: Any, behavior_logprobs: Any, reward: Any) -> int:
    """One sample's checksum: exact integer sums of the token ids and of the float fields' raw bits."""
    lp = np.ascontiguousarray(behavior_logprobs, dtype=np.float32).view(np.int32)
    rw = np.asarray(reward, dtype=np.float32).reshape(1).view(np.int32)
    return int(np.sum(prompt_ids)) + 3 * int(np.sum(response_ids)) + 5 * int(np.sum(lp, dtype=np.int64)) + 7 * int(rw[0])


def expected_checksums(batches: list[dict[str, np.ndarray]]) -> dict[int, int]:
    """idx -> checksum, computed before the timed window."""
    out: dict[int, int] = {}
    for b in batches:
        for j, idx in enumerate(b["idx"].tolist()):
            out[idx] = checksum(b["prompt_ids"][j], b["response_ids"][j], b["behavior_logprobs"][j], b["reward"][j])
    return out


def row(placement: str, mode: str, samples: int, seconds: float, **extra: Any) -> dict[str, Any]:
    """A STORE-1 result row with the DESIGN.md keys (MB = 10^6 payload bytes, counted once)."""
    return {
        "placement": placement,
        "mode": mode,
        "samples": samples,
        "seconds": round(seconds, 4),
        "samples_per_s": round(samples / max(seconds, 1e-12), 1),
        "MB_per_s": round(samples * BYTES_PER_SAMPLE / 1e6 / max(seconds, 1e-12), 2),
        **extra,
    }
