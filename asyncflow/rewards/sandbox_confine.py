"""What the sandboxed code's process gives up before the code runs (Linux): a user id of its own,
every capability, the right to gain privileges, and the system calls that would reach past its
namespaces.

Stdlib only: sandbox_boot.py executes this file's text in the sandbox child (which cannot import
asyncflow). `confine(uid)` runs in the process that then executes the code (or the tests) and
returns the layers that were applied and the ones that were refused, with the kernel's reason.
"""
import os
import struct
import sys

PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 4, 24, 38, 22
SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# seccomp return values: errno in the low 16 bits
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _EACCES, _ENOSYS = 1, 13, 38
_NS_FLAGS = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME

# Per architecture: its audit id, and the numbers of the calls denied with EACCES (a new socket of
# any family — Unix sockets reach host services by path whatever the network namespace; io_uring
# can open and connect sockets without calling socket(); namespaces and mounts would undo the
# others), then clone3 (ENOSYS: its flags are in memory a filter cannot read, so the C library falls
# back to clone, whose namespace flags are checked).
_ARCHS = {
    "x86_64": (0xC000003E, {"socket": 41, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166,
                            "pivot_root": 155, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
                            "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442},
               56, 435),
    "aarch64": (0xC00000B7, {"socket": 198, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39,
                             "pivot_root": 41, "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
                             "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442},
                220, 435),
}


def _libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)


def _ins(code, k, jt=0, jf=0):
    return struct.pack("HBBI", code, jt, jf, k & 0xFFFFFFFF)


def seccomp_program(machine):
    """The classic-BPF filter for `machine` (`os.uname().machine`) as bytes, or None if unknown."""
    if machine not in _ARCHS:
        return None
    arch, denied, clone, clone3 = _ARCHS[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    deny, nosys = _ERRNO | _EACCES, _ERRNO | _ENOSYS
    body = [_ins(ld, 0)]  # the call's number
    if machine == "x86_64":
        body.append(("jge", 0x40000000))  # the x32 ABI: same calls under other numbers
    for nr in denied.values():
        body.append(("jeq", nr))
    body += [_ins(jeq, clone3, 0, 1), _ins(ret, nosys), _ins(jeq, clone, 0, 4),
             _ins(ld, 16),  # clone's flags (low 32 bits of its first argument)
             _ins(jset, _NS_FLAGS, 1, 0), _ins(ret, _ALLOW), _ins(ret, deny), _ins(ret, _ALLOW)]
    # each ("jeq"/"jge", k) jumps to the final `deny` when it matches
    out = []
    for i, item in enumerate(body):
        if isinstance(item, tuple):
            op, k = item
            to_deny = len(body) - 2 - (i + 1)
            out.append(_ins(jeq if op == "jeq" else jge, k, to_deny, 0))
        else:
            out.append(item)
    head = [_ins(ld, 4), _ins(jeq, arch, 1, 0), _ins(ret, _ERRNO | _EPERM)]  # another ABI: nothing allowed
    return b"".join(head + out)


def _install_seccomp(ctypes, libc):
    prog = seccomp_program(os.uname().machine)
    if prog is None:
        return "seccomp_unavailable: no filter for " + os.uname().machine

    class Prog(ctypes.Structure):  # type: ignore[name-defined]
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    fprog = Prog(len(prog) // 8, prog)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        return "seccomp_unavailable: " + os.strerror(ctypes.get_errno())
    return "seccomp"


def _drop_bounding(libc):
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # without CAP_SETPCAP this fails; the check below says so


def _clear_caps(ctypes, libc):
    header = struct.pack("Ii", _LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} words, all zero
    if libc.capset(ctypes.c_char_p(header), ctypes.c_char_p(data)) != 0:
        return os.strerror(ctypes.get_errno())
    return ""


def _caps_left():
    """The capability sets that are not empty (from /proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            rows = [line.split() for line in f if line.startswith("Cap")]
    except OSError:
        return ["unreadable"]
    # the bounding set empties only where the process may (root, a user namespace); no_new_privs
    # makes it irrelevant elsewhere
    return [row[0].rstrip(":") for row in rows if len(row) == 2 and int(row[1], 16) != 0 and row[0] != "CapBnd:"]


def confine(uid, dumpable=True):
    """Give up privileges for good: as root, switch to `uid` (its own group, no supplementary
    groups); drop the bounding set and every capability; no_new_privs; the seccomp filter.
    `dumpable=False` also makes this process untraceable by others of its user. The layers applied
    or refused, in order."""
    if not sys.platform.startswith("linux"):
        return ["caps_unavailable: not Linux", "seccomp_unavailable: not Linux"]
    ctypes, libc = _libc()
    applied = []
    if not dumpable:
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _drop_bounding(libc)
    if os.geteuid() == 0 and uid is not None:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)  # clears the permitted and effective capabilities
            applied.append("uid_switch")
        except OSError as exc:
            applied.append("uid_switch_unavailable: " + (exc.strerror or type(exc).__name__))
    why = _clear_caps(ctypes, libc)
    left = _caps_left()
    applied.append("caps_dropped" if not left else f"caps_unavailable: {why or ', '.join(left) + ' not empty'}")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        applied.append("no_new_privs")
    else:
        applied.append("no_new_privs_unavailable: " + os.strerror(ctypes.get_errno()))
    applied.append(_install_seccomp(ctypes, libc))
    return applied
