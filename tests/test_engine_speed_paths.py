"""The HF engine's paths that make it fast on a real model, checked for what they must keep: sampling
by the inverse of the cumulative distribution draws from the distribution; a group's requests share
one prefill and still sample independently; the decode thread ends when idle and comes back with
work; heavy work handed to a thread of its own runs there with its own torch threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from asyncflow.compute_thread import in_own_thread
from asyncflow.engines.base import GenRequest
from asyncflow.engines.hf import IDLE_EXIT_S, HFEngine
from asyncflow.engines.sampling import sample_tokens


def test_sampling_draws_each_token_with_its_probability_and_never_a_zero_one() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.2, 0.7]]).repeat(20_000, 1)
    tokens = sample_tokens(probs.clone(), torch.Generator().manual_seed(0), [None] * len(probs))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert freq[1] == 0
    assert torch.allclose(freq, probs[0], atol=0.01)


def test_a_seeded_row_draws_the_same_token_whatever_batch_it_is_in() -> None:
    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(1)), -1)
    alone = sample_tokens(probs[2:3].clone(), torch.Generator().manual_seed(7), [torch.Generator().manual_seed(3)])
    own: list[torch.Generator | None] = [None, None, torch.Generator().manual_seed(3), None, None]
    together = sample_tokens(probs.clone(), torch.Generator().manual_seed(99), own)
    assert together[2] == alone[0]


def _record_widths(model, shapes: list[tuple[int, int]]):
    """Record the input width of every forward of `model` until the returned handle is removed."""
    return model.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)) if "input_ids" in kw else None,
        with_kwargs=True)  # type: ignore[arg-type,return-value]


def test_a_groups_requests_share_one_prefill_and_each_samples_on_its_own(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, pad_token_id=0, max_batch=16)
    shapes: list[tuple[int, int]] = []
    hook = _record_widths(engine.model, shapes)  # (the session's model: the hook goes when the test ends)
    try:
        prompts = [[5, 6, 7], [8, 9]]
        futures = [engine.submit(GenRequest(i, prompts[i % 2], 6, temperature=1.0, seed=i)) for i in range(8)]
        results = [f.result(timeout=60) for f in futures]
        prefills = [s for s in shapes if s[1] > 1]
        assert prefills[0] == (2, 3)  # two distinct contexts, not eight rows
        # each request's tokens are its own seed's: as when it runs alone
        alone = HFEngine(tiny_model, eos_token_id=1, pad_token_id=0)
        try:
            for i in (0, 3):
                solo = alone.generate_many([GenRequest(i, prompts[i % 2], 6, temperature=1.0, seed=i)], timeout=60)[0]
                assert solo.response_ids == results[i].response_ids
                assert solo.behavior_logprobs == pytest.approx(results[i].behavior_logprobs, abs=1e-5)
        finally:
            alone.shutdown()
        assert len({tuple(r.response_ids) for r in results}) > 2  # (the copies did not all sample alike)
    finally:
        hook.remove()
        engine.shutdown()


def test_the_decode_thread_ends_when_idle_and_a_new_one_serves_the_next_request(tiny_model) -> None:
    engine = HFEngine(tiny_model, eos_token_id=1, pad_token_id=0, threads=1)
    try:
        engine.generate_many([GenRequest(0, [5, 6], 3, temperature=0.0)], timeout=60)
        deadline = time.monotonic() + 10 * IDLE_EXIT_S + 5
        while engine._thread is not None and time.monotonic() < deadline:
            time.sleep(IDLE_EXIT_S / 4)
        assert engine._thread is None
        assert not any(t.name == "asyncflow-rollout" for t in threading.enumerate())
        out = engine.generate_many([GenRequest(1, [5, 6], 3, temperature=0.0)], timeout=60)
        assert len(out[0].response_ids) >= 1
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(GenRequest(2, [5], 1))


def test_work_in_its_own_thread_runs_with_its_thread_count_and_the_thread_ends() -> None:
    seen: dict[str, object] = {}

    def work(x: int) -> int:
        seen["thread"] = threading.current_thread()
        seen["threads"] = torch.get_num_threads()
        return x + 1

    def fail() -> None:
        raise ValueError("boom")

    async def main() -> None:
        assert await in_own_thread(work, 1, threads=1) == 2
        with pytest.raises(ValueError, match="boom"):
            await in_own_thread(fail)

    before = torch.get_num_threads()
    asyncio.run(main())
    thread = seen["thread"]
    assert isinstance(thread, threading.Thread) and thread is not threading.main_thread()
    thread.join(timeout=10)
    assert not thread.is_alive() and seen["threads"] == 1 and torch.get_num_threads() == before


def test_one_malloc_arena_is_asked_for_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from asyncflow.malloc_arena import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # (the user's setting stands)
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_malloc_arenas() is sys.platform.startswith("linux")  # (glibc: mallopt took it)
