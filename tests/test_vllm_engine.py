"""The in-process vLLM engine: importable without vLLM; generation and weight loading need vLLM and a GPU."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

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
