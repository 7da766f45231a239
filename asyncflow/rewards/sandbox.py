"""Running untrusted, model-written Python in a limited child process (for code reward functions).

Why a subprocess and not `exec`: generated code loops forever, allocates without bound, prints
megabytes, writes files, opens sockets and reads the environment; a reward function must survive
all of it and still return a number. Each run gets:

- a fresh interpreter (`python -I`: no user site, no PYTHON* variables) in a new session;
- its own processes: on Linux a PID namespace (with a mount namespace and a /proc of its own), so
  the code sees and can signal only its own processes, and killing the namespace's init ends every
  descendant, setsid'd or not (as root directly, else inside a new user namespace); where the kernel
  refuses, the fallback: a child subreaper that kills whatever the code left behind before it
  returns, while the code can still see and signal the user's other processes (`processes=`);
- a process-count limit: a pids cgroup where one can be made (root), and RLIMIT_NPROC under the
  call's own user id or user namespace;
- resource limits set in the child before the code runs: RLIMIT_CPU (CPU seconds), RLIMIT_AS
  (address space), RLIMIT_FSIZE (largest file written) and RLIMIT_CORE = 0;
- privileges given up before the code runs (sandbox_confine.py): as root a user id of the call's
  own, no capabilities, no_new_privs, and a seccomp filter that refuses every new socket and the
  calls that would undo the namespaces; private /tmp and /dev/shm (sandbox_mounts.py);
- no network: a network namespace (only a loopback device that is down) where permitted, the filter,
  and every Python name of the socket constructors replaced by a class that raises;
- a fresh interpreter of the code's own (sandbox_runner.py) and, with tests, a separate process for
  them that the code cannot reach;
- a fresh temporary working directory (also HOME and TMPDIR), removed afterwards;
- a minimal environment (PATH, HOME, TMPDIR, LANG): no inherited secrets;
- stdout and stderr capped at `max_output_bytes` each (the rest is read and discarded).

`SandboxResult.isolation` lists the layers a probe saw hold from inside (sandbox_verify.py). This is
not a virtual machine: the kernel is shared, and as an unprivileged user the code keeps that user's
id and can read the user's files. For hostile code at scale, run the reward workers in a container
or VM as well (docs/rewards.md says what holds where).
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

from asyncflow.rewards.sandbox_verify import annotate, missing, verified

Status = Literal["ok", "timeout", "cpu_limit", "memory_limit", "error", "network_blocked"]
Processes = Literal["auto", "require", "fallback"]
REQUIRE_ENV = "ASYNCFLOW_SANDBOX_REQUIRE"  # comma-separated layers every run_code must see hold

_DRAIN_S = 0.2  # once the code's group is killed, its pipes are read this long more (a process that
# called setsid escaped the kill and may hold them open)
_BACKSTOP_S = 5.0  # the child kills the code at timeout_s; run_code kills the child this much later
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
    max_processes: int = 64
    """Most processes and threads of the code at once: a pids cgroup where one can be made (root or
    a delegated cgroup), else RLIMIT_NPROC inside a new user namespace; otherwise not enforced."""


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
    """What held, in order: pids_cgroup, userns, pidns, mountns, proc, netns, ipcns, rlimits,
    nproc_rlimit, subreaper, socket_guard, tmpdir, clean_env; `X_unavailable: REASON` for one that
    was tried and refused (pids_cgroup, pidns, netns), `proc_hidden`/`proc_unavailable: REASON`."""
    tests_passed: list[bool] | None = None
    """`run_tests` only: one entry per test (a test that never ran, e.g. after a timeout, is False)."""


# The child's first code: isolation, limits and guards, then the user's code (sandbox_boot.py, a
# stdlib-only script run with `python -I -c`; its module docstring says how the processes are laid out).
_BOOTSTRAP = Path(__file__).with_name("sandbox_boot.py").read_text()
_CONFINE = Path(__file__).with_name("sandbox_confine.py").read_text()
_MOUNTS = Path(__file__).with_name("sandbox_mounts.py").read_text()
_RUNNER = Path(__file__).with_name("sandbox_runner.py").read_text()
# As root, each call runs as its own user id from this range (2**31 - 2**26 ... 2**31): far above
# any account's and any user namespace's usual subordinate ids.
_UID_BASE, _UID_SLOTS = 2**31 - 2**26, 2**25


def run_code(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    tests: list[str] | None = None,
    python: str = sys.executable,
    processes: Processes | None = None,
    require: Sequence[str] | None = None,
) -> SandboxResult:
    """Run `code` (a Python program, as `__main__`) in a limited child process and say what happened.

    With `tests`, the code is executed as a module and then each test source (e.g. an `assert`)
    runs against it in a separate process; `tests_passed` holds the outcome of each. `processes`
    (default: the environment variable ASYNCFLOW_SANDBOX_PROCESSES, else "auto"): "auto" uses a PID
    namespace where the kernel permits and the subreaper fallback elsewhere; "require" refuses to
    run the code without one (status `error`, `exit_code` None); "fallback" never tries.
    `require` (default: ASYNCFLOW_SANDBOX_REQUIRE, comma-separated): isolation layers that must
    hold (as verified from inside the sandbox, once per process), else the code is refused the same way.
    """
    lim = limits or SandboxLimits()
    mode = processes or os.environ.get("ASYNCFLOW_SANDBOX_PROCESSES") or "auto"
    if mode not in ("auto", "require", "fallback"):
        raise ValueError(f"run_code: processes must be auto, require or fallback, got {mode!r}")
    mode = cast(Processes, mode)
    if require is None:
        require = [x.strip() for x in os.environ.get(REQUIRE_ENV, "").split(",") if x.strip()]

    def probe(probe_code: str, probe_stdin: str) -> tuple[list[str], str, str]:
        res = _run(probe_code, probe_stdin, SandboxLimits(), None, python, mode)
        return res.isolation, res.stdout, res.stderr

    proven = verified((python, mode), probe)
    why = missing(tuple(require), proven)
    if why is not None:
        return SandboxResult("error", "", f"sandbox: refused to run the code: {why}", None, 0.0)
    result = _run(code, stdin, lim, tests, python, mode)
    result.isolation = annotate(result.isolation, proven)
    return result


def _run(code: str, stdin: str, lim: SandboxLimits, tests: list[str] | None, python: str,
         mode: Processes) -> SandboxResult:
    workdir = Path(tempfile.mkdtemp(prefix="asyncflow-sandbox-"))
    cgroup, cgroup_note = _make_pids_cgroup(lim.max_processes)
    try:
        return _run_in(workdir, code, stdin, lim, tests, python, mode, cgroup, cgroup_note)
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
        _remove_tree(workdir)


def require_layers(layers: Sequence[str] | None) -> None:
    """Make every later `run_code` of this process and of the processes it starts require `layers`
    (`reward.sandbox_require`; unknown names are refused when the config loads)."""
    if layers:
        os.environ[REQUIRE_ENV] = ",".join(layers)


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
            python: str, mode: Processes, cgroup: Path | None, cgroup_note: str) -> SandboxResult:
    cpu = max(1, math.ceil(lim.cpu_s if lim.cpu_s is not None else lim.timeout_s))
    nonce = secrets.token_hex(16)
    cfg_file = _write_config(workdir, code, tests, lim, cpu, nonce, mode, cgroup, python)
    try:
        return _start(workdir, cfg_file, stdin, lim, tests, python, nonce, cpu, cgroup, cgroup_note)
    finally:
        with contextlib.suppress(OSError):
            cfg_file.unlink()  # the child deletes it before the code runs; this if it never started


def _start(workdir: Path, cfg_file: Path, stdin: str, lim: SandboxLimits, tests: list[str] | None, python: str,
           nonce: str, cpu: int, cgroup: Path | None, cgroup_note: str) -> SandboxResult:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir),
           "LANG": "C.UTF-8"}
    report_r, report_w = os.pipe()
    notes_r, notes_w = os.pipe()
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            # -B, -X utf8: no .pyc written, UTF-8 stdio (as options: -I ignores the PYTHON* variables)
            [python, "-I", "-B", "-X", "utf8", "-c", _BOOTSTRAP, str(report_w), str(notes_w), str(cfg_file)],
            bufsize=0, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir, env=env,
            pass_fds=(report_w, notes_w), start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        for fd in (report_r, report_w, notes_r, notes_w):
            os.close(fd)
        return SandboxResult("error", "", f"sandbox: cannot start {python}: {exc}", None, 0.0)
    os.close(report_w)
    os.close(notes_w)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = _Capped(lim.max_output_bytes), _Capped(lim.max_output_bytes)
    rep, notes = _Capped(1_000_000), _Capped(4096)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, report_r: rep, notes_r: notes}
    try:
        # the child enforces timeout_s itself (it must outlive the code to sweep what the code left);
        # this later deadline is the backstop if it cannot
        backstop = _exchange(proc.pid, proc.stdin, stdin.encode(), sinks, start + lim.timeout_s + _BACKSTOP_S)
        seconds = time.monotonic() - start
    finally:
        # the group is killed while its leader is not yet reaped, so its id cannot have been reused
        _kill_group(proc.pid)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
        os.close(report_r)
        os.close(notes_r)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
    report = _parse_report(rep.text(), nonce)
    refused = next((r["refused"] for r in report if "refused" in r), None)
    if refused is not None:
        return SandboxResult("error", "", f"sandbox: refused to run the code: {refused}", None, seconds)
    own = _parse_notes(notes.text())
    killed = backstop or any(r.get("timeout") is True for r in report)
    status = _status(proc.returncode, killed, own, usage.ru_utime + usage.ru_stime >= cpu - _CPU_SLACK_S)
    return SandboxResult(status, out.text(), err.text(), proc.returncode, seconds, out.truncated or err.truncated,
                         _isolation(report, cgroup, cgroup_note, tests is not None), _tests_passed(report, tests))


def _isolation(report: list[dict[str, Any]], cgroup: Path | None, cgroup_note: str, with_tests: bool) -> list[str]:
    """The layers the child reported (the supervisor's, then the code process's), then the parent's."""
    applied = next((list(r["isolation"]) for r in report if "isolation" in r), [])
    confined = next((list(r["confined"]) for r in report if "confined" in r), [])
    notes = [cgroup_note] if cgroup is None else []  # the child reports `pids_cgroup` once it joined it
    return [*applied, *confined, "socket_guard", *(["tests_process"] if with_tests else []), *notes,
            "tmpdir", "clean_env"]


def _tests_passed(report: list[dict[str, Any]], tests: list[str] | None) -> list[bool] | None:
    if tests is None:
        return None
    ran: dict[int, bool] = {}
    for r in report:
        if "test" in r:
            ran.setdefault(int(r["test"]), r["passed"] is True)
    return [ran.get(i, False) for i in range(len(tests))]


def _sandbox_uid() -> int | None:
    """A user id of this call's own (and the next one, for its tests) when running as root: no
    process or file of any other user has it. None when not root (the sandbox then uses a user
    namespace)."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return None
    return _UID_BASE + 2 * secrets.randbelow(_UID_SLOTS)


def _kept_folders(python: str) -> list[str]:
    """The interpreter's folders, which must stay visible to the code's user in its mount namespace."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:
        prefixes = {os.path.dirname(os.path.dirname(python))}
    prefixes |= {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    return sorted({os.path.realpath(p) for p in prefixes})


def _write_config(workdir: Path, code: str, tests: list[str] | None, lim: SandboxLimits, cpu: int, nonce: str,
                  mode: Processes, cgroup: Path | None, python: str) -> Path:
    """The code's file and the child's config (read and deleted by the child before the code runs).
    Under a user id of its own the code owns its working folder and nothing else."""
    code_file = workdir / "solution.py"
    code_file.write_text(code)
    uid = _sandbox_uid()
    try:
        for path, perms in ((code_file, 0o600), (workdir, 0o711)) if uid is not None else ():
            os.chown(path, cast(int, uid), cast(int, uid))
            os.chmod(path, perms)  # root without CAP_DAC_OVERRIDE can still enter (not list) the folder
    except OSError:  # root without CAP_CHOWN: the code runs as this user (the report says so)
        uid = None
    fd, name = tempfile.mkstemp(prefix="asyncflow-sandbox-", suffix=".json")  # outside the code's folder
    with os.fdopen(fd, "w") as f:
        json.dump({
            "code_file": str(code_file), "tests": tests, "cpu_s": cpu, "nonce": nonce, "timeout_s": lim.timeout_s,
            "memory": lim.memory_mb * 2**20, "fsize": lim.max_file_mb * 2**20, "max_processes": lim.max_processes,
            "processes": mode, "cgroup": None if cgroup is None else str(cgroup), "uid": uid,
            "python": python, "keep": _kept_folders(python), "private_tmp_mb": lim.max_file_mb,
            "confine_text": _CONFINE, "mounts_text": _MOUNTS, "runner_text": _RUNNER}, f)
    cfg_file = Path(name)
    return cfg_file


def _make_pids_cgroup(max_processes: int) -> tuple[Path | None, str]:
    """A new pids cgroup limited to `max_processes` tasks (root, or a delegated cgroup), else
    (None, why not). cgroup v1's pids hierarchy, or v2 where our cgroup delegates `pids`."""
    if not sys.platform.startswith("linux"):
        return None, "pids_cgroup_unavailable: not Linux"
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError as exc:
        return None, f"pids_cgroup_unavailable: {exc.strerror}"
    bases = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            bases.append(Path("/sys/fs/cgroup/pids") / path.lstrip("/"))
        elif controllers == "":
            bases.append(Path("/sys/fs/cgroup") / path.lstrip("/"))
    why = "no pids controller"
    for base in bases:
        if not (base / "cgroup.procs").is_file():  # not a cgroup (a tmpfs where one is mounted, say)
            continue
        group = base / f"asyncflow-sandbox-{secrets.token_hex(6)}"
        try:
            group.mkdir()
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            continue
        try:
            if not (group / "pids.max").is_file():  # a hierarchy without the pids controller
                raise OSError(0, "no pids controller")
            (group / "pids.max").write_text(str(max_processes + 2))  # + the supervisor and the init
            return group, "pids_cgroup"
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            with contextlib.suppress(OSError):
                group.rmdir()
    return None, f"pids_cgroup_unavailable: {why}"


def _remove_cgroup(group: Path) -> None:
    """Kill whatever is still in the cgroup (a process that escaped every other sweep), then remove it.
    Bounded: a cgroup that will not empty within 2 s is left behind (its processes are SIGKILLed)."""
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        except OSError:
            return
        if not pids:
            with contextlib.suppress(OSError):
                group.rmdir()
                return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


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


def _status(returncode: int, killed: bool, notes: list[dict[str, Any]], used_cpu_limit: bool) -> Status:
    if killed:
        return "timeout"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and used_cpu_limit):
        return "cpu_limit"  # the soft CPU limit, or the hard one (SIGKILL) if SIGXCPU was ignored
    limit = next((r["limit"] for r in notes if r.get("limit")), None)
    if limit == "memory":
        return "memory_limit"
    if limit == "network":
        return "network_blocked"
    if returncode == 0:
        return "ok"
    if any(r.get("network_attempts") for r in notes):
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


def _parse_notes(text: str) -> list[dict[str, Any]]:
    """The code's own notes (a limit it hit, sockets it tried): they only choose between statuses of a
    failed run, so the code gains nothing by writing them itself."""
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict):
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
    folder is made accessible first (top-down: a folder's own mode must allow listing it; as root, it
    is also taken back from the code's user id), then removed."""

    root = os.geteuid() == 0

    def unlock(folder: str) -> None:
        with contextlib.suppress(OSError):
            if root:  # the code's own user id owned it: root may lack the capability to enter it
                os.chown(folder, 0, 0)
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
