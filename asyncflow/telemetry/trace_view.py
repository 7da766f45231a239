"""`asyncflow trace RUN_DIR`: open a run's `trace.json` in the Perfetto UI.

The Perfetto UI (a web page) loads a trace from a URL it is given, and its content policy lets it
fetch only from `http://127.0.0.1:9001`; so, as Perfetto's own `open_trace_in_ui` does, the trace is
served once from that address (loopback only), with the one CORS header the UI needs, and the link
that opens it is printed. The serve ends after the UI has fetched the file, or after `timeout_s`.
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from asyncflow.errors import UserError
from asyncflow.telemetry.runlog import parse_trace

PORT = 9001
UI = "https://ui.perfetto.dev"


def trace_file(run_dir: Path) -> Path:
    """The run's `trace.json`, checked to be a JSON trace (a killed run's, without its closing `]`,
    is one: Perfetto reads it); a one-line UserError otherwise."""
    path = run_dir / "trace.json" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise UserError(f"trace: {path} not found (a run writes trace.json as it goes)")
    try:
        parse_trace(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"trace: {path} is not a JSON trace ({exc})") from None
    return path


def serve_trace(path: Path, *, timeout_s: float, log: Callable[[str], None], port: int = PORT) -> bool:
    """Serve `path` on 127.0.0.1:`port` until the UI fetched it (True) or `timeout_s` passed (False)."""
    body = path.read_bytes()
    fetched = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            if self.path.split("?")[0] != "/" + path.name:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Access-Control-Allow-Origin", UI)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            fetched.set()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (quiet)
            return

    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as exc:
        raise UserError(f"trace: cannot serve on 127.0.0.1:{port} ({exc.strerror}); the Perfetto UI fetches "
                        f"only from that address: open {path} in {UI} by hand (Open trace file)") from None
    thread = threading.Thread(target=server.serve_forever, name="trace-server", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/{quote(path.name)}"
    log(f"open this link in a browser on this machine: {UI}/#!/?url={quote(url, safe=':/')}")
    log(f"(serving {path} until it has been fetched, at most {timeout_s:g} s; or open the file in {UI} by hand)")
    try:
        done = fetched.wait(timeout_s)
        if done:
            time.sleep(0.5)  # let the reply finish before the server goes
        return done
    finally:
        server.shutdown()
        server.server_close()
