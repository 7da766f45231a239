"""The sandbox's view of the filesystem, set up by the namespace's init in its private mount
namespace (Linux): a fresh /proc, /tmp and /dev/shm of its own, cgroups out of sight, and the
folders the code needs (its working folder, the interpreter) visible to the user it runs as.

Stdlib only: sandbox_boot.py executes this file's text (the sandbox child cannot import asyncflow).
Nothing here reaches the host's mounts: / is made private first.
"""
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
_PRIVATE_TMP = ("/tmp", "/dev/shm")


def _libc():
    import ctypes
    return ctypes, ctypes.CDLL(None, use_errno=True)


def _mount(libc, source, target, fstype, flags, data=None):
    def enc(x):
        return None if x is None else x.encode()
    return libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) == 0


def _blocked_ancestor(path):
    """The topmost folder above `path` that other users cannot enter, or None."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    for i in range(1, len(parts)):
        folder = os.sep + os.sep.join(parts[:i])
        try:
            if not os.stat(folder).st_mode & 0o001:
                return folder
        except OSError:
            return None
    return None


def _covers(folder, path):
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _tmpfs(libc, target, mode, size_mb):
    return _mount(libc, "tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode},size={size_mb}m")


def arrange(keep, private_tmp_mb, other_users):
    """Mount a fresh /proc, private /tmp and /dev/shm (`private_tmp_mb` each), an empty read-only
    /sys/fs/cgroup, and make each folder in `keep` visible at its own path again (bind mounts; with
    `other_users`, also through folders that others cannot enter, which get an empty tmpfs with
    just the kept folders). The layers that held, or `X_unavailable: REASON`."""
    ctypes, libc = _libc()

    def why():
        return os.strerror(ctypes.get_errno())
    if not _mount(libc, None, "/", None, MS_REC | MS_PRIVATE):
        return ["proc_unavailable: " + why()]
    layers = []
    if _mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC):
        layers.append("proc")
    else:
        layers.append("proc_unavailable: " + why())
    keep = [os.path.realpath(p) for p in keep if os.path.isdir(p)]
    covered = [d for d in _PRIVATE_TMP if os.path.isdir(d)]
    for path in keep if other_users else ():
        above = _blocked_ancestor(path)
        if above and not any(_covers(c, above) for c in covered):
            covered.append(above)
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep if any(_covers(c, p) for c in covered)}
    try:
        ok = True
        for folder in covered:
            mode = "1777" if folder in _PRIVATE_TMP else "0755"
            ok = _tmpfs(libc, folder, mode, private_tmp_mb) and ok
        if not ok:
            layers.append("tmp_private_unavailable: " + why())
        for path, fd in fds.items():
            os.makedirs(path, mode=0o755, exist_ok=True)
            if not _mount(libc, f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC):
                layers.append(f"bind_unavailable: {path}: {why()}")
    finally:
        for fd in fds.values():
            os.close(fd)
    if ok:
        layers.append("tmp_private")
    if os.path.isdir("/sys/fs/cgroup"):
        _mount(libc, "tmpfs", "/sys/fs/cgroup", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k")
    return layers
