"""Weight-sync backends and the openai engine's config, against a fake HTTP server.

vLLM and SGLang cannot run here (no GPU): these tests check the requests their backends send
match those servers' documented HTTP APIs, and how replies are parsed. The asyncflow backend is
also exercised against a real `asyncflow serve` (tests/test_serve.py)."""

from __future__ import annotations

import asyncio
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.config import load_config
from asyncflow.engines.base import GenRequest
from asyncflow.engines.http_client import HTTPError, request_json
from asyncflow.engines.openai_engine import OpenAIEngine, parse_choice
from asyncflow.engines.server_sync import SGLangSync, VLLMSync, WeightFolderWriter, make_weight_sync
from asyncflow.errors import UserError, WaitTimeout


class FakeServer:
    """Records every request; answers from `replies[path]` (default `{}`), status `statuses[path]` (200)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, Any, str | None]] = []
        self.replies: dict[str, Any] = {}
        self.statuses: dict[str, int] = {}
        self.delay = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def _answer(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.seen.append((method, self.path, body, self.headers.get("Authorization")))
                route = self.path.split("?")[0]
                if route == "/slow":
                    fake.delay.wait(timeout=30)
                data = json.dumps(fake.replies.get(route, {})).encode()
                self.send_response(fake.statuses.get(route, 200))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.delay.set()
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture()
def fake() -> Iterator[FakeServer]:
    f = FakeServer()
    try:
        yield f
    finally:
        f.close()


def test_vllm_sync_pauses_reloads_from_disk_and_resumes(fake: FakeServer, tmp_path: Path) -> None:
    asyncio.run(VLLMSync().load(fake.url, tmp_path, 4, "swap", token="t", timeout=10))
    assert [(m, p) for m, p, _, _ in fake.seen] == [
        ("POST", "/pause?mode=keep"), ("POST", "/collective_rpc"), ("POST", "/resume")]
    assert fake.seen[1][2]["method"] == "reload_weights"
    assert all(auth == "Bearer t" for *_, auth in fake.seen)
    fake.seen.clear()
    asyncio.run(VLLMSync().load(fake.url, tmp_path, 5, "drain", token=None, timeout=10))
    assert fake.seen[0][1] == "/pause?mode=wait" and fake.seen[0][3] is None
    assert VLLMSync.PAUSE_MODES["abort"] == "abort"


def test_vllm_sync_resumes_even_when_the_reload_fails(fake: FakeServer, tmp_path: Path) -> None:
    fake.statuses["/collective_rpc"] = 500
    fake.replies["/collective_rpc"] = {"detail": "no such method"}
    with pytest.raises(HTTPError, match="no such method"):
        asyncio.run(VLLMSync().load(fake.url, tmp_path, 4, "abort", token=None, timeout=10))
    assert [p for _, p, _, _ in fake.seen] == ["/pause?mode=abort", "/collective_rpc", "/resume"]


def test_vllm_sync_resumes_when_the_pause_itself_times_out(
    fake: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pause that times out may still take effect on the server: the resume is sent regardless
    (it used to be sent only once the pause had answered, leaving such a server paused)."""
    import asyncflow.engines.server_sync as sync

    async def pause_times_out(method: str, url: str, body: Any, **kw: Any) -> Any:
        if "/pause" in url:
            raise WaitTimeout("timed out after 0.1 s waiting for /pause")
        return await request_json(method, url, body, **kw)

    monkeypatch.setattr(sync, "request_json", pause_times_out)
    with pytest.raises(WaitTimeout, match="/pause"):
        asyncio.run(VLLMSync().load(fake.url, tmp_path, 4, "drain", token=None, timeout=10))
    assert [p for _, p, _, _ in fake.seen] == ["/resume"]


def test_vllm_sync_reports_the_pause_error_when_the_resume_fails_too(fake: FakeServer, tmp_path: Path) -> None:
    fake.statuses["/pause"] = 404  # e.g. a server started without VLLM_SERVER_DEV_MODE
    fake.replies["/pause"] = {"detail": "pause route not found"}
    fake.statuses["/resume"] = 404
    fake.replies["/resume"] = {"detail": "resume route not found"}
    with pytest.raises(HTTPError, match="pause route not found"):
        asyncio.run(VLLMSync().load(fake.url, tmp_path, 4, "swap", token=None, timeout=10))
    assert [p for _, p, _, _ in fake.seen] == ["/pause?mode=keep", "/resume"]


def test_sglang_sync_posts_update_weights_from_disk(fake: FakeServer, tmp_path: Path) -> None:
    fake.replies["/update_weights_from_disk"] = {"success": True, "message": "ok"}
    asyncio.run(SGLangSync().load(fake.url, tmp_path, 7, "abort", token=None, timeout=10))
    method, path, body, _ = fake.seen[0]
    assert (method, path) == ("POST", "/update_weights_from_disk")
    assert body == {"model_path": str(tmp_path.resolve()), "abort_all_requests": True, "weight_version": "7"}
    asyncio.run(SGLangSync().load(fake.url, tmp_path, 8, "swap", token=None, timeout=10))
    assert fake.seen[1][2]["abort_all_requests"] is False
    fake.replies["/update_weights_from_disk"] = {"success": False, "message": "bad shape"}
    with pytest.raises(HTTPError, match="bad shape"):
        asyncio.run(SGLangSync().load(fake.url, tmp_path, 9, "swap", token=None, timeout=10))


def test_asyncflow_sync_and_factory(fake: FakeServer, tmp_path: Path) -> None:
    fake.replies["/admin/load_weights"] = {"version": 2, "seconds": 0.1}
    asyncio.run(make_weight_sync("asyncflow").load(fake.url, tmp_path, 2, "drain", token=None, timeout=10))
    assert fake.seen[0][1:3] == ("/admin/load_weights", {"path": str(tmp_path.resolve()), "version": 2, "mode": "drain"})
    assert isinstance(make_weight_sync("sglang"), SGLangSync) and make_weight_sync("vllm").in_place
    with pytest.raises(ValueError, match="unknown server type"):
        make_weight_sync("tgi")


def test_every_http_call_has_a_deadline(fake: FakeServer) -> None:
    with pytest.raises(WaitTimeout, match="timed out after 0.3 s"):
        asyncio.run(request_json("POST", f"{fake.url}/slow", {}, timeout=0.3))
    with pytest.raises(HTTPError, match="cannot connect"):
        asyncio.run(request_json("GET", "http://127.0.0.1:1/v1/models", timeout=5))


@pytest.mark.parametrize(("reply", "needle"), [
    (b"", "closed the connection without a reply"),  # (a server killed mid-request)
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\n{\"a\"", "connection was lost mid-reply (IncompleteReadError"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n{}", "connection was lost mid-reply (ValueError"),
    # chunked, cut at a chunk boundary: it read as the end of the body ("not JSON: b'{\\"a\\": '")
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\n{\"a\": \r\n",
     "connection was lost mid-reply (EOFError: the chunked body ended before its last chunk"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\n{\"a\": ", "connection was lost mid-reply (EOFError"),
    # a redirect was success: a weight sync through a redirecting proxy did nothing and passed
    (b"HTTP/1.1 302 Found\r\nLocation: https://x/v1/models\r\nContent-Length: 0\r\n\r\n",
     "HTTP 302, a redirect to https://x/v1/models: give the final URL"),
])
def test_a_connection_lost_mid_reply_is_an_http_error_naming_the_call(reply: bytes, needle: str) -> None:
    """A reset, a cut-short body or a bad Content-Length escaped as ConnectionResetError,
    IncompleteReadError or ValueError: a traceback where the run prints one line for an HTTPError."""

    async def main() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(HTTPError, match=r"^GET http://127.0.0.1:\d+/v1/models: .*" + re.escape(needle)):
                await request_json("GET", f"http://127.0.0.1:{port}/v1/models", timeout=10)
        finally:
            server.close()

    asyncio.run(main())


def test_vllm_style_replies_give_token_ids_and_the_sent_version() -> None:
    reply = {"choices": [{"text": "ab", "finish_reason": "stop",
                          "logprobs": {"tokens": ["token_id:5", "token_id:1"], "token_logprobs": [-0.5, -0.1]}}]}
    assert parse_choice(reply, 3, "x") == ([5, 1], [-0.5, -0.1], [3, 3], "stop")
    reply = {"choices": [{"token_ids": [4], "finish_reason": "abort", "logprobs": {"token_logprobs": [-1.0]}}]}
    assert parse_choice(reply, 0, "x")[3] == "cancelled"
    with pytest.raises(HTTPError, match="exact ids"):
        parse_choice({"choices": [{"text": "a", "logprobs": {"tokens": ["a"], "token_logprobs": [-1.0]}}]}, 0, "x")
    # what the trainer indexes with is checked: a float id was truncated, a null version or a string id
    # was a traceback, a short version list or a negative id failed later inside the trainer
    def choice(**kw: Any) -> dict[str, Any]:
        return {"choices": [{"finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5, -0.1]},
                             "token_ids": [5, 1], **kw}]}

    with pytest.raises(HTTPError, match="exact ids"):  # (an int where the list belongs was a TypeError traceback)
        parse_choice(choice(token_ids=5), 0, "x")
    for bad, needle in (({"token_ids": [5.7, 1]}, "token ids are not all non-negative integers (e.g. 5.7)"),
                        ({"token_ids": ["a", "b"]}, "token ids are not all non-negative integers (e.g. 'a')"),
                        ({"token_ids": [5, -3]}, "token ids are not all non-negative integers (e.g. -3)"),
                        ({"token_versions": [0, None]}, "token_versions are not one integer per generated token (2 for 2"),
                        ({"token_versions": [0]}, "token_versions are not one integer per generated token (1 for 2"),
                        ({"logprobs": {"token_logprobs": [-0.5, float("nan")]}}, "token_logprobs are not all finite")):
        with pytest.raises(HTTPError, match=r"^x/v1/completions: the reply's " + re.escape(needle)):
            parse_choice(choice(**bad), 0, "x")
    assert parse_choice(choice(token_versions=[2, 3]), 0, "x") == ([5, 1], [-0.5, -0.1], [2, 3], "stop")


def test_openai_engine_request_and_cancel_floor(fake: FakeServer, tmp_path: Path) -> None:
    fake.replies["/v1/completions"] = {"choices": [
        {"token_ids": [5, 1], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.2, -0.3]}}]}
    engine = OpenAIEngine(fake.url, sync=VLLMSync(), writer=WeightFolderWriter(tmp_path, tmp_path, in_place=True),
                          server_type="vllm", model="m", max_batch=8, request_timeout_s=10)
    res = asyncio.run(engine.generate(GenRequest(1, [3, 4], 5, 0.0, 0.9, 7)))
    body = fake.seen[0][2]
    assert body["prompt"] == [3, 4] and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["top_p"] == 0.9 and body["top_k"] == 7 and body["return_token_ids"] is True and body["model"] == "m"
    assert (res.response_ids, res.token_versions, res.finish_reason) == ([5, 1], [0, 0], "stop")
    engine.cancel_older_than(1)  # a reply whose oldest token is older than the floor ends as cancelled
    assert asyncio.run(engine.generate(GenRequest(2, [3], 5))).finish_reason == "cancelled"
    assert asyncio.run(engine.generate(GenRequest(-1, [3], 5))).finish_reason == "stop"  # an evaluation's: kept


def test_in_place_writer_refuses_a_sharded_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    writer = WeightFolderWriter(tmp_path, tmp_path, in_place=True)
    with pytest.raises(RuntimeError, match="sharded"):
        asyncio.run(writer.folder_for({"w": torch.zeros(2)}, 1))


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["rollout.engine=openai"], "rollout.server_urls: rollout.engine=openai needs"),
        (["rollout.server_urls=[http://a:1]"], "only used with rollout.engine=openai"),
        (["rollout.engine=openai", "rollout.server_urls=[ftp://a]"], "not an http"),
        (["rollout.engine=openai", "rollout.server_urls=http://a:1"], "expected a list"),
        (["rollout.engine=openai", "rollout.server_urls=[http://a:1, http://a:1/]"], "listed twice"),
        (["rollout.engine=openai", "rollout.server_urls=[http://a:1]", "rollout.workers=2"], "rollout.workers"),
        (["rollout.engine=openai", "rollout.server_urls=[http://a:1]", "rollout.server_type=vllm"], "rollout.sync_dir"),
        (["rollout.sync_dir=/tmp/x"], "rollout.sync_dir: only used"),
    ],
)
def test_invalid_openai_engine_settings_are_refused_at_load(sets: list[str], needle: str) -> None:
    with pytest.raises(UserError, match=None) as info:
        load_config(None, ["task=arith", *sets])
    assert needle in str(info.value)


def test_openai_engine_resolves_one_worker_per_server() -> None:
    cfg, _ = load_config(None, ["task=arith", "rollout.engine=openai", "rollout.server_urls=[http://a:1, http://b:2]"])
    assert cfg.rollout.workers == 2 and cfg.rollout.server_type == "asyncflow"


def test_a_chunked_reply_with_trailer_fields_is_read_whole() -> None:
    async def main() -> Any:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"4;ext=1\r\n{\"a\"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\nX-Checksum: 7\r\n\r\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await request_json("GET", f"http://127.0.0.1:{port}/v1/models", timeout=10)
        finally:
            server.close()

    assert asyncio.run(main()) == {"a": 1}


def test_an_ipv6_server_gets_its_host_header_in_brackets() -> None:
    """`Host: ::1:PORT` (no brackets) is refused by strict front ends such as nginx."""
    seen: list[bytes] = []

    async def main() -> Any:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "::1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            return await request_json("GET", f"http://[::1]:{port}/v1/models", timeout=10), port
        finally:
            server.close()

    reply, port = asyncio.run(main())
    assert reply == {} and f"\r\nHost: [::1]:{port}\r\n".encode() in seen[0]


def test_a_model_list_that_names_no_model_id_is_one_line(fake: FakeServer, tmp_path: Path) -> None:
    """`/v1/models` answering without `data[0].id` (a proxy's own shape) was a KeyError/TypeError traceback."""
    engine = OpenAIEngine(fake.url, sync=VLLMSync(), writer=WeightFolderWriter(tmp_path, tmp_path, in_place=True),
                          server_type="vllm", max_batch=8, request_timeout_s=10)
    for data, needle in (([{"name": "m"}], "does not name its model as data[0].id"),
                         (["m"], "does not name its model as data[0].id"),
                         ({"x": 1}, "lists no model"), ([], "lists no model")):
        fake.replies["/v1/models"] = {"data": data}
        with pytest.raises(UserError, match=r"^rollout.server_urls: http://127.0.0.1:\d+/v1/models " + re.escape(needle)):
            asyncio.run(engine.connect(None))
    fake.replies["/v1/models"] = {"data": [{"id": "tiny"}]}
    asyncio.run(engine.connect(None))
    assert engine.model == "tiny"


def test_concurrent_requests_of_one_sample_are_each_counted_in_flight(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """An agent's concurrent calls carry their sample's uid: keyed by it, the first call to end took
    the other, still generating, out of `load()` and out of `cancel_older_than`'s count."""
    import asyncflow.engines.openai_engine as oe

    delays = iter([0.05, 0.5])

    async def slow_server(method: str, url: str, body: Any = None, **kw: Any) -> Any:
        await asyncio.sleep(next(delays))
        return {"choices": [{"token_ids": [5, 1], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.1, -0.2]}}]}

    monkeypatch.setattr(oe, "request_json", slow_server)
    engine = OpenAIEngine("http://x", sync=VLLMSync(), writer=WeightFolderWriter(tmp_path, tmp_path, in_place=True),
                          server_type="asyncflow", model="m", max_batch=8, request_timeout_s=10)

    async def main() -> tuple[int, int, int]:
        calls = [asyncio.ensure_future(engine.generate(GenRequest(7, [3], 4))) for _ in range(2)]
        await asyncio.sleep(0.2)  # the first has ended, the second is still generating
        seen = engine.load(), engine.cancel_older_than(5)
        await asyncio.gather(*calls)
        return (*seen, engine.load())

    assert asyncio.run(main()) == (1, 1, 0)


def test_lora_adapter_routes_of_vllm_and_sglang(fake: FakeServer, tmp_path: Path) -> None:
    """A LoRA publication: vLLM's /v1/load_lora_adapter replaced in place under one name; SGLang's
    unload of the previous version's name, then load of this one's; asyncflow serve's admin route."""
    from asyncflow.engines.server_sync import ADAPTER_NAME, AsyncflowSync

    name = asyncio.run(VLLMSync().load_adapter(fake.url, tmp_path, 3, "swap", token=None, timeout=10))
    assert name == ADAPTER_NAME
    assert [(m, p) for m, p, _, _ in fake.seen] == [("POST", "/v1/load_lora_adapter")]
    assert fake.seen[0][2] == {"lora_name": ADAPTER_NAME, "lora_path": str(tmp_path.resolve()), "load_inplace": True}
    fake.seen.clear()
    name = asyncio.run(SGLangSync().load_adapter(fake.url, tmp_path, 4, "drain", token=None, timeout=10))
    assert name == f"{ADAPTER_NAME}-v4"
    assert [(p, b) for _, p, b, _ in fake.seen] == [
        ("/unload_lora_adapter", {"lora_name": f"{ADAPTER_NAME}-v3"}),
        ("/load_lora_adapter", {"lora_name": f"{ADAPTER_NAME}-v4", "lora_path": str(tmp_path.resolve())})]
    fake.seen.clear()
    fake.replies["/admin/load_weights"] = {"version": 5}
    assert asyncio.run(AsyncflowSync().load_adapter(fake.url, tmp_path, 5, "swap", token=None, timeout=10)) is None
    assert fake.seen[0][1] == "/admin/load_weights"  # asyncflow serve merges: the model keeps its name
