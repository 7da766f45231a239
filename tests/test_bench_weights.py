"""`asyncflow bench weights`: a row per path x engine count x mode with the contract's fields, the
bytes of the model's shape, and every engine holding the trainer's weights after each publication
(the workload checks that itself and fails otherwise); bad `--set` values are one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch

FIELDS = {"path", "engines", "mode", "params", "bytes", "seconds", "GB_per_s", "bound_s", "ratio_to_bound"}


@pytest.mark.ray
def test_every_path_delivers_the_trainers_weights_to_every_engine(ray_session) -> None:
    from asyncflow.bench.weights import PATHS, run_weights
    from asyncflow.bench.weights_actors import build_model

    rows = run_weights(["shapes=tiny", "engines=1,2", "modes=drain,swap,abort"])
    assert [(r["path"], r["engines"], r["mode"]) for r in rows] == [
        (p, n, m) for p in PATHS for n in (1, 2) for m in ("drain", "swap", "abort")]
    model = build_model("tiny", torch.bfloat16, initialise=False)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # (the tied embedding once)
    for row in rows:
        assert set(row) >= FIELDS, row
        assert row["params"] == sum(unique.values()) and row["bytes"] == 2 * row["params"]
        assert row["match"] is True and row["seconds"] > 0 and row["bound_s"] > 0
        assert row["ratio_to_bound"] == pytest.approx(row["seconds"] / row["bound_s"], rel=0.05)
    copies = {(r["path"], r["engines"]): r["copies"] for r in rows}
    assert copies[("object_store", 2)] == 4 and copies[("broadcast", 2)] == 5 and copies[("folder", 1)] == 3


@pytest.mark.ray
def test_delta_rows_move_only_the_changed_elements_on_every_path(ray_session) -> None:
    """Each delta row starts with a full publication (`first_s`) and then publishes deltas, which
    every engine applies and holds bit for bit (checked by the workload after each)."""
    from asyncflow.bench.weights import PATHS, run_weights

    rows = run_weights(["shapes=tiny", "engines=1,2", "modes=swap", "sync=delta", "repeats=2"])
    assert [(r["sync"], r["path"], r["engines"]) for r in rows] == [("delta", p, n) for p in PATHS for n in (1, 2)]
    for row in rows:
        assert set(row) >= FIELDS | {"first_s", "changed_frac", "full_bytes"}, row
        # `mark` changes the first element of every tensor: each goes as one index and one value
        assert 0 < row["changed_frac"] < 0.01 and 0 < row["bytes"] < row["full_bytes"] / 100
        assert row["match"] is True and row["first_s"] > 0 and row["runs"] == 2


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("engines=0", "--set engines: must be > 0, got 0"),
        ("engines=two", "--set engines: expected a number, got 'two'"),
        ("paths=nccl", "--set paths: unknown ['nccl']"),
        ("modes=later", "--set modes: unknown ['later']"),
        ("shapes=7b", "--set shapes: unknown ['7b']"),
        ("bucket_mb=-1", "--set bucket_mb: must be > 0"),
        ("sync_dir=/no/such/folder", "--set sync_dir: /no/such/folder is not a folder"),
        ("colour=red", "--set: expected one of"),
        ("sync=half", "--set sync: unknown ['half']"),
        ("model=/no/such/folder", "--set model: /no/such/folder is not a Hugging Face model folder"),
    ],
)
def test_bad_bench_weights_values_are_one_line_naming_the_key(setting: str, needle: str, one_line_error: Any) -> None:
    err = one_line_error(["bench", "weights", "--set", setting])
    assert f"bench weights {needle}" in err


def test_the_bench_trainer_exports_into_its_last_exports_memory_as_the_runtime_trainer_does() -> None:
    from asyncflow.bench.weights_actors import BenchTrainer

    threads = torch.get_num_threads()
    try:
        trainer = BenchTrainer("tiny", "bfloat16", 2**20, 10.0, 1)
    finally:
        torch.set_num_threads(threads)
    trainer.sync("full")
    first = {k: v.data_ptr() for k, v in trainer.engine.export_weights().items()}
    trainer.new_version(2)
    second = trainer.engine.export_weights()
    assert {k: v.data_ptr() for k, v in second.items()} == first
    assert float(second["model.norm.weight"][0]) == float(2 % 7 + 1) / 8
