"""`asyncflow serve` against hostile clients, engine failures and misused admin routes (issue 33,
items 2-4): each test here failed on the server before these bounds existed."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncflow.errors import UserError
from asyncflow.serve_options import options_from_args

REPO = Path(__file__).resolve().parent.parent


def raw(port: int, request: bytes, timeout: float = 10) -> tuple[int, dict[str, str], Any]:
    """(status, lower-case headers, JSON body) of one request written as it is."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as client:
        client.sendall(request)
        data = b""
        while chunk := client.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, json.loads(payload) if payload else None


def post(path: str, body: Any, token: str | None = None, host: str = "127.0.0.1") -> bytes:
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


def test_a_refused_request_is_answered_from_its_headers_without_reading_its_body(make_server: Any) -> None:
    """It read the whole body (up to 64 MiB, as slowly as the client liked) before checking the token."""
    s = make_server(token="s3cret")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {64 * 1024 * 1024}\r\n\r\n").encode()
    t0 = time.monotonic()
    status, _, reply = raw(s.port, head + b"{", timeout=5)  # (the body never comes)
    assert status == 401 and reply["error"]["type"] == "authentication_error" and time.monotonic() - t0 < 3
    # admin routes take small bodies only, authorised or not
    status, _, reply = raw(s.port, b"POST /admin/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\n"
                                   b"Content-Length: 1048576\r\n\r\n", timeout=5)
    assert status == 413 and "/admin/pause" in reply["error"]["message"]
    assert raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}, "s3cret"))[0] == 200


def test_a_client_sending_a_byte_a_second_is_dropped_at_the_request_deadline(make_server: Any) -> None:
    """Each byte restarted the 60 s read timeout, so it held its thread for as long as it kept sending."""
    s = make_server(read_timeout_s=1.0)
    request = post("/v1/completions", {"prompt": [5], "max_tokens": 1})
    t0 = time.monotonic()
    closed_after = None
    with socket.create_connection(("127.0.0.1", s.port), timeout=0.1) as client:
        for i in range(len(request)):  # one byte every 0.1 s (each well within any per-read timeout)
            try:
                client.sendall(request[i:i + 1])
                client.recv(100)  # returns: a reply or end-of-file, the server ended it
                closed_after = time.monotonic() - t0
                break
            except TimeoutError:  # (still open: nothing to read yet)
                continue
            except OSError:
                closed_after = time.monotonic() - t0
                break
    assert closed_after is not None and 0.9 < closed_after < 3


def test_connections_over_the_cap_get_503_with_retry_after_and_no_thread(make_server: Any) -> None:
    """300 half-sent requests made 303 threads: there was no cap."""
    s = make_server(max_connections=6, read_timeout_s=30)
    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(6)]
    try:
        time.sleep(0.3)
        statuses = [raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1})) for _ in range(20)]
        assert all(st == 503 and h.get("retry-after") == "1" for st, h, _ in statuses), statuses[0]
        assert threading.active_count() <= threads_before + 6
    finally:
        for c in idle:
            c.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # (the idle ones' threads see end-of-file and end)
        if raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}))[0] == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server did not serve again after the idle connections closed")


def test_choices_over_the_queue_cap_get_429_with_retry_after(make_server: Any) -> None:
    s = make_server(max_queued_choices=8)
    assert raw(s.port, post("/admin/pause", {}))[0] == 200
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(raw(s.port, post("/v1/completions",
                                                                        {"prompt": [5], "max_tokens": 2, "n": 6}))))
    first.start()
    deadline = time.monotonic() + 10
    while s.app._queued < 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    status, headers, reply = raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 2, "n": 6}))
    assert status == 429 and headers["retry-after"] == "1" and "--max-queued-choices 8" in reply["error"]["message"]
    status, _, reply = raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 2, "n": 9}))
    assert status == 400 and "more than 8 choices" in reply["error"]["message"]
    assert raw(s.port, post("/admin/resume", {}))[0] == 200
    first.join(timeout=60)
    assert got[0][0] == 200 and len(got[0][2]["choices"]) == 6 and s.app._queued == 0


class _CountingTokenizer:
    """The server's tokenizer, counting the calls that convert a prompt (tokenizing, a chat render
    that tokenizes); everything else passes through."""

    def __init__(self, tok: Any) -> None:
        self.__dict__["tok"], self.__dict__["converted"] = tok, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["converted"] += 1
        return self.tok(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True):
            self.__dict__["converted"] += 1
        return self.tok.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tok, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.tok, name, value)


def test_requests_past_the_choice_or_length_limits_are_refused_before_any_prompt_is_converted(
        make_server: Any) -> None:
    """Every prompt was tokenized before the request's choices were counted: 4M one-character
    prompts (16 MiB) took 8.5 s of CPU and ~900 MiB to be refused, and a 48 MiB text prompt ~19 GiB.
    The counts (prompts x n, token-id lengths, text characters, messages) now come first."""
    s = make_server()
    tok = _CountingTokenizer(s.app.tok)
    s.app.tok = tok
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        refused = [
            ("/v1/completions", {"prompt": ["1+2="] * 5000, "max_tokens": 1}, "5000 prompts x n=1 is more than 4096"),
            ("/v1/completions", {"prompt": ["1+2="] * 100, "n": 50}, "100 prompts x n=50 is more than 4096"),
            # the tiny model has 32 positions; no token of its tokenizer stands for more than 5 characters
            ("/v1/completions", {"prompt": "1+2=" * 5000, "max_tokens": 1}, "prompt (20000 characters) + max_tokens (1)"),
            ("/v1/completions", {"prompt": [[5] * 40, "1"], "max_tokens": 1}, "prompt (40 tokens) + max_tokens (1)"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}] * 40},
             "messages: 40 messages cannot fit the 31 tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+2=" * 5000}]},
             "messages: the conversation (20000 characters) cannot fit the 31 tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "n": 129}, "n: expected"),
        ]
        for route, body, needle in refused:
            status, _, reply = raw(s.port, post(route, body))
            assert tok.converted == 0, needle  # not one prompt was tokenized for it
            assert status == 400 and needle in reply["error"]["message"], (needle, reply)
            assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] is not None
        status, _, reply = raw(s.port, post("/v1/completions", {"prompt": ["1+2=", "3+4="], "n": 2, "max_tokens": 1}))
        assert status == 200 and len(reply["choices"]) == 4 and tok.converted == 2
        status, _, reply = raw(s.port, post("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+"}],
                                                                     "max_tokens": 1}))
        assert status == 200 and tok.converted == 3
    finally:
        s.app.tok = tok.tok
        tok.tok.chat_template = None


def test_request_headers_are_bounded_in_count_and_total_size(make_server: Any) -> None:
    """Each header line could be 64 KiB, 100 of them: 6.4 MiB of headers per connection were taken in."""
    s = make_server()
    body = b'{"prompt": [5], "max_tokens": 1}'
    head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    many = "".join(f"X-Filler-{i}: {'a' * 2000}\r\n" for i in range(40))  # 80 KiB in 40 lines
    status, _, reply = raw(s.port, (head + many + "\r\n").encode() + body)
    assert status == 431 and reply["error"]["message"] == "request headers: more than 65536 bytes of header lines"
    few = "".join(f"X-Filler-{i}: {'a' * 1000}\r\n" for i in range(40))  # 40 KiB: within the bound
    assert raw(s.port, (head + few + "\r\n").encode() + body)[0] == 200


def test_out_of_memory_fails_only_the_affected_requests_and_the_server_goes_on(make_server: Any) -> None:
    """An exception in the decode thread stopped the engine: every later request failed."""
    s = make_server()
    model = s.app.engine.model
    original = model.forward
    decode_oom = threading.Event()

    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        if ids.shape[1] > 20:  # (a prefill of a long prompt: out of memory)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        if ids.shape[1] == 1 and decode_oom.is_set():  # (one decode step)
            decode_oom.clear()
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(*args, **kwargs)

    model.forward = forward
    status, headers, reply = raw(s.port, post("/v1/completions", {"prompt": [5] * 30, "max_tokens": 2}))
    assert status == 503 and "out of memory" in reply["error"]["message"] and headers["retry-after"] == "1"
    assert raw(s.port, post("/v1/completions", {"prompt": [5, 6], "max_tokens": 3}))[0] == 200
    decode_oom.set()
    status, _, reply = raw(s.port, post("/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "n": 2}))
    assert status == 503 and "out of memory" in reply["error"]["message"]
    assert raw(s.port, post("/v1/completions", {"prompt": [5, 6], "max_tokens": 3}))[0] == 200
    assert raw(s.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == 200
    assert s.app.engine.counts["out_of_memory"] == 2 and s.app.engine.error is None


def test_prefills_stay_within_the_token_budget(serve_dir: Path) -> None:
    """All waiting prompts were prefilled at once, padded to the longest: no bound on that tensor."""
    from asyncflow.engines.base import GenRequest
    from asyncflow.engines.hf import HFEngine

    engine = HFEngine(serve_dir, eos_token_id=[-1], max_batch=64, max_prefill_tokens=64)
    shapes: list[tuple[int, int]] = []
    original = engine.model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs["input_ids"].shape[1] > 1:
            shapes.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    try:
        with engine._cv:  # all 16 wait together, as when many requests arrive in one step
            engine.model.forward = forward
            futures = [engine.submit(GenRequest(i, [5 + i % 10] * (5 + i), 2)) for i in range(16)]
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.shutdown()
    assert len(results) == 16 and len(shapes) > 1
    assert all(rows * width <= 64 or rows == 1 for rows, width in shapes), shapes


def test_a_fatal_engine_error_ends_the_server_with_exit_1(serve_dir: Path) -> None:
    """The process stayed up answering 500 to everything after its decode thread died."""
    script = ("import sys, asyncflow.engines.hf as hf\n"
              "def broken(self): raise RuntimeError('injected engine failure')\n"
              "hf.HFEngine._decode_step = broken\n"
              "from asyncflow.cli import main\n"
              f"sys.exit(main(['serve', {str(serve_dir)!r}, '--port', '0']))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        port = int(line.split("listening on http://127.0.0.1:")[1].split()[0])
        status, _, reply = raw(port, post("/v1/completions", {"prompt": [5], "max_tokens": 2}))
        assert status in (500, 503) and "injected engine failure" in reply["error"]["message"]
        with contextlib.suppress(ConnectionError):  # until it exits, /health says the engine stopped
            assert raw(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == 503
        assert proc.wait(timeout=20) == 1
        err = proc.stderr.read() if proc.stderr else ""
        assert "the engine stopped after an error (RuntimeError: injected engine failure)" in err
        assert "supervisor" in err
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _args(tmp_path: Path, **kw: Any) -> argparse.Namespace:
    base = dict(model_dir=tmp_path, host="127.0.0.1", port=0, served_model_name="m", token=None, token_file=None,
                admin_token_file=None, weights_root=None, max_batch=4, max_prefill_tokens=64, max_connections=8,
                max_queued_choices=8, read_timeout=5.0, max_pause_s=10.0)
    return argparse.Namespace(**{**base, **kw})


def test_tokens_come_from_a_file_or_the_environment_and_bad_ones_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    (tmp_path / "admin").write_text("adm\n")
    (tmp_path / "empty").write_text("\n")
    opts = options_from_args(_args(tmp_path, token_file=tmp_path / "tok", admin_token_file=tmp_path / "admin"), env={})
    assert (opts.token, opts.admin_token) == ("from-file", "adm")
    opts = options_from_args(_args(tmp_path, host="0.0.0.0"), env={"ASYNCFLOW_SERVE_TOKEN": "from-env",
                                                                     "ASYNCFLOW_SERVE_ADMIN_TOKEN": "adm2"})
    assert (opts.token, opts.admin_token) == ("from-env", "adm2")
    for kw, needle in (({"token_file": tmp_path / "empty"}, "expected one line"),
                       ({"token_file": tmp_path / "missing"}, "cannot be read"),
                       ({"token": "x", "token_file": tmp_path / "tok"}, "not both"),
                       ({"host": "0.0.0.0"}, "--token-file or ASYNCFLOW_SERVE_TOKEN"),
                       ({"weights_root": tmp_path / "nowhere"}, "--weights-root"),
                       ({"max_prefill_tokens": 0}, "--max-prefill-tokens 0"),
                       ({"read_timeout": 1e308}, "--read-timeout")):
        with pytest.raises(UserError, match=needle):
            options_from_args(_args(tmp_path, **kw), env={})
    proc = subprocess.run([sys.executable, "-m", "asyncflow", "serve", str(tmp_path), "--token-file", str(tmp_path / "empty")],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr


def test_a_separate_admin_token_guards_admin_routes(make_server: Any) -> None:
    s = make_server(token="user", admin_token="admin")
    pause = b"POST /admin/pause HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nContent-Length: 2\r\n\r\n{}"
    assert raw(s.port, pause % b"user")[0] == 401
    assert raw(s.port, pause % b"admin")[0] == 200
    assert raw(s.port, post("/admin/resume", {}, "admin"))[0] == 200
    assert raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}, "user"))[0] == 200
    assert raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}, "admin"))[0] == 200
    assert raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}, "other"))[0] == 401


def test_load_weights_reads_only_under_the_weights_root_one_load_at_a_time(make_server: Any, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Any folder could be loaded, and two concurrent loads each read a full state dict before the
    lock (two copies of the weights in memory at once)."""
    import asyncflow.serve as serve_mod
    from asyncflow.tasks.arith import make_model, make_tokenizer

    root, outside = tmp_path / "root", tmp_path / "outside"
    make_model(make_tokenizer(), seed=1, hidden=64).save_pretrained(str(root / "v1"))
    make_model(make_tokenizer(), seed=1, hidden=64).save_pretrained(str(outside))
    (root / "link").symlink_to(outside)
    (root / "v2").mkdir()
    (root / "v2" / "model.safetensors").symlink_to(outside / "model.safetensors")
    s = make_server(weights_root=root)
    for path in (str(outside), "../outside", "link", str(root / "v1" / ".." / ".." / "outside"), "v2"):
        status, _, reply = raw(s.port, post("/admin/load_weights", {"path": path, "version": 3}))
        assert status == 403 and "outside the weights root" in reply["error"]["message"], (path, reply)
    readers, most = [0], [0]
    real = serve_mod.read_weights

    def counting(folder: Path, model: Any, root: Path | None = None) -> Any:
        readers[0] += 1
        most[0] = max(most[0], readers[0])
        time.sleep(0.3)
        try:
            return real(folder, model, root)
        finally:
            readers[0] -= 1

    monkeypatch.setattr(serve_mod, "read_weights", counting)
    replies: list[Any] = []
    loads = [threading.Thread(target=lambda v=v: replies.append(raw(s.port, post("/admin/load_weights", {
        "path": "v1", "version": v})))) for v in (4, 5)]
    for t in loads:
        t.start()
    for t in loads:
        t.join(timeout=60)
    assert [r[0] for r in replies] == [200, 200] and most[0] == 1
    # bound beyond loopback without a root: no folder at all
    s.app.weights_root, s.app.load_anywhere = None, False
    status, _, reply = raw(s.port, post("/admin/load_weights", {"path": str(root / "v1"), "version": 6}))
    assert status == 403 and "--weights-root" in reply["error"]["message"]


def test_a_pause_expires_by_itself(make_server: Any) -> None:
    """A trainer that paused the server and died left it paused for good."""
    s = make_server(max_pause_s=0.8)
    status, _, reply = raw(s.port, post("/admin/pause", {"timeout_s": 5}))
    assert status == 400 and "timeout_s" in reply["error"]["message"]
    t0 = time.monotonic()
    assert raw(s.port, post("/admin/pause", {}))[0] == 200
    assert raw(s.port, post("/v1/completions", {"prompt": [5], "max_tokens": 1}))[0] == 200
    assert 0.6 < time.monotonic() - t0 < 5
    assert raw(s.port, b"GET /admin/version HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[2]["paused"] is False


def test_authorised_requests_are_answered_while_hostile_clients_run(make_server: Any) -> None:
    """The acceptance load test, short: idle connections, 1 byte/s clients and unauthenticated 64 MiB
    bodies at once; authorised requests keep being answered and the thread count stays bounded."""
    from asyncflow.bench.serve_load import run_serve_load

    s = make_server(token="t", max_connections=120, read_timeout_s=2.0)
    threads_before = threading.active_count()
    quiet, attack = run_serve_load([f"url={s.url}", "token=t", f"pid={os.getpid()}", "seconds=4", "clients=2",
                                    "idle=60", "slow=20", "big=4", "max_tokens=4"])
    assert quiet["ok"] > 0 and attack["ok"] > 0 and attack["failed"] == 0, attack
    assert attack["idle_opened"] == 60 and attack["slow_opened"] == 20
    assert attack["big_statuses"] == [401] and attack["big_mib_accepted"] < 4 * 64
    assert attack["slow_closed_by_server"] == 20 and attack["idle_closed_by_server"] == 60
    # this process's threads: the test's own clients (2 + 2 attackers) and at most max_connections
    assert attack["server_threads_max"] <= threads_before + 4 + 120


def test_the_serve_load_bench_passes_its_server_token_by_environment_not_argv() -> None:
    """A token on a command line is visible to every local user in `ps`: the server the bench starts
    gets it from ASYNCFLOW_SERVE_TOKEN, and still requires it."""
    import urllib.error
    import urllib.request

    from asyncflow.bench.serve_load import start_local_server

    proc, url, folder = start_local_server("not-in-argv-7f3a", 0)
    try:
        assert "not-in-argv-7f3a" not in Path(f"/proc/{proc.pid}/cmdline").read_text(errors="replace")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30)
        req = urllib.request.Request(url.rstrip("/") + "/v1/models", headers={"Authorization": "Bearer not-in-argv-7f3a"})
        assert urllib.request.urlopen(req, timeout=30).status == 200
    finally:
        proc.kill()
        proc.wait(timeout=30)
        shutil.rmtree(folder.parent, ignore_errors=True)
