"""Every config in examples/ loads, and each runs a few steps (model and sizes shrunk for the test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from asyncflow.config import load_config
from asyncflow.runner import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ALL = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))
FAST = ["train.max_steps=2", "train.batch_size=16", "rollout.n=4", "eval.every=0", "eval.size=8",
        "logging.progress=false"]


def test_every_example_loads() -> None:
    assert {"arith_async.yaml", "arith_sync.yaml", "arith_offpolicy.yaml", "arith_dapo.yaml", "arith_ray.yaml",
            "calc_agent.yaml", "calc_turn_barrier.yaml", "byo/config.yaml"} <= set(ALL)
    for name in ALL:
        extra = ["model.path=/nonexistent"] if name.startswith("byo/") else []
        if name == "verl_grpo.yaml" and importlib.util.find_spec("vllm") is None:
            extra = ["rollout.engine=hf"]  # (its engine is checked to be installed)
        cfg, _ = load_config(EXAMPLES / name, extra)
        assert cfg.task in ("arith", "calc", None), name


@pytest.mark.slow
# Ray: tests/test_ray.py; verl_grpo.yaml needs 8 GPUs, Qwen2-7B and GSM8K (tests/test_cli_config.py loads it)
@pytest.mark.parametrize("name", [n for n in ALL if n not in ("arith_ray.yaml", "verl_grpo.yaml")])
def test_example_runs(
    name: str, arith_dir: Path, calc_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(EXAMPLES.parent)  # byo/config.yaml names its data and reward module from the repo root
    model = calc_dir if name.startswith("calc") else arith_dir
    extra = ["train.max_steps=3", "train.mini_batches=1"] if name == "arith_offpolicy.yaml" else []
    if name.startswith("byo/"):
        extra = ["train.batch_size=16"]
    cfg, _ = load_config(EXAMPLES / name, [*FAST, f"model.path={model}", *extra])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == cfg.train.max_steps * cfg.train.batch_size
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, cfg.train.max_steps + 1))
