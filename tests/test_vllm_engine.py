"""The in-process vLLM engine: importable without vLLM; its cancel and abort paths against a fake AsyncLLM; generation and weight loading on vLLM itself need vLLM and a GPU."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_gpu_vllm = pytest.mark.skipif(
    not (HAS_VLLM and torch.cuda.is_available()),
    reason=f"needs vLLM and a CUDA GPU (vllm installed: {HAS_VLLM}, GPU: {torch.cuda.is_available()})",
)


def test_module_imports_without_vllm_and_names_its_worker_extension() -> None:
    from asyncflow.engines import vllm_engine

    module, _, name = vllm_engine.EXTENSION.rpartition(".")
    assert module == vllm_engine.__name__ and hasattr(vllm_engine, name)


class _FakeLLM:
    """The slice of vLLM's AsyncLLM the engine uses: token-by-token DELTA outputs, abort, rpc."""

    def __init__(self) -> None:
        self.aborted: set[str] = set()

    async def generate(self, prompt: Any, params: Any, rid: str) -> Any:
        for i in range(params.max_tokens):
            await asyncio.sleep(0.001 * (1 + int(rid.split("-")[0]) % 7))
            if rid in self.aborted:
                yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], logprobs=[], finish_reason="abort")],
                                      finished=True)
                return
            last = i == params.max_tokens - 1
            yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(logprob=-1.0)}],
                                                           finish_reason="length" if last else None)], finished=last)

    async def abort(self, rid: str) -> None:
        await asyncio.sleep(0.002)
        self.aborted.add(rid)

    async def collective_rpc(self, name: str, args: Any) -> None:
        await asyncio.sleep(0.01)


@pytest.fixture()
def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    """A `VLLMEngine` around `_FakeLLM`, with the three vLLM modules it imports faked (vLLM is not
    installed here), and `save_file` slowed for a tensor named "slow", so that a load can be cancelled
    mid-write."""
    from asyncflow.engines.vllm_engine import VLLMEngine

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = SimpleNamespace(DELTA=1)  # type: ignore[attr-defined]
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.sampling_params", sampling)):
        monkeypatch.setitem(sys.modules, name, module)

    def slow_save(tensors: Any, path: str) -> None:
        time.sleep(0.3 if "slow" in tensors else 0.0)
        Path(path).write_bytes(b"weights")

    monkeypatch.setattr("safetensors.torch.save_file", slow_save)
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._setup(_FakeLLM(), 64, 30.0)
    os.rmdir(engine._dir)  # (made by _setup, in /dev/shm)
    engine._dir = str(tmp_path)
    yield engine


def test_a_load_cancelled_while_its_weights_are_written_removes_the_file(fake_vllm: Any) -> None:
    """The weights file (hundreds of MB in /dev/shm) used to stay when the load was cancelled during
    the write: the cleanup ran before the writing thread had created it."""
    async def main() -> None:
        load = asyncio.ensure_future(fake_vllm.load_weights({"slow": torch.zeros(4)}, 1, "swap"))
        await asyncio.sleep(0.05)
        load.cancel()
        await asyncio.sleep(0.6)  # the write ends at 0.3 s

    asyncio.run(main())
    assert os.listdir(fake_vllm._dir) == []


def test_an_abort_load_survives_requests_ending_while_it_aborts(fake_vllm: Any) -> None:
    from asyncflow.engines.base import GenRequest

    async def main() -> list[Any]:
        gens = [asyncio.ensure_future(fake_vllm.generate(GenRequest(i, [1], 3 + i % 5, 1.0))) for i in range(40)]
        await asyncio.sleep(0.004)
        await fake_vllm.load_weights({"w": torch.zeros(4)}, 1, "abort")  # ~80 ms of aborts: most end meanwhile
        return await asyncio.gather(*gens)

    results = asyncio.run(main())
    assert fake_vllm.version == 1 and os.listdir(fake_vllm._dir) == []
    # every request still ends with all its tokens (aborted ones are resubmitted with the tokens so far)
    assert [len(r.response_ids) for r in results] == [3 + i % 5 for i in range(40)]


def test_requests_parked_by_an_abort_load_and_then_cancelled_are_not_resubmitted(fake_vllm: Any) -> None:
    """The publication cancels what the new version's floor drops right after an abort-mode load
    (`Trainer.publish`): requests the load had parked were resubmitted anyway and decoded to their
    max_new_tokens for nobody (the hf engine ends them)."""
    from asyncflow.engines.base import GenRequest

    submitted: list[str] = []
    generate = fake_vllm.llm.generate

    def counting(prompt: Any, params: Any, rid: str) -> Any:
        submitted.append(rid)
        return generate(prompt, params, rid)

    fake_vllm.llm.generate = counting

    async def main() -> tuple[int, list[Any]]:
        gens = [asyncio.ensure_future(fake_vllm.generate(GenRequest(i, [1], 200, 1.0))) for i in range(8)]
        await asyncio.sleep(0.05)  # each holds a few tokens of version 0
        await fake_vllm.load_weights({"w": torch.zeros(4)}, 1, "abort")
        cancelled = fake_vllm.cancel_older_than(1)
        return cancelled, await asyncio.wait_for(asyncio.gather(*gens), 5)

    cancelled, results = asyncio.run(main())
    assert cancelled == 8 and len(submitted) == 8  # none sent again
    assert {r.finish_reason for r in results} == {"cancelled"}
    assert all(0 < len(r.response_ids) < 200 for r in results)


def test_concurrent_requests_of_one_sample_are_tracked_apart(fake_vllm: Any) -> None:
    """An agent's concurrent calls share their sample's uid; keyed by it, one call's end dropped the
    other from the running set (out of load(), abort-mode restarts and staleness cancels)."""
    from asyncflow.engines.base import GenRequest

    async def main() -> tuple[int, int, list[Any]]:
        short = asyncio.ensure_future(fake_vllm.generate(GenRequest(7, [1], 2, 1.0)))
        long = asyncio.ensure_future(fake_vllm.generate(GenRequest(7, [1], 200, 1.0)))
        await asyncio.wait_for(short, 5)
        running = fake_vllm.load()
        cancelled = fake_vllm.cancel_older_than(1)  # the long one still runs, from version 0
        return running, cancelled, [await asyncio.wait_for(long, 5)]

    running, cancelled, (result,) = asyncio.run(main())
    assert running == 1 and cancelled == 1 and result.finish_reason == "cancelled" and len(result.response_ids) < 200


def _hf_logprobs(model_dir: Path, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


@needs_gpu_vllm
def test_vllm_generates_with_temperature_scaled_logprobs_and_loads_weights(arith_dir: Path) -> None:
    from asyncflow.engines.base import GenRequest
    from asyncflow.engines.vllm_engine import VLLMEngine

    async def run() -> None:
        engine = VLLMEngine(arith_dir, max_batch=8, dtype="float32", gpu_memory_utilization=0.2)
        try:
            prompt = [3, 4, 5, 6]
            results = await asyncio.gather(*(engine.generate(GenRequest(i, prompt, 6, 0.9)) for i in range(4)))
            for r in results:
                assert len(r.response_ids) == len(r.behavior_logprobs) == len(r.token_versions) > 0
                assert set(r.token_versions) == {0}
                want = _hf_logprobs(arith_dir, prompt, r.response_ids, 0.9)
                assert max(abs(a - b) for a, b in zip(r.behavior_logprobs, want, strict=True)) < 2e-2
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(str(arith_dir)).state_dict()
            for version, mode in enumerate(("swap", "drain", "abort"), start=1):
                pending = [asyncio.ensure_future(engine.generate(GenRequest(10 + i, prompt, 6, 1.0))) for i in range(4)]
                await asyncio.sleep(0.01)
                await engine.load_weights(state, version, mode)  # type: ignore[arg-type]
                assert engine.version == version
                for r in await asyncio.gather(*pending):
                    assert r.token_versions == sorted(r.token_versions)
                    assert set(r.token_versions) <= {version - 1, version}
        finally:
            await engine.close()

    asyncio.run(run())
