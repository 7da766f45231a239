"""A local OpenEnv server the run starts and stops (`rollout.env: openenv+server:...`).

```
 rollout worker process                          child process (python -m asyncflow.envs.openenv_server)
   LocalServer.url() ── binds 127.0.0.1:0 ──fd──► uvicorn on that socket: the target's FastAPI app, or
        │  waits (bounded) for GET /health        OpenEnv's create_fastapi_app(Environment class)
        └─ episodes connect to ws://127.0.0.1:PORT/ws (one session each)
```

One server per environment factory: the rollout worker's and the evaluation's (on Ray, each rollout
actor builds its own). The child dies with its parent (Linux: PR_SET_PDEATHSIG) and is terminated
when the factory is collected or the process exits. A server that exited is started again by the
next episode that needs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from asyncflow.envs.openenv_types import environment_class, environment_types, session_limit, text_field
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.user_code import load_attr

START_TIMEOUT_S = 120.0  # a server that is not answering /health by then fails the episode waiting for it
STOP_GRACE_S = 5.0


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this process dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
    procs.clear()


def target_sessions(target: str) -> int | None:
    """How many sessions a server of `target` allows: an Environment class's declaration (one unless
    it supports concurrent sessions); None for an app (its own setting decides)."""
    found = load_attr(target, "rollout.env", "Environment class or FastAPI app")
    if isinstance(found, type):
        return session_limit(environment_class(target, "rollout.env"))
    if not callable(found):
        raise UserError(f"rollout.env: {target!r} is neither an openenv Environment class nor an ASGI app")
    return None


class LocalServer:
    """The child server of one factory; `url()` starts it on first need (and after it died)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.sessions = target_sessions(target)  # (also: a target that cannot be imported is bad input now)
        self.start_timeout_s = START_TIMEOUT_S
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._port = 0
        self._ready = False
        self._log = Path(tempfile.gettempdir()) / f"asyncflow-openenv-{os.getpid()}-{id(self):x}.log"
        self._finalizer = weakref.finalize(self, _stop, self._procs)

    def _spawn(self) -> None:
        _stop(self._procs)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        self._port = int(sock.getsockname()[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-m", "asyncflow.envs.openenv_server", self.target, str(sock.fileno()),
               str(self.sessions or 0)]
        with open(self._log, "ab") as out:
            self._procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                pass_fds=(sock.fileno(),), preexec_fn=_die_with_parent))
        sock.close()  # (the child holds it)
        self._ready = False

    def start(self) -> None:
        """Start the server now, if it is not running (the factory does, so that the first episode's
        reset, bounded by rollout.env_timeout_s, does not wait for a whole start)."""
        with self._lock:
            if not self._procs or self._procs[-1].poll() is not None:
                self._spawn()

    async def url(self) -> str:
        """The running server's URL, once it answers /health (started again first if it exited)."""
        import httpx

        self.start()
        with self._lock:
            proc, port = self._procs[-1], self._port
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.start_timeout_s
        async with httpx.AsyncClient(timeout=5.0) as client:
            while not self._ready:
                if proc.poll() is not None:
                    raise RuntimeError(f"the openenv server for {self.target!r} exited with code {proc.returncode}: "
                                       f"{_tail(self._log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        self._ready = True
                        break
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"timed out after {self.start_timeout_s:g} s waiting for the openenv server for "
                                      f"{self.target!r} to answer /health: {_tail(self._log)}")
                await _sleep(0.1)
        return url

    @property
    def pid(self) -> int | None:
        """The running server's process id (None before its start or after it exited)."""
        proc = self._procs[-1] if self._procs else None
        return proc.pid if proc is not None and proc.poll() is None else None

    def stop(self) -> None:
        _stop(self._procs)


async def _sleep(s: float) -> None:
    import asyncio

    await asyncio.sleep(s)


def _tail(path: Path) -> str:
    try:
        text = path.read_bytes()[-4000:].decode(errors="replace")
    except OSError:
        return "(no output)"
    return " | ".join(line.strip() for line in text.strip().splitlines()[-5:] if line.strip()) or "(no output)"


async def action_text_field(url: str, timeout_s: float = 30.0) -> str | None:
    """The action's one text field, from the server's `/schema` (None: a structured action)."""
    import httpx

    http = url.replace("ws://", "http://", 1).replace("wss://", "https://", 1)
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        reply = await client.get(f"{http}/schema")
        reply.raise_for_status()
        return text_field(reply.json().get("action") or {})


def build_app(target: str, sessions: int) -> Any:
    """The ASGI app of `target`: an app as it is, or OpenEnv's app around an Environment class."""
    found = load_attr(target, "rollout.env", "Environment class or FastAPI app")
    if not isinstance(found, type):
        return found
    from openenv.core.env_server.http_server import create_fastapi_app

    action_cls, observation_cls = environment_types(found)
    return create_fastapi_app(found, action_cls, observation_cls, max_concurrent_envs=sessions or 1)


def main(argv: list[str]) -> None:
    """Child entry: `target fd sessions`."""
    import uvicorn

    target, fd, sessions = argv[0], int(argv[1]), int(argv[2])
    uvicorn.run(build_app(target, sessions), fd=fd, log_level="warning", ws_max_size=100 * 1024 * 1024)


if __name__ == "__main__":
    main(sys.argv[1:])
