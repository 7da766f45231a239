"""Tests for the built-in `arith` task pack: splits, verifier, tokenizer and the prepared folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncflow.tasks import TASK_NAMES, arith, get_task


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared folder with a few SFT steps only (the real warm start is too slow for a unit test)."""
    return arith.cached_prepare(tmp_path_factory.mktemp("cache"), seed=3, sft_steps=5)


def test_splits_are_disjoint_deterministic_and_large_enough() -> None:
    train, evals = arith.make_splits(0)
    assert len(evals) >= 1000
    assert len(train) >= 10_000
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    assert len({r["prompt"] for r in evals}) == len(evals)
    assert (train, evals) == arith.make_splits(0)
    assert evals != arith.make_splits(1)[1]
    assert {r["level"] for r in evals} == {2, 3}
    assert {r["level"] for r in train} == {1, 2, 3}


def test_split_answers_are_correct() -> None:
    train, evals = arith.make_splits(0)
    for r in train[:500] + evals:
        expr = r["prompt"].removesuffix("=")
        assert str(eval(expr)) == r["answer"]  # noqa: S307 - digits and one operator only
        assert int(r["answer"]) >= 0


def test_score_is_exact_match_after_strip() -> None:
    assert arith.score(" 68\n", "68") == 1.0
    assert arith.score("68 ", " 68") == 1.0
    assert arith.score("6 8", "68") == 0.0
    assert arith.score("680", "68") == 0.0
    assert arith.score("", "68") == 0.0


def test_reward_fn_takes_trl_signature() -> None:
    rewards = arith.reward_fn(
        prompts=["2+3=", "9-4="], completions=["5", "4"], answer=["5", "5"], level=[1, 3]
    )
    assert rewards == [1.0, 0.0]
    # with the ids (as asyncflow and TRL pass them): paid only for an answer that ends with the EOS and
    # holds no other special token (decoding drops them: "12" + pad never stopped; "1<pad>2" read "12")
    tok = arith.make_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    twelve = tok("12")["input_ids"]
    ids = [twelve + [eos], twelve + [pad, pad], [twelve[0], pad, twelve[1], eos], twelve]
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    assert texts == ["12"] * 4
    assert arith.reward_fn(prompts=["7+5="] * 4, completions=texts, answer=["12"] * 4,
                           completion_ids=ids) == [1.0, 0.0, 0.0, 0.0]


def test_tokenizer_encodes_chars_without_extra_tokens_and_round_trips() -> None:
    tok = arith.make_tokenizer()
    ids = tok("23+45=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == list("23+45=")
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id not in ids
    text = "12 - 3 = 9"
    assert tok.decode(tok(text)["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == text


def test_prepared_folder_loads_with_auto_classes(prepared: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepared)
    ids = tok("23+45=")["input_ids"]
    assert ids == arith.make_tokenizer()("23+45=")["input_ids"]
    assert len(ids) == 6
    assert tok.decode(tok("7 + 8")["input_ids"], skip_special_tokens=True) == "7 + 8"
    model = AutoModelForCausalLM.from_pretrained(prepared)
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 6, len(tok)) == (1, 6, model.config.vocab_size)


def test_prepared_folder_holds_data_and_metadata(prepared: Path) -> None:
    for name, minimum in (("train.jsonl", 10_000), ("eval.jsonl", 1000)):
        rows = [json.loads(line) for line in (prepared / name).read_text().splitlines()]
        assert len(rows) >= minimum
        assert {"prompt", "answer", "level"} <= rows[0].keys()
    meta = json.loads((prepared / "asyncflow_task.json").read_text())
    assert meta["task"] == "arith" and meta["seed"] == 3 and meta["version"] == arith.VERSION
    assert 0.0 <= meta["base_eval_accuracy"] <= 1.0
    assert not [p for p in prepared.parent.iterdir() if p.name.startswith(".")]


def test_cached_prepare_reuses_a_complete_folder(prepared: Path) -> None:
    mtime = (prepared / "model.safetensors").stat().st_mtime_ns
    again = arith.cached_prepare(prepared.parent, seed=3, sft_steps=5)
    assert again == prepared
    # a short warm start has its own name: it was served to runs expecting the 900-step base model
    assert prepared.name == f"arith-v{arith.VERSION}-seed3-sft5"
    assert json.loads((prepared / "asyncflow_task.json").read_text())["sft_steps"] == 5
    assert (prepared / "model.safetensors").stat().st_mtime_ns == mtime


def test_cached_prepare_uses_env_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ASYNCFLOW_CACHE", str(tmp_path))
    assert arith.default_cache_dir() == tmp_path


def test_get_task_returns_pack_and_rejects_unknown_names() -> None:
    assert "arith" in TASK_NAMES
    task = get_task("arith")
    assert task.name == "arith"
    assert task.reward_fn_path == "asyncflow.tasks.arith:reward_fn"
    assert task.defaults["reward"]["fn"] == task.reward_fn_path
    assert task.defaults["train"]["batch_size"] % task.defaults["rollout"]["n"] == 0
    with pytest.raises(KeyError, match="arith"):
        get_task("nope")


def test_importing_tasks_does_not_import_torch() -> None:
    code = "import sys, asyncflow.tasks; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_trailing_dot_share_is_honoured_and_does_not_change_the_data_order(monkeypatch) -> None:
    import random

    tok = arith.make_tokenizer()
    rows = [{"prompt": "12+3=", "answer": "15", "level": 2}] * 400
    rng_off, rng_on = random.Random(0), random.Random(0)
    plain, _ = arith._sft_batch(rows, tok, rng_off)
    monkeypatch.setattr(arith, "SFT_TRAILING_DOT", 0.5)
    ids, labels = arith._sft_batch(rows, tok, rng_on)
    assert rng_off.random() == rng_on.random()  # same number of draws either way
    dot = tok(".")["input_ids"][0]
    assert not (plain == dot).any()
    share = float((ids == dot).any(dim=1).float().mean())
    assert 0.4 < share < 0.6
    # labels score exactly the answer (with or without the dot) and the EOS
    assert int((labels[0] != -100).sum()) in (3, 4)


def test_a_task_folder_written_through_a_symbolic_link_keeps_the_link(tmp_path: Path) -> None:
    """`prepare --out LINK` (a link to a folder) failed after the whole warm start: rmtree refuses a
    link. The folder it points to is built now, and the link stays."""
    from asyncflow.tasks.tiny import write_task_folder

    class _Saves:  # stands in for the model and tokenizer: each writes one file
        def __init__(self, name: str) -> None:
            self.name = name

        def save_pretrained(self, path: Path, **kw: object) -> None:
            (Path(path) / self.name).write_text("x")

    real = tmp_path / "real"
    real.mkdir()
    (real / "old.txt").write_text("replaced")
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    row = {"prompt": "1+1=", "answer": "2"}
    write_task_folder(link, _Saves("model.bin"), _Saves("tok.json"), [row], [row], {"task": "t"})
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["asyncflow_task.json", "eval.jsonl", "model.bin",
                                                      "tok.json", "train.jsonl"]
