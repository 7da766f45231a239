"""Starting or joining Ray: one place, so every entry point gets the same safe defaults."""

from __future__ import annotations

import os
import socket
from typing import Any

# Ray settings of a Ray this process starts (a joined cluster keeps its own). The raylet frees
# objects that went out of scope in batches, by default once a second: the store's payloads turn
# over in milliseconds, so each put then landed in fresh object-store memory, and every 4 KiB page of
# it cost its writer a page fault (STORE-1: ~20 of a 30 ms put). Freed within 10 ms, the memory
# of the puts before is reused, already mapped.
SYSTEM_CONFIG = {"free_objects_period_milliseconds": 10}


def ensure_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Join `address` (a running cluster) or start a local Ray: loopback only, no dashboard.

    A Ray that is already initialised in this process (tests, notebooks) is reused as it is.
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # (read when ray is imported: set it first)
    if address is None:  # a local Ray stays on loopback: Ray on Linux otherwise binds the interface address
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return ray
    if address:
        check_reachable(address)
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(
            # "local": a new Ray of this process's own, even where RAY_ADDRESS (set by `ray job submit`)
            # or a `ray start` on this machine would make a bare init join that cluster (which refuses
            # num_cpus: a traceback)
            address="local",
            num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
            _system_config=dict(SYSTEM_CONFIG),
        )
    return ray


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A `host:port` (or `ray://host:port`) address must accept a connection: `ray.init` retries an
    unreachable one for minutes before failing. "auto" and other forms are left to Ray."""
    from asyncflow.errors import UserError

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as exc:
        raise UserError(f"runtime.address: cannot reach {address} ({exc.strerror or exc}); is the cluster's head "
                        "running there (`ray start --head`)?") from None
    # Ray's GCS and client server speak gRPC (HTTP/2: a request in HTTP/1 gets binary frames back);
    # an HTTP/1 answer is a web server, e.g. the dashboard (:8265), which ray.init retried for minutes
    try:
        conn.settimeout(3.0)
        conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
        web = conn.recv(5) == b"HTTP/"
    except OSError:
        web = False  # (no answer in time: left to Ray)
    finally:
        conn.close()
    if web:
        raise UserError(f"runtime.address: {address} answers as a web server (the dashboard's port?), not as a Ray "
                        "cluster; give the head's HOST:PORT from `ray start --head` (port 6379 by default)")
