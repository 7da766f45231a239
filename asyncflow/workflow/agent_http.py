"""The agent proxy's HTTP transport: bounded connections, a request read in two steps, the replies.

    connection ──► ConnectionGate: handled now (at most `MAX_CONNECTIONS`), or queued unread
         │           (at most `MAX_WAITING`, each up to its wait), or refused 503 + Retry-After
         ▼
    request line + headers (`http_limits`' bounds: 431) ──► the proxy looks up the route and the
         │          episode key from the path; refused (404, 411, 413) ──► answered, the body unread
         ▼
    body (Content-Length, at most `MAX_BODY_BYTES`) ──► the proxy's answer ──► JSON or events ──► closed

Every read shares one deadline (`READ_TIMEOUT_S`); every write is bounded by it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

from asyncflow.engines.http_client import read_headers
from asyncflow.openai_wire import MAX_BODY_BYTES, READ_TIMEOUT_S, RequestError

MAX_CONNECTIONS = 512  # connections answered at once (as `asyncflow serve`'s --max-connections)
MAX_WAITING = 1024  # connections queued for a turn beyond those; past them a connection gets 503
RETRY_AFTER_S = 1
_DRAIN_BYTES = 64 * 1024  # a refused request's body up to this is read (its client then sees the reply, not a reset)


class ConnectionGate:
    """At most `limit` connections handled at once; up to `queue` more wait their turn, each for at
    most `wait_s` and not read from meanwhile (what the kernel holds is all they cost); past that a
    connection is refused. Refusals and the first wait are logged (the 1st, 10th, 100th, ...)."""

    def __init__(self, limit: int = MAX_CONNECTIONS, queue: int = MAX_WAITING, wait_s: float = 600.0) -> None:
        self.limit, self.queue, self.wait_s = limit, queue, wait_s
        self.active = self.waiting = self.waited = self.refused = 0
        self._slots = asyncio.Semaphore(limit)

    async def enter(self, transport: asyncio.BaseTransport) -> str | None:
        """Wait for a turn; None once it is this connection's (`leave` it after), else why it was refused."""
        if not self._slots.locked():
            await self._slots.acquire()
            self.active += 1
            return None
        if self.waiting >= self.queue:
            return self._refuse(f"the agent endpoint has {self.limit} connections open and {self.waiting} waiting")
        self.waiting += 1
        self.waited += 1
        _log_count(self.waited, f"{self.limit} connections are open; later ones wait for a turn (at most "
                                 f"{self.queue} at once, each up to {self.wait_s:g} s)")
        # (paused here only when reading: a stream reader that paused it for a full buffer resumes it)
        paused = transport if isinstance(transport, asyncio.ReadTransport) and transport.is_reading() else None
        if paused is not None:
            paused.pause_reading()
        try:
            await asyncio.wait_for(self._slots.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            return self._refuse(f"waited {self.wait_s:g} s for one of the agent endpoint's {self.limit} connections")
        finally:
            self.waiting -= 1
            if paused is not None and not paused.is_closing():
                paused.resume_reading()
        self.active += 1
        return None

    def leave(self) -> None:
        self.active -= 1
        self._slots.release()

    def _refuse(self, why: str) -> str:
        self.refused += 1
        _log_count(self.refused, f"refused a connection: {why}", total=self.refused)
        return f"{why}; retry later"


def _log_count(n: int, what: str, total: int | None = None) -> None:
    """One stderr line for the 1st, 10th, 100th, ... occurrence (a flood logs a handful of lines)."""
    if str(n).strip("0") == "1":
        count = f" ({total} so far)" if total is not None and total > 1 else ""
        print(f"[asyncflow] agent proxy: {what}{count}", file=sys.stderr, flush=True)


async def read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    """(method, path, headers by lower-case name) of the next request; `ValueError` when malformed,
    `HeaderLimitError` past the header bounds."""
    line = (await reader.readline()).decode("latin-1").split()
    if len(line) != 3 or not line[2].startswith("HTTP/"):
        raise ValueError(f"malformed request line {' '.join(line)[:100]!r}")
    return line[0].upper(), line[1], await read_headers(reader)


def body_length(headers: dict[str, str]) -> int:
    """The body's length from its headers; a refusal (`RequestError`) for one it cannot read."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise RequestError("send the body with a Content-Length (chunked transfer encoding is not supported)",
                           status=411)
    try:
        length = int(headers.get("content-length") or 0)
    except ValueError:
        raise RequestError("bad Content-Length") from None
    if length < 0:
        raise RequestError("bad Content-Length")
    if length > MAX_BODY_BYTES:
        raise RequestError(f"the body ({length} bytes) is larger than the {MAX_BODY_BYTES} bytes allowed", status=413)
    return length


async def drain_small_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    """Read a refused request's body when it is small (a large one is left unread, the connection closed)."""
    try:
        length = int(headers.get("content-length") or 0)
    except ValueError:
        return
    if 0 < length <= _DRAIN_BYTES:
        with contextlib.suppress(OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            await asyncio.wait_for(reader.readexactly(length), READ_TIMEOUT_S)


def error_reply(exc: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(exc), "type": exc.kind, "param": exc.param, "code": None}}


async def write_json(writer: asyncio.StreamWriter, status: int, reply: dict[str, Any]) -> None:
    data = json.dumps(reply).encode()
    # a refusal (4xx: max turns, staleness, bad request) is final: the OpenAI SDK retried 409
    # and 429 twice with back-off unless told not to; 503 (busy) is worth a retry
    extra = "x-should-retry: false\r\n" if 400 <= status < 500 else ""
    if status == 503:
        extra = f"Retry-After: {RETRY_AFTER_S}\r\n"
    writer.write(f"HTTP/1.1 {status} {'OK' if status < 400 else 'Error'}\r\nContent-Type: application/json\r\n"
                 f"{extra}Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)


async def write_events(writer: asyncio.StreamWriter, events: AsyncIterator[bytes]) -> None:
    """A `text/event-stream` reply ended by the connection's close; each write bounded."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                 b"Connection: close\r\n\r\n")
    try:
        async for data in events:
            writer.write(data)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        pass  # the agent left: the stream is closed below, which abandons its call
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
