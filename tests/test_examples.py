"""Every config in examples/ loads, and each runs a few steps (model and sizes shrunk for the test)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from asyncflow.config import load_config, read_yaml
from asyncflow.runner import train

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ALL = sorted(p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*.yaml"))
# real models with vLLM on GPUs, fetched from the Hub: loaded here, never run (no GPU, no network)
NOT_RUN_HERE = {"gsm8k/qwen_gsm8k.yaml", "verl_grpo.yaml"}
FAST = ["train.max_steps=2", "train.batch_size=16", "rollout.n=4", "eval.every=0", "eval.size=8",
        "logging.progress=false"]


def test_every_example_loads(monkeypatch: pytest.MonkeyPatch) -> None:

    find_spec = importlib.util.find_spec  # vLLM counts as installed: only that check is skipped
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a))
    assert {"arith_async.yaml", "arith_sync.yaml", "arith_offpolicy.yaml", "arith_dapo.yaml", "arith_ray.yaml",
            "calc_agent.yaml", "calc_turn_barrier.yaml", "byo/config.yaml", *NOT_RUN_HERE} <= set(ALL)
    for name in ALL:
        extra = ["model.path=/nonexistent"] if name.startswith("byo/") else []
        assert "task" in read_yaml(EXAMPLES / name), f"{name}: name its task (a pack, or null)"
        cfg, _ = load_config(EXAMPLES / name, extra)
        assert cfg.task in ("arith", "calc", "chat_arith", None), name


@pytest.mark.slow
# Ray: tests/test_ray.py; the examples for real models need GPUs and the Hub (they are loaded above)
@pytest.mark.parametrize("name", [n for n in ALL if n != "arith_ray.yaml" and n not in NOT_RUN_HERE])
def test_example_runs(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.chdir(EXAMPLES.parent)  # byo/config.yaml names its data and reward module from the repo root
    # the real model's examples on the real model (prepared once by scripts/test.sh), the others on the
    # quickly prepared task folders
    fixture = "smollm2_dir" if name.startswith("smollm2") else "calc_dir" if name.startswith("calc") else "arith_dir"
    model = request.getfixturevalue(fixture)
    extra = ["train.max_steps=3", "train.mini_batches=1"] if name == "arith_offpolicy.yaml" else []
    if name.startswith("byo/"):
        extra = ["train.batch_size=16"]
    if name.startswith("smollm2"):  # (the task's prompts into this test's cache)
        extra = ["rollout.max_new_tokens=24", f"model.cache_dir={tmp_path / 'cache'}"]
    cfg, _ = load_config(EXAMPLES / name, [*FAST, f"model.path={model}", *extra])
    out = tmp_path / "run"
    summary = train(cfg, out, progress_enabled=False)
    assert summary["samples"] == cfg.train.max_steps * cfg.train.batch_size
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, cfg.train.max_steps + 1))


def test_the_gsm8k_example_reads_hub_ids_and_its_reward_scores_the_last_number() -> None:
    from examples.gsm8k.reward import score

    cfg, _ = load_config(EXAMPLES / "gsm8k" / "qwen_gsm8k.yaml", ["rollout.engine=hf"])
    assert (cfg.model.path, cfg.dataset.path, cfg.dataset.config) == ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k", "main")
    assert (cfg.train.lr_schedule, cfg.train.gradient_checkpointing) == ("cosine", True)
    answers = ["Half of 48 is 24.\n#### 72", "#### 1,000", "#### 5"]
    assert score(["q"] * 3, ["So 48 + 24 = 72.", "It is 1000 in all", "no number"], answers) == [1.0, 1.0, 0.0]
