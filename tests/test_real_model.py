"""The real pretrained model (SmolLM2-135M-Instruct, prepared once by scripts/test.sh) through the
whole system, a few steps each: training the chat_arith task with a checkpoint and a resume, the
report of that run, `asyncflow serve` answering with the model's chat template, and the agent proxy
refusing `tools` its chat template cannot render."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

FEW = ["train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=24", "eval.size=8", "eval.every=0",
       "logging.progress=false"]


def _rows(out: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_chat_arith_trains_the_real_model_checkpoints_and_resumes(smollm2_dir: Path, tmp_path: Path) -> None:
    from asyncflow.config import load_config
    from asyncflow.runner import train
    from asyncflow.telemetry.report import write_report

    out = tmp_path / "run"
    sets = [f"model.path={smollm2_dir}", f"model.cache_dir={tmp_path / 'cache'}", *FEW, "checkpoint.every=1"]
    cfg, _ = load_config(Path("examples/smollm2_chat_arith.yaml"), [*sets, "train.max_steps=1"])
    train(cfg, out, progress_enabled=False)
    assert (out / "checkpoints" / "step_1").is_dir()
    cfg, _ = load_config(Path("examples/smollm2_chat_arith.yaml"), [*sets, "train.max_steps=2", "checkpoint.resume=auto"])
    summary = train(cfg, out, progress_enabled=False)
    assert [r["step"] for r in _rows(out, "train")] == [1, 2]
    assert summary["accounting"]["lost"] == 0 and summary["samples"] == 2 * 16
    evals = _rows(out, "eval")
    assert evals and all("eval_lenient_accuracy" in r and r["eval_size"] == 8 for r in evals)
    final = json.loads((out / "final" / "config.json").read_text())
    assert final["model_type"] == "llama" and final["dtype"] == "bfloat16"  # (the task's model.dtype)
    png, md = write_report([out], log=lambda line: None)
    assert png.stat().st_size > 10_000 and "eval" in md.read_text()


def test_serve_answers_chat_requests_through_the_models_chat_template(smollm2_dir: Path) -> None:
    from tests.conftest import InProcessServer

    server = InProcessServer(smollm2_dir)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 32,
                "temperature": 0}
        req = urllib.request.Request(f"{server.url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            reply = json.loads(resp.read())
    finally:
        server.close()
    choice = reply["choices"][0]
    assert "4" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert choice["token_ids"][-1] == 2  # (<|im_end|>: the template's end of turn, the model's EOS)


def test_the_agent_proxy_refuses_tools_that_the_models_chat_template_cannot_render(smollm2_dir: Path) -> None:
    """SmolLM2's ChatML template has no tool section: a black-box agent's `tools` would never reach the
    model, so the proxy answers 400 naming it rather than silently dropping them."""
    import asyncio

    from asyncflow.clock import RealClock
    from asyncflow.tokenizer import Tokenizer, load_tokenizer
    from asyncflow.workflow.agent_proxy import EpisodeRecorder, RecorderSettings, RequestError

    tok = Tokenizer.of(load_tokenizer(smollm2_dir), smollm2_dir)
    assert tok.hf.chat_template and "tools" not in tok.hf.chat_template
    settings = RecorderSettings(max_new_tokens=8, temperature=1.0, train_temperature=1.0, request_timeout_s=30.0,
                                max_calls=4)
    recorder = EpisodeRecorder(engine=None, tok=tok, uid=0, settings=settings, clock=RealClock())  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with pytest.raises(RequestError, match="the policy's chat template does not render tools"):
        asyncio.run(recorder.chat({"messages": [{"role": "user", "content": "What is 2 + 2?"}], "tools": tools}))
