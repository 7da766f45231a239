"""The built-in `calc` task pack: multi-turn tool use (a calculator) with a tiny warm-started model.

Why it exists: `arith` exercises single-turn RL; `calc` exercises multi-turn episodes (LLM turn,
environment step, next turn, with environment tokens masked out of the loss) on a model that builds
and trains in minutes on two CPU cores, with no hub download. It runs with `rollout.env: calculator`
(`asyncflow.envs.builtin.CalculatorEnv`).

Problems are products with a four-digit value and a six-char prompt: level 1 a three-digit number
times a digit (`347*6=`), level 2 two-digit times two-digit (`37*48=`). A two-layer character-level
model cannot compute them; it solves them by copying the expression into a tool call and the tool's
result into its answer. One episode's token stream, exactly as `workflow/episode.py::run_episode`
builds it (a turn ends with the EOS the model generated; environment text is tokenized without
special tokens and masked out of the loss):

    37*48=                     prompt (the dataset row's `prompt`)
    <calc>37*48</calc><eos>    turn 1, generated
    <result>1776</result>      observation (environment tokens)
    <answer>1776</answer><eos> turn 2, generated; the episode ends, reward 1.0 if 1776 == `answer`

Where the RL headroom comes from: the warm start (SFT on whole transcripts, loss on generated tokens
only) imitates a teacher that answers "easy-looking" level-1 products from memory
(`<answer>2082</answer>` right after `347*6=`) in `SFT_DIRECT_SHARE[1]` = 90% of its level-1
transcripts, and always uses the tool on level 2. The student cannot learn those products, so its direct answers are wrong: greedy, it
answers level 1 directly and fails, and solves level 2 with the tool: 49.6% episode success on the
eval split for seed 0. Sampled at T=1 it calls the tool on 8% of level-1 episodes, and those succeed
(all prompts have the same length, so the copy it learned on level 2 transfers), which is the
signal GRPO turns into "always use the tool" (49.6% -> 98% in 60 steps). Other seeds land
elsewhere (seed 2: 16%, still ending near 100%); numbers and commands: docs/tasks.md.

Why these shapes (measured while building the pack): with prompts of different lengths (e.g.
`37*48=` and `12*34+56=`) the copy learned on one length did not transfer to the other in a
two-minute warm start, so sampled tool calls on the direct level failed and RL had nothing to
reinforce; with equal lengths but a 60% direct share the model did not yet tell the levels apart and
its greedy choice flipped between "always tool" and "never tool" from checkpoint to checkpoint.

Everything is deterministic given the seed. `prepare` builds the folder in a sibling temp dir and
renames it into place, so a half-written folder is never mistaken for a finished one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import string
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.engines.kv_cache import returned_cache, with_cache
from asyncflow.envs.builtin import CalculatorEnv, same_number
from asyncflow.tasks import TaskPack, tiny

VERSION = 1
EVAL_PER_LEVEL = {1: 250, 2: 250}
TRAIN_SIZE = 20_000
TRAIN_LEVEL_WEIGHTS = {1: 0.5, 2: 0.5}
POOL_SIZES = {1: 6_169, 2: 6_610}  # distinct prompts with a four-digit value
SPECIALS = ("<|pad|>", "<|eos|>", "<|bos|>", "<|unk|>")
# Printable ASCII without "|": every char the calculator environment can answer with (its error
# messages quote the model's text), and the special tokens' names cannot be spelled by the model.
CHARS = string.digits + string.ascii_letters + string.punctuation.replace("|", "") + " "
MAX_POSITIONS = 256  # RoPE: a bound, not learned; a correct episode is under 80 tokens
MAX_TURNS = 3
MAX_NEW_TOKENS = 24  # per turn: `<answer>1776</answer>` + EOS is 22 tokens

SFT_STEPS = 450
SFT_DIRECT_SHARE = {1: 0.9, 2: 0.0}

Row = dict[str, Any]
Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------------------------


def _problem(level: int, rng: random.Random) -> tuple[str, int]:
    """One random (product, value) with a four-digit value and a six-char prompt: level 1 = a
    three-digit number times a digit 2-9, level 2 = two-digit times two-digit."""
    while True:
        if level == 1:
            a, d = rng.randint(100, 999), rng.randint(2, 9)
            expr, value = f"{a}*{d}", a * d
        elif level == 2:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            expr, value = f"{a}*{b}", a * b
        else:
            raise ValueError(f"unknown calc level {level}; levels are 1-2")
        if 1000 <= value <= 9999:
            return expr, value


def make_splits(seed: int = 0) -> tuple[list[Row], list[Row]]:
    """Train and eval rows `{"prompt", "answer", "level"}`; disjoint by prompt, deterministic.

    Eval holds `EVAL_PER_LEVEL` distinct prompts per level; train holds `TRAIN_SIZE` rows drawn by
    `TRAIN_LEVEL_WEIGHTS` from prompts eval does not use (distinct up to 80% of a level's pool, then
    cycled: the pools hold 6,169 and 6,610 prompts). Prompts are `EXPR=`; answers are the values as strings.
    """
    rng = random.Random(seed)
    seen: dict[int, set[str]] = {level: set() for level in POOL_SIZES}

    def draw(level: int, count: int) -> list[Row]:
        rows: list[Row] = []
        room = POOL_SIZES[level] * 4 // 5 - len(seen[level])  # rejection sampling stays fast
        while len(rows) < min(count, room):
            expr, value = _problem(level, rng)
            if expr + "=" not in seen[level]:
                seen[level].add(expr + "=")
                rows.append({"prompt": expr + "=", "answer": str(value), "level": level})
        return [rows[i % len(rows)] for i in range(count)]

    evals = [r for level, n in EVAL_PER_LEVEL.items() for r in draw(level, n)]
    train = [r for level, w in TRAIN_LEVEL_WEIGHTS.items() for r in draw(level, round(TRAIN_SIZE * w))]
    rng.shuffle(train)
    rng.shuffle(evals)
    return train, evals


# ---------------------------------------------------------------------------------------------------
# Verifier (single-turn fallback; with `rollout.env: calculator` the environment scores episodes)
# ---------------------------------------------------------------------------------------------------


def score(completion: str, answer: str) -> float:
    """1.0 when the completion holds `<answer>N</answer>` with N equal to `answer`, else 0.0.

    Parsed as `CalculatorEnv` parses a turn, so both score the same text the same way.
    """
    m = CalculatorEnv.ANSWER.search(completion)
    if m is None:
        return 0.0
    try:
        return 1.0 if same_number(m.group(1), str(answer)) else 0.0
    except ValueError:
        return 0.0


def reward_fn(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL-signature reward: `score` of each completion against its `answer` column."""
    del prompts, kwargs
    return [score(c, a) for c, a in zip(completions, answer, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Transcripts: the exact token layout of an episode
# ---------------------------------------------------------------------------------------------------


def transcript(row: Row, *, use_tool: bool = True) -> list[tuple[str, bool]]:
    """The turns of a correct episode as `(text, generated)`; each generated turn ends with EOS.

    With the tool: call, result, answer. Without: the answer alone (the direct transcripts of the
    warm start). The result text is what `CalculatorEnv` answers for an integer value.
    """
    expr = row["prompt"].removesuffix("=")
    answer = f"<answer>{row['answer']}</answer>"
    if not use_tool:
        return [(answer, True)]
    return [(f"<calc>{expr}</calc>", True), (f"<result>{row['answer']}</result>", False), (answer, True)]


def encode_transcript(tokenizer: Any, row: Row, *, use_tool: bool = True) -> tuple[list[int], list[int]]:
    """`(ids, labels)` of one whole episode: prompt, then each turn (generated text + EOS, or
    environment text), tokenized as the pipeline does; labels are -100 on prompt and env tokens."""
    ids = list(tokenizer(row["prompt"])["input_ids"])
    labels = [-100] * len(ids)
    for text, generated in transcript(row, use_tool=use_tool):
        seg = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if generated:
            seg.append(tokenizer.eos_token_id)
        ids += seg
        labels += seg if generated else [-100] * len(seg)
    return ids, labels


# ---------------------------------------------------------------------------------------------------
# Tokenizer and model
# ---------------------------------------------------------------------------------------------------


def make_tokenizer() -> Any:
    """The calc char-level tokenizer (`tiny.char_tokenizer` over `CHARS`): one id per char, no BOS added."""
    return tiny.char_tokenizer(CHARS, SPECIALS, MAX_POSITIONS)


def make_model(tokenizer: Any, *, seed: int, hidden: int = 128, layers: int = 2) -> Any:
    """A tiny float32 Qwen2 (hidden 128, 2 layers) with tied embeddings, freshly initialised from `seed`."""
    return tiny.tiny_qwen2(
        tokenizer,
        seed=seed,
        hidden=hidden,
        layers=layers,
        max_positions=MAX_POSITIONS,
        max_new_tokens=MAX_NEW_TOKENS,
    )


# ---------------------------------------------------------------------------------------------------
# Warm start
# ---------------------------------------------------------------------------------------------------


def _sft_batch(rows: list[Row], tokenizer: Any, rng: random.Random) -> tuple[Any, Any]:
    """Right-padded whole-episode ids and labels; a row answers directly (no tool) with the
    probability `SFT_DIRECT_SHARE[level]`, drawn from `rng`."""
    pairs = [
        encode_transcript(tokenizer, r, use_tool=rng.random() >= SFT_DIRECT_SHARE.get(r.get("level", 0), 0.0))
        for r in rows
    ]
    return tiny.pad_batch(pairs, tokenizer.pad_token_id)


def warm_start(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    steps: int,
    seed: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    log: Log | None = None,
) -> float:
    """Teacher-forced SFT on whole transcripts for `steps` AdamW steps; returns the last loss."""
    return tiny.sft(
        model,
        lambda rng: _sft_batch(rng.sample(rows, batch_size), tokenizer, rng),
        steps=steps,
        seed=seed,
        lr=lr,
        name="calc",
        attention_mask_pad=tokenizer.pad_token_id,
        log=log,
    )


# ---------------------------------------------------------------------------------------------------
# Episodes without the pipeline (the base model's success, measured in `prepare`)
# ---------------------------------------------------------------------------------------------------


def _turns(
    model: Any, tokenizer: Any, contexts: list[list[int]], max_new_tokens: int, temperature: float, gen: Any
) -> list[list[int]]:
    """One turn per context: generated ids up to and including EOS (or `max_new_tokens`), greedy at
    temperature 0. Contexts of equal length are batched with a KV cache, so no padding is needed."""
    import torch

    def pick(logits: Any) -> Any:
        if temperature == 0.0:
            return logits[:, -1].argmax(-1, keepdim=True)
        return torch.multinomial(torch.softmax(logits[:, -1] / temperature, -1), 1, generator=gen)

    out: dict[int, list[int]] = {}
    by_len: dict[int, list[int]] = {}
    for i, c in enumerate(contexts):
        by_len.setdefault(len(c), []).append(i)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        for idx in by_len.values():
            res = model(input_ids=torch.tensor([contexts[i] for i in idx]), use_cache=True)
            nxt, new = pick(res.logits), []
            for step in range(max_new_tokens):
                new.append(nxt)
                if step + 1 == max_new_tokens or bool((torch.cat(new, 1) == eos).any(1).all()):
                    break
                res = model(input_ids=nxt, **with_cache(model, returned_cache(res)))
                nxt = pick(res.logits)
            for i, toks in zip(idx, torch.cat(new, 1).tolist(), strict=True):
                out[i] = toks[: toks.index(eos) + 1] if eos in toks else toks
    return [out[i] for i in range(len(contexts))]


PLAY_TIMEOUT_S = 3600.0  # playing a task's evaluation episodes (minutes on a CPU) ends within this


def play_episodes(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    temperature: float = 0.0,
    seed: int = 0,
    max_turns: int = MAX_TURNS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    timeout_s: float = PLAY_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Play each row's episode against `CalculatorEnv` with `run_episode`'s token layout, without
    the pipeline (greedy at temperature 0). Returns per row `{"reward", "turns", "tool_calls", "ids"}`
    (ids: prompt + whole response). Raises TimeoutError past `timeout_s`."""
    import torch

    from asyncflow.clock import RealClock

    gen = torch.Generator().manual_seed(seed)

    async def play() -> list[dict[str, Any]]:
        envs = [CalculatorEnv(RealClock(), max_turns=max_turns) for _ in rows]
        state: list[dict[str, Any]] = []
        for env, r in zip(envs, rows, strict=True):
            first = await env.reset(r, seed)
            ids = list(tokenizer(r["prompt"])["input_ids"]) + _encode_env(tokenizer, first)
            state.append({"reward": 0.0, "turns": 0, "tool_calls": 0, "ids": ids})
        live = list(range(len(rows)))
        for turn in range(1, max_turns + 1):
            turns = _turns(
                model, tokenizer, [state[i]["ids"] for i in live], max_new_tokens, temperature, gen
            )
            still = []
            for i, ids in zip(live, turns, strict=True):
                st = state[i]
                st["ids"] += ids
                st["turns"] = turn
                text = tokenizer.decode(
                    ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids, skip_special_tokens=True
                )
                step = await envs[i].step(text)
                st["reward"] += step.reward
                st["tool_calls"] += step.info.get("tool_calls", 0)
                if not step.done and turn < max_turns:
                    st["ids"] += _encode_env(tokenizer, step.observation)
                    still.append(i)
            live = still
        return state

    # its own thread and event loop: `prepare` also runs inside a run's event loop (runner: task.prepare);
    # the loop cancels the episodes at the deadline, and this thread waits a little longer for that
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(asyncio.run, asyncio.wait_for(play(), timeout_s)).result(timeout_s + 60.0)
    except concurrent.futures.TimeoutError as exc:
        raise TimeoutError(f"calc: playing {len(rows)} episodes took over {timeout_s:g} s") from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # (never wait on a thread stuck in a model call)


def _encode_env(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def episode_success(
    model: Any, tokenizer: Any, rows: list[Row], *, temperature: float = 0.0
) -> dict[str, float]:
    """Episode success rate (reward 1.0) and the share of episodes that called the tool."""
    eps = play_episodes(model, tokenizer, rows, temperature=temperature)
    n = max(1, len(eps))
    return {
        "success": sum(e["reward"] >= 1.0 for e in eps) / n,
        "tool_use": sum(e["tool_calls"] > 0 for e in eps) / n,
    }


# ---------------------------------------------------------------------------------------------------
# Prepare
# ---------------------------------------------------------------------------------------------------


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
        base = episode_success(model, tokenizer, evals)
    if log is not None:
        log(
            f"calc: greedy episode success {base['success']:.3f} (tool use {base['tool_use']:.3f}) "
            f"after {time.monotonic() - start:.1f}s"
        )
    meta = {
        "task": "calc",
        "seed": seed,
        "version": VERSION,
        "sft_steps": sft_steps,
        "base_eval_success": round(base["success"], 4),
        "base_tool_use": round(base["tool_use"], 4),
    }
    return tiny.write_task_folder(Path(out_dir), model, tokenizer, train, evals, meta)


def folder_name(seed: int, sft_steps: int = SFT_STEPS) -> str:
    """This pack's prepared folder name (`tiny.folder_name`)."""
    return tiny.folder_name("calc", VERSION, seed, sft_steps, SFT_STEPS)


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
    "rollout": {
        "env": "calculator",
        "max_turns": MAX_TURNS,
        "n": 8,
        "max_new_tokens": MAX_NEW_TOKENS,
        "temperature": 1.0,
    },
    # Measured (docs/tasks.md): 8 prompts x 8 episodes per step at lr 2e-4 lift greedy success to
    # 95-100% within 20-40 steps (seeds 0-2); 60 steps leave a margin and take ~2 minutes on 2 cores.
    "train": {"batch_size": 64, "mini_batches": 1, "lr": 2e-4, "max_steps": 60, "max_grad_norm": 1.0},
    "eval": {"every": 20, "size": 500, "success_threshold": 1.0},
    "dataset": {"prompt_key": "prompt", "label_key": "answer"},
}

TASK = TaskPack(
    name="calc",
    prepare=cached_prepare,
    shipped=shipped,
    defaults=DEFAULTS,
    reward_fn_path="asyncflow.tasks.calc:reward_fn",
    description="Multi-turn tool use: four-digit products solved by calling a calculator tool.",
)
