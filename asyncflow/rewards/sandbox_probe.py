"""Run inside the sandbox as the code would be: try each isolation layer from the inside and print,
as one JSON object, "" for each layer that held or why it did not.

Stdlib only. Its input (stdin, JSON): the trainer's namespace links, its user id, and files it made
in /tmp and /dev/shm. The attempts are the ones an attacker makes: unmount /proc, open a Unix
socket, enter a new user namespace, raise the pids limit, read the host's processes.
"""
import ctypes
import json
import os
import resource
import sys

MNT_DETACH, CLONE_NEWUSER, AF_UNIX, SOCK_STREAM, EACCES = 2, 0x10000000, 1, 1, 13


def _status():
    with open("/proc/self/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _namespaces(host, out):
    for layer, kind in (("userns", "user"), ("pidns", "pid"), ("mountns", "mnt"), ("netns", "net"), ("ipcns", "ipc")):
        try:
            same = os.readlink(f"/proc/self/ns/{kind}") == host.get(kind)
        except OSError as exc:
            same, out[layer] = True, f"cannot read /proc/self/ns/{kind}: {exc.strerror}"
            continue
        out[layer] = "the host's namespace" if same else ""


def _proc(libc, out):
    if os.readlink("/proc/self") != str(os.getpid()):
        out["proc"] = "/proc is not this PID namespace's"
    elif libc.umount2(b"/proc", MNT_DETACH) == 0:
        out["proc"] = "the code unmounted /proc"
    else:
        out["proc"] = ""


def _privileges(libc, status, out):
    caps = [k for k in ("CapInh", "CapPrm", "CapEff", "CapAmb") if int(status.get(k, "1"), 16)]
    out["caps_dropped"] = "" if not caps else "not empty: " + ", ".join(caps)
    out["no_new_privs"] = "" if status.get("NoNewPrivs") == "1" else "NoNewPrivs is not set"
    fd = libc.socket(AF_UNIX, SOCK_STREAM, 0)
    err = ctypes.get_errno()
    if fd >= 0:
        os.close(fd)
        out["seccomp"] = "a Unix socket could be opened"
    elif libc.unshare(CLONE_NEWUSER) == 0:
        out["seccomp"] = "a new user namespace could be made"
    else:
        out["seccomp"] = "" if err == EACCES and status.get("Seccomp") == "2" else "no filter"


def _guard(out):
    import _socket
    import socket
    held = []
    for make in (socket.socket, _socket.socket, socket.SocketType, _socket.SocketType):
        try:
            make()
        except PermissionError as exc:  # the guard's own class, not the seccomp filter's refusal
            held.append(type(exc).__name__ == "NetworkBlocked")
        except Exception:
            held.append(False)
        else:
            held.append(False)
    out["socket_guard"] = "" if all(held) else "a socket constructor was not replaced"


def _limits(out):
    out["rlimits"] = ("" if resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY
                      and resource.getrlimit(resource.RLIMIT_CORE) == (0, 0) else "the limits are not set")
    out["nproc_rlimit"] = "" if resource.getrlimit(resource.RLIMIT_NPROC)[0] != resource.RLIM_INFINITY else "unlimited"
    writable = []
    try:
        with open("/proc/self/cgroup") as f:
            paths = [line.rstrip("\n").split(":", 2)[2] for line in f]
    except OSError:
        paths = []
    for path in paths:
        for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/pids"):
            target = root + path.rstrip("/") + "/pids.max"
            try:  # opening for writing is the permission check; nothing is written
                os.close(os.open(target, os.O_WRONLY))
                writable.append(target)
            except OSError:
                pass
    out["pids_cgroup"] = "" if not writable else "the code may raise its own limit in " + writable[0]


def main():
    info = json.loads(sys.stdin.read())
    libc = ctypes.CDLL(None, use_errno=True)
    out: dict = {}
    _namespaces(info["ns"], out)
    out["uid_switch"] = "" if os.getuid() not in (0, info["uid"]) else f"runs as uid {os.getuid()}"
    _proc(libc, out)
    hidden = [not os.path.exists(p) for p in info["markers"]]
    out["tmp_private"] = "" if all(hidden) else "the host's /tmp or /dev/shm is visible"
    _privileges(libc, _status(), out)
    _guard(out)
    _limits(out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
