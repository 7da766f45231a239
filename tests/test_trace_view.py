"""`asyncflow trace RUN_DIR`: the trace is served once on loopback with the CORS header the Perfetto
UI needs, the printed link points at it, and a missing or broken trace is one line, exit 2."""

from __future__ import annotations

import json
import socket
import threading
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from asyncflow.errors import UserError
from asyncflow.telemetry.trace_view import UI, serve_trace, trace_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_trace_is_served_once_to_the_perfetto_ui(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "dur": 1}]}))
    port, lines, got = _free_port(), [], {}
    result: list[bool] = []
    server = threading.Thread(target=lambda: result.append(
        serve_trace(trace_file(tmp_path), timeout_s=30, log=lines.append, port=port)))
    server.start()
    for _ in range(100):  # until the link is printed (the server is listening by then)
        if lines:
            break
        threading.Event().wait(0.05)
    link = lines[0].split(": ", 1)[1]
    assert link.startswith(f"{UI}/#!/?url=")
    url = urllib.parse.unquote(link.split("url=", 1)[1])
    assert url == f"http://127.0.0.1:{port}/trace.json"
    with urllib.request.urlopen(url, timeout=10) as reply:
        got["cors"] = reply.headers["Access-Control-Allow-Origin"]
        got["body"] = json.loads(reply.read())
    server.join(10)
    assert result == [True] and got["cors"] == UI and got["body"]["traceEvents"][0]["name"] == "x"


def test_nothing_fetched_ends_after_the_timeout(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text("{}")
    assert serve_trace(tmp_path / "trace.json", timeout_s=0.2, log=lambda _: None, port=_free_port()) is False


def test_a_killed_runs_trace_without_its_bracket_is_served(tmp_path: Path) -> None:
    (tmp_path / "trace.json").write_text('[{"ph": "M", "name": "process_name", "pid": 1, "args": {}},\n'
                                         '{"name": "x", "ph": "X", "ts": 0, "dur": 1}')
    assert trace_file(tmp_path) == tmp_path / "trace.json"


@pytest.mark.parametrize(("content", "needle"), [(None, "not found"), ("{cut", "is not a JSON trace"),
                                                  ("[{cut", "is not a JSON trace")])
def test_a_missing_or_broken_trace_is_refused(tmp_path: Path, content: str | None, needle: str) -> None:
    if content is not None:
        (tmp_path / "trace.json").write_text(content)
    with pytest.raises(UserError, match=needle):
        trace_file(tmp_path)
