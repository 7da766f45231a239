"""The eval set as distinct prompts: which rows a run evaluates, and how copies of a prompt count.

Datasets repeat prompts (the same question many times, a dataset repeated). Greedy decoding gives
every copy of a prompt the same completion, so evaluating each copy spends generation on answers
already known and weights the eval score by how often a prompt happens to be copied. Here a prompt
is counted once: `eval.size` and the eval row's `eval_size` count distinct prompts, the engine
generates each distinct prompt once, and a held-out slice takes a prompt with all its copies (no
eval prompt is also trained on).

Two prompts are the same when their values are equal: the same text, or the same message list
(compared as JSON with sorted keys). Copies of a prompt that differ in their other columns (two
reference answers, say) keep a row each: the prompt's one completion is scored against each of
them, and the prompt's reward is the mean over its copies (`prompt_reward`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def prompt_identity(prompt: Any) -> str:
    """What two copies of a prompt share: its text, or its message list as sorted-key JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)


def rows_by_prompt(rows: Sequence[dict[str, Any]], prompt_key: str) -> list[list[int]]:
    """Row indices of each distinct prompt, the prompts in order of first appearance."""
    copies: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        copies.setdefault(prompt_identity(r[prompt_key]), []).append(i)
    return list(copies.values())


def first_prompts(groups: Sequence[Sequence[int]], n: int) -> list[int]:
    """The row indices (ascending) of every copy of the first `n` distinct prompts (`eval.size`)."""
    return sorted(i for g in groups[:n] for i in g)


def draw_held_out(groups: Sequence[Sequence[int]], max_prompts: int, max_rows: int, seed: int) -> list[int]:
    """Row indices (ascending) of whole prompts drawn at random: `groups` (one per prompt, as
    `rows_by_prompt` gives) in an order shuffled by `random.Random(seed)`, each prompt taken when its
    copies keep the slice within `max_rows`, until `max_prompts` are taken. A prompt with more copies
    than the room left stays out (one prompt copied 95 times of 100 never takes the training data)."""
    order = list(groups)
    random.Random(seed).shuffle(order)
    held: list[int] = []
    taken = 0
    for g in order:
        if taken >= max_prompts or len(held) >= max_rows:
            break
        if len(held) + len(g) <= max_rows:
            held.extend(g)
            taken += 1
    return sorted(held)


@dataclass
class EvalPrompt:
    """One distinct eval prompt: its distinct rows (copies that differ in another column; one row
    when all copies are equal) and how many copies each row stands for."""

    rows: list[dict[str, Any]]
    copies: list[int]


def distinct_prompts(rows: Sequence[dict[str, Any]], prompt_key: str) -> list[EvalPrompt]:
    """The eval rows as distinct prompts, in order of first appearance; equal copies merged."""
    out = []
    for g in rows_by_prompt(rows, prompt_key):
        at: dict[str, int] = {}
        prompt = EvalPrompt([], [])
        for i in g:
            j = at.setdefault(json.dumps(rows[i], sort_keys=True, default=str), len(at))
            if j == len(prompt.rows):
                prompt.rows.append(rows[i])
                prompt.copies.append(0)
            prompt.copies[j] += 1
        out.append(prompt)
    return out


def prompt_reward(rewards: Sequence[float | None], copies: Sequence[int]) -> float | None:
    """A prompt's reward from its distinct rows' rewards: their mean weighted by copies; None (the
    prompt failed) when any of them failed."""
    if any(r is None for r in rewards):
        return None
    if len(rewards) == 1:  # (exactly the row's reward: a threshold compares it as the reward function gave it)
        return rewards[0]
    return sum(float(r) * c for r, c in zip(rewards, copies, strict=True) if r is not None) / sum(copies)


def fold_rewards(prompts: Sequence[EvalPrompt], rewards: Sequence[float | None]) -> list[float | None]:
    """Per-prompt rewards from rewards of every prompt's distinct rows, in order (as episodes give them)."""
    out = []
    at = 0
    for p in prompts:
        out.append(prompt_reward(rewards[at:at + len(p.rows)], p.copies))
        at += len(p.rows)
    return out
