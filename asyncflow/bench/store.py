"""`asyncflow bench store`: STORE-1 (see `store1`) on asyncflow's store, in both placements and modes.

- `local`: one process; the producer and the consumer are two threads on one `TransferQueue`.
- `ray`: the producer and the consumer are two Ray actors (two processes) on one `RayTransferQueue`
  (controller actor + object store), so every byte crosses a process boundary.

Each measurement starts from warmed-up processes: an untimed round runs first on the same store
(`local`: 256 samples; `ray`: a whole pass on the same actors and the same store controller, as the
`transferqueue` baseline warms its controller and storage units). The timed window runs from the producer's first put to the consumer's last
verified checksum (`time.monotonic()` is one clock for every process on a machine).
`--set transferqueue=true` adds the `transferqueue` 0.1.11 package on the same workload, side by side
(needs `pip install -e .[bench]`, i.e. `transferqueue==0.1.11`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from asyncflow.bench.options import read_sets
from asyncflow.bench.store1 import FIELDS, Store1Spec, expected_checksums, make_batches, row, verify
from asyncflow.errors import UserError

TIMEOUT_S = 120.0


def produce(store: Any, batches: list[dict[str, np.ndarray]]) -> float:
    """Put every batch; returns the monotonic time of the first put."""
    start = time.monotonic()
    for b in batches:  # columnar, as the batches come (both stores take columns; so does transferqueue)
        idx = b["idx"]
        store.put_columns_blocking({"idx": idx, **{f: b[f] for f in FIELDS}}, idx.tolist(), 1, timeout=TIMEOUT_S)
    if hasattr(store, "flush"):
        store.flush()  # pipelined puts (Ray client): all landed
    return start


def consume(store: Any, total: int, take_batch: int, expected: np.ndarray, readahead: int) -> float:
    """Take batches of `take_batch` as column blocks until `total` samples are verified (each one's
    checksum, with column operations over each block); returns the end time."""
    seen = np.zeros(len(expected), dtype=bool)
    done = 0
    for taken in store.iter_columns("train", take_batch, total, timeout=TIMEOUT_S, fields_extra=["idx"],
                                    readahead=readahead):
        for b in taken.blocks:
            done += verify(b, expected, seen)
        store.ack(taken.lease, remove=True)
    if done != total:
        raise RuntimeError(f"STORE-1: verified {done} samples, expected {total}")
    return time.monotonic()


def _local(mode: str, spec: Store1Spec) -> dict[str, Any]:
    from asyncflow.transfer_queue import TransferQueue

    batches = make_batches(spec)
    expected = expected_checksums(batches)
    store = TransferQueue(capacity=spec.samples)
    store.register_stage("train", list(FIELDS))
    if mode == "sequential":
        start = produce(store, batches)
        end = consume(store, spec.samples, spec.take_batch, expected, spec.readahead)
    else:
        out: dict[str, float] = {}
        t = threading.Thread(target=lambda: out.setdefault("end", consume(store, spec.samples, spec.take_batch, expected,
                                                                         spec.readahead)))
        t.start()
        start = produce(store, batches)
        t.join(TIMEOUT_S)
        if "end" not in out:
            raise RuntimeError("STORE-1 local streaming: the consumer did not finish")
        end = out["end"]
    return row("local", mode, spec.samples, end - start)


class _Producer:
    def __init__(self, spec: Store1Spec) -> None:
        self.batches = make_batches(spec)

    def run(self, store: Any, limit: int | None = None) -> float:
        """Put every batch, or (a warm-up) the first batches that hold at least `limit` samples: whole
        batches rounded down left a consumer waiting for `limit` 120 s, then a crash, when `limit`
        was not a multiple of the batch size (samples=100)."""
        batches = self.batches
        if limit is not None:
            count, upto = 0, 0
            while upto < len(batches) and count < limit:
                count += len(batches[upto]["idx"])
                upto += 1
            batches = batches[:upto]
        return produce(store, batches)


class _Consumer:
    def __init__(self, spec: Store1Spec) -> None:
        self.expected = expected_checksums(make_batches(spec))
        self.spec = spec

    def run(self, store: Any, total: int) -> float:
        return consume(store, total, self.spec.take_batch, self.expected, self.spec.readahead)


def _ray(mode: str, spec: Store1Spec, actors: tuple[Any, Any], store: Any) -> dict[str, Any]:
    import ray

    producer, consumer = actors
    if mode == "sequential":
        start = ray.get(producer.run.remote(store), timeout=TIMEOUT_S * 2)
        end = ray.get(consumer.run.remote(store, spec.samples), timeout=TIMEOUT_S * 2)
    else:
        end_ref = consumer.run.remote(store, spec.samples)
        start = ray.get(producer.run.remote(store), timeout=TIMEOUT_S * 2)
        end = ray.get(end_ref, timeout=TIMEOUT_S * 2)
    return row("ray", mode, spec.samples, end - start, readahead=spec.readahead)


def _ray_rows(spec: Store1Spec, repeats: int) -> list[dict[str, Any]]:
    """Both modes on one store (its controller warmed up by an untimed round, as the actors are, and
    as the transferqueue baseline's controller is); every pass consumes and removes all it put."""
    import ray

    from asyncflow.transfer_queue.ray_store import RayTransferQueue

    actors: tuple[Any, Any] = (
        ray.remote(_Producer).options(num_cpus=0).remote(spec),
        ray.remote(_Consumer).options(num_cpus=0).remote(spec),
    )
    store = RayTransferQueue.create(capacity=spec.samples)
    try:
        store.register_stage("train", list(FIELDS))
        # a whole untimed pass: it also maps into both processes the object-store pages the timed
        # passes reuse (a first touch costs a page fault per 4 KiB: ~3x the copy on this VM)
        ray.get(actors[0].run.remote(store), timeout=TIMEOUT_S)
        ray.get(actors[1].run.remote(store, spec.samples), timeout=TIMEOUT_S)
        return [_best([_ray(mode, spec, actors, store) for _ in range(repeats)]) for mode in ("sequential", "streaming")]
    finally:
        store.kill()
        for a in actors:
            ray.kill(a)


def run_store(overrides: list[str]) -> list[dict[str, Any]]:
    """STORE-1: local and Ray placements x sequential and streaming modes (best of `repeats`)."""
    opts = read_sets("store", overrides, _KNOWN)
    spec = Store1Spec(samples=_count(opts, "samples", 4096), readahead=_count(opts, "readahead", 4, least=0))
    repeats = _count(opts, "repeats", 3)
    placements = str(opts.get("placements", "local,ray")).split(",")
    transferqueue = _flag(opts, "transferqueue")
    if transferqueue:
        import importlib.util

        if importlib.util.find_spec("transfer_queue") is None:
            raise UserError("bench store --set transferqueue=true: the transferqueue package is not installed "
                            "(pip install -e '.[bench]')")
    unknown = set(placements) - {"local", "ray"}
    if unknown:
        raise UserError(f"bench store --set placements: unknown placement(s) {sorted(unknown)}; use local, ray")
    rows: list[dict[str, Any]] = []
    for mode in ("sequential", "streaming"):
        if "local" in placements:
            _local(mode, Store1Spec(samples=256))  # warm caches and allocators
            rows.append(_best([_local(mode, spec) for _ in range(repeats)]))
    if "ray" in placements or transferqueue:
        from asyncflow.runtime.ray_init import ensure_ray

        ensure_ray(None)
    if "ray" in placements:
        rows += _ray_rows(spec, repeats)
    if transferqueue:
        from asyncflow.bench.tq_baseline import run_transferqueue

        for mode in ("sequential", "streaming"):
            rows.append(run_transferqueue(mode, spec, repeats=repeats))
    return rows


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(rows, key=lambda r: r["samples_per_s"])
    return {**best, "repeats": len(rows), "worst_samples_per_s": min(r["samples_per_s"] for r in rows)}


_KNOWN = ("samples", "repeats", "placements", "transferqueue", "readahead")


def _count(opts: dict[str, str], key: str, default: int, least: int = 1) -> int:
    """`--set key=N` as an int >= `least` (0 samples or repeats has nothing to measure), checked before any work."""
    if key not in opts:
        return default
    try:
        value = int(opts[key])
    except ValueError:
        raise UserError(f"bench store --set {key}: expected an integer, got {opts[key]!r}") from None
    if value < least:
        raise UserError(f"bench store --set {key}: must be >= {least}, got {value}")
    return value


def _flag(opts: dict[str, str], key: str) -> bool:
    """`--set key=true|false` (or 1|0, any case); anything else is refused rather than read as false."""
    value = opts.get(key, "false")
    word = value.strip().lower()
    if word in ("true", "1"):
        return True
    if word in ("false", "0"):
        return False
    raise UserError(f"bench store --set {key}: expected true or false, got {value!r}")
