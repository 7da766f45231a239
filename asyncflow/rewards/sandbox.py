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
import dataclasses
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

Status = Literal["ok", "timeout", "cpu_limit", "memory_limit", "error", "network_blocked"]

_DRAIN_S = 0.2  # once the code's group is killed, its pipes are read this long more (a process that
# called setsid escaped the kill and may hold them open)
_CPU_SLACK_S = 0.05  # a SIGKILL after at least cpu_s - this of CPU time is the hard CPU limit


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
# limits there needs no preexec_fn (unsafe in a threaded parent such as the reward workers). Its
# config comes in a file it deletes before the code runs (a command-line argument is visible to the
# code and limited to 128 KiB); its report lines carry a nonce from that file, so a line the code
# writes to the report descriptor is ignored; `exec` and `compile` are taken before the code can
# replace them. The code runs as a real module (`__main__`, or `solution` with tests) with
# `sys.argv == [its file]`; at its end, as in a normal interpreter exit, its non-daemon threads are
# joined and its atexit functions run.
_BOOTSTRAP = r"""
import os, sys
def _boot(report_fd, cfg_path):
    import atexit, json, threading, types
    _exec, _compile, _print = exec, compile, print
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.unlink(cfg_path)
    nonce = cfg["nonce"]
    report = os.fdopen(report_fd, "w", buffering=1)
    say = report.write

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

    applied = [_unshare_net()]
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

    attempts = [0]

    class _NoSocket:
        def __init__(self, *args, **kwargs):
            attempts[0] += 1
            raise NetworkBlocked("network access is disabled in the sandbox")

    socket.socket = _socket.socket = _NoSocket
    socket.socketpair = socket.create_connection = socket.fromfd = _NoSocket
    applied.append("socket_guard")
    say(json.dumps({"isolation": applied, "nonce": nonce}) + "\n")
    tests = cfg["tests"]
    code_file = cfg["code_file"]
    del cfg
    sys.argv = [code_file]
    module = types.ModuleType("__main__" if tests is None else "solution")
    module.__file__ = code_file
    module.__builtins__ = __builtins__
    sys.modules[module.__name__] = module

    def _run():
        with open(code_file) as f:
            source = f.read()
        _exec(_compile(source, "<solution>", "exec"), module.__dict__)
        for i, test in enumerate(tests or ()):
            try:
                _exec(_compile(test, f"<test {i}>", "exec"), module.__dict__)
                ok = "true"
            except (MemoryError, NetworkBlocked):
                raise
            except BaseException as exc:
                ok = "false"
                _print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            say(f'{{"test": {i}, "passed": {ok}, "nonce": "{nonce}"}}\n')

    limit = None
    try:
        _run()
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox memory limit was reached\n")
        code, limit = 1, "memory"
    except NetworkBlocked as exc:
        sys.stderr.write(f"NetworkBlocked: {exc}\n")
        code, limit = 1, "network"
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")  # as the interpreter prints sys.exit("message")
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
        try:
            for t in threading.enumerate():
                if t is not threading.main_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        if limit is not None:
            say(f'{{"limit": "{limit}", "nonce": "{nonce}"}}\n')
        say(f'{{"network_attempts": {attempts[0]}, "nonce": "{nonce}"}}\n')
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

_boot(int(sys.argv[1]), sys.argv[2])
"""


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


def run_tests(code: str, tests: list[str], *, timeout_s: float | None = None,
              limits: SandboxLimits | None = None) -> float:
    """Fraction of `tests` (assert statements, say) that pass against `code`, in the sandbox.

    0.0 when the code does not run at all (syntax error, a limit hit before the tests). `timeout_s`
    (default 10 s) replaces `limits.timeout_s` when both are given. Raises RuntimeError when the
    sandbox itself cannot run (the interpreter cannot start), so a reward function fails loudly
    (`reward_error`) instead of scoring a correct solution 0. For reward functions:
    `[run_tests(extract_code(c), tests) for c, tests in zip(completions, tests)]`.
    """
    if not tests:
        raise ValueError("run_tests: no tests given")
    if limits is None:
        lim = SandboxLimits(timeout_s=10.0 if timeout_s is None else timeout_s)
    else:
        lim = limits if timeout_s is None else dataclasses.replace(limits, timeout_s=timeout_s)
    result = run_code(code, tests=tests, limits=lim)
    if result.exit_code is None:
        raise RuntimeError(result.stderr)
    passed = result.tests_passed or []
    return sum(passed) / len(tests)


def _run_in(workdir: Path, code: str, stdin: str, lim: SandboxLimits, tests: list[str] | None,
            python: str) -> SandboxResult:
    code_file = workdir / "solution.py"
    code_file.write_text(code)
    cfg_file = workdir / ".asyncflow-sandbox.json"  # read and deleted by the bootstrap before the code runs
    cpu = max(1, math.ceil(lim.cpu_s if lim.cpu_s is not None else lim.timeout_s))
    nonce = secrets.token_hex(16)
    cfg_file.write_text(json.dumps({"code_file": str(code_file), "tests": tests, "cpu_s": cpu, "nonce": nonce,
                                    "memory": lim.memory_mb * 2**20, "fsize": lim.max_file_mb * 2**20}))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
           "LANG": "C.UTF-8"}
    report_r, report_w = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            # -B, -X utf8: no .pyc written, UTF-8 stdio (as options: -I ignores the PYTHON* variables
            # that were set for these, so they had no effect)
            [python, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, str(report_w), str(cfg_file)], bufsize=0,
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
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, report_r: rep}
    try:
        killed = _exchange(proc.pid, proc.stdin, stdin.encode(), sinks, start + lim.timeout_s)
        seconds = time.monotonic() - start
    finally:
        # the group is killed while its leader is not yet reaped, so its id cannot have been reused:
        # this ends the code on timeout and any process it left behind in every case
        _kill_group(proc.pid)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
        os.close(report_r)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
    report = _parse_report(rep.text(), nonce)
    status = _status(proc.returncode, killed, report, usage.ru_utime + usage.ru_stime >= cpu - _CPU_SLACK_S)
    tests_passed = None
    if tests is not None:
        ran: dict[int, bool] = {}
        for r in report:
            if "test" in r:
                ran.setdefault(int(r["test"]), r["passed"] is True)
        tests_passed = [ran.get(i, False) for i in range(len(tests))]
    isolation = next((list(r["isolation"]) for r in report if "isolation" in r), [])
    return SandboxResult(status, out.text(), err.text(), proc.returncode, seconds, out.truncated or err.truncated,
                         [*isolation, "tmpdir", "clean_env"], tests_passed)


def _exchange(pid: int, stdin: IO[bytes], data: bytes, sinks: dict[int, _Capped], deadline: float) -> bool:
    """Feed `data` to the child and read its output into `sinks` until it exits (and its pipes end)
    or `deadline` passes; True if it was still running at the deadline. One thread, one selector: a
    process that escaped the group kill and holds the pipes costs `_DRAIN_S`, not a blocked reader."""
    with selectors.DefaultSelector() as sel:
        for fd in sinks:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        stdin_fd = stdin.fileno()
        if data:
            os.set_blocking(stdin_fd, False)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
        else:
            stdin.close()  # nothing to send: the code reads EOF at once
        sent = 0
        killed = False
        drain_until: float | None = None
        pause = 0.002
        while sel.get_map():
            now = time.monotonic()
            if drain_until is None:
                exited = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
                if exited or now >= deadline:
                    killed = not exited
                    _kill_group(pid)  # ends what the code left running; its pipes then close
                    drain_until = now + _DRAIN_S
                    continue
                wait = min(pause, deadline - now)
                pause = min(pause * 2, 0.05)
            elif now >= drain_until:
                break
            else:
                wait = drain_until - now
            for key, _ in sel.select(max(wait, 0.0)):
                pause = 0.002
                if key.fd == stdin_fd:
                    try:
                        sent += os.write(stdin_fd, data[sent:sent + 65536])
                    except BlockingIOError:
                        continue
                    except OSError:  # the code exited or closed its input without reading all of it
                        sent = len(data)
                    if sent >= len(data):
                        sel.unregister(stdin_fd)
                        stdin.close()  # all sent: the code reads EOF after it
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    sinks[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
        if drain_until is None:  # every pipe ended: wait for the exit itself
            killed = not _wait_unreaped(pid, deadline - time.monotonic())
    return killed


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


def _status(returncode: int, killed: bool, report: list[dict[str, Any]], used_cpu_limit: bool) -> Status:
    if killed:
        return "timeout"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and used_cpu_limit):
        return "cpu_limit"  # the soft CPU limit, or the hard one (SIGKILL) if SIGXCPU was ignored
    limit = next((r["limit"] for r in report if "limit" in r), None)
    if limit == "memory":
        return "memory_limit"
    if limit == "network":
        return "network_blocked"
    if returncode == 0:
        return "ok"
    if any(r.get("network_attempts") for r in report):
        return "network_blocked"  # the code failed after a blocked socket (e.g. caught it and exited 1)
    return "error"


def _parse_report(text: str, nonce: str) -> list[dict[str, Any]]:
    """The bootstrap's report rows; a row without the run's nonce was written by the code: ignored."""
    rows: list[dict[str, Any]] = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("nonce") == nonce:
            rows.append(row)
    return rows


class _Capped:
    """The first `cap` bytes of a stream; the rest is counted as cut."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    def add(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.truncated = True
        self.data += chunk[: max(room, 0)]

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _remove_tree(path: Path) -> None:
    """Remove the working directory even if the code took permissions away from its folders: every
    folder is made accessible first (top-down: a folder's own mode must allow listing it), then removed."""

    def unlock(folder: str) -> None:
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    unlock(entry.path)

    unlock(str(path))
    shutil.rmtree(path, ignore_errors=True)
