"""Issue 35: the KL reference's passes match the trainer's (bf16), and `mismatch_kl` counts only the
responses the trainer's own version generated wholly, and stays finite."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncflow.algorithms.losses import kl_estimate
from asyncflow.engines.torch_train import ReferenceModel, TorchTrainEngine, before_update
from asyncflow.workflow.batch import build_train_batch
from asyncflow.workflow.learner import current_version_mask, mismatch_kl


def _sample(prompt: list[int], versions: list[int]) -> Any:
    return SimpleNamespace(fields={"prompt_ids": prompt, "token_versions": versions})


def test_mismatch_kl_counts_only_responses_generated_wholly_by_the_current_version() -> None:
    # row 0: all version 3; row 1: swapped to 3 mid-response (prefix KV cache from version 2); row 2: version 2
    samples = [_sample([5, 6], [3, 3]), _sample([5, 6], [2, 3, 3]), _sample([5], [2, 2])]
    batch = build_train_batch([[5, 6], [5, 6], [5]], [[7, 8], [7, 8, 9], [7, 8]],
                              [[-1.0] * 2, [-1.0] * 3, [-1.0] * 2], torch.zeros(3), [True] * 3, 0)
    same = current_version_mask(samples, 3, batch.response_mask)  # type: ignore[arg-type]
    assert same[0].tolist() == [0.0, 1.0, 1.0, 0.0] and same[1].sum() == 0 and same[2].sum() == 0
    current = batch.behavior_logprobs.clone()
    current[0, 1] = -1.0 + math.log(2.0)  # the trainer gives one counted token twice the engine's probability
    current[1, 2] = -200.0  # a swapped response far apart: not counted
    want = (2.0 - math.log(2.0) - 1) / 2  # k3 of KL(mu || pi): pi/mu - log(pi/mu) - 1, over 2 tokens
    batch.mismatch_mask = same
    sums = before_update(current, batch, proximal=False)
    assert sums["mismatch_tokens"] == 2.0 and batch.proximal_logprobs is None
    assert mismatch_kl(sums) == pytest.approx(want, rel=1e-5) and sums == {}  # (the sums are taken out)
    batch.mismatch_mask = None
    assert mismatch_kl(before_update(current, batch, proximal=True)) is None
    assert batch.proximal_logprobs is not None and torch.equal(batch.proximal_logprobs, current)


def test_mismatch_kl_is_clamped_not_inf() -> None:
    batch = build_train_batch([[5]], [[7, 8]], [[-100.0, -1.0]], torch.zeros(1), [True], 0)
    current = torch.tensor([[-0.01, -1.0]])  # the engine gave a token ~100 nats less: e^99.99 overflowed
    batch.mismatch_mask = torch.ones(1, 2)
    assert mismatch_kl(before_update(current, batch, proximal=False)) == pytest.approx(10.0 / 2)


def test_reference_kl_is_zero_at_step_0_in_bfloat16(tiny_model: torch.nn.Module, tmp_path: Path) -> None:
    """The reference ran bf16 weights without autocast, the policy float32 weights under bf16 autocast:
    the same model gave a non-zero KL before any update."""
    folder = tmp_path / "model"
    copy.deepcopy(tiny_model).save_pretrained(folder)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 32, (3 + i % 3,), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(2, 32, (2 + i,), generator=g).tolist() for i in range(4)]
    batch = build_train_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(4), [True] * 4, 0)
    ref = ReferenceModel(folder, temperature=0.7, dtype=torch.bfloat16)(batch)
    policy = TorchTrainEngine(folder, lr=0.0, dtype=torch.bfloat16).logprobs(batch, temperature=0.7).cpu()
    mask = batch.response_mask
    assert float(mask.sum()) > 0
    kl = kl_estimate(policy * mask, ref * mask, "k3") * mask
    assert float(kl.abs().sum()) == 0.0 and torch.equal(policy * mask, ref * mask)
