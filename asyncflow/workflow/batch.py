"""Training batches from store samples: the fields the trainer takes, the padded batch, and the
group helpers (whole groups, equal rewards).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from asyncflow.engines.base import TrainBatch
from asyncflow.transfer_queue import SampleView

TRAIN_FIELDS = ("prompt_ids", "response_ids", "behavior_logprobs", "token_versions", "behavior_version", "reward_error",
                "row", "finish_reason", "reward", "loss_mask", "turns", "ref_logprobs", "teacher_logprobs", "agent_calls", "agent_calls_dropped",
                "reward_parts")


def build_train_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    behavior: list[list[float]],
    advantages: torch.Tensor,
    valid: list[bool],
    pad_token_id: int,
    loss_masks: Sequence[Sequence[int] | None] | None = None,
) -> TrainBatch:
    """Right-padded prompt+response rows; the mask marks response tokens (EOS included) of valid rows,
    and of those only the generated ones where `loss_masks` (multi-turn episodes) says so."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    width = max(lengths)
    b = len(prompts)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width - 1), dtype=torch.float32)
    blp = torch.zeros((b, width - 1), dtype=torch.float32)
    for i, (p, r, lp) in enumerate(zip(prompts, responses, behavior, strict=True)):
        ids[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attn[i, : lengths[i]] = 1
        start = len(p) - 1  # logits at position t predict token t+1
        if valid[i]:
            lm = None if loss_masks is None else loss_masks[i]
            mask[i, start : start + len(r)] = 1.0 if lm is None else torch.tensor(list(lm), dtype=torch.float32)
        blp[i, start : start + len(r)] = torch.tensor(list(lp), dtype=torch.float32)
    return TrainBatch(ids, attn, mask, advantages, blp)


def generated_count(sample: SampleView) -> int:
    """Tokens the policy generated for a sample (an episode's environment tokens excluded)."""
    mask = sample.fields.get("loss_mask")
    return int(sum(mask)) if mask is not None else len(sample.fields["response_ids"])


def all_equal(group: list[SampleView]) -> bool:
    """True when every scored sample of the group has the same reward (and there are >= 2)."""
    rewards = [s.fields["reward"] for s in group if s.fields["reward_error"] is None]
    return len(rewards) >= 2 and all(r == rewards[0] for r in rewards)


def batch_metrics(groups: list[list[SampleView]], valid: list[bool], rewards: list[float],
                  filtered: int = 0) -> dict[str, float]:
    """A train batch's reward and length metrics (`valid`, `rewards`: per sample, groups flattened):
    the spread of the scored rewards (`reward_std`, over the batch), the fraction of groups whose
    scored rewards are all equal (no GRPO signal; `filtered` such groups the dynamic-sampling filter
    dropped while this batch was collected count too), the fraction of responses cut by the length
    limit, the response lengths' min and max, and each reward function's mean (`reward/<name>`)."""
    scored = [r for r, ok in zip(rewards, valid, strict=True) if ok]
    mean = sum(scored) / max(len(scored), 1)
    zero_std = sum(1 for g in groups if all_equal(g)) + filtered
    # one pass over the samples for the rest (a batch is up to hundreds of thousands of samples)
    n = truncated = 0
    lo, hi = math.inf, 0
    parts: dict[str, list[float]] = {}
    ok_of = iter(valid)
    for g in groups:
        for s in g:
            f = s.fields
            length = len(f["response_ids"])
            if length < lo:
                lo = length
            if length > hi:
                hi = length
            if f.get("finish_reason") == "length":
                truncated += 1
            reward_parts = f.get("reward_parts")
            if next(ok_of) and reward_parts:
                for name, value in reward_parts.items():
                    parts.setdefault(name, []).append(value)
            n += 1
    if n != len(valid):
        raise ValueError(f"batch_metrics: {len(valid)} valid flags for {n} samples")
    out = {
        "reward_std": math.sqrt(sum((r - mean) ** 2 for r in scored) / max(len(scored), 1)),
        "zero_std_group_frac": zero_std / max(len(groups) + filtered, 1),
        "truncated_frac": truncated / max(n, 1),
        "response_len_min": float(lo if n else 0),
        "response_len_max": float(hi),
    }
    out.update({f"reward/{name}": sum(values) / len(values) for name, values in parts.items()})
    return out


def by_group(samples: list[SampleView]) -> list[list[SampleView]]:
    groups: dict[int, list[SampleView]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    return list(groups.values())
