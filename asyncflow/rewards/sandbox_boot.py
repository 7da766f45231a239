"""The sandbox child's first code (run as `python -I -c <this file's text> REPORT_FD CONFIG_PATH`).

Stdlib only: it runs in an isolated interpreter that cannot import asyncflow. Three processes:

- the supervisor (the process `run_code` starts) joins the pids cgroup, unshares the namespaces,
  sets the limits, forks, enforces the wall-clock deadline and relays the code's exit status;
- with a PID namespace, its child is the namespace's init (PID 1): it mounts a fresh /proc, forks
  the code and reaps every orphan; killing it makes the kernel kill everything in the namespace;
- the code's process runs the user's code as a real module (PID 2 in the namespace).

Without a PID namespace the supervisor is a child subreaper: whatever the code leaves behind
(setsid'd or not) is re-parented to it and killed before it exits.

Its config comes in a file it deletes before the code runs (a command-line argument is visible to
the code and limited to 128 KiB); its report lines carry a nonce from that file, so a line the code
writes to the report descriptor is ignored; `exec` and `compile` are taken before the code can
replace them.
"""
import os
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
PR_SET_CHILD_SUBREAPER = 36


def _libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)


def _unshare(flags):
    """'' or 'userns' if `flags` were unshared, else the reason (as root alone, else inside a new user
    namespace that maps the caller's own ids, so files it writes keep their owner)."""
    ctypes, libc = _libc()
    if libc.unshare(flags) == 0:
        return ""
    reason = os.strerror(ctypes.get_errno())
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | flags) != 0:
        return os.strerror(ctypes.get_errno()) or reason
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return "userns"


def _isolate(cfg):
    """Namespaces and the process limit, as `cfg["processes"]` asks; (applied, pid_ns)."""
    applied = []
    if cfg["cgroup"]:
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))  # before any fork: every descendant is counted and swept
        applied.append("pids_cgroup")
    if not sys.platform.startswith("linux"):
        return applied + ["pidns_unavailable: not Linux", "netns_unavailable: not Linux"], False
    if cfg["processes"] != "fallback":
        why = _unshare(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC)
        if why in ("", "userns"):
            return applied + ["userns"] * (why == "userns") + ["pidns", "mountns", "netns", "ipcns"], True
        applied.append("pidns_unavailable: " + why)
    else:
        applied.append("pidns_unavailable: fallback requested")
    why = _unshare(CLONE_NEWNET)
    applied += ["userns"] * (why == "userns") + ["netns" if why in ("", "userns") else "netns_unavailable: " + why]
    return applied, False


def _limit(cfg, applied):
    import resource
    cpu, procs = cfg["cpu_s"], cfg["max_processes"] + 2
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, cfg["memory"], cfg["memory"]),
              (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]), (resource.RLIMIT_CORE, 0, 0)]
    # RLIMIT_NPROC counts the user's processes: only in a new user namespace (counted per namespace
    # on Linux >= 5.14) is that the sandbox's alone; elsewhere it would count the trainer's too
    if "userns" in applied:
        limits.append((resource.RLIMIT_NPROC, procs, procs))
    for lim, soft, hard in limits:
        cur_hard = resource.getrlimit(lim)[1]
        if cur_hard != resource.RLIM_INFINITY:  # never ask for more than the parent may have
            hard = min(hard, cur_hard)
        resource.setrlimit(lim, (min(soft, hard), hard))
    applied.append("rlimits")
    if "userns" in applied:
        applied.append("nproc_rlimit")


def _mount_proc():
    """A /proc of this PID namespace only, in a mount namespace whose mounts never reach the host's."""
    ctypes, libc = _libc()
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return "proc_unavailable: " + os.strerror(ctypes.get_errno())
    if libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None) == 0:
        return "proc"
    why = os.strerror(ctypes.get_errno())
    if libc.umount2(b"/proc", 2) == 0:  # MNT_DETACH: no /proc beats the host's
        return "proc_hidden: " + why
    return "proc_unavailable: " + why


def _relay(wait_status):
    """Exit as the code did: the same code, or killed by the same signal."""
    if os.WIFSIGNALED(wait_status):
        import signal
        sig = os.WTERMSIG(wait_status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(wait_status))


def _wait(pid, deadline):
    """The child's wait status, or None once `deadline` (monotonic) passes."""
    import time
    pause = 0.002
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)


def _sweep(me, seconds):
    """Kill and reap every process re-parented to this subreaper until none is left (bounded)."""
    import contextlib
    import signal
    import time
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return True
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me:
                with contextlib.suppress(OSError):
                    os.kill(int(entry), signal.SIGKILL)
        time.sleep(0.005)
    return False


def _init(code_main, status_w):
    """PID 1 of the namespace: fork the code, reap every process, and report the code's status.
    Unbounded waits here are bounded by the supervisor, which kills this process at the deadline."""
    proc = _mount_proc()
    os.write(status_w, (proc + "\n").encode())
    pid = os.fork()
    if pid == 0:
        os.close(status_w)
        code_main()
    while True:
        done, status = os.wait()  # orphans of the namespace are re-parented here
        if done == pid:
            os.write(status_w, f"{status}\n".encode())
            os._exit(0)  # PID 1 exiting: the kernel kills the rest of the namespace


def _supervise(cfg, say, code_main):
    import signal
    import time
    applied, pid_ns = _isolate(cfg)
    if cfg["processes"] == "require" and not pid_ns:
        say({"refused": "no PID namespace here (" + "; ".join(applied) + ")"})
        os._exit(1)
    _limit(cfg, applied)
    deadline = time.monotonic() + cfg["timeout_s"]
    if pid_ns:
        status_r, status_w = os.pipe()
    else:
        _, libc = _libc()
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
            applied.append("subreaper")
    pid = os.fork()
    if pid == 0:
        if pid_ns:
            os.close(status_r)
            _init(code_main, status_w)
        code_main()
    buf = [b""]
    if pid_ns:
        os.close(status_w)
        lines = _read_lines(status_r, 1, deadline, buf)
        applied.insert(applied.index("mountns") + 1, lines[0] if lines else "proc_unavailable: no report")
    say({"isolation": applied + ["socket_guard"]})
    status = _wait(pid, deadline)
    if status is None:
        say({"timeout": True})
        os.kill(pid, signal.SIGKILL)
        status = os.waitpid(pid, 0)[1]
    if pid_ns:
        lines = _read_lines(status_r, 2, time.monotonic() + 1.0, buf)
        status = int(lines[1]) if len(lines) > 1 else status
    else:
        _sweep(os.getpid(), 2.0)
    _relay(status)


def _read_lines(fd, n, deadline, buf):
    """Up to `n` lines from `fd` (the init's status pipe; `buf` keeps what was read), reading until
    EOF or `deadline`."""
    import select
    import time
    while buf[0].count(b"\n") < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf[0] += chunk
    return buf[0].decode().splitlines()[:n]


def _guard_sockets():
    """Replace the socket constructors by one that raises before any socket exists."""
    import _socket
    import socket

    class NetworkBlocked(PermissionError):
        pass

    attempts = [0]

    class _NoSocket:
        def __init__(self, *args, **kwargs):
            attempts[0] += 1
            raise NetworkBlocked("network access is disabled in the sandbox")

    socket.socket = _socket.socket = _NoSocket  # type: ignore[misc, assignment]
    socket.socketpair = socket.create_connection = socket.fromfd = _NoSocket  # type: ignore[assignment]
    return NetworkBlocked, attempts


def _code(code_file, tests, say, run=(exec, compile, print)):
    """Run the code as a real module (`__main__`, or `solution` with tests) with `sys.argv == [its
    file]`, then each test; at its end, as in a normal interpreter exit, its non-daemon threads are
    joined and its atexit functions run. Never returns."""
    import atexit
    import threading
    import types
    _exec, _compile, _print = run
    NetworkBlocked, attempts = _guard_sockets()
    sys.argv = [code_file]
    module = types.ModuleType("__main__" if tests is None else "solution")
    module.__file__ = code_file
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module

    def _run():
        with open(code_file) as f:
            source = f.read()
        _exec(_compile(source, "<solution>", "exec"), module.__dict__)
        for i, test in enumerate(tests or ()):
            try:
                _exec(_compile(test, f"<test {i}>", "exec"), module.__dict__)
                ok = True
            except (MemoryError, NetworkBlocked):
                raise
            except BaseException as exc:
                ok = False
                _print(f"test {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            say({"test": i, "passed": ok})

    code, limit = _outcome(_run, NetworkBlocked)
    try:
        try:
            for t in threading.enumerate():
                if t is not threading.main_thread() and not t.daemon:
                    t.join()
            atexit._run_exitfuncs()
        except BaseException:
            pass
        if limit is not None:
            say({"limit": limit})
        say({"network_attempts": attempts[0]})
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _outcome(run, NetworkBlocked):
    """(exit code, limit hit or None) of `run()`, printing what the interpreter would."""
    try:
        run()
    except MemoryError:
        sys.stderr.write("MemoryError: the sandbox memory limit was reached\n")
        return 1, "memory"
    except NetworkBlocked as exc:
        sys.stderr.write(f"NetworkBlocked: {exc}\n")
        return 1, "network"
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")  # as the interpreter prints sys.exit("message")
        return (exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)), None
    except BaseException as exc:
        import traceback
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # hide this bootstrap's frames
            tb = tb.tb_next
        traceback.print_exception(type(exc), exc, tb)
        return 1, None
    return 0, None


def _boot(report_fd, cfg_path):
    import json
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.unlink(cfg_path)
    nonce = cfg.pop("nonce")
    report = os.fdopen(report_fd, "w", buffering=1)

    def say(row):
        report.write(json.dumps({**row, "nonce": nonce}) + "\n")

    code_file, tests = cfg["code_file"], cfg["tests"]
    _supervise(cfg, say, lambda: _code(code_file, tests, say))


if __name__ == "__main__":
    _boot(int(sys.argv[1]), sys.argv[2])
