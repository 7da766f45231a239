"""Heavy torch work in a thread of its own that ends with the work.

Why not `asyncio.to_thread`: torch's CPU ops run on OpenMP (libgomp), which keeps a pool of worker
threads for every thread that has run a parallel region, for that thread's whole life. Once the
pools' threads outnumber the cores, every pool spins only briefly at its barriers before sleeping,
and each parallel region pays for the wake-ups: measured on this project's 2-core machine, an
elementwise op over 1M floats took 93 us instead of 53 us while another thread's pool lived, and a
decode step of SmolLM2-135M at 64 rows 188 ms instead of 120 ms. The executor's threads live for the
whole run and each one that ran a train step or an export kept its pool, so the rollout engine and
the trainer slowed each other even when they never ran at the same time (sync mode). A thread that
ends frees its pool: starting one costs ~0.1 ms, nothing beside a train step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def in_own_thread(fn: Callable[..., T], *args: object, threads: int | None = None) -> T:
    """`fn(*args)` in a new thread that ends when it returns, with `threads` torch threads (None: the
    process default); its result or exception, awaited. (Through the loop's `run_in_executor`, so a
    virtual-time loop knows real work is outstanding.)"""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncflow-compute")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, with_threads, threads, fn, *args)
    finally:
        pool.shutdown(wait=False)  # (its thread ends once `fn` returns, even if this await was cancelled)


def with_threads(threads: int | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` with this thread's torch threads set to `threads` first (None: left as they are).
    The count is the calling thread's own: the process's other threads keep theirs."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return fn(*args)
