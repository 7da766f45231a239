"""The base models shipped inside the package load, are the files their manifest hashed, and score
what the manifest says they scored when they were built (so the demo starts from the same accuracy on
every machine). Rebuild them with scripts/build_base_models.py."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from asyncflow.tasks import get_task, tiny

SHIPPED = {"arith": "base_eval_accuracy", "calc": "base_eval_success"}


def _manifest(folder: Path) -> dict:
    return json.loads((folder / tiny.MANIFEST).read_text())


@pytest.mark.parametrize("task", sorted(SHIPPED))
def test_shipped_folder_matches_its_manifest(task: str) -> None:
    folder = get_task(task).shipped(0)
    assert folder is not None and folder.parent == tiny.SHIPPED_DIR
    meta = _manifest(folder)
    assert meta["task"] == task and meta["seed"] == 0
    assert meta["version"] == importlib.import_module(f"asyncflow.tasks.{task}").VERSION
    assert tiny.file_hashes(folder) == meta["files"]  # every file, none missing or added
    assert {"model.safetensors", "config.json", "tokenizer.json", "train.jsonl", "eval.jsonl"} <= set(meta["files"])


@pytest.mark.parametrize("task", sorted(SHIPPED))
def test_shipped_model_scores_what_its_manifest_says(task: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    module = importlib.import_module(f"asyncflow.tasks.{task}")
    folder = module.shipped(0)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in (folder / "eval.jsonl").read_text().splitlines()]
    with tiny.torch_threads(2):
        score = (module.eval_accuracy(model, tok, rows) if task == "arith"
                 else module.episode_success(model, tok, rows)["success"])
    # within a point: another CPU's float sums may flip a near-tie argmax on a few prompts
    assert score == pytest.approx(_manifest(folder)[SHIPPED[task]], abs=0.01)


def test_other_seeds_are_not_shipped_and_prepare_into_the_cache(tmp_path: Path) -> None:
    from asyncflow.tasks import arith

    assert arith.shipped(1) is None
    assert arith.cached_prepare(tmp_path, seed=0) == arith.shipped(0)  # the cache is not touched
    assert not any(tmp_path.iterdir())
    built = arith.cached_prepare(tmp_path, seed=1, sft_steps=3)
    assert built.parent == tmp_path and _manifest(built)["files"] == tiny.file_hashes(built)
