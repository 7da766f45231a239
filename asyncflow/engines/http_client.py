"""A small asyncio HTTP/1.1 JSON client with pooled keep-alive connections and a deadline on every call.

Why not a library: the standard library has no asyncio HTTP client, and running urllib in threads
would cap concurrent generation requests at the thread pool's size, which defeats continuous
batching on the server. JSON bodies over HTTP/1.1 (Content-Length or chunked replies, optional
TLS) are all the OpenAI-compatible servers asyncflow talks to need.

Connections: one pool per event loop, keyed by (scheme, host, port); at most `MAX_CONNECTIONS` open
per key (later calls wait, within their deadline), at most `MAX_IDLE` idle ones kept, each for
`IDLE_S` seconds (under uvicorn's 5 s keep-alive, so the server rarely closes one first). A reply
that says `Connection: close` (asyncflow serve does), is HTTP/1.0, or is not length-framed closes
its connection. TLS: one `ssl.SSLContext` per process and CA setting (`SSL_CERT_FILE` /
`SSL_CERT_DIR` name a private CA), built once in a thread (loading the CA store takes ~40 ms).

A kept connection the server has closed: seen before sending (end of stream, transport closing,
idle too long) it is dropped and another taken, for every request; a request sent on a reused
connection that got not one byte of a status line back (the server closed it as the request went
out) is sent once more on a fresh connection only when it is safe to repeat: an idempotent method
(GET, HEAD, OPTIONS, PUT, DELETE) or a caller's `retry_safe=True`. Otherwise it fails as before.
`await close_pool()` closes the current loop's connections (engines do it at close).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import threading
import time
import urllib.parse
import weakref
from dataclasses import dataclass, field
from typing import Any

from asyncflow.errors import WaitTimeout
from asyncflow.http_limits import MAX_HEADER_BYTES, HeaderBudget, HeaderLimitError

MAX_CONNECTIONS = 512  # open per (scheme, host, port), in use or idle (asyncflow serve's own cap)
MAX_IDLE = 64  # idle connections kept per key
IDLE_S = 4.0  # an idle connection older than this is closed rather than reused
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
CLOSE_WAIT_S = 1.0  # close_pool waits at most this for the connections to finish closing


class HTTPError(RuntimeError):
    """The server answered with an error status, or not with JSON, or not at all."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _NoReply(Exception):
    """A reused connection failed before a single byte of a reply: the server may have closed it idle."""


@dataclass
class _Conn:
    key: tuple[str, str, int]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0
    uses: int = 0

    def stale(self, now: float) -> bool:
        return self.reader.at_eof() or self.writer.transport.is_closing() or now - self.idle_since > IDLE_S

    def close(self) -> None:
        self.writer.close()


@dataclass
class ConnectionPool:
    """Keep-alive connections of one event loop, per (scheme, host, port)."""

    max_connections: int = MAX_CONNECTIONS
    max_idle: int = MAX_IDLE
    opened: int = 0  # connections opened so far (for tests and benchmarks)
    _idle: dict[tuple[str, str, int], list[_Conn]] = field(default_factory=dict)
    _slots: dict[tuple[str, str, int], asyncio.Semaphore] = field(default_factory=dict)
    _closed: bool = False

    async def acquire(self, key: tuple[str, str, int], fresh: bool = False) -> _Conn:
        """A live idle connection for `key` (unless `fresh`), or a new one; holds one of key's slots."""
        slots = self._slots.setdefault(key, asyncio.Semaphore(self.max_connections))
        await slots.acquire()
        try:
            idle, now = self._idle.get(key, []), time.monotonic()
            while idle and not fresh:
                conn = idle.pop()  # (the most recently used: the likeliest to be alive)
                if not conn.stale(now):
                    return conn
                conn.close()
            conn = await _open(key)
            self.opened += 1
            return conn
        except BaseException:
            slots.release()
            raise

    def release(self, conn: _Conn, keep: bool) -> None:
        """Give back `conn`'s slot; keep the connection for reuse if `keep` and there is room."""
        idle = self._idle.setdefault(conn.key, [])
        if keep and not self._closed and len(idle) < self.max_idle and not conn.writer.transport.is_closing():
            conn.idle_since, conn.uses = time.monotonic(), conn.uses + 1
            idle.append(conn)
        else:
            conn.close()
        self._slots[conn.key].release()

    async def close(self) -> None:
        """Close the idle connections (those in use close when released), waiting a bounded time."""
        self._closed = True
        conns = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        for c in conns:
            c.close()
        waits = [asyncio.ensure_future(c.writer.wait_closed()) for c in conns]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=CLOSE_WAIT_S)
            for w in pending:
                w.cancel()
            for w in waits:  # (retrieved: a reset while closing is not worth a warning)
                if w.done() and not w.cancelled():
                    w.exception()


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ConnectionPool] = weakref.WeakKeyDictionary()


def pool() -> ConnectionPool:
    """The running event loop's pool (connections belong to one loop)."""
    loop = asyncio.get_running_loop()
    if loop not in _pools:
        _pools[loop] = ConnectionPool()
    return _pools[loop]


async def close_pool() -> None:
    """Close the running loop's connections; a later request opens a new pool."""
    p = _pools.pop(asyncio.get_running_loop(), None)
    if p is not None:
        await p.close()


_tls: dict[tuple[str | None, str | None], ssl.SSLContext] = {}
_tls_lock = threading.Lock()


def _tls_key() -> tuple[str | None, str | None]:
    return os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR")


def _build_tls(key: tuple[str | None, str | None]) -> ssl.SSLContext:
    with _tls_lock:  # (concurrent first calls: one builds, the others wait for it)
        if key not in _tls:
            _tls[key] = ssl.create_default_context()  # (reads SSL_CERT_FILE / SSL_CERT_DIR, else the system store)
        return _tls[key]


async def tls_context() -> ssl.SSLContext:
    """The process's client TLS context for the current CA setting, built once off the event loop."""
    key = _tls_key()
    ctx = _tls.get(key)
    return ctx if ctx is not None else await asyncio.to_thread(_build_tls, key)


async def _open(key: tuple[str, str, int]) -> _Conn:
    scheme, host, port = key
    tls = await tls_context() if scheme == "https" else None
    try:
        reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    except OSError as exc:
        raise HTTPError(0, f"cannot connect to {host}:{port}: {exc}") from None
    return _Conn(key, reader, writer)


async def request_json(method: str, url: str, body: Any = None, *, token: str | None = None,
                       timeout: float, retry_safe: bool = False) -> Any:
    """Send `body` as JSON (none for GET) and return the decoded JSON reply; an error status raises
    `HTTPError` with the server's message, and a call past `timeout` seconds (waiting for a
    connection included) raises `WaitTimeout`. `retry_safe`: the request may be sent twice (see the
    module docstring); idempotent methods are."""
    try:
        return await asyncio.wait_for(_request(method, url, body, token, retry_safe or method in IDEMPOTENT), timeout)
    except asyncio.TimeoutError:
        raise WaitTimeout(f"timed out after {timeout:g} s waiting for {method} {url}") from None


def _prepare(method: str, url: str, body: Any, token: str | None) -> tuple[tuple[str, str, int], bytes]:
    """The pool key and the request's bytes."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = b"" if body is None else json.dumps(body).encode()
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # (IPv6 in brackets)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Accept: application/json",
             f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return (parts.scheme, parts.hostname, port), ("\r\n".join(lines) + "\r\n\r\n").encode() + data


async def _request(method: str, url: str, body: Any, token: str | None, may_repeat: bool) -> Any:
    key, request = _prepare(method, url, body, token)
    connections = pool()
    conn = await connections.acquire(key)
    try:
        status, headers, raw = await _exchange(conn, request, method, url)
    except _NoReply:
        connections.release(conn, keep=False)
        if not may_repeat:
            raise HTTPError(0, f"{method} {url}: the server closed the connection without a reply") from None
        conn = await connections.acquire(key, fresh=True)  # (once, on a new connection)
        try:
            status, headers, raw = await _exchange(conn, request, method, url)
        except BaseException:
            connections.release(conn, keep=False)
            raise
    except BaseException:  # (cancelled or failed mid-exchange: the connection's state is unknown)
        connections.release(conn, keep=False)
        raise
    connections.release(conn, keep=_keeps_alive(headers))
    return _decode(method, url, status, headers, raw)


async def _exchange(conn: _Conn, request: bytes, method: str, url: str) -> tuple[int, dict[str, str], bytes]:
    """Send `request` on `conn` and read the reply; `_NoReply` when a reused connection gave no reply."""
    started = False
    try:
        conn.writer.write(request)
        await conn.writer.drain()
        status_line = await conn.reader.readline()
        started = bool(status_line)
        status, headers = await _read_head(status_line, conn.reader)
        raw = await _read_body(conn.reader, headers)
    except HTTPError as exc:
        if conn.uses and not started:
            raise _NoReply from None
        raise HTTPError(exc.status, f"{method} {url}: {exc}") from None
    except HeaderLimitError as exc:
        raise HTTPError(0, f"{method} {url}: the reply's {exc}") from None
    except (OSError, EOFError, ValueError) as exc:  # reset, cut-short body (IncompleteReadError), bad length
        if conn.uses and not started:
            raise _NoReply from None
        raise HTTPError(0, f"{method} {url}: the connection was lost mid-reply ({type(exc).__name__}: {exc})") from None
    headers[":version"] = status_line.split(None, 1)[0].decode("latin-1")
    return status, headers, raw


def _keeps_alive(headers: dict[str, str]) -> bool:
    """Whether the connection may carry another request after this reply."""
    if headers.get(":version") != "HTTP/1.1" or "close" in headers.get("connection", "").lower():
        return False
    return "content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()


def _decode(method: str, url: str, status: int, headers: dict[str, str], raw: bytes) -> Any:
    if 300 <= status < 400:  # (not followed: a redirect of a POST loses its body; it was taken as success)
        raise HTTPError(status, f"{method} {url}: HTTP {status}, a redirect to {headers.get('location', '?')}: "
                                "give the final URL")
    try:
        reply = json.loads(raw) if raw else None
    except ValueError:
        raise HTTPError(status, f"{method} {url}: HTTP {status}, not JSON: {raw[:200]!r}") from None
    if not 200 <= status < 300:
        raise HTTPError(status, f"{method} {url}: HTTP {status}: {_error_message(reply)}")
    return reply


async def _read_head(status_line: bytes, reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    if not status_line:
        raise HTTPError(0, "the server closed the connection without a reply")
    fields = status_line.decode("latin-1").split(None, 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise HTTPError(0, f"malformed HTTP status line {status_line[:100]!r}")
    return int(fields[1]), await read_headers(reader)


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """The header lines up to the blank line, by lower-case name (requests and replies alike);
    `HeaderLimitError` past `http_limits`' bounds, raised as the line that passes them is read."""
    headers: dict[str, str] = {}
    budget = HeaderBudget()
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # one line past the stream's limit (64 KiB unless its opener chose another)
            raise HeaderLimitError(f"headers: a line longer than the {MAX_HEADER_BYTES} bytes allowed") from None
        budget.take(line)
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return headers


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            line = await reader.readline()
            if not line.endswith(b"\n"):  # the connection ended at a chunk boundary: the body is cut short
                raise EOFError("the chunked body ended before its last chunk")
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailer fields, up to the blank line
                return bytes(out)
            out += await reader.readexactly(size)
            if not (await reader.readline()).endswith(b"\n"):
                raise EOFError("the chunked body ended inside a chunk")
    if "content-length" in headers:
        return await reader.readexactly(int(headers["content-length"]))
    return await reader.read()


def _error_message(reply: Any) -> str:
    """The message of an OpenAI-style `{"error": {"message": ...}}` (or FastAPI `{"detail": ...}`) reply."""
    if isinstance(reply, dict):
        err = reply.get("error", reply.get("detail", reply))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        return str(err)
    return str(reply)
