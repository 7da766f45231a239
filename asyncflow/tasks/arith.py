"""The built-in `arith` task pack: verifiable arithmetic prompts and a tiny warm-started base model.

Why it exists: the demo, the tests and the E2E benchmark need an RL task that runs anywhere in
minutes on two CPU cores, with no hub download. Arithmetic answers are checked exactly, so the
reward is cheap and unambiguous, and a character-level tokenizer keeps the model tiny.

Levels: 1 = one-digit sums, 2 = two-digit plus one-digit, 3 = two-digit plus two-digit. The eval
split is 700 level-2 and 300 level-3 prompts, disjoint from train.

The base model is a small Qwen2 (hidden 192, 2 layers) given a supervised warm start of 900 steps.
This model learns two-digit addition in a sharp transition, and for seed 0 the 900th step lands
inside it (measured on 400 eval prompts: step 750 greedy 10% / pass@8 at T=1 54%; step 900 31% /
74%; step 1,050 48% / 85%): greedy accuracy is still low while sampling often finds the answer —
the headroom GRPO turns into greedy accuracy within the demo. Where the transition falls depends
on the data order: a variant that drew its batches differently reached it only at ~1,700 steps, and
a model stopped before it (8% greedy) does not improve under RL in the demo's budget (both measured).
So other seeds may need more warm-start steps. Prepare: ~1.5 min on 2 cores.

The warm start can also write a share of answers with a trailing "." (`SFT_TRAILING_DOT`), which
the exact-match verifier rejects; it is off, because measured it only lowered the base model's
pass@8. Its per-row coin is drawn either way, so the data order (and the seed-0 model) does not
depend on the share.

Everything is deterministic given the seed. `prepare` builds the folder in a sibling temp dir and
renames it into place, so a half-written folder is never mistaken for a finished one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from asyncflow.tasks import TaskPack, tiny

VERSION = 3
EVAL_PER_LEVEL = {2: 700, 3: 300}
TRAIN_SIZE = 20_000
TRAIN_LEVEL_WEIGHTS = {1: 0.05, 2: 0.45, 3: 0.50}
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
CHARS = "0123456789+-*= ?.abcdefghijklmnopqrstuvwxyz"
MAX_POSITIONS = 32

Row = dict[str, Any]
Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------


def _level_pool(level: int) -> list[tuple[str, str]]:
    """Every distinct (prompt, answer) of one difficulty level, in a fixed order."""
    if level == 1:  # one-digit plus one-digit
        return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]
    if level == 2:  # two-digit plus one-digit, either order
        return [(f"{a}+{b}=", str(a + b)) for a in range(10, 100) for b in range(10)] + [
            (f"{b}+{a}=", str(a + b)) for a in range(10, 100) for b in range(10)
        ]
    if level == 3:  # two-digit plus two-digit
        return [(f"{a}+{b}=", str(a + b)) for a in range(10, 100) for b in range(10, 100)]
    raise ValueError(f"unknown arith level {level}; levels are 1-3")


def make_splits(seed: int = 0) -> tuple[list[Row], list[Row]]:
    """Train and eval rows `{"prompt", "answer", "level"}`; disjoint by prompt, deterministic.

    Eval holds 1000 distinct prompts; train holds `TRAIN_SIZE` rows drawn from the rest of each
    level's pool by `TRAIN_LEVEL_WEIGHTS` (a level's pool is cycled when it runs out, so the small
    levels repeat).
    """
    rng = random.Random(seed)
    train: list[Row] = []
    evals: list[Row] = []
    for level in TRAIN_LEVEL_WEIGHTS:
        n_eval = EVAL_PER_LEVEL.get(level, 0)
        pool = _level_pool(level)
        rng.shuffle(pool)
        evals += [{"prompt": p, "answer": a, "level": level} for p, a in pool[:n_eval]]
        rest = pool[n_eval:]
        n_train = round(TRAIN_SIZE * TRAIN_LEVEL_WEIGHTS[level])
        train += [
            {"prompt": p, "answer": a, "level": level}
            for p, a in (rest[i % len(rest)] for i in range(n_train))
        ]
    rng.shuffle(train)
    rng.shuffle(evals)
    return train, evals


# ---------------------------------------------------------------------------------------------------
# Verifier
# ---------------------------------------------------------------------------------------------------


def score(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer after stripping whitespace, else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


def finished_cleanly(ids: Sequence[int]) -> bool:
    """The completion ends with the EOS and holds no other special token. Completions are decoded
    without special tokens, so "12" + padding up to `rollout.max_new_tokens` (no EOS: the model never
    stopped) or "1<pad>2" read as the answer "12" and were paid."""
    eos = SPECIALS.index("<eos>")
    return bool(ids) and ids[-1] == eos and all(i >= len(SPECIALS) for i in ids[:-1])


def reward_fn(prompts: list[str], completions: list[str], answer: list[str],
              completion_ids: list[list[int]] | None = None, **kwargs: Any) -> list[float]:
    """TRL-signature reward: exact-match score of each completion against its `answer` column; a
    completion that did not end with the EOS, or holds another special token, scores 0."""
    del prompts, kwargs
    ids = completion_ids if completion_ids is not None else [None] * len(completions)
    return [score(c, a) if i is None or finished_cleanly(i) else 0.0
            for c, a, i in zip(completions, answer, ids, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------------


def make_tokenizer() -> Any:
    """The arith char-level tokenizer (`tiny.char_tokenizer` over `CHARS`)."""
    return tiny.char_tokenizer(CHARS, SPECIALS, MAX_POSITIONS)


def make_model(tokenizer: Any, *, seed: int, hidden: int = 192, layers: int = 2) -> Any:
    """A tiny float32 Qwen2 (hidden 192, 2 layers) with tied embeddings, freshly initialised from `seed`."""
    return tiny.tiny_qwen2(
        tokenizer, seed=seed, hidden=hidden, layers=layers, max_positions=MAX_POSITIONS, max_new_tokens=6
    )


# ---------------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------------


def _sft_batch(rows: list[Row], tokenizer: Any, rng: random.Random | None = None) -> tuple[Any, Any]:
    """Right-padded `prompt+answer+EOS` ids and labels that score only the answer and the EOS.

    With `rng`, a share `SFT_TRAILING_DOT` of the answers is written the way much scraped text
    writes them, with a trailing "." (off by default; see the module docstring). One coin is drawn
    per row whatever the share, so the share never changes the data order.
    """
    pairs = []
    for r in rows:
        p = tokenizer(r["prompt"])["input_ids"]
        coin = rng.random() if rng is not None else 1.0
        text = r["answer"] + ("." if coin < SFT_TRAILING_DOT else "")
        a = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        pairs.append((p + a, [-100] * len(p) + a))
    return tiny.pad_batch(pairs, tokenizer.pad_token_id)


def warm_start(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    steps: int,
    seed: int,
    batch_size: int = 128,
    lr: float = 3e-3,
    log: Log | None = None,
) -> float:
    """Teacher-forced SFT on `rows` for `steps` AdamW steps; returns the last loss."""
    return tiny.sft(
        model,
        lambda rng: _sft_batch(rng.sample(rows, batch_size), tokenizer, rng),
        steps=steps,
        seed=seed,
        lr=lr,
        name="arith",
        log=log,
    )


def greedy_completions(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int = 6) -> list[str]:
    """Greedy completions, batched by prompt length so no padding is needed; stops at EOS."""
    import torch

    out: dict[int, str] = {}
    by_len: dict[int, list[int]] = {}
    encoded = [tokenizer(p)["input_ids"] for p in prompts]
    for i, e in enumerate(encoded):
        by_len.setdefault(len(e), []).append(i)
    with torch.no_grad():
        for idx in by_len.values():
            ids = torch.tensor([encoded[i] for i in idx])
            new = []
            for _ in range(max_new_tokens):
                nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
                new.append(nxt)
                ids = torch.cat([ids, nxt], dim=1)
            gen = torch.cat(new, dim=1).tolist()
            for i, toks in zip(idx, gen, strict=True):
                if tokenizer.eos_token_id in toks:
                    toks = toks[: toks.index(tokenizer.eos_token_id)]
                out[i] = tokenizer.decode(toks, skip_special_tokens=True)
    return [out[i] for i in range(len(prompts))]


def eval_accuracy(model: Any, tokenizer: Any, rows: list[Row]) -> float:
    """Fraction of `rows` whose greedy completion scores 1.0."""
    comps = greedy_completions(model, tokenizer, [r["prompt"] for r in rows])
    return sum(score(c, r["answer"]) for c, r in zip(comps, rows, strict=True)) / max(1, len(rows))


# ---------------------------------------------------------------------------------------------------
# Prepare
# ---------------------------------------------------------------------------------------------------

SFT_STEPS = 900
SFT_TRAILING_DOT = 0.0  # off: measured to hurt RL headroom; kept as a knob


def prepare(
    out_dir: str | Path,
    *,
    seed: int = 0,
    log: Log | None = None,
    sft_steps: int = SFT_STEPS,
) -> Path:
    """Write the HF model folder plus `train.jsonl`, `eval.jsonl` and `asyncflow_task.json` to `out_dir`.

    The folder is built next to `out_dir` and renamed into place; an existing `out_dir` is replaced.
    `sft_steps` shortens the warm start (tests use a handful of steps).
    """
    start = time.monotonic()
    with tiny.torch_threads(2):
        train, evals = make_splits(seed)
        tokenizer = make_tokenizer()
        model = make_model(tokenizer, seed=seed)
        warm_start(model, tokenizer, train, steps=sft_steps, seed=seed, log=log)
        acc = eval_accuracy(model, tokenizer, evals)
    if log is not None:
        log(f"arith: greedy eval accuracy {acc:.3f} after {time.monotonic() - start:.1f}s")
    meta = {"task": "arith", "seed": seed, "version": VERSION, "sft_steps": sft_steps, "base_eval_accuracy": round(acc, 4)}
    return tiny.write_task_folder(Path(out_dir), model, tokenizer, train, evals, meta)


default_cache_dir = tiny.default_cache_dir


def folder_name(seed: int, sft_steps: int = SFT_STEPS) -> str:
    """This pack's prepared folder name (`tiny.folder_name`)."""
    return tiny.folder_name("arith", VERSION, seed, sft_steps, SFT_STEPS)


def shipped(seed: int) -> Path | None:
    """The base model for `seed` shipped inside the package (seed 0), or None."""
    return tiny.shipped(folder_name(seed))


def cached_prepare(
    cache_dir: str | Path | None = None,
    *,
    seed: int = 0,
    log: Log | None = None,
    sft_steps: int = SFT_STEPS,
) -> Path:
    """The prepared folder `folder_name(seed, sft_steps)`: shipped inside the package, else in the
    cache, built there only when not already complete."""
    return tiny.cached(cache_dir, folder_name(seed, sft_steps),
                       lambda out: prepare(out, seed=seed, log=log, sft_steps=sft_steps))


DEFAULTS: dict[str, Any] = {
    "rollout": {"n": 8, "max_new_tokens": 6, "temperature": 1.0},
    # Measured: lr 2e-4 x 600 steps of 16 prompts x 8 gave +30 points; 4e-4 was
    # unstable (+24) and 1e-3 collapses this model.
    "train": {"batch_size": 128, "mini_batches": 1, "lr": 2e-4, "max_steps": 600, "max_grad_norm": 1.0},
    "eval": {"every": 50, "size": 1000, "success_threshold": 1.0},
    "reward": {"fn": "asyncflow.tasks.arith:reward_fn"},
    "dataset": {"prompt_key": "prompt", "label_key": "answer"},
}

TASK = TaskPack(
    name="arith",
    prepare=cached_prepare,
    shipped=shipped,
    defaults=DEFAULTS,
    reward_fn_path="asyncflow.tasks.arith:reward_fn",
    description="Verifiable arithmetic (one- and two-digit sums) with a tiny warm-started Qwen2.",
)
