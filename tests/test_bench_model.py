"""`asyncflow bench model`: its rows on a small model (each phase's keys and what they must hold), the
FLOP count against a hand count, and bad `--set` values answered in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from asyncflow.bench.model_flops import Shape, train_flops


def test_a_train_steps_useful_flops_are_counted_as_by_hand() -> None:
    shape = Shape(hidden=4, layers=2, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10)
    # per token per layer: q 4x4, k and v 4x2 each, o 4x4, gate and up 4x8 each, down 8x4: 144 weights
    layers = 2 * 144 * 2 * 3  # 2 FLOPs a weight, 2 layers, forward + backward
    head = 2 * 4 * 10 * 3  # the head on a trained token
    # attention: QK^T and AV, 2 heads of 2, causal pairs of a 3-token sequence: 6
    attention = 2 * 2 * 2 * 2 * 6 * 2 * 3
    assert train_flops(shape, [3], trained_tokens=2) == 3 * layers + 2 * head + attention
    config = SimpleNamespace(hidden_size=4, num_hidden_layers=2, intermediate_size=8, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=10, head_dim=None)
    assert Shape.of(config) == shape


def test_the_model_workload_measures_generation_training_and_sync(serve_dir: Path) -> None:
    from asyncflow.bench.model import run_model

    sets = [f"model.path={serve_dir}", "dtypes=float32", "prompts=2", "n=2", "max_new_tokens=4", "batch_size=4",
            "micro_batch_size=2", "repeats=1", "threads=1"]
    reported: list[dict[str, Any]] = []
    rows = run_model(sets, report=reported.append)
    assert rows == reported and [(r["phase"], r["engine"]) for r in rows] == [
        ("generate", "hf"), ("train", "torch"), ("sync", "full"), ("sync", "lora")]
    gen, train, full, lora = rows
    assert gen["requests"] == 4 and gen["tokens"] >= 4 and gen["tokens_per_s"] > 0 < gen["baseline_tokens_per_s"]
    assert train["samples"] == 4 and train["mfu"] > 0 and train["flops_per_s"] > 0 and train["peak_rss_bytes"] > 0
    assert 0 < lora["bytes"] < full["bytes"] and full["bound_s"] > 0


@pytest.mark.parametrize(("setting", "needle"), [
    ("colour=red", "--set: expected one of"),
    ("dtypes=float16", "--set dtypes: unknown ['float16']"),
    ("prompts=0", "--set prompts: must be > 0"),
    ("n=two", "--set n: expected a number"),
])
def test_bad_bench_model_values_are_one_line_naming_the_key(setting: str, needle: str, one_line_error: Any,
                                                             serve_dir: Path) -> None:
    err = one_line_error(["bench", "model", "--set", f"model.path={serve_dir}", "--set", setting])
    assert f"bench model {needle}" in err


def test_bench_model_needs_a_model_folder(one_line_error: Any) -> None:
    assert "--set model.path=DIR is required" in one_line_error(["bench", "model"])
    assert "model.path: /no/such/model does not exist" in one_line_error(["bench", "model", "--set",
                                                                          "model.path=/no/such/model"])
