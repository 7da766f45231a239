"""`asyncflow serve` (real HTTP on a free loopback port, tiny model) and the openai engine against it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.engines.base import GenRequest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def server(make_server: Any) -> Any:
    return make_server(max_batch=64)


def call(url: str, body: Any = None, token: str | None = None, method: str | None = None) -> tuple[int, Any]:
    """(status, JSON reply) of one HTTP request (POST with a body, GET without)."""
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method or ("GET" if data is None else "POST"))
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def full_forward_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float() / temperature
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(response)]


def test_completions_with_text_and_token_id_prompts_match_a_full_forward_pass(server: Any, serve_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(serve_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(serve_dir))
    text_ids = list(tok("12+5=")["input_ids"])
    status, models = call(f"{server.url}/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"
    for prompt, ids in (("12+5=", text_ids), ([7, 8, 9, 10], [7, 8, 9, 10])):
        status, reply = call(f"{server.url}/v1/completions",
                             {"model": "any-name", "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "n": 3})
        assert status == 200, reply
        assert len(reply["choices"]) == 3
        for choice in reply["choices"]:
            out, lps = choice["token_ids"], choice["logprobs"]["token_logprobs"]
            assert 1 <= len(out) <= 8 and len(lps) == len(out)
            assert choice["finish_reason"] == ("stop" if out[-1] == tok.eos_token_id else "length")
            assert choice["token_versions"] == [0] * len(out)
            ref = full_forward_logprobs(model, ids, out, 0.7)
            assert max(abs(a - b) for a, b in zip(ref, lps, strict=True)) < 1e-4
        assert reply["usage"]["prompt_tokens"] == len(ids)  # the prompt once, as OpenAI and vLLM count (n=3)
    # greedy: the first token is the argmax of a full forward pass
    status, reply = call(f"{server.url}/v1/completions", {"prompt": text_ids, "max_tokens": 3, "temperature": 0})
    with torch.no_grad():
        first = int(model(torch.tensor([text_ids])).logits[0, -1].argmax())
    assert status == 200 and reply["choices"][0]["token_ids"][0] == first


def test_chat_completions_apply_the_chat_template_or_refuse_without_one(server: Any) -> None:
    status, reply = call(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})
    assert status == 400 and "chat template" in reply["error"]["message"]
    tok = server.app.tok
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        status, reply = call(f"{server.url}/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4, "temperature": 0})
    finally:
        tok.chat_template = None
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert 1 <= len(choice["token_ids"]) <= 4 and len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert reply["usage"]["prompt_tokens"] == len(tok("1+1=")["input_ids"])


def test_concurrent_requests_are_batched_not_served_one_by_one(server: Any) -> None:
    call(f"{server.url}/admin/pause", {})
    before = call(f"{server.url}/admin/stats")[1]
    bodies = [{"prompt": [5 + i % 20, 6, 7], "max_tokens": 12, "temperature": 1.0} for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(call, f"{server.url}/v1/completions", b) for b in bodies]
        call(f"{server.url}/admin/resume", {})  # all 16 are released together into the running batch
        results = [f.result(timeout=120) for f in futures]
    assert all(status == 200 for status, _ in results)
    after = call(f"{server.url}/admin/stats")[1]
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decode_rows"] - before["decode_rows"]
    # one by one, every decode step would carry exactly one row
    assert steps > 0 and rows / steps > 1.0


def _slow_without_eos(server: Any) -> Any:
    """The server's engine, made to decode 0.1 s a step and never stop at EOS (a 25-token choice
    then takes ~2.5 s), so a test can tell cancelled choices from ones left to decode."""
    import time

    engine = server.app.engine
    engine.eos = frozenset()
    original = engine._decode_step

    def slow() -> None:
        time.sleep(0.1)
        original()

    engine._decode_step = slow
    return engine


def test_a_timed_out_request_is_abandoned_not_decoded_to_its_end(server: Any) -> None:
    """A 504 cancels the request's choices in the engine: they leave the batch at the next step
    instead of decoding to `max_tokens` for nobody."""
    import time

    engine = _slow_without_eos(server)
    server.app.request_timeout_s = 0.3
    status, reply = call(f"{server.url}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 25, "n": 4})
    assert status == 504 and "timed out" in reply["error"]["message"]
    deadline = time.monotonic() + 1.5  # without the cancel, the 4 rows stay ~2 s more
    while engine.load() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.load() == 0


def test_a_client_that_disconnects_has_its_requests_cancelled(server: Any) -> None:
    """A client that closes its connection while its choices decode (a killed rollout worker, a
    client-side timeout): the server notices within `_GONE_POLL_S` and cancels them."""
    import socket
    import time

    engine = _slow_without_eos(server)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 25, "n": 4}).encode()
    host, port = server.http.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while engine.load() < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.load() == 4
    deadline = time.monotonic() + 1.2  # uncancelled, the 4 rows would decode ~2 s more
    while engine.load() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.load() == 0


def test_pause_holds_new_requests_until_resume(server: Any) -> None:
    assert call(f"{server.url}/admin/pause", {})[1] == {"paused": True}
    assert call(f"{server.url}/admin/version")[1]["paused"] is True
    got: list[tuple[int, Any]] = []
    t = threading.Thread(target=lambda: got.append(call(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})))
    t.start()
    t.join(timeout=1.0)
    assert t.is_alive() and not got  # held at the gate, not in the engine
    assert call(f"{server.url}/admin/stats")[1]["in_flight"] == 0
    assert call(f"{server.url}/admin/resume", {})[1] == {"paused": False}
    t.join(timeout=60)
    assert got and got[0][0] == 200


def test_load_weights_changes_outputs_and_version(server: Any, serve_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from asyncflow.tasks.arith import make_model, make_tokenizer

    new_dir = tmp_path / "new"
    make_model(make_tokenizer(), seed=1, hidden=64).save_pretrained(str(new_dir))  # tied lm_head left out
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    before = call(f"{server.url}/v1/completions", body)[1]["choices"][0]
    status, reply = call(f"{server.url}/admin/load_weights", {"path": str(new_dir), "version": 5})
    assert status == 200 and reply["version"] == 5
    assert call(f"{server.url}/admin/version")[1]["version"] == 5
    after = call(f"{server.url}/v1/completions", body)[1]["choices"][0]
    assert after["token_versions"] == [5] * len(after["token_ids"])
    assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]
    new_model = AutoModelForCausalLM.from_pretrained(str(new_dir)).eval()
    ref = full_forward_logprobs(new_model, [5, 6, 7], after["token_ids"], 1.0)
    assert max(abs(a - b) for a, b in zip(ref, after["logprobs"]["token_logprobs"], strict=True)) < 1e-4
    status, reply = call(f"{server.url}/admin/load_weights", {"path": str(tmp_path / "missing"), "version": 6})
    assert status == 400 and "safetensors" in reply["error"]["message"]
    assert call(f"{server.url}/admin/version")[1]["version"] == 5
    # NaN weights: refused (loaded, the first request stopped the decode thread and the server for good)
    from safetensors.torch import load_file, save_file

    bad = load_file(str(new_dir / "model.safetensors"))
    name = next(k for k, t in bad.items() if t.is_floating_point())
    bad[name][0] = float("nan")
    (tmp_path / "nan").mkdir()
    save_file(bad, str(tmp_path / "nan" / "model.safetensors"))
    status, reply = call(f"{server.url}/admin/load_weights", {"path": str(tmp_path / "nan"), "version": 7})
    assert status == 400 and f"weight {name} holds NaN" in reply["error"]["message"]
    assert call(f"{server.url}/v1/completions", body)[0] == 200 and call(f"{server.url}/health")[0] == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"max_tokens": 2}, "prompt"),
        ({"prompt": [5], "temperature": -1}, "temperature"),
        ({"prompt": [5], "stream": "yes"}, "stream"),
        ({"prompt": [5], "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [5], "seed": 3.5}, "seed"),
        ({"prompt": [5], "stop": ["a", ""]}, "stop"),
        ({"prompt": [5], "stop": ["a"] * 17}, "stop"),
        ({"prompt": [5], "n": 0}, "n:"),
        ({"prompt": [5, 999]}, "vocabulary"),
        ({"prompt": [5], "max_tokens": 10_000}, "context"),
        (b"{not json", "JSON"),
        # vLLM's extra sampling keys and top alternatives: refused, not silently ignored
        ({"prompt": [5], "ignore_eos": True}, "ignore_eos"),
        ({"prompt": [5], "min_tokens": 2}, "min_tokens"),
        ({"prompt": [5], "stop_token_ids": [7]}, "stop_token_ids"),
        ({"prompt": [5], "repetition_penalty": 2.0}, "repetition_penalty"),
        ({"prompt": [5], "logprobs": 21}, "logprobs: expected an integer in [0, 20]"),
        ({"prompt": [5], "logprobs": -3}, "logprobs: expected an integer in [0, 20]"),
        ({"prompt": [5], "top_logprobs": 3}, "top_logprobs: a chat field"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, "not valid JSON", id="deep JSON"),  # (RecursionError: a 500)
        ({"prompt": [[5, 6]] * 40, "n": 128}, "40 prompts x n=128 is more than 4096 choices"),  # (unbounded memory)
    ],
)
def test_bad_requests_get_openai_style_400s(server: Any, body: Any, needle: str) -> None:
    status, reply = call(f"{server.url}/v1/completions", body)
    assert status == 400
    assert needle in reply["error"]["message"] and reply["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in json.dumps(reply)
    assert call(f"{server.url}/v1/nowhere")[0] == 404
    assert call(f"{server.url}/v1/completions", {"prompt": [5]}, method="PUT")[0] == 405  # (was an HTML 501 page)


def test_requests_that_used_to_stop_the_engine_are_answered_and_it_keeps_serving(server: Any,
                                                                                tmp_path: Path) -> None:
    """A temperature of 1e-38 (logits / t overflowed to NaN probabilities) or a chat conversation that
    renders to no tokens raised inside the decode thread, which stopped the engine for good: every
    later request got 500 while /health said ok. Now the first samples greedily (below 1e-5, as vLLM)
    and the second is a 400; /health turns 503 if the engine does stop."""
    status, reply = call(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 1e-38})
    greedy = call(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0})[1]
    assert status == 200 and reply["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    tok = server.app.tok
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        status, reply = call(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]})
        assert status == 400 and "empty after the chat template" in reply["error"]["message"]
        # content as a list of text parts (OpenAI's format) is the text it holds, not its repr
        status, reply = call(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "1+"}, {"type": "text", "text": "1="}]}], "temperature": 0, "n": 2})
        assert status == 200 and reply["usage"]["prompt_tokens"] == len(tok("1+1=")["input_ids"])  # once, n=2
        assert len(reply["choices"][0]["token_ids"]) > 16 or reply["choices"][0]["finish_reason"] == "stop"
        status, reply = call(f"{server.url}/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
        assert status == 400 and "only text parts" in reply["error"]["message"]
    finally:
        tok.chat_template = None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_text("garbage")
    status, reply = call(f"{server.url}/admin/load_weights", {"path": str(tmp_path / "bad"), "version": 1})
    assert status == 400 and "cannot be read as safetensors" in reply["error"]["message"]
    with pytest.raises(ValueError, match="empty prompt"):  # (refused for its caller, not in the decode thread)
        server.app.engine.submit(GenRequest(99, [], 2))
    assert call(f"{server.url}/health") == (200, {"status": "ok"})
    assert call(f"{server.url}/v1/completions", {"prompt": [5], "max_tokens": 2})[0] == 200
    server.app.engine.error = RuntimeError("CUDA out of memory")  # as the decode thread records a failure
    status, reply = call(f"{server.url}/health")
    assert status == 503 and "CUDA out of memory" in reply["error"]["message"]
    server.app.engine.error = None


def test_a_chunked_request_body_gets_411_not_an_empty_prompt(server: Any) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.http.server_address[1], timeout=30)
    conn.request("POST", "/v1/completions", body=iter([b'{"prompt": [5], "max_tokens": 2}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 411 and "Content-Length" in json.loads(resp.read())["error"]["message"]
    conn.close()


def test_a_token_is_required_off_loopback_and_checked_on_every_request(serve_dir: Path, make_server: Any) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncflow", "serve", str(serve_dir), "--host", "0.0.0.0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--token" in proc.stderr and "Traceback" not in proc.stderr
    s = make_server(token="s3cret")
    for path in ("/v1/models", "/admin/version"):
        status, reply = call(f"{s.url}{path}")
        assert status == 401 and reply["error"]["type"] == "authentication_error"
        assert call(f"{s.url}{path}", token="wrong")[0] == 401
        assert call(f"{s.url}{path}", token="s3cret")[0] == 200
    for header in ("bearer s3cret", "BEARER  s3cret"):  # the scheme is case-insensitive (RFC 7235)
        assert _raw(s, f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {header}\r\n\r\n")[0] == 200
    # with a token, a web page that has it may call (the browser had to ask before sending it)
    assert _raw(s, "GET /v1/models HTTP/1.1\r\nHost: example.org\r\nOrigin: https://example.org\r\n"
                   "Authorization: Bearer s3cret\r\n\r\n")[0] == 200
    assert call(f"{s.url}/admin/pause", {})[0] == 401
    assert call(f"{s.url}/v1/completions", {"prompt": [5], "max_tokens": 1}, token="s3cret")[0] == 200


def test_openai_engine_generates_and_syncs_weights_through_asyncflow_serve(server: Any, serve_dir: Path,
                                                                           tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from asyncflow.engines.openai_engine import OpenAIEngine
    from asyncflow.engines.server_sync import AsyncflowSync, WeightFolderWriter

    model = AutoModelForCausalLM.from_pretrained(str(serve_dir)).eval()
    engine = OpenAIEngine(server.url, sync=AsyncflowSync(), writer=WeightFolderWriter(tmp_path / "sync", serve_dir, in_place=False),
                          server_type="asyncflow", request_timeout_s=60, sync_timeout_s=60)

    async def scenario() -> tuple[Any, Any, float]:
        await engine.connect(None)
        res = await asyncio.gather(*(engine.generate(GenRequest(i, [5, 6, 7 + i], 6, 0.8)) for i in range(4)))
        state = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
        seconds = await engine.load_weights(state, 3, "swap")
        after = await engine.generate(GenRequest(9, [5, 6], 3, 1.0))
        return res, after, seconds

    res, after, seconds = asyncio.run(scenario())
    assert engine.model == "tiny" and seconds >= 0
    for i, r in enumerate(res):
        ref = full_forward_logprobs(model, [5, 6, 7 + i], r.response_ids, 0.8)
        assert max(abs(a - b) for a, b in zip(ref, r.behavior_logprobs, strict=True)) < 1e-4
        assert r.token_versions == [0] * len(r.response_ids)
    assert engine.version == 3 and after.token_versions == [3] * len(after.response_ids)
    assert call(f"{server.url}/admin/version")[1]["version"] == 3
    assert (tmp_path / "sync" / "v000003" / "model.safetensors").is_file()
    assert (tmp_path / "sync" / "v000003" / "config.json").is_file()


def test_asyncflow_serve_loads_versions_written_over_old_ones_on_a_memory_file_system(server: Any,
                                                                                        serve_dir: Path) -> None:
    """The writer reuses the file of the version two back once the server's maps of it are gone, and
    the server holds every version's weights exactly."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from asyncflow.engines.openai_engine import OpenAIEngine
    from asyncflow.engines.server_sync import AsyncflowSync, WeightFolderWriter, on_memory_fs

    if not on_memory_fs(Path("/dev/shm")):
        pytest.skip("no memory file system at /dev/shm")
    model = AutoModelForCausalLM.from_pretrained(str(serve_dir)).eval()
    with tempfile.TemporaryDirectory(prefix="asyncflow-test-", dir="/dev/shm") as shm:
        writer = WeightFolderWriter(Path(shm) / "sync", serve_dir, in_place=False, reuse_files=True)
        engine = OpenAIEngine(server.url, sync=AsyncflowSync(), writer=writer, server_type="asyncflow",
                              request_timeout_s=60, sync_timeout_s=60)

        async def publish(versions: range) -> None:
            await engine.connect(None)
            for v in versions:
                state = {k: t + 0.01 * v for k, t in model.state_dict().items()}
                await engine.load_weights(state, v, "swap")
                held = server.app.engine.model.state_dict()
                assert all(torch.equal(held[k], t.to(held[k].dtype)) for k, t in state.items()), v

        asyncio.run(publish(range(1, 5)))
        assert writer.reused == 2 and sorted(p.name for p in (Path(shm) / "sync").glob("v*")) == ["v000003", "v000004"]
    assert call(f"{server.url}/admin/version")[1]["version"] == 4


@pytest.mark.slow
def test_train_with_the_openai_engine_against_a_real_asyncflow_serve(
        arith_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import queue

    import asyncflow.workflow.logprob_probe as probe
    from asyncflow.config import load_config
    from asyncflow.runner import train

    gaps: list[Any] = []
    real_probe = probe.check_server_logprobs

    async def recorded(*args: Any) -> Any:
        gaps.append(await real_probe(*args))
        return gaps[-1]

    monkeypatch.setattr(probe, "check_server_logprobs", recorded)
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow", "serve", str(arith_dir), "--port", "0", "--max-batch", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    try:
        line = lines.get(timeout=120)
        assert "listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ")[1].split()[0]
        out = tmp_path / "run"
        cfg, _ = load_config(None, ["task=arith",
            "train.max_steps=3", "train.batch_size=16", "rollout.n=4", "rollout.max_new_tokens=4", "eval.size=16",
            "eval.every=0", "logging.progress=false", f"model.path={arith_dir}", "rollout.engine=openai",
            f"rollout.server_urls=[{url}]", "rollout.request_timeout_s=120", "rollout.sync_timeout_s=120",
            "rollout.temperature=0.8",  # (not 1: the start-up log-prob probe runs, and asyncflow serve passes it)
        ])
        summary = train(cfg, out, progress_enabled=False)
        assert len(gaps) == 1 and gaps[0] is not None and gaps[0][0] < 1e-4 < gaps[0][1]  # probed: scaled log-probs
        metrics = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in metrics if r["kind"] == "train"]
        assert [r["policy_version"] for r in steps] == [1, 2, 3]
        assert summary["samples"] == 48 and all(r["staleness_max"] <= 1 for r in steps)
        samples = [json.loads(r) for r in (out / "samples.jsonl").read_text().splitlines()]
        trained = [s for s in samples if s["status"] == "trained"]
        assert len(trained) == 48 and max(s["behavior_version"] for s in trained) >= 1  # later steps used synced weights
        assert call(f"{url}/admin/version")[1]["version"] == 3  # the server holds the last published weights
        assert (out / "weight_sync" / "v000003" / "model.safetensors").is_file()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _raw(server: Any, request: str, body: bytes = b"") -> tuple[int, Any, bytes]:
    """(status, JSON reply, raw bytes) of one request written as it is on a fresh connection."""
    import socket

    host, port = server.http.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(request.encode("latin-1") + body)
        raw = b""
        while chunk := client.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload) if payload else None, raw


def test_without_a_token_web_pages_and_other_host_names_are_refused(server: Any) -> None:
    """A loopback server without a token answered any page the user had open: a browser sends a
    text/plain POST cross-site unasked (pause, load weights from any folder, generate), and a page
    whose name re-resolves to 127.0.0.1 (DNS rebinding) could read the replies."""
    body = b'{"prompt": [5], "max_tokens": 1}'
    post = ("POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    port = server.http.server_address[1]
    status, reply, _ = _raw(server, post.format(host=f"127.0.0.1:{port}", extra="Origin: https://evil.example\r\n"), body)
    assert status == 403 and "--token" in reply["error"]["message"]
    status, reply, _ = _raw(server, "POST /admin/pause HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: null\r\n"
                                    "Content-Length: 0\r\n\r\n")
    assert status == 403 and call(f"{server.url}/admin/version")[1]["paused"] is False
    status, reply, _ = _raw(server, f"GET /admin/version HTTP/1.1\r\nHost: rebind.evil.example:{port}\r\n\r\n")
    assert status == 403 and "rebind.evil.example" in reply["error"]["message"]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "app.localhost"):
        assert _raw(server, post.format(host=host, extra=""), body)[0] == 200, host


def test_the_standard_librarys_own_refusals_are_json_too(server: Any) -> None:
    """A malformed request line, an over-long header and HEAD/OPTIONS got its HTML page (the first
    without even a status line)."""
    status, reply, raw = _raw(server, "GARBAGE\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400") and reply["error"]["type"] == "invalid_request_error"
    status, reply, _ = _raw(server, "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + "a" * 70_000 + "\r\n\r\n")
    assert status == 431 and "error" in reply
    status, reply, _ = _raw(server, "OPTIONS /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 405 and "OPTIONS" in reply["error"]["message"]
    status, reply, raw = _raw(server, "HEAD /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 405 and reply is None  # headers only


def test_chat_takes_max_completion_tokens_when_max_tokens_is_null(server: Any) -> None:
    """Clients that send unset fields as null: `max_completion_tokens` was ignored and the choice ran
    to the end of the context."""
    server.app.engine.eos = frozenset()  # (never stops early: only the limit ends the choice)
    tok = server.app.tok
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        status, reply = call(f"{server.url}/v1/chat/completions", {
            "messages": [{"role": "user", "content": "1+1="}], "max_tokens": None, "max_completion_tokens": 2})
    finally:
        tok.chat_template = None
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_a_paused_request_whose_client_left_is_never_generated(server: Any) -> None:
    """It held its thread until the pause ended (or the 600 s timeout), then its choices were prefilled
    for nobody."""
    import socket
    import time

    assert call(f"{server.url}/admin/pause", {})[0] == 200
    uid_before = server.app._uid
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "n": 8}).encode()
    host, port = server.http.server_address[:2]
    with socket.create_connection((host, port), timeout=30) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)
    time.sleep(1.0)  # four times the paused request's check for its client (_GONE_POLL_S)
    assert call(f"{server.url}/admin/resume", {})[0] == 200
    time.sleep(0.3)
    assert server.app._uid == uid_before and server.app.engine.load() == 0


def test_weight_loads_are_one_at_a_time_and_a_timed_out_one_never_takes_effect(server: Any, serve_dir: Path,
                                                                              tmp_path: Path) -> None:
    """Two loads at once: the first was superseded by the second before it was used and answered 200
    with the old version. A load answered 504 stayed queued and took effect after the caller was told
    it had not."""
    import time

    from asyncflow.tasks.arith import make_model, make_tokenizer

    new_dir = tmp_path / "new"
    make_model(make_tokenizer(), seed=1, hidden=64).save_pretrained(str(new_dir))
    engine = _slow_without_eos(server)
    busy = threading.Thread(target=call, args=(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 15}))
    busy.start()  # ~1.5 s of decoding: a drain load waits for it
    while engine.load() == 0:
        time.sleep(0.02)
    replies: dict[int, tuple[int, Any]] = {}

    def load(version: int) -> None:
        replies[version] = call(f"{server.url}/admin/load_weights", {"path": str(new_dir), "version": version,
                                                                     "mode": "drain"})

    first = threading.Thread(target=load, args=(5,))
    first.start()
    time.sleep(0.3)
    second = threading.Thread(target=load, args=(6,))
    second.start()
    for t in (first, second, busy):
        t.join(timeout=60)
    assert replies[5][0] == 200 and replies[5][1]["version"] == 5, replies[5]
    assert replies[6][0] == 200 and replies[6][1]["version"] == 6
    busy = threading.Thread(target=call, args=(f"{server.url}/v1/completions", {"prompt": [5, 6], "max_tokens": 15}))
    busy.start()
    while engine.load() == 0:
        time.sleep(0.02)
    server.app.request_timeout_s = 0.4
    status, reply = call(f"{server.url}/admin/load_weights", {"path": str(new_dir), "version": 9, "mode": "drain"})
    assert status == 504 and "withdrawn and version 6 stays" in reply["error"]["message"]
    busy.join(timeout=60)
    time.sleep(0.3)
    assert engine.version == 6 and call(f"{server.url}/admin/version")[1]["version"] == 6


def test_a_weight_load_that_begins_but_never_finishes_is_a_504(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The second wait (a load already being copied in, so not withdrawn) raised a bare TimeoutError:
    a 500 "internal error" instead of the timeout's 504."""
    import concurrent.futures as cf
    import types

    import asyncflow.serve as serve_mod
    from asyncflow.serve import OpenAIServer, RequestError

    never: cf.Future[float] = cf.Future()
    engine = types.SimpleNamespace(
        model=types.SimpleNamespace(get_input_embeddings=lambda: types.SimpleNamespace(weight=torch.zeros(4, 2))),
        version=3, request_weights=lambda state, version, mode: never, withdraw_weights=lambda done: False)
    monkeypatch.setattr(serve_mod, "read_weights", lambda path, model, root=None: {})
    app = OpenAIServer(engine, None, "tiny", request_timeout_s=0.05)
    with pytest.raises(RequestError, match="began but did not finish within 0.05 s more; version 3 is loaded") as info:
        app._load_weights({"path": str(tmp_path), "version": 4, "mode": "swap"})
    assert info.value.status == 504
