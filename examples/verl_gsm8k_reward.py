"""GSM8K's rule-based reward as verl scores it, with TRL's signature for `reward.fn`: 1.0 when the
last `#### <number>` of the completion equals the row's `reward_model.ground_truth`, else 0.0.

verl's GSM8K parquet rows hold the answer inside the `reward_model` column; every column reaches a
reward function as a list (docs/verl.md), so this reads it from there.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"#### (-?[0-9.,$]+)")


def extract_answer(text: str) -> str | None:
    """The last `#### <number>` of `text`, without commas or dollar signs; None when there is none."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "").replace("$", "").rstrip(".") if found else None


def gsm8k_reward(prompts: list[Any], completions: list[Any], reward_model: list[dict[str, Any]],
                 **columns: Any) -> list[float]:
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # (chat prompts: one message)
    return [float(extract_answer(t) == str(rm["ground_truth"])) for t, rm in zip(texts, reward_model, strict=True)]
