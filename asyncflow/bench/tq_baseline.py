"""STORE-1 on the public `transferqueue` package (import name `transfer_queue`, v0.1.11): the baseline
that asyncflow's own store is compared against, moving exactly the bytes of `asyncflow.bench.store1`.

Set-up (mirrors `transfer_queue.init()` and the package's tutorials, see below for the one change):

* One `TransferQueueController` (the named actor `TransferQueueController` in Ray namespace
  `transfer_queue`, so `tq.init()` in any other process attaches to it), built with the default
  `SequentialSampler` and `polling_mode=True`: the tutorials' setting for streaming consumption, where
  `get_meta` answers at once with an empty `BatchMeta` while fewer than `batch_size` samples are
  ready (without it the controller's request thread sleeps 5 s per unsatisfied request and then
  raises).
* The default `SimpleStorage` backend with 2 `SimpleStorageUnit` actors: the package default and
  the tutorials' choice, and its config's advice (">= 2 x number of nodes") for one node. Each put
  and get fans out to the units in parallel (samples are routed by `global_index % units`). On this
  2-core machine 1, 2 and 4 units measured within the run-to-run noise of each other.
* Producer and consumer are two separate Ray actors; each calls `tq.init()` (which finds the live
  controller and builds a `TransferQueueClient` from the stored config) and uses the low-level
  client: the producer `put(TensorDict, partition_id=...)` per batch of 64 (the tutorials'
  insert-mode put: the controller assigns the sample indexes; STORE-1's own `idx` travels as a
  field), the consumer `get_meta(fields, 256, partition_id, task_name="train")` then
  `get_data(meta)`. `get_data` hands the 2-D fields back as jagged nested tensors (the units keep
  one row per sample and re-pack them), so the consumer unbinds them into per-sample rows.
* Streaming: the consumer is started first and polls `get_meta` with a 2 ms back-off on an empty
  answer. (The package's `StreamingDataset` runs the same `get_meta`/`get_data` loop but sleeps a
  fixed 1 s after an empty answer, which would dominate a 46 MB run; the short back-off is the
  favourable choice.) Sequential: the consumer is started after the producer has returned.

Differences from a plain `tq.init()`: (1) it creates the controller and every storage unit with
`num_cpus=1`, which does not fit the 2 logical CPUs Ray is given here (controller + 2 units = 3:
the units would never be scheduled), so this module creates the same actors with the same arguments
itself, with fractional CPUs (0.25 each; 0.25 for producer and consumer too), and stores the merged
config on the controller as `init()` does; (2) `TQ_NUM_THREADS` is set to the physical core count
(see `_tq_runtime_env`). Every other knob keeps the package default.

Timing and checks: the data (`store1.make_batches`, seeded, built by the producer before the clock)
and the expected checksums (built here) exist before the timed window, which runs from the first
put to the last verified sample (wall clock, same host). The consumer checks every sample with
`store1.verify` (each sample's checksum, computed with column operations, as asyncflow's consumer
does) inside the window and fails on a mismatch, a duplicate or a missing sample. A full
untimed warm-up pass on its own partition precedes the timed passes, so both sides' sockets, the
controller's partition code paths and the storage units are warm; every timed pass uses a fresh
partition, which the consumer clears after the clock stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from importlib import resources
from typing import Any

import numpy as np
import psutil
import ray

import asyncflow.bench.store1 as store1
from asyncflow.bench.store1 import Store1Spec

PLACEMENT = "transferqueue-ray"
MODES = ("sequential", "streaming")
NUM_STORAGE_UNITS = 2
TQ_ACTOR_CPUS = 0.25  # the controller and each storage unit
WORKER_CPUS = 0.25  # the producer and the consumer
POLL_INTERVAL_S = 0.002  # consumer back-off after an empty get_meta answer (streaming)
TASK_NAME = "train"
CONTROLLER_NAME = "TransferQueueController"  # where `tq.init()` looks for a live controller
TQ_NAMESPACE = "transfer_queue"
STARTUP_TIMEOUT_S = 120.0
PASS_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 20.0


def _tq_runtime_env() -> dict[str, Any]:
    """TQ_NUM_THREADS for every process that runs TransferQueue code, as a Ray runtime_env.

    The package caps torch's threads per put/get at TQ_NUM_THREADS (default 8) and, when that exceeds
    the physical cores, logs a warning on every request. It is read when `transfer_queue` is imported,
    and the controller and storage-unit classes travel to their actors by value with the importing
    (driver) process's module constants, so it is set here, before the first import, unless the caller
    set it; the producer and consumer import the package themselves and get it through the runtime_env.
    """
    value = os.environ.setdefault("TQ_NUM_THREADS", str(psutil.cpu_count(logical=False) or 1))
    return {"env_vars": {"TQ_NUM_THREADS": value}}


def _ray_get(refs: Any, timeout: float, what: str) -> Any:
    """`ray.get` with a deadline; any failure becomes a RuntimeError naming the step."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise RuntimeError(f"transferqueue baseline: {what} did not finish within {timeout:.0f} s") from e
    except ray.exceptions.RayError as e:
        raise RuntimeError(f"transferqueue baseline: {what} failed: {e}") from e


def _rows_of(value: Any) -> list[np.ndarray]:
    """One numpy view per sample of a field returned by `get_data` (dense or jagged nested tensor)."""
    if value.is_nested:
        return [t.numpy() for t in value.unbind(0)]
    array = value.numpy()
    return [array[j] for j in range(array.shape[0])]


@ray.remote
class _Producer:
    """Puts the STORE-1 batches (64 samples each) into a partition, from its own process."""

    def __init__(self, spec: Store1Spec) -> None:
        import torch
        import transfer_queue as tq

        tq.init()  # attaches to the live controller: client only
        self._client = tq.get_client()
        self._batches = [
            {name: torch.from_numpy(array) for name, array in batch.items()}
            for batch in store1.make_batches(spec)
        ]

    def ready(self) -> int:
        return len(self._batches)

    def produce(self, partition_id: str) -> dict[str, float]:
        from tensordict import TensorDict

        t_first_put = time.time()
        for batch in self._batches:
            data = TensorDict(batch, batch_size=[batch["idx"].shape[0]])
            self._client.put(data=data, partition_id=partition_id)
        return {"t_first_put": t_first_put, "t_last_put": time.time()}


@ray.remote
class _Consumer:
    """Takes batches of 256 for task `train` until every sample is consumed, verifying each one."""

    def __init__(self, spec: Store1Spec, expected: np.ndarray) -> None:
        import transfer_queue as tq

        tq.init()
        self._client = tq.get_client()
        self._spec = spec
        self._expected = expected
        self._fields = ["idx", *store1.FIELDS]

    def ready(self) -> int:
        return len(self._expected)

    def consume(self, partition_id: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        seen = np.zeros(len(self._expected), dtype=bool)
        remaining = self._spec.samples
        t_first_take = 0.0
        empty_polls = 0
        batches = 0
        while remaining > 0:
            want = min(self._spec.take_batch, remaining)
            meta = self._client.get_meta(
                data_fields=self._fields, batch_size=want, partition_id=partition_id, task_name=TASK_NAME
            )
            if meta.size == 0:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"consumer: {int(seen.sum())}/{self._spec.samples} samples after {timeout_s:.0f} s "
                        f"({empty_polls} empty get_meta answers)"
                    )
                empty_polls += 1
                time.sleep(POLL_INTERVAL_S)
                continue
            if not t_first_take:
                t_first_take = time.time()
            data = self._client.get_data(meta)
            self._verify(data, seen)
            remaining = self._spec.samples - int(seen.sum())
            batches += 1
        t_last_verified = time.time()
        missing = np.flatnonzero(~seen)
        if missing.size:
            raise RuntimeError(
                f"consumer: {missing.size} samples never delivered, e.g. {missing[:5].tolist()}"
            )
        self._client.clear_partition(partition_id)  # after the clock: frees the storage units
        return {
            "t_first_take": t_first_take,
            "t_last_verified": t_last_verified,
            "empty_polls": empty_polls,
            "batches": batches,
        }

    def _verify(self, data: Any, seen: np.ndarray) -> None:
        """Every sample's checksum with the same column operations as asyncflow's consumer
        (`store1.verify`), over the columns `get_data` returned (jagged ones re-stacked: one copy)."""
        block = {"idx": data["idx"].reshape(-1).numpy()}
        for name in store1.FIELDS:
            value = data[name]
            block[name] = np.stack(_rows_of(value)) if value.is_nested else value.numpy()
        store1.verify(block, self._expected, seen)


class _TransferQueue:
    """The controller and storage units of one TransferQueue instance, created as `tq.init()` does."""

    def __init__(self, runtime_env: dict[str, Any], num_storage_units: int = NUM_STORAGE_UNITS) -> None:
        from omegaconf import OmegaConf
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.sampler import SequentialSampler
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        try:
            ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
        except ValueError:
            pass
        else:
            raise RuntimeError(
                "transferqueue baseline: a TransferQueueController is already live in this Ray cluster"
            )
        conf = OmegaConf.merge(
            OmegaConf.create({}, flags={"allow_objects": True}),
            OmegaConf.load(str(resources.files("transfer_queue") / "config.yaml")),
            {
                "controller": {"polling_mode": True},
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {"num_data_storage_units": num_storage_units},
                },
            },
        )
        self.controller = TransferQueueController.options(  # type: ignore[attr-defined]
            name=CONTROLLER_NAME, namespace=TQ_NAMESPACE, num_cpus=TQ_ACTOR_CPUS, runtime_env=runtime_env
        ).remote(sampler=SequentialSampler, polling_mode=True)
        self.units: list[Any] = []
        try:
            conf.controller.zmq_info = _ray_get(
                self.controller.get_zmq_server_info.remote(), STARTUP_TIMEOUT_S, "controller start-up"
            )
            unit_config = dict(conf.backend.SimpleStorage)
            unit_config["_run_id"] = uuid.uuid4().hex
            unit_options: dict[str, Any] = {"num_cpus": TQ_ACTOR_CPUS, "runtime_env": runtime_env}
            unit_class = SimpleStorageUnit.options(**unit_options)  # type: ignore[attr-defined]
            self.units = [unit_class.remote(config=unit_config) for _ in range(num_storage_units)]
            infos = _ray_get(
                [unit.get_zmq_server_info.remote() for unit in self.units],
                STARTUP_TIMEOUT_S,
                "storage unit start-up",
            )
            conf.backend.SimpleStorage.zmq_info = {
                f"TransferQueueStorageUnit#{rank}": info for rank, info in enumerate(infos)
            }
            _ray_get(self.controller.store_config.remote(conf), STARTUP_TIMEOUT_S, "controller config")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Shut the storage units down, kill them and the controller, and wait for the name to free."""
        if self.units:
            with contextlib.suppress(Exception):  # best effort; the kill below is what matters
                ray.get([unit.shutdown.remote() for unit in self.units], timeout=SHUTDOWN_TIMEOUT_S)
            for unit in self.units:
                ray.kill(unit)
            self.units = []
        ray.kill(self.controller)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(CONTROLLER_NAME, namespace=TQ_NAMESPACE)
            except ValueError:
                return
            time.sleep(0.05)


def _one_pass(mode: str, producer: Any, consumer: Any, partition_id: str) -> dict[str, float]:
    """One full STORE-1 pass on a fresh partition; returns the timed window and its parts."""
    if mode == "sequential":
        produced = _ray_get(producer.produce.remote(partition_id), PASS_TIMEOUT_S, "producer puts")
        consumed = _ray_get(
            consumer.consume.remote(partition_id, PASS_TIMEOUT_S), PASS_TIMEOUT_S + 30, "consumer takes"
        )
    else:
        consume_ref = consumer.consume.remote(partition_id, PASS_TIMEOUT_S)
        produce_ref = producer.produce.remote(partition_id)
        produced = _ray_get(produce_ref, PASS_TIMEOUT_S, "producer puts (streaming)")
        consumed = _ray_get(consume_ref, PASS_TIMEOUT_S + 30, "consumer takes (streaming)")
    return {
        "seconds": consumed["t_last_verified"] - produced["t_first_put"],
        "put_s": produced["t_last_put"] - produced["t_first_put"],
        "take_s": consumed["t_last_verified"] - consumed["t_first_take"],
        "empty_polls": consumed["empty_polls"],
    }


def run_transferqueue(mode: str, spec: Store1Spec = Store1Spec(), repeats: int = 1) -> dict[str, Any]:
    """STORE-1 on TransferQueue in `mode` ("sequential" or "streaming"); the best of `repeats` timed
    passes after one warm-up pass, as a `store1.row` (the slowest pass in `seconds_worst`)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False)
    expected = store1.expected_checksums(store1.make_batches(spec))
    runtime_env = _tq_runtime_env()
    tq: _TransferQueue | None = None
    workers: list[Any] = []
    try:
        tq = _TransferQueue(runtime_env, NUM_STORAGE_UNITS)
        options: dict[str, Any] = {"num_cpus": WORKER_CPUS, "runtime_env": runtime_env}
        producer = _Producer.options(**options).remote(spec)  # type: ignore[attr-defined]
        consumer = _Consumer.options(**options).remote(spec, expected)  # type: ignore[attr-defined]
        workers = [producer, consumer]
        _ray_get(
            [producer.ready.remote(), consumer.ready.remote()],
            STARTUP_TIMEOUT_S,
            "producer/consumer start-up",
        )
        run_id = uuid.uuid4().hex[:8]
        warmup = _one_pass(mode, producer, consumer, f"store1-{mode}-{run_id}-warmup")
        passes = [
            _one_pass(mode, producer, consumer, f"store1-{mode}-{run_id}-{rep}") for rep in range(repeats)
        ]
    finally:
        for worker in workers:
            ray.kill(worker)
        if tq is not None:
            tq.close()
        if started_ray:
            ray.shutdown()
    from transfer_queue.storage import simple_storage

    best = min(passes, key=lambda p: p["seconds"])
    return store1.row(
        PLACEMENT,
        mode,
        spec.samples,
        best["seconds"],
        storage_units=NUM_STORAGE_UNITS,
        tq_num_threads=simple_storage.TQ_NUM_THREADS,  # as the storage units got it
        repeats=repeats,
        seconds_worst=round(max(p["seconds"] for p in passes), 4),  # (a row is flat: DESIGN.md's contract)
        warmup_s=round(warmup["seconds"], 4),
        put_s=round(best["put_s"], 4),
        take_s=round(best["take_s"], 4),
        empty_polls=int(best["empty_polls"]),
    )


def main() -> None:
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False)
    try:
        for mode in MODES:
            print(json.dumps(run_transferqueue(mode, repeats=3)), flush=True)
    finally:
        if started_ray:
            ray.shutdown()


if __name__ == "__main__":
    main()
