"""The trainer's passes: log-probs through the output head only at trained positions, a chunk of
tokens at a time (never batch x length x vocabulary floats), and one forward pass per micro-batch a
step (the proximal log-probs and the mismatch measure come from it)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncflow.algorithms.losses import LossSettings, make_loss_fn
from asyncflow.engines import head_logprobs
from asyncflow.engines.base import TrainBatch
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.workflow.batch import build_train_batch

VOCAB = 300


def _model(tied: bool = True, vocab: int = VOCAB) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg).eval()


def _batch(rows: int = 6, seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, VOCAB, (3 + i % 4,), generator=g).tolist() for i in range(rows)]
    responses = [torch.randint(2, VOCAB, (2 + (i * 3) % 7,), generator=g).tolist() for i in range(rows)]
    behavior = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    adv = torch.linspace(-1.0, 1.0, rows)
    return build_train_batch(prompts, responses, behavior, adv, [i != 2 for i in range(rows)], 0)


def _full_logits_reference(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """log_softmax over the whole vocabulary at every position, the textbook way."""
    pos = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=pos).logits
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    return logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * batch.response_mask


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tied", [True, False])
def test_chunked_head_log_probs_and_gradients_equal_the_full_logits_ones(monkeypatch: pytest.MonkeyPatch,
                                                                         temperature: float, tied: bool) -> None:
    monkeypatch.setattr(head_logprobs, "CHUNK_BYTES", 4 * VOCAB * 5)  # chunks of 16 tokens (its floor): several
    batch = _batch(rows=8)
    assert head_logprobs.chunk_tokens(VOCAB) < int(batch.response_mask.sum())
    model = _model(tied)
    twin = copy.deepcopy(model)
    weights = torch.randn(batch.response_mask.shape)
    logp, entropy = head_logprobs.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                                 temperature)
    (logp * weights).sum().backward()
    want = _full_logits_reference(twin, batch, temperature)
    (want * weights).sum().backward()
    assert torch.allclose(logp, want, atol=1e-5) and bool((logp[batch.response_mask == 0] == 0).all())
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4), name
    assert entropy.min() >= 0 and bool((entropy[batch.response_mask == 0] == 0).all())


def test_a_model_that_changes_logits_after_its_head_is_scored_on_its_real_logits() -> None:
    """Gemma 2 soft-caps its logits after the head: the chunked path would skip that, so the pass sees
    the head's output replaced and falls back to the model's own logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, final_logit_softcapping=0.5)
    model = Gemma2ForCausalLM(cfg).eval()
    batch = _batch()
    with torch.no_grad():
        logp, _ = head_logprobs.token_logprobs(model, batch.input_ids, batch.attention_mask, batch.response_mask, 1.0)
        want = _full_logits_reference(model, batch, 1.0)
    assert torch.allclose(logp, want, atol=1e-5)
    assert getattr(model, "_asyncflow_full_logits", False)  # (decided once, for good)


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


def test_a_train_step_never_holds_logits_for_the_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 4096  # (a vocabulary large enough that logits are the largest tensors of a pass)
    monkeypatch.setattr(head_logprobs, "CHUNK_BYTES", 4 * vocab * 16)
    batch = _batch(rows=32)
    engine = TorchTrainEngine(_model(vocab=vocab), lr=1e-3)
    with _LargestTensor() as seen:
        engine.train_step(batch, make_loss_fn(LossSettings()), 1.0)
    rows, length = batch.input_ids.shape
    # the head's weight (and its gradient) or one chunk's logits, never the batch's (6x as many here)
    assert seen.most == max(16 * vocab, vocab * 64) and rows * length * vocab > 6 * seen.most


def _count_forwards(engine: TorchTrainEngine) -> list[int]:
    calls = [0]
    engine.model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("micro", [None, 2])
def test_a_train_step_runs_one_forward_per_micro_batch_with_proximal_and_mismatch(micro: int | None) -> None:
    batch = _batch(rows=6)
    batch.mismatch_mask = batch.response_mask.clone()
    engine = TorchTrainEngine(_model(), lr=1e-3, micro_batch_size=micro)
    calls = _count_forwards(engine)
    metrics = engine.train_step(batch, make_loss_fn(LossSettings(loss="decoupled_ppo")), 1.0, proximal=True)
    assert calls[0] == (1 if micro is None else 3)
    assert metrics["mismatch_tokens"] == float(batch.response_mask.sum()) and metrics["mismatch_kl_sum"] > 0


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_proximal_log_probs_from_the_train_pass_train_as_a_separate_pass_does(mini_batches: int) -> None:
    """Decoupled PPO: the weights after a step with proximal log-probs taken from the first
    mini-batch's own passes (and a no-grad pass for the later rows) equal those after a step given
    proximal log-probs from a separate pass over the whole batch first."""
    batch = _batch(rows=8)
    loss = make_loss_fn(LossSettings(loss="decoupled_ppo"))
    a = TorchTrainEngine(_model(), lr=1e-2, mini_batches=mini_batches)
    b = TorchTrainEngine(_model(), lr=1e-2, mini_batches=mini_batches)
    calls = _count_forwards(a)
    got = a.train_step(copy.deepcopy(batch), loss, 1.0, proximal=True)
    assert calls[0] == 2 * mini_batches - 1  # a pass per mini-batch, and one no-grad pass for the later rows
    given = copy.deepcopy(batch)
    given.proximal_logprobs = b.logprobs(given, 1.0)
    want = b.train_step(given, loss, 1.0)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_micro_batches_take_rows_by_length_and_pad_only_to_their_own_longest_row() -> None:
    batch = _batch(rows=8)
    lengths = batch.attention_mask.sum(-1).tolist()
    engine = TorchTrainEngine(_model(), lr=1e-3, micro_batch_size=2)
    widths: list[tuple[int, int]] = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True)  # type: ignore[arg-type,return-value]
    logp = engine.logprobs(batch, 1.0)
    want = sorted(lengths, reverse=True)
    assert widths == [(2, int(want[i])) for i in range(0, 8, 2)]  # each part as wide as its longest row
    assert torch.allclose(logp, TorchTrainEngine(_model(), lr=1e-3).logprobs(batch, 1.0), atol=1e-5)
