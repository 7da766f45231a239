"""Start-up probe of an OpenAI-compatible server's log-probs (`rollout.engine: openai`).

The losses need the behavior log-probs of the distribution the server sampled from, softmax(logits /
temperature). `vllm serve` reports the unscaled model's (softmax(logits)) unless started with
`--logprobs-mode processed_logprobs`: at temperature != 1 every importance ratio is then biased, and
nothing else shows it. One short reply's log-probs are compared with the trainer's of the same tokens,
scaled and unscaled; a server closer to the unscaled ones is refused.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from asyncflow.engines.base import GenRequest
from asyncflow.errors import UserError
from asyncflow.workflow.batch import build_train_batch

PROBE_TOKENS = 8


def probe_needed(engine_kind: str, temperature: float) -> bool:
    """At temperature 1 scaled and unscaled log-probs are the same; at 0 (greedy) none are trained."""
    return engine_kind == "openai" and temperature not in (0.0, 1.0)


async def check_server_logprobs(engine: Any, trainer: Any, prompt_ids: list[int],
                                temperature: float) -> tuple[float, float] | None:
    """Refuse a server whose reported log-probs ignore `temperature` (the trainer and the server hold
    the same weights); else the mean per-token gaps to the trainer's scaled and unscaled log-probs
    (None: the reply was empty). `trainer.logprobs` is blocking: it runs in a worker thread."""
    res = await engine.generate(GenRequest(uid=-1, prompt_ids=list(prompt_ids), max_new_tokens=PROBE_TOKENS,
                                           temperature=temperature))
    if not res.response_ids:
        return None
    batch = build_train_batch([list(prompt_ids)], [list(res.response_ids)], [list(res.behavior_logprobs)],
                              torch.zeros(1), [True], pad_token_id=0)
    scaled = await asyncio.to_thread(trainer.logprobs, batch, temperature)
    raw = await asyncio.to_thread(trainer.logprobs, batch, 1.0)
    far_scaled, far_raw = (_mean_gap(x, batch.behavior_logprobs, batch.response_mask) for x in (scaled, raw))
    # (a clear margin: bf16 or kernel differences move both gaps alike; mismatch_kl reports those)
    if far_raw < 0.5 * far_scaled:
        url = getattr(engine, "base_url", "the server")
        raise UserError(
            f"rollout.server_urls: {url} reports log-probs not scaled by rollout.temperature={temperature:g} "
            f"(mean gap {far_raw:.3g} to the unscaled model, {far_scaled:.3g} to the sampled distribution), so every "
            "importance ratio would be biased; start vLLM with --logprobs-mode processed_logprobs")
    return far_scaled, far_raw


def _mean_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.cpu() - b).abs() * mask).sum() / mask.sum().clamp(min=1.0))
