"""WEIGHTS: one policy publication from the trainer to 1, 2 and 4 rollout engines, per sync path and
weight-update mode, against this machine's memory-bandwidth bound measured in the same run.

Paths (each the runtime's own code, `weights_actors`):

- `object_store` (`runtime.weight_sync: object_store`): the trainer actor's `export_weights` result
  is stored once; every rollout actor's `load_weights` takes it from the object store.
- `broadcast` (`runtime.weight_sync: collective`, gloo): the trainer's `send_weights` streams buckets
  over the weight group; every rollout actor's `receive_weights` takes them.
- `folder` (server engines, `rollout.engine: openai`): the version is written once as a safetensors
  folder (`WeightFolderWriter`); every engine loads it as `asyncflow serve`'s admin route does.

`bound_s` = the seconds one memory copy of `bytes` takes here (a `copy_` between two 256 MiB
buffers, best of 3, one thread, scaled to `bytes`) x the copies the path must make at the least (`copies`). Every
path starts with the trainer's export: its float32 master weights cast into the published dtype, a
snapshot it needs because it trains on while engines load (object store, folder) or because a member
that misses a broadcast loads it later. Then:

- object_store: 2 + N — the export; into the shared store (Ray has no way to write a new object in
  place, so the export and the store are two copies); out of it into each engine's parameters.
- broadcast: 1 + 2N — the export; per receiver a socket write and read (gloo over loopback TCP: two
  kernel copies), the read landing in the engine's parameters (tensors under 1 MiB are packed into
  buckets and unpacked: ~1% of the bytes, not counted).
- folder: 2 + N — the export; written into the page cache; read out of it into each engine's
  parameters.

`trainer_s`: how long the trainer was busy with the publication (the export and what follows it on
the trainer: the store, the whole broadcast, the folder write). `GB_per_s`: bytes delivered to all
engines per second.

The update mode decides *when* an engine loads relative to its running requests (swap between two
decode steps, drain after they finish, abort after evicting them); with no request running the bytes
take the same way in every mode, so its rows measure that same path (`note`).
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncflow.bench.options import names, positive, read_sets
from asyncflow.errors import UserError

PATHS = ("object_store", "broadcast", "folder")
MODES = ("drain", "swap", "abort")
SYNCS = ("full", "delta")
_KNOWN = ("shapes", "engines", "paths", "modes", "bucket_mb", "repeats", "timeout_s", "sync_dir", "sync", "model", "lr")
MODE_NOTE = "same byte path in every mode (idle engines)"


def copies(path: str, engines: int) -> int:
    """The memory copies of the whole state `path` must make at the least (module docstring)."""
    return {"object_store": 2 + engines, "broadcast": 1 + 2 * engines, "folder": 2 + engines}[path]


def delta_copies(path: str, engines: int, share: float) -> float:
    """A delta publication's copies of the whole state, at the least: the export and its comparison
    with the last published copy (a pass that reads both: counted as one copy), then the path's
    copies of the delta's bytes (`share` of the whole)."""
    return 2 + copies(path, engines) * share


PROBE_BYTES = 256 * 2**20  # far beyond any cache: the copy time per byte is the memory's


def copy_seconds(nbytes: int, repeats: int = 3) -> float:
    """Seconds for one `copy_` of `nbytes` between two buffers on one thread (best of `repeats`),
    measured on at most `PROBE_BYTES` and scaled (so the bench itself never holds two more copies
    of a large model)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    size = min(nbytes, PROBE_BYTES)
    try:
        src = torch.ones(size, dtype=torch.uint8)
        dst = torch.zeros(size, dtype=torch.uint8)  # (zeros: its pages are touched before the clock starts)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return best * nbytes / size
    finally:
        torch.set_num_threads(threads)


def run_weights(overrides: list[str], report: Any = None) -> list[dict[str, Any]]:
    """Rows per shape (or model) x sync x path x engine count x mode: each row's first publication,
    and the median of `repeats` publications after it (the steady state)."""
    opts = parse(overrides)
    rows: list[dict[str, Any]] = []
    from asyncflow.runtime.ray_init import ensure_ray

    ensure_ray(None)
    for shape in opts["shapes"]:
        with Bench(shape, opts) as bench:
            for sync in opts["sync"]:
                for path in opts["paths"]:
                    for n in opts["engines"]:
                        for mode in opts["modes"]:
                            row = bench.row(sync, path, n, mode)
                            rows.append(row)
                            if report is not None:
                                report(row)
    return rows


class Bench:
    """One shape's trainer and engines (the largest engine count; smaller counts use the first ones)."""

    def __init__(self, shape: str, opts: dict[str, Any]) -> None:
        import ray

        from asyncflow.bench.weights_actors import BenchRollout, BenchTrainer

        self.shape, self.opts = shape, opts
        bucket = int(opts["bucket_mb"] * 2**20)
        self.timeout_s = float(opts["timeout_s"])
        args = (shape, "bfloat16", bucket, self.timeout_s, 1, opts["model"], opts["lr"])
        trainer_cls: Any = ray.remote(BenchTrainer)
        rollout_cls: Any = ray.remote(BenchRollout)
        self.trainer = trainer_cls.options(num_cpus=0).remote(*args)
        self.engines = [rollout_cls.options(num_cpus=0).remote(i, *args) for i in range(max(opts["engines"]))]
        self.params, self.bytes = self._get(self.trainer.params.remote(), "the trainer to start")
        self._get([e.stats.remote() for e in self.engines], "the rollout engines to start")
        self.copy_s = copy_seconds(self.bytes)
        self.version = 0
        self.group: int | None = None  # the engine count the weight group was built for
        self.epoch = 0
        self.tmp = tempfile.TemporaryDirectory(prefix="asyncflow-weights-", dir=opts["sync_dir"])
        self.model_dir = Path(self.tmp.name) / "model"
        self.model_dir.mkdir()
        if opts["model"] is not None:  # (the served folder's config files: the model's own)
            for f in Path(opts["model"]).iterdir():
                if f.suffix in (".json", ".txt") and f.is_file():
                    (self.model_dir / f.name).write_bytes(f.read_bytes())
        else:
            (self.model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2", "shape": shape}))
        self.session = secrets.token_hex(4)

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: Any) -> None:
        import ray

        for actor in [self.trainer, *self.engines]:
            ray.kill(actor)
        self.tmp.cleanup()

    def _get(self, refs: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"bench weights: timed out after {self.timeout_s:.0f} s waiting for {what}") from None

    def row(self, sync: str, path: str, n: int, mode: str) -> dict[str, Any]:
        """Publish 1 + `repeats` versions over `path` to the first `n` engines: the first one's
        seconds (`first_s`; a delta row's first publication is full: it starts the delta stream),
        and the median of the others (`seconds`, the steady state; `bytes` and `changed_frac` theirs)."""
        import statistics

        self._get(self.trainer.sync.remote(sync), "the trainer to switch its publications")
        first = self.publish(path, n, mode)
        runs = [self.publish(path, n, mode) for _ in range(self.opts["repeats"])]
        seconds = statistics.median(r[0] for r in runs)
        trainer_s = statistics.median(r[1] for r in runs)
        sent = [r[2] for r in runs]
        nbytes = int(statistics.median(b for b, _ in sent)) if sync == "delta" else self.bytes
        bound = self.copy_s * (copies(path, n) if sync == "full" else delta_copies(path, n, nbytes / self.bytes))
        row = {"shape": self.shape, "sync": sync, "path": path, "engines": n, "mode": mode, "params": self.params,
               "bytes": nbytes, "full_bytes": self.bytes,
               "changed_frac": float(f"{statistics.median(c for _, c in sent):.4g}") if sync == "delta" else None,
               "first_s": round(first[0], 4), "seconds": round(seconds, 4), "runs": len(runs),
               "GB_per_s": round(nbytes * n / seconds / 1e9, 3), "trainer_s": round(trainer_s, 4),
               "copies": copies(path, n), "copy_GB_per_s": round(self.bytes / self.copy_s / 1e9, 2),
               "bound_s": float(f"{bound:.4g}"), "ratio_to_bound": round(seconds / bound, 2),
               "first_ratio_to_bound": round(first[0] / (self.copy_s * copies(path, n)), 2),
               "versions_by": "train steps" if self.opts["model"] is not None else "mark",
               "match": True, "note": MODE_NOTE, **({"sync_dir": self.opts["sync_dir"]} if path == "folder" else {})}
        return row

    def publish(self, path: str, n: int, mode: str) -> tuple[float, float, tuple[Any, Any]]:
        """One version to the first `n` engines; (seconds until all loaded it, seconds the trainer was
        busy, (bytes, changed share) of a delta). Every engine's weights are checked against the
        trainer's afterwards."""
        import ray

        self.version += 1
        version = self.version
        expected = self._get(self.trainer.new_version.remote(version), "the trainer to change its weights")
        engines = self.engines[:n]
        if path == "broadcast" and self.group != n:
            self._join(n)
        t0 = time.perf_counter()
        if path == "object_store":
            ref = self.trainer.export_weights.remote()
            loads = [e.load_weights.remote(ref, version, mode) for e in engines]
            trainer_ref = ref
        elif path == "broadcast":
            trainer_ref = self.trainer.send_weights.remote(version)
            loads = [e.receive_weights.remote(version, mode) for e in engines]
        else:
            trainer_ref = self.trainer.write_folder.remote(str(Path(self.tmp.name) / "sync"), str(self.model_dir),
                                                           version, self.session)
            folder = self._get(trainer_ref, f"the trainer to write version {version}")
            loads = [e.load_folder.remote(folder, version, mode) for e in engines]
        ray.wait([trainer_ref], timeout=self.timeout_s)
        trainer_s = time.perf_counter() - t0
        # (the object-store path's trainer reference is the state itself: not fetched into this process)
        self._get([*loads, *([] if path == "object_store" else [trainer_ref])], f"version {version} to load over {path} into {n} engines")
        seconds = time.perf_counter() - t0
        got = self._get([e.digest.remote() for e in engines], "the engines' weights")
        if any(abs(g - expected) > 1e-6 * max(1.0, abs(expected)) for g in got):
            raise RuntimeError(f"bench weights: after {path} ({mode}) the engines hold {got}, the trainer {expected}")
        return seconds, trainer_s, self._get(self.trainer.last_publication.remote(), "the publication's size")

    def _join(self, n: int) -> None:
        """A weight group of the trainer and the first `n` engines (as `WeightChannel` builds it)."""
        self.epoch += 1
        host, port = self._get(self.trainer.weights_address.remote(), "the trainer's address")
        refs = [self.trainer.join_weights.remote(host, port, 0, n + 1, self.epoch, "gloo")]
        refs += [e.join_weights.remote(host, port, k + 1, n + 1, self.epoch, "gloo") for k, e in enumerate(self.engines[:n])]
        self._get(refs, f"weight group {self.epoch} to form")
        self.group = n


def parse(overrides: list[str]) -> dict[str, Any]:
    """`--set key=value` items; a bad one is a one-line `UserError` naming the key."""
    raw = read_sets("weights", overrides, _KNOWN)
    from asyncflow.bench.weights_actors import SHAPES

    model = raw.get("model")
    if model is not None and not (Path(model) / "config.json").is_file():
        raise UserError(f"bench weights --set model: {model} is not a Hugging Face model folder (no config.json)")
    return {
        "shapes": [f"model:{Path(model).name}"] if model is not None else names("weights", raw, "shapes", "0.5b", tuple(SHAPES)),
        "model": None if model is None else str(Path(model).resolve()),
        "sync": names("weights", raw, "sync", "full", SYNCS),
        "lr": positive("weights", "lr", raw.get("lr", "1e-5"), float),
        "paths": names("weights", raw, "paths", ",".join(PATHS), PATHS),
        "modes": names("weights", raw, "modes", ",".join(MODES), MODES),
        "engines": [positive("weights", "engines", v, int) for v in raw.get("engines", "1,2,4").split(",")],
        "bucket_mb": positive("weights", "bucket_mb", raw.get("bucket_mb", "256"), float),
        "repeats": positive("weights", "repeats", raw.get("repeats", "3"), int),
        "timeout_s": positive("weights", "timeout_s", raw.get("timeout_s", "600"), float),
        "sync_dir": _folder(raw.get("sync_dir")),
    }


def _folder(value: str | None) -> str:
    """Where the folder path writes: a memory file system where there is one (`/dev/shm`: same-node
    servers read it from memory), else the system's temporary folder."""
    if value is not None:
        if not Path(value).is_dir():
            raise UserError(f"bench weights --set sync_dir: {value} is not a folder")
        return value
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else tempfile.gettempdir()
