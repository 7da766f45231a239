"""Starting or joining Ray: one place, so every entry point gets the same safe defaults."""

from __future__ import annotations

import os
from typing import Any


def ensure_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Join `address` (a running cluster) or start a local Ray: loopback only, no dashboard.

    A Ray that is already initialised in this process (tests, notebooks) is reused as it is.
    """
    import ray

    if ray.is_initialized():
        return ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=True,
            configure_logging=False,
        )
    return ray
