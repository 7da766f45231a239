"""SERVE-LOAD: `asyncflow serve` under hostile clients, on loopback, bounded in count and time.

    quiet phase (seconds)                      attack phase (seconds)
    `clients` authorised loops ──► latency     the same loops ──► latency, while:
                                                 `idle`  connections that send nothing
                                                 `slow`  clients that send one header byte a second
                                                 `big`   unauthenticated 64 MiB bodies (sent as fast as accepted)

Reported per phase: authorised requests, failures, p50/p95/max latency, requests/s, and the server's
thread count (its /proc status, when this process started it or was given its `pid`); for the attack
phase also how many hostile connections the server closed or refused, and how long the slow ones
were held. A server is started on a tiny model (the tests' 2-layer arith model) unless `url` is set
(`read_timeout`: its `--read-timeout`, so that the deadline shows within a short attack phase).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from asyncflow.errors import UserError

_KNOWN = ("url", "token", "pid", "seconds", "clients", "idle", "slow", "big", "max_tokens", "read_timeout")
_BIG_BODY = 64 * 1024 * 1024
_BODY = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 1.0})


def _options(overrides: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {"url": "", "token": "", "pid": 0, "seconds": 10, "clients": 4, "idle": 200, "slow": 50,
                            "big": 20, "max_tokens": 8, "read_timeout": 0}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in _KNOWN:
            raise UserError(f"bench serve --set: expected one of {', '.join(k + '=...' for k in _KNOWN)}, got {item!r}")
        if isinstance(opts[key], int):
            try:
                opts[key] = int(value)
            except ValueError:
                raise UserError(f"bench serve --set {key}: expected an integer, got {value!r}") from None
            if opts[key] < 0 or (key in ("seconds", "clients", "max_tokens") and opts[key] < 1):
                raise UserError(f"bench serve --set {key}: out of range, got {value!r}")
        else:
            opts[key] = value
    if opts["url"] and not opts["token"]:
        raise UserError("bench serve --set url=...: also set token=... (the server must require one)")
    return opts


def _threads(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return None


class _Target:
    def __init__(self, url: str, token: str, pid: int) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.token, self.pid = parts.hostname or "127.0.0.1", int(parts.port or 80), token, pid

    def complete(self, body: str) -> tuple[int, float]:
        """(status or 0 when the connection failed, seconds) of one authorised completion."""
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body=body, headers={
                "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            return resp.status, time.perf_counter() - t0
        except OSError:
            return 0, time.perf_counter() - t0
        finally:
            conn.close()


def _authorised(target: _Target, clients: int, seconds: float, body: str) -> dict[str, Any]:
    """`clients` loops of completions for `seconds`: counts and latency percentiles of the 200s."""
    lat: list[float] = []
    failed: list[int] = []
    stop = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < stop:
            status, dt = target.complete(body)
            (lat.append(dt) if status == 200 else failed.append(status))

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for w in workers:
        w.start()
    threads = None
    while any(w.is_alive() for w in workers):
        threads = max(threads or 0, _threads(target.pid) or 0) if target.pid else None
        time.sleep(0.2)
    lat.sort()
    pick = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1)) if lat else (lambda q: None)
    return {"ok": len(lat), "failed": len(failed), "fail_statuses": sorted(set(failed)), "p50_ms": pick(0.5),
            "p95_ms": pick(0.95), "max_ms": pick(1.0), "req_per_s": round(len(lat) / seconds, 2),
            "server_threads_max": threads}


def _open(target: _Target) -> socket.socket | None:
    try:
        return socket.create_connection((target.host, target.port), timeout=5)
    except OSError:
        return None


def _closed(sock: socket.socket) -> bool:
    """The server closed (or refused) the connection: a read gives end-of-file, a reply, or an error."""
    sock.setblocking(False)
    try:
        sock.recv(4096)  # (a reply or end-of-file)
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


@dataclass
class _Slow:
    sock: socket.socket
    opened: float
    sent: int = 0
    ended: float | None = None  # when the server closed it


def _slow_and_idle(target: _Target, idle: int, slow: int, stop: float, out: dict[str, Any]) -> None:
    """Open the idle and slow connections; send the slow ones one byte a second until `stop`."""
    header = f"POST /v1/completions HTTP/1.1\r\nHost: {target.host}\r\nContent-Length: 100\r\n\r\n".encode()
    idles = [s for s in (_open(target) for _ in range(idle)) if s is not None]
    slows = [_Slow(s, time.monotonic()) for s in (_open(target) for _ in range(slow)) if s is not None]
    out["idle_opened"], out["slow_opened"] = len(idles), len(slows)
    while time.monotonic() < stop:
        for c in slows:
            if c.ended is None and c.sent < len(header):
                try:
                    c.sock.send(header[c.sent:c.sent + 1])
                    c.sent += 1
                except OSError:
                    c.ended = time.monotonic()
        time.sleep(max(0.0, min(1.0, stop - time.monotonic())))
    now = time.monotonic()
    for c in slows:
        if c.ended is None and _closed(c.sock):
            c.ended = now
    held = [c.ended - c.opened for c in slows if c.ended is not None]
    out["slow_closed_by_server"] = len(held)
    out["slow_held_max_s"] = round(max(held), 1) if held else None
    out["idle_closed_by_server"] = sum(_closed(s) for s in idles)
    for s in idles + [c.sock for c in slows]:
        s.close()


def _big_bodies(target: _Target, count: int, stop: float, out: dict[str, Any]) -> None:
    """`count` unauthenticated 64 MiB bodies, one after another: how many bytes each got in, what status."""
    statuses: list[int] = []
    accepted = 0
    chunk = b"x" * (1 << 20)
    for _ in range(count):
        if time.monotonic() >= stop:
            break
        sock = _open(target)
        if sock is None:
            statuses.append(0)
            continue
        sock.settimeout(5)
        try:
            sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {target.host}\r\nContent-Length: {_BIG_BODY}\r\n"
                         "Content-Type: application/json\r\n\r\n".encode())
            for _ in range(_BIG_BODY // len(chunk)):  # (the kernel's buffers take a few MiB unread)
                if time.monotonic() >= stop:
                    break
                sock.sendall(chunk)
                accepted += len(chunk)
        except OSError:
            pass
        try:
            head = sock.recv(64)
            statuses.append(int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0)
        except (OSError, ValueError, IndexError):
            statuses.append(0)
        sock.close()
    out["big_sent"], out["big_statuses"], out["big_mib_accepted"] = len(statuses), sorted(set(statuses)), accepted >> 20


def start_local_server(token: str, read_timeout: int) -> tuple[subprocess.Popen[str], str, Path]:
    """`asyncflow serve` on a tiny model in a temporary folder, on a free loopback port, requiring
    `token` (given through the environment): the process, its URL and the folder."""
    from asyncflow.tasks.arith import make_model, make_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="asyncflow-serve-load-")) / "tiny"
    tok = make_tokenizer()
    make_model(tok, seed=0, hidden=64).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    env = {**os.environ, "ASYNCFLOW_SERVE_TOKEN": token}  # (never on the command line, where `ps` shows it)
    extra = ["--read-timeout", str(read_timeout)] if read_timeout else []  # (0: the server's default)
    proc = subprocess.Popen([sys.executable, "-m", "asyncflow", "serve", str(folder), "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = ""
    deadline = time.monotonic() + 180
    while "listening on" not in line and time.monotonic() < deadline and proc.poll() is None:
        line = (proc.stdout.readline() if proc.stdout else "") or line
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"bench serve: the server did not start within 180 s: {line!r}")
    return proc, line.split("listening on ")[1].split()[0], folder


def run_serve_load(overrides: list[str]) -> list[dict[str, Any]]:
    """SERVE-LOAD rows: the quiet phase, then the attack phase (see the module docstring)."""
    opts = _options(overrides)
    proc = None
    url, token, pid = opts["url"], opts["token"] or "bench-token", opts["pid"]
    if not url:
        proc, url, _ = start_local_server(token, opts["read_timeout"])
        pid = proc.pid
    try:
        target = _Target(url, token, pid)
        body = json.dumps({**json.loads(_BODY), "max_tokens": opts["max_tokens"]})
        target.complete(body)  # warm-up
        quiet = {"phase": "quiet", **_authorised(target, opts["clients"], opts["seconds"], body)}
        stop = time.monotonic() + opts["seconds"]
        hostile: dict[str, Any] = {}
        attackers = [threading.Thread(target=_slow_and_idle, args=(target, opts["idle"], opts["slow"], stop, hostile)),
                     threading.Thread(target=_big_bodies, args=(target, opts["big"], stop, hostile))]
        for a in attackers:
            a.start()
        time.sleep(min(1.0, opts["seconds"] / 4))  # the hostile connections are open before the measurement
        attack = {"phase": "attack", **_authorised(target, opts["clients"], max(0.5, stop - time.monotonic()), body)}
        for a in attackers:
            a.join(timeout=opts["seconds"] + 30)
        return [quiet, {**attack, **hostile}]
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
