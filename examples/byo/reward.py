"""A TRL-signature reward function: `score(prompts, completions, **columns) -> list[float]`.

Every dataset column except the prompt arrives as a keyword list (here `solution`), plus
`completion_ids`. Return one finite number per completion; a call that raises or returns anything
else (a None included) marks its group's samples as `reward_error` (kept out of the loss, logged
in samples.jsonl).
"""


def score(prompts: list[str], completions: list[str], solution: list[str], **kwargs: object) -> list[float]:
    del prompts, kwargs
    return [1.0 if c.strip() == s.strip() else 0.0 for c, s in zip(completions, solution, strict=True)]
