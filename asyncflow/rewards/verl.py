"""verl's reward functions, unchanged: `compute_score(data_source, solution_str, ground_truth, extra_info)`
(one call per completion, a number or a dict with a "score") wrapped as a TRL-style reward function.

In a config, prefix the function with `verl:`: `reward.fn: "verl:my_reward.py:compute_score"`. In
Python: `verl_compute_score(compute_score, label_key="answer")`. The arguments, per completion:
`solution_str` = the completion's text; `ground_truth` = the label column (`dataset.label_key`), or
verl's `reward_model.ground_truth` when there is no label column; `data_source` = the row's
`data_source` column, else the dataset's name; `extra_info` = the row's `extra_info` column (verl's
data layout), else the whole row (its columns other than the prompt).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncflow.data import REWARD_ARGUMENTS

VERL_PREFIX = "verl:"


class VerlScore:
    """A verl `compute_score` as a TRL reward function (one call of `fn` per completion)."""

    def __init__(self, fn: Callable[..., Any], *, label_key: str | None = "answer", data_source: str | None = None) -> None:
        self.fn, self.label_key, self.data_source = fn, label_key, data_source
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)  # (its metric is `reward/<name>`)

    def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        out = []
        for i, completion in enumerate(completions):
            row = {c: v[i] for c, v in columns.items() if c not in REWARD_ARGUMENTS}
            score = self.fn(data_source=row.get("data_source", self.data_source), solution_str=_text(completion),
                            ground_truth=self._ground_truth(row),
                            extra_info=row.get("extra_info", row))
            out.append(score["score"] if isinstance(score, dict) else score)
        return out

    def _ground_truth(self, row: dict[str, Any]) -> Any:
        if self.label_key is not None and self.label_key in row:
            return row[self.label_key]
        reward_model = row.get("reward_model")  # verl's parquet layout: {"style": ..., "ground_truth": ...}
        return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def _text(completion: Any) -> str:
    """The completion's text (a conversational completion is a one-message assistant turn)."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def verl_compute_score(fn: Callable[..., Any], *, label_key: str | None = "answer",
                       data_source: str | None = None) -> VerlScore:
    """`fn(data_source, solution_str, ground_truth, extra_info)` as a TRL-style reward function."""
    return VerlScore(fn, label_key=label_key, data_source=data_source)
