"""The sandbox child's first code (run as `python -I -c <this file's text> REPORT_FD NOTES_FD CONFIG_PATH`).

Stdlib only: it runs in an isolated interpreter that cannot import asyncflow (the texts of
sandbox_confine.py, sandbox_mounts.py and sandbox_runner.py come in its config). The processes:

- the supervisor (the process `run_code` starts) joins the pids cgroup, unshares the namespaces,
  sets the limits, forks, enforces the wall-clock deadline and relays the code's exit status;
- with a PID namespace, its child is the namespace's init (PID 1): it arranges the mounts (a fresh
  /proc, private /tmp and /dev/shm), starts the processes below and reaps every orphan; killing it
  makes the kernel kill everything in the namespace;
- the code's process gives up its privileges (sandbox_confine.py) and executes a fresh interpreter
  (sandbox_runner.py) that runs the user's code as a real module: nothing of the sandbox's memory,
  descriptors or nonce survives into it;
- with tests, the tests' process (confined the same way, as another user where the sandbox
  switches users, and not traceable) runs the tests and reports each result; it reaches the code's
  module only through the runner's pipes.

Without a PID namespace the supervisor is a child subreaper: whatever the code leaves behind
(setsid'd or not) is re-parented to it and killed before it exits.

The config comes in a file the supervisor deletes before the code runs; report lines carry a nonce
from it. The code's own notes (a limit it hit, blocked sockets) come on a separate descriptor.
"""
# every module is imported here, before any mount changes: later imports could race them
import contextlib
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
PR_SET_CHILD_SUBREAPER = 36


def _libc():
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
    cpu, procs = cfg["cpu_s"], cfg["max_processes"] + 2
    limits = [(resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, cfg["memory"], cfg["memory"]),
              (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]), (resource.RLIMIT_CORE, 0, 0)]
    # RLIMIT_NPROC counts the user's processes: only in a new user namespace (counted per namespace
    # on Linux >= 5.14) or under a user id of the call's own is that the sandbox's alone
    own_user = "userns" in applied or cfg["uid"] is not None
    if own_user:
        limits.append((resource.RLIMIT_NPROC, procs, procs))
    for lim, soft, hard in limits:
        cur_hard = resource.getrlimit(lim)[1]
        if cur_hard != resource.RLIM_INFINITY:  # never ask for more than the parent may have
            hard = min(hard, cur_hard)
        resource.setrlimit(lim, (min(soft, hard), hard))
    applied.append("rlimits")
    if own_user:
        applied.append("nproc_rlimit")


def _relay(wait_status):
    """Exit as the code did: the same code, or killed by the same signal."""
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(wait_status))


def _wait(pid, deadline):
    """The child's wait status, or None once `deadline` (monotonic) passes."""
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


def _init(cfg, lib, say, status_w):
    """PID 1 of the namespace: arrange the mounts, start the processes, reap every process, and
    report the mounts, then the code's and the tests' statuses. Unbounded waits here are bounded by
    the supervisor, which kills this process at the deadline."""
    _unshare(CLONE_NEWNS)  # a mount namespace of the init's own: the supervisor's view never changes
    keep = [os.path.dirname(cfg["code_file"]), *cfg["keep"]]
    layers = lib["arrange"](keep, cfg["private_tmp_mb"], cfg["uid"] is not None)
    os.write(status_w, (" ".join(x.replace(" ", "\x00") for x in layers) + "\n").encode())
    pids = _launch(cfg, lib, say)
    statuses: dict = {}
    while len(statuses) < len(pids):
        done, status = os.wait()  # orphans of the namespace are re-parented here
        if done in pids:
            statuses[done] = status
    os.write(status_w, (" ".join(str(statuses[p]) for p in pids) + "\n").encode())
    os._exit(0)  # PID 1 exiting: the kernel kills the rest of the namespace


def _launch(cfg, lib, say):
    """Fork the tests' process (with tests) and the code's; their pids, the code's first."""
    tests = cfg["tests"]
    req_r, req_w = os.pipe()
    ans_r, ans_w = os.pipe()
    pids = []
    if tests is not None:
        pid = os.fork()
        if pid == 0:
            lib["confine"](None if cfg["uid"] is None else cfg["uid"] + 1, dumpable=False)
            os.close(req_r)
            os.close(ans_w)
            lib["ask"](tests, lib["Line"](ans_r, req_w), say)
            os._exit(0)
        pids.append(pid)
    pid = os.fork()
    if pid == 0:
        _exec_code(cfg, lib, say, (req_r, ans_w) if tests is not None else ())
    for fd in (req_r, req_w, ans_r, ans_w):
        os.close(fd)
    os.close(cfg["notes_fd"])
    return [pid, *pids]


def _exec_code(cfg, lib, say, link_fds):
    """In the code's process: confine it, then replace it by the runner's fresh interpreter, which
    inherits only stdio, the notes descriptor and the pipes to the tests."""
    say({"confined": lib["confine"](cfg["uid"])})
    for fd in (cfg["notes_fd"], *link_fds):
        os.set_inheritable(fd, True)
    python = cfg["python"]
    argv = [python, "-I", "-B", "-X", "utf8", "-c", cfg["runner_text"], str(cfg["notes_fd"]), cfg["code_file"],
            "main" if cfg["tests"] is None else "solution", *map(str, link_fds)]
    try:
        os.execv(python, argv)
    except OSError as exc:
        say({"refused": f"cannot run {python} in the sandbox: {exc.strerror}"})
    os._exit(127)


def _supervise(cfg, lib, say):
    _, libc = _libc()
    applied, pid_ns = _isolate(cfg)
    libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0 (after the user namespace's maps are written): untraceable
    if cfg["processes"] == "require" and not pid_ns:
        say({"refused": "no PID namespace here (" + "; ".join(applied) + ")"})
        os._exit(1)
    if not pid_ns and cfg["uid"] is not None and not all(map(_others_can_reach, cfg["keep"])):
        applied.append("uid_switch_unavailable: the interpreter's folders are closed to other users "
                       "and no mount namespace can expose them")
        cfg["uid"] = None
        for path in (cfg["code_file"], os.path.dirname(cfg["code_file"])):
            os.chown(path, os.getuid(), os.getgid())  # the code runs as this user after all
    _limit(cfg, applied)
    deadline = time.monotonic() + cfg["timeout_s"]
    if pid_ns:
        status_r, status_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(status_r)
            _init(cfg, lib, say, status_w)
        os.close(status_w)
        os.close(cfg["notes_fd"])
        buf = [b""]
        lines = _read_lines(status_r, 1, deadline, buf)
        mounts = [x.replace("\x00", " ") for x in lines[0].split()] if lines else ["proc_unavailable: no report"]
        applied[applied.index("mountns") + 1:applied.index("mountns") + 1] = mounts
    elif libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        applied.append("subreaper")
    say({"isolation": applied})
    if not pid_ns:
        pids = _launch(cfg, lib, say)
        statuses = [_wait(p, deadline) for p in pids]
    else:
        statuses = [_wait(pid, deadline)]
    if None in statuses:
        say({"timeout": True})
        os.kill(pid if pid_ns else pids[0], signal.SIGKILL)
    if pid_ns:
        if statuses[0] is None:
            os.waitpid(pid, 0)
        lines = _read_lines(status_r, 2, time.monotonic() + 1.0, buf)
        statuses = [int(x) for x in lines[1].split()] if len(lines) > 1 else [signal.SIGKILL]
    else:
        statuses = [s if s is not None else signal.SIGKILL for s in statuses]
        _sweep(os.getpid(), 2.0)
    _relay(_worst(statuses))


def _worst(statuses):
    """The code's status, unless the tests' process was killed while the code exited normally."""
    code = statuses[0]
    for other in statuses[1:]:
        if os.WIFSIGNALED(other) and not os.WIFSIGNALED(code):
            return other
    return code


def _others_can_reach(path):
    """True if a user other than the owner may enter every folder above `path` and `path` itself."""
    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & 0o001:
                return False
        except OSError:
            return False
        if path == os.sep:
            return True
        path = os.path.dirname(path)


def _read_lines(fd, n, deadline, buf):
    """Up to `n` lines from `fd` (the init's status pipe; `buf` keeps what was read), reading until
    EOF or `deadline`."""
    while buf[0].count(b"\n") < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf[0] += chunk
    return buf[0].decode().splitlines()[:n]


def _boot(report_fd, notes_fd, cfg_path):
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.unlink(cfg_path)
    nonce = cfg.pop("nonce")
    os.set_inheritable(report_fd, False)  # the code's interpreter never gets the report
    os.set_inheritable(notes_fd, False)
    cfg["notes_fd"] = notes_fd
    report = os.fdopen(report_fd, "w", buffering=1)
    lib = {"__name__": "sandbox_lib"}
    for text in (cfg.pop("confine_text"), cfg.pop("mounts_text"), cfg["runner_text"]):
        exec(text, lib)

    def say(row):
        report.write(json.dumps({**row, "nonce": nonce}) + "\n")

    _supervise(cfg, lib, say)


if __name__ == "__main__":
    _boot(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
