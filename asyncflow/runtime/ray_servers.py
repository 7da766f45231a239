"""Servers the run starts itself (`rollout.launch_servers`): one `ServerActor` per rollout worker.

```
 placement-group bundle i (one node; its CPUs and GPUs are the server's)
   ServerActor i ── child process group ──► asyncflow serve | vllm serve | sglang  on 127.0.0.1:PORT
   RolloutActor i ── OpenAIEngine(http://127.0.0.1:PORT) ── on a lost connection: ServerLink.recover()
```

A server's only client is its rollout actor, which shares its bundle and so its node: the server
listens on that node's loopback (nothing exposed beyond the machine), on a port picked once and kept
across restarts, so the rollout actor's URL never changes. Loopback is open to every local user, so
each server requires a random token of its own, which its actor holds and hands to its environment
(never to a command line, which `ps` shows to everyone) and the rollout actor's engine asks for
(`ServerLink.token`); an `asyncflow serve` also loads weights only from the run's weight-sync folder
(`--weights-root`). The driver starts every server and waits (bounded by
`rollout.server_start_timeout_s`) until each answers `GET /v1/models` before it builds the rollout
actors with those URLs.

The actor watches its child: an exit, or `HEALTH_FAILURES` health checks in a row that get no answer,
restarts it (at most `runtime.max_restarts` times, one log line each); a restarted server loads the
last weights its engine loaded (`loaded`) before it counts as up again. Meanwhile the rollout actor's
requests that met the dead server wait for it (`wait_up`, bounded) and are sent again; a server that
cannot come back is one line naming its command and the tail of its output. Stopping kills the child's
whole process group (`stop`, before the run's actors are killed); a child also gets SIGKILL when its
actor's process dies (Linux `PR_SET_PDEATHSIG`), so a killed actor leaves no server behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncflow.config import Config
from asyncflow.engines.http_client import HTTPError, request_json
from asyncflow.engines.server_sync import make_weight_sync, sync_root
from asyncflow.errors import RunFailed, WaitTimeout
from asyncflow.runtime.secret_flag import SECRET_FLAG_MODULE
from asyncflow.serve_options import ADMIN_TOKEN_ENV, TOKEN_ENV

HOST = "127.0.0.1"  # the server's one client (its rollout actor) is on the same node
POLL_S = 0.5  # how often the actor looks at its child, and a wait for a server looks again
HEALTH_EVERY_S = 5.0  # a health check (GET /v1/models) of a running server this often
HEALTH_TIMEOUT_S = 30.0  # one health check's answer (a loaded CPU server answers slowly)
HEALTH_FAILURES = 3  # checks in a row without an answer: the server hangs, and is restarted
STOP_GRACE_S = 10.0  # SIGTERM to SIGKILL of a server's process group
TAIL_LINES = 5  # of a failed server's output, in its error
TOKEN_TIMEOUT_S = 60.0  # a rollout actor's engine asking the server actor for the token
SGLANG_KEY_ENV = "ASYNCFLOW_SGLANG_API_KEY"  # `secret_flag` hands it to SGLang as --api-key (SGLang reads no variable)
# where each kind of server reads its token (never a flag: `ps` shows every command line to every user)
TOKEN_VARS = {"asyncflow": TOKEN_ENV, "vllm": "VLLM_API_KEY", "sglang": SGLANG_KEY_ENV}
# not inherited by a server: an admin token would be the only one its /admin/* routes accept, not the run's
DROPPED_ENV = (ADMIN_TOKEN_ENV,)


def server_command(cfg: Config, index: int, model_dir: str, port: int, weights_root: str,
                   token: str) -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of server `index` (`rollout.launch_servers`), with the
    flags asyncflow needs from it (generated token ids and log-probs; docs/engines.md). `token` goes
    into the environment only; `weights_root` is the run's weight-sync folder (`sync_root`)."""
    ro, name = cfg.rollout, cfg.rollout.server_model
    if ro.launch_servers not in TOKEN_VARS:
        raise ValueError(f"rollout.launch_servers: {ro.launch_servers!r}")
    common = ["--host", HOST, "--port", str(port), *(["--served-model-name", name] if name else [])]
    env = {TOKEN_VARS[ro.launch_servers]: token}
    if ro.launch_servers == "asyncflow":  # /admin/load_weights reads only folders under weights_root
        return [sys.executable, "-m", "asyncflow", "serve", model_dir, *common, "--max-batch", str(ro.max_batch),
                "--weights-root", weights_root], env
    if ro.launch_servers == "vllm":  # serves sync_dir: weight versions replace its model.safetensors in place
        exe = Path(sys.executable).with_name("vllm")
        cmd = [str(exe) if exe.exists() else "vllm", "serve", weights_root, *common, "--dtype", cfg.model.dtype,
               "--seed", str(cfg.seed + index), "--max-num-seqs", str(ro.max_batch),
               "--logprobs-mode", "processed_logprobs"]
        # the /pause, /collective_rpc and /resume routes the vllm weight sync calls exist only in dev mode
        return cmd, {**env, "VLLM_SERVER_DEV_MODE": "1"}
    return [sys.executable, "-m", SECRET_FLAG_MODULE, SGLANG_KEY_ENV, "--api-key", "sglang.launch_server",
            "--model-path", model_dir, *common, "--dtype", cfg.model.dtype, "--random-seed", str(cfg.seed + index),
            "--max-running-requests", str(ro.max_batch)], env


def free_port() -> int:
    """A port free on loopback now (kept for the server's life; a restart binds it again)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the actor's process dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last lines of a server's output, joined on one line."""
    try:
        text = path.read_bytes()[-8192:].decode(errors="replace")
    except OSError:
        return "(no output)"
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip()) or "(no output)"


class ServerFailed(RuntimeError):
    """A server could not be started, or died with no restart left (one line)."""


class ServerActor:
    """Actor: one server process (a child process group), its health and its restarts."""

    def __init__(self, index: int, cfg: Config, model_dir: str, log_path: str, weights_root: str) -> None:
        self.index = index
        self.kind = cfg.rollout.launch_servers
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.token = secrets.token_hex(32)  # (hex: never taken for a flag by a server's argument parser)
        self.weights_root = Path(weights_root)
        self.cmd, env = server_command(cfg, index, model_dir, self.port, weights_root, self.token)
        self.env = {**{k: v for k, v in os.environ.items() if k not in DROPPED_ENV}, **env}
        self.log_path = Path(log_path)
        self.start_timeout_s = cfg.rollout.server_start_timeout_s
        self.sync_timeout_s = cfg.rollout.sync_timeout_s
        self.max_restarts = cfg.runtime.max_restarts
        self.sync = make_weight_sync(cfg.rollout.server_type)
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = False  # answering, with the last loaded weights
        self.failed: str | None = None  # set: gone for good, and why
        self.restarts = 0
        self.weights: tuple[str, int] | None = None  # the last (folder, version) its engine loaded
        self.watcher: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Start the server and wait until it answers; its URL. Then watch it (restarts)."""
        await self._launch()
        self.watcher = asyncio.ensure_future(self._watch())
        return self.url

    def _spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.weights_root.mkdir(parents=True, exist_ok=True)  # (`asyncflow serve --weights-root` needs it)
        with open(self.log_path, "ab") as out:  # (the child keeps its own descriptor)
            # own session: stopping kills the server's whole process group (vLLM's engine processes too)
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True, preexec_fn=_die_with_parent)
            out.write(f"[asyncflow] server {self.index} pid {self.proc.pid}: {' '.join(self.cmd)}\n".encode())

    async def _launch(self) -> None:
        """Start the child and wait (bounded) until it answers, then load the last weights into it."""
        self._spawn()
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not await self._probe(min(HEALTH_TIMEOUT_S, max(0.1, deadline - time.monotonic()))):
            code = self.proc.poll()
            if code is not None:
                raise ServerFailed(f"server {self.index} ({' '.join(self.cmd)}) exited with code {code} before it "
                                   f"answered: {tail(self.log_path)}")
            if time.monotonic() > deadline:
                self._kill()
                raise ServerFailed(f"server {self.index} ({' '.join(self.cmd)}) did not answer GET {self.url}/v1/models "
                                   f"within rollout.server_start_timeout_s ({self.start_timeout_s:g} s): "
                                   f"{tail(self.log_path)}")
            await asyncio.sleep(POLL_S)
        if self.weights is not None and not self.sync.in_place:  # (vLLM serves the folder the weights replace)
            folder, version = self.weights
            await self.sync.load(self.url, Path(folder), version, "drain", token=self.token, timeout=self.sync_timeout_s)
        self.up = True

    async def _probe(self, timeout: float) -> bool:
        try:
            await request_json("GET", f"{self.url}/v1/models", token=self.token, timeout=timeout)
            return True
        except (HTTPError, WaitTimeout, OSError):
            return False

    async def _watch(self) -> None:
        """Restart the child when it exits or stops answering, until no restart is left."""
        misses, checked = 0, time.monotonic()
        while self.failed is None:
            await asyncio.sleep(POLL_S)
            assert self.proc is not None
            code, why = self.proc.poll(), ""
            if code is not None:
                why = f"exited with code {code}"
            elif time.monotonic() - checked >= HEALTH_EVERY_S:
                checked = time.monotonic()
                misses = 0 if await self._probe(HEALTH_TIMEOUT_S) else misses + 1
                if misses >= HEALTH_FAILURES:
                    why = f"gave no answer to {misses} health checks in a row"
            if why:
                misses = 0
                await self._restart(why)
                checked = time.monotonic()

    async def _restart(self, why: str) -> None:
        """Bring the server back (the same command and port), or mark it failed with why."""
        self.up = False
        while True:
            self._kill()
            if self.restarts >= self.max_restarts:
                self.failed = (f"server {self.index} ({' '.join(self.cmd)}) {why}; runtime.max_restarts="
                               f"{self.max_restarts} allows no more restarts ({self.restarts} so far): "
                               f"{tail(self.log_path)}")
                print(f"[asyncflow] ray: {self.failed}", flush=True)
                return
            self.restarts += 1
            t0 = time.monotonic()
            try:
                await self._launch()
            except (ServerFailed, HTTPError, WaitTimeout) as exc:
                why = f"{why}, then its restart failed ({exc})"
                continue
            weights = "" if self.weights is None else f", policy version {self.weights[1]} loaded"
            print(f"[asyncflow] ray: server {self.index} {why}; restarted ({self.restarts} of {self.max_restarts}) "
                  f"in {time.monotonic() - t0:.1f} s as pid {self.proc.pid if self.proc else '?'} on {self.url}"
                  f"{weights}", flush=True)
            return

    async def wait_up(self) -> str:
        """Return once the server answers again (after a restart, with its weights); raise
        `ServerFailed` when it cannot come back. Bounded by the restarts it has left."""
        deadline = time.monotonic() + self.start_timeout_s * (1 + self.max_restarts - self.restarts) + 60
        while True:
            if self.failed is not None:
                raise ServerFailed(self.failed)
            if self.up and self.proc is not None and self.proc.poll() is None and await self._probe(HEALTH_TIMEOUT_S):
                return self.url
            if time.monotonic() > deadline:
                raise ServerFailed(f"server {self.index} ({self.url}) did not answer again in time: {tail(self.log_path)}")
            await asyncio.sleep(POLL_S)

    def loaded(self, folder: str, version: int) -> None:
        """Record the weights its engine loaded (a restarted server loads them first)."""
        if self.weights is None or version >= self.weights[1]:
            self.weights = (folder, version)

    def client_token(self) -> str:
        """The server's bearer token, for its rollout actor's engine (`ServerLink.token`)."""
        return self.token

    def info(self) -> dict[str, Any]:
        import ray

        return {"url": self.url, "pid": self.proc.pid if self.proc else None, "restarts": self.restarts,
                "node_id": ray.get_runtime_context().get_node_id(), "actor_pid": os.getpid(),
                "failed": self.failed}

    async def stop(self) -> int | None:
        """Stop watching and kill the server's process group (SIGTERM, then SIGKILL); its pid."""
        if self.watcher is not None:
            self.watcher.cancel()
        self.up = False
        if self.proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._kill()
        return self.proc.pid

    def _kill(self) -> None:
        """SIGKILL the child's process group (what is left of it) and reap the child."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE_S)


@dataclass
class ServerLink:
    """A rollout actor's engine's line to its server's actor (`OpenAIEngine.server`)."""

    name: str  # the ServerActor's Ray name
    timeout_s: float  # longest a recovery may take (every start and restart it has left)
    _handle: Any = field(default=None, repr=False)

    def _actor(self) -> Any:
        import ray

        if self._handle is None:
            self._handle = ray.get_actor(self.name)
        return self._handle

    async def recover(self) -> None:
        """Wait until the server answers again, or raise one line saying why it will not."""
        await self._ask("wait_up", self.timeout_s, "to answer again")

    async def token(self) -> str:
        """The server's bearer token (held by its actor only: never in a config, a file or a command line)."""
        return str(await self._ask("client_token", TOKEN_TIMEOUT_S, "to give its token"))

    async def _ask(self, method: str, timeout: float, what: str) -> Any:
        """Call the server actor's `method`, bounded; its failure or death is one line."""
        import ray

        try:
            return await asyncio.wait_for(getattr(self._actor(), method).remote(), timeout)
        except asyncio.TimeoutError:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for the server of {self.name} {what}") from None
        except ray.exceptions.RayTaskError as exc:
            raise RunFailed(str(exc.cause).strip().splitlines()[-1]) from None
        except ray.exceptions.RayActorError:
            raise RunFailed(f"the server actor {self.name} died (its server went with it)") from None

    def loaded(self, folder: Path, version: int) -> None:
        self._actor().loaded.remote(str(folder), version)  # (not awaited: the record is for a later restart)


def server_link(cfg: Config, session: str, index: int) -> ServerLink | None:
    """Rollout actor `index`'s link to its server (None: the user's servers, `rollout.server_urls`)."""
    if cfg.rollout.launch_servers is None:
        return None
    timeout = cfg.rollout.server_start_timeout_s * (1 + cfg.runtime.max_restarts) + 120
    return ServerLink(f"{session}-server-{index}", timeout)


@dataclass
class Servers:
    """The driver's view of the run's servers: their actors and URLs (`start_servers`)."""

    actors: list[Any]
    urls: list[str]

    def info(self) -> list[dict[str, Any]]:
        """Each server's URL, process, node and restarts (for `summary.json`)."""
        import ray

        out = []
        for i, actor in enumerate(self.actors):
            try:
                out.append({"index": i, **ray.get(actor.info.remote(), timeout=60)})
            except ray.exceptions.RayError as exc:
                out.append({"index": i, "url": self.urls[i], "pid": None, "error": type(exc).__name__})
        return out

    def stop(self) -> None:
        """Kill every server's process group, then its actor (bounded: SIGKILL after STOP_GRACE_S)."""
        import ray

        refs = [a.stop.remote() for a in self.actors]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S + 20)
        for a in self.actors:
            ray.kill(a)  # (a child still alive then dies with its actor: PR_SET_PDEATHSIG)


def rollout_options(options: dict[str, Any]) -> dict[str, Any]:
    """Rollout actor options beside a server: its bundle's resources are the server's (the actor only
    talks HTTP), and without a bundle it goes to the driver's node, as its server does."""
    from asyncflow.runtime.ray_placement import driver_node

    o = {**options, "num_cpus": 0, "num_gpus": 0}
    o.setdefault("scheduling_strategy", driver_node())
    return o


def start_servers(cfg: Config, place: Any, model_dir: str, out: Path, log: Any = print) -> Servers:
    """One `ServerActor` per rollout worker in that worker's bundle, each started and answering
    (bounded by `rollout.server_start_timeout_s`); on any failure all are stopped and the placement
    group is freed, and the error is one line naming the command and the tail of its output."""
    import ray

    t0 = time.monotonic()
    w = cfg.rollout.workers
    cls: Any = ray.remote(ServerActor)
    root = str(sync_root(cfg.rollout, out).resolve())  # (as the rollout actors' engines write it)
    actors: list[Any] = []
    for i in range(w):
        o = place.options(i, f"server-{i}")  # the bundle of rollout actor i, all its CPUs and GPUs
        for key in ("max_restarts", "max_task_retries"):  # (the actor restarts its child, not itself)
            o.pop(key, None)
        o.setdefault("scheduling_strategy", rollout_options({})["scheduling_strategy"])
        actors.append(cls.options(**{**o, "max_concurrency": 1000}).remote(
            i, cfg, model_dir, str(out / "servers" / f"server-{i}.log"), root))
    servers = Servers(actors, [])
    refs = [a.start.remote() for a in actors]
    try:
        _, pending = ray.wait(refs, num_returns=w, timeout=cfg.rollout.server_start_timeout_s + 60)
        if pending:
            raise WaitTimeout(f"timed out after {cfg.rollout.server_start_timeout_s + 60:g} s waiting for the "
                              f"server actors to start their servers (see {out / 'servers'})")
        servers.urls = list(ray.get(refs, timeout=60))
    except BaseException as exc:
        servers.stop()
        place.remove()
        if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, ServerFailed):
            raise RunFailed(f"rollout.launch_servers: {exc.cause}") from None
        raise
    log(f"[asyncflow] ray: {w} {cfg.rollout.launch_servers} server(s) answering in {time.monotonic() - t0:.1f} s "
        f"({', '.join(servers.urls)}; output in {out / 'servers'})")
    return servers
