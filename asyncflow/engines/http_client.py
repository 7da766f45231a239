"""A minimal asyncio HTTP/1.1 JSON client: one request per connection, a deadline on every call.

Why not a library: the standard library has no asyncio HTTP client, and running urllib in threads
would cap concurrent generation requests at the thread pool's size, which defeats continuous
batching on the server. JSON bodies over HTTP/1.1 (Content-Length or chunked replies, optional
TLS) are all the OpenAI-compatible servers asyncflow talks to need.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import urllib.parse
from typing import Any

from asyncflow.errors import WaitTimeout


class HTTPError(RuntimeError):
    """The server answered with an error status, or not with JSON, or not at all."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def request_json(method: str, url: str, body: Any = None, *, token: str | None = None,
                       timeout: float) -> Any:
    """Send `body` as JSON (none for GET) and return the decoded JSON reply; an error status raises
    `HTTPError` with the server's message, and a call past `timeout` seconds raises `WaitTimeout`."""
    try:
        return await asyncio.wait_for(_request(method, url, body, token), timeout)
    except asyncio.TimeoutError:
        raise WaitTimeout(f"timed out after {timeout:g} s waiting for {method} {url}") from None


async def _request(method: str, url: str, body: Any, token: str | None) -> Any:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = b"" if body is None else json.dumps(body).encode()
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname  # (IPv6 in brackets)
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}", "Accept: application/json",
             "Connection: close", f"Content-Length: {len(data)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=ssl.create_default_context() if parts.scheme == "https" else None)
    except OSError as exc:
        raise HTTPError(0, f"cannot connect to {parts.hostname}:{port}: {exc}") from None
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
        await writer.drain()
        status, headers = await _read_head(reader)
        raw = await _read_body(reader, headers)
    except HTTPError as exc:
        raise HTTPError(exc.status, f"{method} {url}: {exc}") from None
    except (OSError, EOFError, ValueError) as exc:  # reset, cut-short body (IncompleteReadError), bad length
        raise HTTPError(0, f"{method} {url}: the connection was lost mid-reply ({type(exc).__name__}: {exc})") from None
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
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


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise HTTPError(0, "the server closed the connection without a reply")
    fields = status_line.decode("latin-1").split(None, 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise HTTPError(0, f"malformed HTTP status line {status_line[:100]!r}")
    return int(fields[1]), await read_headers(reader)


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """The header lines up to the blank line, by lower-case name (requests and replies alike)."""
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
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
