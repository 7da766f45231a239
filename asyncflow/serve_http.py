"""The HTTP transport of `asyncflow serve`: a thread per connection, bounded against hostile clients.

    accept thread ──(over max_connections: 503 + Retry-After, no thread)──► closed
         │
         ▼  connection thread (one request per connection; every read shares one deadline)
    headers ──► app.precheck (token, origin, body limit per route) ──refused──► 401/403/413, body unread
         │  (more than 100 header lines, or 64 KiB of them: 431 as they come in)
         ▼
    body (Content-Length) ──► app.handle ──► JSON reply (or server-sent events) ──► closed

Bounds: at most `max_connections` connection threads; a request's headers and body must arrive
within `read_timeout_s` in total (a client sending a byte a second is dropped at that deadline, not
kept alive by each byte); a refused request's body is not read, so an unauthenticated client cannot
make the server take in 64 MiB. Why the standard library and not an ASGI stack: the work per request
is waiting on a future while the decode thread computes, which threads do well, and these bounds
are a few dozen lines on top of it (no new core dependency).
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import http.server
import io
import ipaddress
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

from asyncflow.errors import UserError
from asyncflow.http_limits import HeaderBudget, HeaderLimitError
from asyncflow.openai_wire import MAX_BODY_BYTES, READ_TIMEOUT_S

MAX_CONNECTIONS = 512  # connection threads at once (idle and slow clients included)
RETRY_AFTER_S = 1  # what a 429/503 refusal tells the client to wait
WRITE_TIMEOUT_S = 10.0  # a client that does not read its reply (a few KiB) is dropped after this
_DRAIN_BYTES = 64 * 1024  # a refused request's body up to this is read (its client then sees the reply)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _DeadlineSocketReader(io.RawIOBase):
    """Reads from a socket with one deadline for all reads (a socket timeout bounds each read only)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not received within its deadline")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _BudgetedLines:
    """The request's reader while its headers are parsed: each line goes through a `HeaderBudget`,
    whose refusal the parser answers with 431 (as its own "too many headers")."""

    def __init__(self, reader: Any) -> None:
        self.reader, self.budget = reader, HeaderBudget()
        self.refusal: str | None = None

    def readline(self, limit: int = -1) -> bytes:
        line: bytes = self.reader.readline(limit)
        try:
            self.budget.take(line)
        except HeaderLimitError as exc:
            self.refusal = f"request {exc}"
            raise http.client.HTTPException(self.refusal) from None
        return line


class _Handler(http.server.BaseHTTPRequestHandler):
    server: ServeHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = None  # (reads are bounded by the request's deadline instead: see `setup`)

    def setup(self) -> None:
        super().setup()
        deadline = time.monotonic() + self.server.read_timeout_s
        self.rfile = io.BufferedReader(_DeadlineSocketReader(self.connection, deadline))

    def parse_request(self) -> bool:
        """The standard library's parse (its own bounds: 100 lines of 64 KiB each), the header lines
        counted against `http_limits`' bounds as they are read; past them: 431, the rest unread."""
        reader = self.rfile
        self.rfile = _BudgetedLines(reader)  # type: ignore[assignment]
        try:
            return super().parse_request()
        finally:
            self.rfile = reader

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_PUT(self) -> None:  # (other methods: an OpenAI-style JSON error, not the standard library's HTML page)
        self._answer("PUT")

    def do_DELETE(self) -> None:
        self._answer("DELETE")

    def do_PATCH(self) -> None:
        self._answer("PATCH")

    def do_HEAD(self) -> None:
        self._answer("HEAD")

    def do_OPTIONS(self) -> None:
        self._answer("OPTIONS")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line, an over-long header, an
        unknown method) as the OpenAI-style JSON object every other error is, not its HTML page."""
        if self.request_version == "HTTP/0.9":  # (a request line it could not parse: no status line was written)
            self.request_version = "HTTP/1.0"
        phrase = message or http.server.BaseHTTPRequestHandler.responses.get(code, ("error",))[0]
        phrase = getattr(self.rfile, "refusal", None) or phrase  # (a header budget's: it names its limit)
        self._reply(self.command or "GET", code, error_body(phrase))

    def _answer(self, method: str) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            length = int(headers.get("content-length") or 0)
        except ValueError:
            length = -1
        # the token and the route's body limit are checked from the headers, before any body is read
        refused = self.server.app.precheck(method, self.path, headers, length)
        if refused is not None:
            self._discard_small_body(length)
            status, reply = refused
        elif "chunked" in headers.get("transfer-encoding", "").lower():  # (its body was read as empty)
            self._skip_chunked_body()  # (answered and closed mid-body, the client's send broke: no 411 seen)
            status, reply = 411, error_body("send the body with a Content-Length (chunked transfer encoding is "
                                            "not supported)")
        elif not 0 <= length <= MAX_BODY_BYTES:
            status, reply = 400, error_body("bad or too large Content-Length")
        else:
            try:
                body = self.rfile.read(length) if length else b""
            except TimeoutError:
                status, reply = 408, error_body(f"the request was not received within {self.server.read_timeout_s:g} s")
            else:
                if len(body) < length:  # (the client closed mid-body: nobody to answer)
                    self.close_connection = True
                    return
                self.connection.settimeout(WRITE_TIMEOUT_S)
                status, reply = self.server.app.handle(method, self.path, headers, body, gone=self._client_gone)
        self._reply(method, status, reply)

    def _reply(self, method: str, status: int, reply: Any) -> None:
        if not isinstance(reply, dict):  # a stream: server-sent events
            self._reply_events(reply)
            return
        data = json.dumps(reply).encode()
        self.close_connection = True
        self.connection.settimeout(WRITE_TIMEOUT_S)
        with contextlib.suppress(OSError):  # the client left before its answer (or does not read it)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status in (429, 503):
                self.send_header("Retry-After", str(RETRY_AFTER_S))
            self.send_header("Connection", "close")
            self.end_headers()
            if method != "HEAD":  # (a HEAD reply has headers only)
                self.wfile.write(data)

    def _reply_events(self, events: Iterator[bytes]) -> None:
        """A `text/event-stream` body, its end the connection's close; every write is bounded by
        `WRITE_TIMEOUT_S`, and a client that leaves closes the stream (which cancels its requests)."""
        self.close_connection = True
        try:
            with contextlib.suppress(OSError):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for data in events:
                    if data:
                        self.wfile.write(data)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    def _discard_small_body(self, length: int) -> None:
        """Read a refused request's body when it is small (its client, still sending, would otherwise
        get a reset instead of the reply); a large one is left unread and the connection closed."""
        if 0 < length <= _DRAIN_BYTES:
            with contextlib.suppress(OSError, ValueError):
                self.rfile.read(length)

    def _skip_chunked_body(self) -> None:
        """Read a chunked body to its end, discarding it (at most `MAX_BODY_BYTES`, within the
        request's deadline), so the client has sent it all before it is answered."""
        left = MAX_BODY_BYTES
        with contextlib.suppress(OSError, ValueError):
            while left > 0:
                size = int(self.rfile.readline(1024).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline(1024)  # (the blank line after the last chunk; trailers are not read)
                    return
                if not 0 < size <= left:
                    return  # (too large: answered without reading it all)
                left -= size
                self.rfile.read(size + 2)  # the chunk and its line end

    def _client_gone(self) -> bool:
        """The client closed its connection: its socket reads end-of-file (its request was read whole)."""
        try:
            if hasattr(select, "poll"):  # (select.select fails on descriptors past 1024: a busy server has those)
                poller = select.poll()
                poller.register(self.connection, select.POLLIN)
                if not poller.poll(0):
                    return False
            elif not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""  # readable: data, or end-of-file
        except OSError:
            return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # one line per request would drown the useful output


class ServeHTTPServer(http.server.ThreadingHTTPServer):
    """The threading server with a cap on connection threads: over it, a connection is answered 503
    from the accept thread and closed, and no thread is started for it."""

    daemon_threads = True
    block_on_close = False  # (closing does not wait for requests still generating: their threads are daemons)
    request_queue_size = 1024  # many clients connect at once; the default backlog of 5 would drop them
    app: Any  # the routes (`serve.OpenAIServer`), set before serving starts (`run_server` binds before the model loads)

    def __init__(self, address: tuple[Any, ...], family: socket.AddressFamily = socket.AF_INET, *,  # (IPv6: a 4-tuple)
                 max_connections: int = MAX_CONNECTIONS, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.address_family = family
        self.max_connections, self.read_timeout_s = max_connections, read_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused_busy = 0
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            self._refuse_busy(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # (no thread started: its slot is free again)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse_busy(self, sock: socket.socket) -> None:
        """503 + Retry-After written without blocking (a few hundred bytes fit any socket buffer)."""
        data = json.dumps(error_body(f"the server has {self.max_connections} connections open (--max-connections); "
                                     "retry later", "server_busy")).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                f"\r\nRetry-After: {RETRY_AFTER_S}\r\nConnection: close\r\n\r\n").encode()
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.recv(_DRAIN_BYTES)  # what already arrived (unread, closing would reset before the reply)
            sock.send(head + data)
            sock.shutdown(socket.SHUT_WR)
        self.shutdown_request(sock)


def listen(host: str, port: int, *, max_connections: int = MAX_CONNECTIONS,
           read_timeout_s: float = READ_TIMEOUT_S) -> ServeHTTPServer:
    """Resolve `host` and bind `host:port` (not serving yet). Done before the model loads (seconds), so
    an unknown host or a busy port ends at once with one line naming `--host` or `--port`, not with a
    traceback after the load. IPv4 is preferred where the host has both (as the standard server does)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)  # "": all
    except (OSError, UnicodeError, ValueError) as exc:  # socket.gaierror is an OSError
        raise UserError(f"serve: --host {host}: cannot be resolved ({getattr(exc, 'strerror', None) or exc})") from None
    family, _, _, _, address = min(infos, key=lambda info: info[0] != socket.AF_INET)
    try:
        return ServeHTTPServer(address, family, max_connections=max_connections, read_timeout_s=read_timeout_s)
    except OSError as exc:
        why = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"serve: --port {port}: address already in use on {host}") from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"serve: --host {host}: not an address of this machine ({why})") from None
        if exc.errno == errno.EACCES:
            raise UserError(f"serve: --port {port}: permission denied on {host} ({why})") from None
        raise UserError(f"serve: cannot listen on --host {host} --port {port} ({why})") from None


def serve_in_thread(server: ServeHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              name="asyncflow-serve-http", daemon=True)
    thread.start()
    return thread
