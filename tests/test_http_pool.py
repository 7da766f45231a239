"""The pooled HTTP client: kept connections are reused, TLS with a private CA, servers that close
kept connections (idle, or as a request goes out), and the pool closed at shutdown."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from asyncflow.engines import http_client
from asyncflow.engines.http_client import HTTPError, close_pool, request_json, tls_context


class KeepAliveServer:
    """An HTTP/1.1 server on loopback that keeps connections open and counts them. `close_idle`:
    close each connection right after its reply; `drop_next`: read the next request that arrives on
    an already used connection and close without answering (the race of an idle close)."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.tls, self.connections, self.requests, self.closed = tls, 0, 0, 0
        self.close_idle = self.drop_next = False
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> KeepAliveServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while line := await reader.readline():
                headers = await http_client.read_headers(reader)
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if served and self.drop_next:
                    self.drop_next = False
                    break
                self.requests += 1
                served += 1
                data = json.dumps({"path": line.split()[1].decode(), "body": json.loads(body or b"null"),
                                   "connection": self.connections}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
                if self.close_idle:
                    break
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self.closed += 1


def test_kept_connections_are_reused_and_bounded() -> None:
    async def main() -> tuple[int, int, int]:
        async with KeepAliveServer() as server:
            for i in range(5):
                assert (await request_json("POST", f"{server.url}/v1/completions", {"i": i}, timeout=10))["body"] == {"i": i}
            sequential = server.connections
            await asyncio.gather(*(request_json("GET", f"{server.url}/v1/models", timeout=10) for _ in range(16)))
            concurrent = server.connections
            http_client.pool().max_connections = 1  # (a new key's slots: a later host sees the bound)
            async with KeepAliveServer() as other:
                await asyncio.gather(*(request_json("GET", f"{other.url}/x", timeout=10) for _ in range(8)))
                bounded = other.connections
            await close_pool()
        return sequential, concurrent, bounded

    sequential, concurrent, bounded = asyncio.run(main())
    assert sequential == 1  # five requests, one connection
    assert concurrent <= 16  # the kept one reused, at most one per request in flight
    assert bounded == 1  # at most max_connections open: the others waited for it


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def main() -> list[int]:
        async with KeepAliveServer() as server:
            server.close_idle = True
            seen = []
            for _ in range(3):  # (POST: not repeatable, so it must never be sent on the closed one)
                seen.append((await request_json("POST", f"{server.url}/v1/completions", {}, timeout=10))["connection"])
                await asyncio.sleep(0.05)  # (the server's close reaches the client)
            await close_pool()
            return seen

    assert asyncio.run(main()) == [1, 2, 3]


def test_a_request_that_meets_a_closing_connection_is_repeated_only_when_safe() -> None:
    async def main() -> tuple[Any, Any, str]:
        async with KeepAliveServer() as server:
            await request_json("GET", f"{server.url}/warm", timeout=10)
            server.drop_next = True
            get = await request_json("GET", f"{server.url}/v1/models", timeout=10)  # idempotent: sent again
            server.drop_next = True
            post = await request_json("POST", f"{server.url}/v1/completions", {"n": 1}, timeout=10, retry_safe=True)
            server.drop_next = True
            with pytest.raises(HTTPError, match="closed the connection without a reply") as err:
                await request_json("POST", f"{server.url}/admin/load_weights", {"version": 3}, timeout=10)
            assert server.requests == 3  # the load_weights request was not repeated
            await close_pool()
            return get, post, str(err.value)

    get, post, message = asyncio.run(main())
    assert get["path"] == "/v1/models" and get["connection"] == 2
    assert post["body"] == {"n": 1} and post["connection"] == 3
    assert message.startswith("POST http://127.0.0.1:")


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


def test_https_with_a_private_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SSL_CERT_FILE names the CA; one TLS context serves every request; without the CA the
    certificate is refused."""
    cert, key = _self_signed(tmp_path)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def main(n: int) -> int:
        async with KeepAliveServer(server_tls) as server:
            for _ in range(n):
                await request_json("GET", f"{server.url}/v1/models", timeout=10)
            await close_pool()
            return server.connections

    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert asyncio.run(main(4)) == 1
    assert asyncio.run(tls_context()) is asyncio.run(tls_context())  # (built once per CA setting)
    monkeypatch.delenv("SSL_CERT_FILE")
    with pytest.raises(HTTPError, match="cannot connect.*CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(main(1))


def test_close_pool_closes_kept_connections() -> None:
    async def main() -> tuple[int, int]:
        async with KeepAliveServer() as server:
            await request_json("GET", f"{server.url}/v1/models", timeout=10)
            before = server.closed
            await close_pool()
            for _ in range(100):  # (bounded: the server sees the close within a few loop turns)
                if server.closed:
                    break
                await asyncio.sleep(0.01)
            return before, server.closed

    assert asyncio.run(main()) == (0, 1)
