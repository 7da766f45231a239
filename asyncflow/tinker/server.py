"""`asyncflow tinker-serve`: the Tinker service over HTTP/1.1 (the standard library's threading server).

Why not `asyncflow serve`'s transport (serve_http): it answers one request per connection with JSON
or server-sent events, while the Tinker SDK keeps connections alive and reads protobuf replies. Here a
thread per connection serves its requests in turn; a `retrieve_future` holds its thread for up to the
futures' poll time (20 s), and a connection idle for `IDLE_S` is closed.
"""

from __future__ import annotations

import contextlib
import http.server
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError
from asyncflow.tinker.build import make_service
from asyncflow.tinker.service import Reply, TinkerService
from asyncflow.tinker.settings import ServeSettings

IDLE_S = 120.0  # a keep-alive connection with no request for this long is closed
MAX_BODY_BYTES = 256 * 2**20
CLOSE_WAIT_S = 30.0  # closing: how long connection threads get to finish (a retrieve_future waits up to 20 s)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: TinkerHTTPServer
    protocol_version = "HTTP/1.1"
    timeout = IDLE_S

    def _answer(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= MAX_BODY_BYTES:
            reply = Reply(413, b'{"detail": "the body is larger than the server accepts"}')
            self.close_connection = True
        else:
            body = self.rfile.read(length) if length else b""
            if self.headers.get("Content-Encoding", "identity") not in ("identity", ""):
                reply = Reply(400, b'{"detail": "compressed request bodies are not supported"}')
            else:
                headers = {k.lower(): v for k, v in self.headers.items()}
                reply = self.server.service.handle(method, self.path, headers, body)
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")

    def do_DELETE(self) -> None:
        self._answer("DELETE")

    def do_PUT(self) -> None:
        self._answer("PUT")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


class TinkerHTTPServer(http.server.ThreadingHTTPServer):
    """Closing the server also closes its open connections and waits (bounded) for their threads: a
    connection thread left blocked on a kept-alive socket held the service (and its tensors) past the
    interpreter's exit, where freeing them from that thread aborted the process."""

    daemon_threads = True
    block_on_close = False  # (its own join covers daemon threads only with this off: `server_close`)
    request_queue_size = 1024  # (the SDK opens many connections at once)

    def __init__(self, address: tuple[str, int], service: TinkerService) -> None:
        self.service = service
        self._connections: dict[threading.Thread, socket.socket] = {}
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address), daemon=True,
                                  name="tinker-connection")
        with self._lock:
            self._connections[thread] = request
        thread.start()

    def _serve_connection(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._connections.pop(threading.current_thread(), None)

    def server_close(self) -> None:
        super().server_close()
        with self._lock:
            open_now = dict(self._connections)
        for sock in open_now.values():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # (wakes a thread waiting for the next request)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in open_now:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def start(service: TinkerService, host: str, port: int) -> tuple[TinkerHTTPServer, threading.Thread]:
    """Bind `host:port` (0: a free port; read it from `server.server_address`) and serve in a thread."""
    try:
        server = TinkerHTTPServer((host, port), service)
    except OSError as exc:
        raise UserError(f"tinker-serve: cannot listen on --host {host} --port {port} ({exc.strerror or exc})") from None
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="tinker-http",
                              daemon=True)
    thread.start()
    return server, thread


def run(settings: ServeSettings, host: str, port: int, *, api_key: str | None = None, state_dir: Path | None = None,
        log: Callable[[str], None] = print) -> None:
    """Serve until interrupted (Ctrl-C or SIGTERM); prints one line with the address once listening."""
    service = make_service(settings, api_key=api_key, state_dir=state_dir)
    try:
        server, thread = start(service, host, port)
    except BaseException:
        service.shutdown()
        raise
    n = settings.max_staleness
    where = f"{settings.sampler} sampling, {settings.trainer} training{' on Ray' if settings.ray else ''}"
    log(f"asyncflow tinker-serve: {settings.model_dir} listening on http://{host}:{server.server_address[1]} "
        f"(base_url for tinker.ServiceClient; api_key: {'the one given' if api_key else 'any tml-... key'}; "
        f"{f'streaming, samplers up to {n} steps behind' if n else 'plain loop'}; {where})")

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()
        service.shutdown()
