"""Running untrusted, model-written Python in a limited child process (for code reward functions).

Why a subprocess and not `exec`: generated code loops forever, allocates without bound, prints
megabytes, writes files, opens sockets and reads the environment; a reward function must survive
all of it and still return a number. Each run gets:

- a fresh interpreter (`python -I`: no user site, no PYTHON* variables) in a new session, so the
  whole process group is killed on the wall-clock limit;
- resource limits set in the child before the code runs: RLIMIT_CPU (CPU seconds), RLIMIT_AS
  (address space), RLIMIT_FSIZE (largest file written) and RLIMIT_CORE = 0;
- no network: on Linux the child tries `unshare(CLONE_NEWNET)` (alone as root, else with a new user
  namespace), which leaves it only a loopback device that is down; in every case `socket.socket`
  and `_socket.socket` are replaced by a class that raises before any socket exists;
- a fresh temporary working directory (also HOME and TMPDIR), removed afterwards;
- a minimal environment (PATH, HOME, TMPDIR, LANG): no inherited secrets;
- stdout and stderr capped at `max_output_bytes` each (the rest is read and discarded).

`SandboxResult.isolation` says what was actually applied. This is NOT a security boundary against a
determined attacker: the code runs as the same user, can read every file that user can read, and
the socket guard alone (where namespaces are unavailable) is bypassable from C extensions such as
ctypes. For hostile code, run the reward workers in a container or VM (docs/rewards.md).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

Status = Literal["ok", "timeout", "cpu_limit", "memory_limit", "error", "network_blocked"]

# exit codes the child's bootstrap uses to report an uncaught limit error (beyond ordinary codes)
_EXIT_MEMORY = 86
_EXIT_NETWORK = 87
_JOIN_TIMEOUT_S = 5.0  # reader threads end once the killed process group's pipes close


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    timeout_s: float = 10.0
    """Wall-clock limit: the process group is killed after this many seconds (status `timeout`)."""
    cpu_s: float | None = None
    """CPU-time limit (RLIMIT_CPU, rounded up to whole seconds; status `cpu_limit`). None: timeout_s."""
    memory_mb: int = 1024
    """Address-space limit (RLIMIT_AS) in MiB; allocating past it raises MemoryError (status `memory_limit`)."""
    max_output_bytes: int = 64_000
    """Most bytes kept of stdout and of stderr each; the rest is discarded and `truncated` is set."""
    max_file_mb: int = 64
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""


@dataclass
class SandboxResult:
    """What one run did."""

    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    """The child's exit code; negative: killed by that signal; None: never started."""
    seconds: float
    truncated: bool = False
    """stdout or stderr went past `max_output_bytes` and was cut."""
    isolation: list[str] = field(default_factory=list)
    """What was applied: rlimits, socket_guard, netns (or netns_unavailable: REASON), tmpdir, clean_env."""
    tests_passed: list[bool] | None = None
    """`run_tests` only: one entry per test (a test that never ran, e.g. after a timeout, is False)."""


# The child's first code: limits and guards, then the user's code. It runs in the child, so setting
# limits there needs no preexec_fn (unsafe in a threaded parent such as the reward workers).
_BOOTSTRAP = r'''
import json, os, sys
report = os.fdopen(int(sys.argv[1]), "w", buffering=1)
cfg = json.loads(sys.argv[2])
applied = []

def _unshare_net():
    if not sys.platform.startswith("linux"):
        return "netns_unavailable: not Linux"
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
        if libc.unshare(CLONE_NEWNET) == 0 or libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            return "netns"
        return "netns_unavailable: " + os.strerror(ctypes.get_errno())
    except Exception as exc:
        return "netns_unavailable: " + type(exc).__name__

applied.append(_unshare_net())
import resource
cpu = cfg["cpu_s"]
for lim, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, cfg["memory"], cfg["memory"]),
                        (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]), (resource.RLIMIT_CORE, 0, 0)):
    cur_hard = resource.getrlimit(lim)[1]
    if cur_hard != resource.RLIM_INFINITY:  # never ask for more than the parent may have
        hard = min(hard, cur_hard)
    resource.setrlimit(lim, (min(soft, hard), hard))
applied.append("rlimits")

import socket, _socket

class NetworkBlocked(PermissionError):
    pass

class _NoSocket:
    def __init__(self, *args, **kwargs):
        global network_attempts
        network_attempts += 1
        raise NetworkBlocked("network access is disabled in the sandbox")

network_attempts = 0
socket.socket = _socket.socket = _NoSocket
socket.socketpair = socket.create_connection = socket.fromfd = _NoSocket
applied.append("socket_guard")
report.write(json.dumps({"isolation": applied}) + "\n")

def _run():
    source = open(cfg["code_file"]).read()
    if cfg["tests"] is None:
        exec(compile(source, "<solution>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    exec(compile(source, "<solution>", "exec"), namespace)
    for i, test in enumerate(cfg["tests"]):
        try:
            exec(compile(test, f"<test {i}>", "exec"), namespace)
            ok = True
        except (MemoryError, NetworkBlocked):
            raise
        except BaseException as exc:
            ok = False
            print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        report.write(json.dumps({"test": i, "passed": ok}) + "\n")

try:
    _run()
except MemoryError:
    sys.stderr.write("MemoryError: the sandbox memory limit was reached\n")
    code = 86
except NetworkBlocked as exc:
    sys.stderr.write(f"NetworkBlocked: {exc}\n")
    code = 87
except SystemExit as exc:
    code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
except BaseException as exc:
    import traceback
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # hide this bootstrap's frames
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    code = 1
else:
    code = 0
try:
    report.write(json.dumps({"network_attempts": network_attempts}) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
finally:
    os._exit(code)
'''


def run_code(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    tests: list[str] | None = None,
    python: str = sys.executable,
) -> SandboxResult:
    """Run `code` (a Python program, as `__main__`) in a limited child process and say what happened.

    With `tests`, the code is executed as a module and then each test source (e.g. an `assert`)
    runs in its namespace; `tests_passed` holds the outcome of each.
    """
    lim = limits or SandboxLimits()
    workdir = Path(tempfile.mkdtemp(prefix="asyncflow-sandbox-"))
    try:
        return _run_in(workdir, code, stdin, lim, tests, python)
    finally:
        _remove_tree(workdir)


def run_tests(code: str, tests: list[str], *, timeout_s: float = 10.0, limits: SandboxLimits | None = None) -> float:
    """Fraction of `tests` (assert statements, say) that pass against `code`, in the sandbox.

    0.0 when the code does not run at all (syntax error, a limit hit before the tests). For reward
    functions: `[run_tests(extract_code(c), tests) for c, tests in zip(completions, tests)]`.
    """
    if not tests:
        raise ValueError("run_tests: no tests given")
    lim = limits or SandboxLimits(timeout_s=timeout_s)
    result = run_code(code, tests=tests, limits=lim)
    passed = result.tests_passed or []
    return sum(passed) / len(tests)


def _run_in(workdir: Path, code: str, stdin: str, lim: SandboxLimits, tests: list[str] | None,
            python: str) -> SandboxResult:
    code_file = workdir / "solution.py"
    code_file.write_text(code)
    cpu = math.ceil(lim.cpu_s if lim.cpu_s is not None else lim.timeout_s)
    cfg = {"code_file": str(code_file), "tests": tests, "cpu_s": max(1, cpu),
           "memory": lim.memory_mb * 2**20, "fsize": lim.max_file_mb * 2**20}
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
           "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}
    report_r, report_w = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, "-I", "-c", _BOOTSTRAP, str(report_w), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            pass_fds=(report_w,), start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        os.close(report_r)
        os.close(report_w)
        return SandboxResult("error", "", f"sandbox: cannot start {python}: {exc}", None, 0.0)
    os.close(report_w)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err, rep = _Capped(lim.max_output_bytes), _Capped(lim.max_output_bytes), _Capped(1_000_000)
    threads = [
        threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True),
        threading.Thread(target=out.drain, args=(proc.stdout,), daemon=True),
        threading.Thread(target=err.drain, args=(proc.stderr,), daemon=True),
        threading.Thread(target=rep.drain, args=(os.fdopen(report_r, "rb"),), daemon=True),
    ]
    for t in threads:
        t.start()
    try:
        killed = not _wait_unreaped(proc.pid, lim.timeout_s)
        seconds = time.monotonic() - start
    finally:
        # the group is killed while its leader is not yet reaped, so its id cannot have been reused:
        # this ends the code on timeout and any process it left behind in every case
        _kill_group(proc.pid)
        proc.wait(timeout=_JOIN_TIMEOUT_S)
    for t in threads:
        t.join(timeout=_JOIN_TIMEOUT_S)
    report = _parse_report(rep.text())
    status = _status(proc.returncode, killed, report)
    tests_passed = None
    if tests is not None:
        ran = {int(r["test"]): bool(r["passed"]) for r in report if "test" in r}
        tests_passed = [ran.get(i, False) for i in range(len(tests))]
    isolation = next((list(r["isolation"]) for r in report if "isolation" in r), [])
    return SandboxResult(status, out.text(), err.text(), proc.returncode, seconds, out.truncated or err.truncated,
                         [*isolation, "tmpdir", "clean_env"], tests_passed)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the child to exit, without reaping it; False if it is still running."""
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _status(returncode: int, killed: bool, report: list[dict[str, Any]]) -> Status:
    if killed:
        return "timeout"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # soft CPU limit, or the hard one if SIGXCPU was ignored
        return "cpu_limit"
    if returncode == _EXIT_MEMORY:
        return "memory_limit"
    if returncode == _EXIT_NETWORK:
        return "network_blocked"
    if returncode == 0:
        return "ok"
    if any(r.get("network_attempts") for r in report):
        return "network_blocked"  # the code failed after a blocked socket (e.g. caught it and exited 1)
    return "error"


def _parse_report(text: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class _Capped:
    """Reads a stream to its end, keeping the first `cap` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def drain(self, stream: IO[bytes]) -> None:
        with stream:
            while chunk := stream.read1(65536):  # type: ignore[attr-defined]
                room = self.cap - len(self.data)
                if len(chunk) > room:
                    self.truncated = True
                self.data += chunk[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _feed(stream: IO[bytes], data: bytes) -> None:
    try:
        with stream:
            stream.write(data)
    except (BrokenPipeError, OSError):
        pass  # the code exited without reading all of its input


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _remove_tree(path: Path) -> None:
    """Remove the working directory even if the code took permissions away from its files."""

    def fix(func, p, _exc):  # type: ignore[no-untyped-def]
        try:
            os.chmod(p, 0o700)
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    shutil.rmtree(path, onerror=fix)
