"""GSM8K reward (TRL signature): 1.0 when the completion's last number equals the reference answer,
the number after `####` in GSM8K's `answer` column; else 0.0."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _value(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score(prompts: list[str], completions: list[str], answer: list[str], **kwargs: object) -> list[float]:
    del prompts, kwargs
    out = []
    for completion, reference in zip(completions, answer, strict=True):
        want = _value(reference.split("####")[-1])
        got = _value(completion)
        out.append(1.0 if want is not None and got is not None and abs(got - want) < 1e-6 else 0.0)
    return out
