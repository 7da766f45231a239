"""Issue 35: the start-up probe refuses a server whose log-probs ignore the temperature (vLLM's default
raw log-probs), against a tiny fake server here, and lets `asyncflow serve` through."""

from __future__ import annotations

import asyncio
import copy
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.engines.openai_engine import OpenAIEngine
from asyncflow.engines.server_sync import AsyncflowSync, VLLMSync, WeightFolderWriter
from asyncflow.engines.torch_train import TorchTrainEngine
from asyncflow.errors import UserError
from asyncflow.workflow.batch import build_train_batch
from asyncflow.workflow.logprob_probe import check_server_logprobs, probe_needed

PROMPT, REPLY = [3, 4, 5], [7, 8, 9, 1]


class FakeVLLM:
    """Answers every completion with REPLY and the log-probs it is given (vLLM's token_id:N tokens)."""

    def __init__(self, logprobs: list[float]) -> None:
        body = json.dumps({"choices": [{"finish_reason": "stop", "logprobs": {
            "token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in REPLY]}}]}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture()
def trainer(tiny_model: torch.nn.Module) -> Iterator[TorchTrainEngine]:
    t = TorchTrainEngine(copy.deepcopy(tiny_model), lr=0.0)
    yield t
    t.close()


def _model_logprobs(trainer: TorchTrainEngine, temperature: float) -> list[float]:
    batch = build_train_batch([PROMPT], [REPLY], [[0.0] * len(REPLY)], torch.zeros(1), [True], 0)
    lp = trainer.logprobs(batch, temperature)[0]
    return [float(lp[len(PROMPT) - 1 + j]) for j in range(len(REPLY))]


def _probe(url: str, trainer: TorchTrainEngine, tmp_path: Path, temperature: float) -> Any:
    engine = OpenAIEngine(url, sync=VLLMSync(), writer=WeightFolderWriter(tmp_path, tmp_path, in_place=True),
                          server_type="vllm", model="m", request_timeout_s=30)
    return asyncio.run(check_server_logprobs(engine, trainer, PROMPT, temperature))


def test_a_server_reporting_unscaled_logprobs_is_refused_with_the_vllm_flag(
        trainer: TorchTrainEngine, tmp_path: Path) -> None:
    fake = FakeVLLM(_model_logprobs(trainer, 1.0))  # vLLM's default: softmax(logits), whatever the temperature
    try:
        with pytest.raises(UserError) as info:
            _probe(fake.url, trainer, tmp_path, 0.6)
    finally:
        fake.close()
    msg = str(info.value)
    assert msg.startswith(f"rollout.server_urls: {fake.url} reports log-probs not scaled by rollout.temperature=0.6")
    assert msg.endswith("--logprobs-mode processed_logprobs") and "\n" not in msg


def test_a_server_reporting_the_sampled_distributions_logprobs_passes(
        trainer: TorchTrainEngine, tmp_path: Path) -> None:
    fake = FakeVLLM(_model_logprobs(trainer, 0.6))
    try:
        far_scaled, far_raw = _probe(fake.url, trainer, tmp_path, 0.6)
    finally:
        fake.close()
    assert far_scaled < 1e-6 < far_raw
    assert probe_needed("openai", 0.6) and not probe_needed("openai", 1.0) and not probe_needed("hf", 0.6)


def test_asyncflow_serve_passes_the_probe(tmp_path: Path) -> None:
    from asyncflow.serve_main import make_app, start_http
    from asyncflow.tasks.arith import make_model, make_tokenizer

    folder = tmp_path / "tiny-arith"
    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    app = make_app(folder, model_name="tiny", token=None, max_batch=8)
    server, _ = start_http(app, "127.0.0.1", 0)
    trainer = TorchTrainEngine(folder, lr=0.0)
    try:
        engine = OpenAIEngine(f"http://127.0.0.1:{server.server_address[1]}", sync=AsyncflowSync(),
                              writer=WeightFolderWriter(tmp_path / "sync", folder, in_place=False),
                              server_type="asyncflow", model="tiny", request_timeout_s=60)
        prompt = tok("12+7=")["input_ids"]
        gaps = asyncio.run(check_server_logprobs(engine, trainer, prompt, 0.6))
        assert gaps is not None and gaps[0] < 1e-4 < gaps[1]  # it replied, with the sampled distribution's
    finally:
        server.shutdown()
        server.server_close()
        app.engine.shutdown()
        trainer.close()
