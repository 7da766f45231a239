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
    readahead: int = 4  # batches asyncflow's Ray consumer may read ahead (`RayTransferQueue.iter_columns`)


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


def checksums(prompt_ids: Any, response_ids: Any, behavior_logprobs: Any, reward: Any) -> np.ndarray:
    """Each sample's checksum over a block of rows (2-D columns, one row per sample; `reward` one
    value per row), with column operations: exact integer sums of the token ids and of the float
    fields' raw bits, per row (int64, which these sums cannot overflow)."""
    lp = np.ascontiguousarray(behavior_logprobs, dtype=np.float32).view(np.int32)
    rw = np.ascontiguousarray(reward, dtype=np.float32).reshape(-1).view(np.int32)
    return (np.sum(prompt_ids, axis=1, dtype=np.int64) + 3 * np.sum(response_ids, axis=1, dtype=np.int64)
            + 5 * np.sum(lp, axis=1, dtype=np.int64) + 7 * rw.astype(np.int64))


def checksum(prompt_ids: Any, response_ids: Any, behavior_logprobs: Any, reward: Any) -> int:
    """One sample's checksum (its row of `checksums`)."""
    one = [np.asarray(prompt_ids)[None], np.asarray(response_ids)[None], np.asarray(behavior_logprobs)[None],
           np.asarray(reward, dtype=np.float32).reshape(1)]
    return int(checksums(*one)[0])


def expected_checksums(batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    """The checksum of sample `idx` at index `idx`, computed before the timed window."""
    total = sum(len(b["idx"]) for b in batches)
    out = np.zeros(total, dtype=np.int64)
    for b in batches:
        out[b["idx"]] = checksums(*(b[f] for f in FIELDS))
    return out


def verify(block: dict[str, Any], expected: np.ndarray, seen: np.ndarray) -> int:
    """Check every row of a block against its expected checksum, once each; returns the row count."""
    idx = np.asarray(block["idx"], dtype=np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= len(expected)):
        raise RuntimeError(f"STORE-1: unknown sample index in {idx.tolist()}")
    got = checksums(*(block[f] for f in FIELDS))
    bad = np.flatnonzero(got != expected[idx])
    if bad.size:
        raise RuntimeError(f"STORE-1: checksum mismatch on sample {int(idx[bad[0]])}")
    if seen[idx].any() or len(np.unique(idx)) != len(idx):
        raise RuntimeError(f"STORE-1: a sample of {idx.tolist()} delivered twice")
    seen[idx] = True
    return len(idx)


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
