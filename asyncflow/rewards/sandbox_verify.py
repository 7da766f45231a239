"""Which of the sandbox's isolation layers hold here, found once per process by trying each from
inside the sandbox (sandbox_probe.py), and the refusal when a layer the user requires does not.

A layer the sandbox reports as applied stays in `isolation` only if the probe saw it hold; else it
reads `LAYER_unverified: WHY`.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

PROBE = Path(__file__).with_name("sandbox_probe.py").read_text()
PROBED = ("userns", "uid_switch", "pidns", "mountns", "proc", "tmp_private", "netns", "ipcns", "rlimits",
          "nproc_rlimit", "pids_cgroup", "caps_dropped", "no_new_privs", "seccomp", "socket_guard")
_NAMESPACES = ("user", "pid", "mnt", "net", "ipc")

_lock = threading.Lock()
_cache: dict[tuple[str, str], dict[str, str]] = {}

# A probe run: (probe code, its stdin) -> (isolation it reported, its stdout, its stderr).
ProbeRun = Callable[[str, str], tuple[list[str], str, str]]


def verified(key: tuple[str, str], run: ProbeRun) -> dict[str, str]:
    """{layer: "" if it held, else why not} for this interpreter and processes mode, probed once."""
    with _lock:
        if key not in _cache:
            _cache[key] = _probe(run)
        return _cache[key]


def _probe(run: ProbeRun) -> dict[str, str]:
    with ExitStack() as stack:
        markers = []
        for folder in ("/tmp", "/dev/shm"):
            if os.path.isdir(folder) and os.access(folder, os.W_OK):
                fd, path = tempfile.mkstemp(prefix="asyncflow-probe-", dir=folder)
                os.close(fd)
                stack.callback(os.unlink, path)
                markers.append(path)
        host = {}
        for kind in _NAMESPACES:
            try:
                host[kind] = os.readlink(f"/proc/self/ns/{kind}")
            except OSError:
                host[kind] = ""
        isolation, out, err = run(PROBE, json.dumps({"ns": host, "uid": os.getuid(), "markers": markers}))
    try:
        seen = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = (err.strip().splitlines() or ["no output"])[-1]
        return {layer: f"the probe did not run: {why}" for layer in PROBED}
    reasons = {}
    for layer in PROBED:
        refused = next((x.split(": ", 1)[1] for x in isolation if x.startswith(layer + "_unavailable: ")), None)
        if layer not in isolation:
            reasons[layer] = refused or "not applied"
        else:
            reasons[layer] = str(seen.get(layer, "not probed"))
    return reasons


def annotate(isolation: list[str], proven: dict[str, str]) -> list[str]:
    """`isolation` with each applied layer the probe did not see hold marked `LAYER_unverified: WHY`."""
    return [f"{x}_unverified: {proven[x]}" if proven.get(x) else x for x in isolation]


def missing(required: tuple[str, ...], proven: dict[str, str]) -> str | None:
    """Why the run must be refused (a required layer does not hold), or None."""
    unknown = [x for x in required if x not in PROBED]
    if unknown:
        raise ValueError(f"sandbox: cannot require {', '.join(unknown)}; the layers are: {', '.join(PROBED)}")
    failed = [f"{x} ({proven.get(x) or 'unknown'})" for x in required if proven.get(x, "unknown") != ""]
    return "required layers do not hold here: " + "; ".join(failed) if failed else None
