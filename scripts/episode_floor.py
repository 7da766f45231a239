"""The least scheduler CPU an agentic turn can cost with one asyncio task per episode.

PIPE's agentic episodes (DESIGN.md) are each their own task: every turn awaits a generation request,
then an environment step. This measures that skeleton alone, on the same virtual-time loop PIPE
uses, with no store, bookkeeping or tokens: `bare` awaits a future that a timer resolves (the
engine) and then `asyncio.sleep` (the environment); `swept` makes both awaits bounded through
`SweptClock`, as episodes do. 1,536 episodes run at once (12 rollout devices x 128 requests in
flight, as PIPE agentic at 16 devices), 12 turns each.

    python scripts/episode_floor.py [EPISODES]

Prints microseconds of CPU per episode and per turn for each variant.
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
import time

from asyncflow.clock import SweptClock
from asyncflow.virtual_loop import VirtualClock, run_virtual

CONCURRENT, TURNS = 12 * 128, 12


async def _measure(clock: VirtualClock, episodes: int, swept: bool) -> float:
    loop = asyncio.get_running_loop()
    rng = random.Random(0)
    bounded = SweptClock(clock)
    left = [episodes]

    def request() -> asyncio.Future[int]:
        fut = loop.create_future()
        loop.call_at(loop.time() + rng.random() * 5, fut.set_result, 1)
        return fut

    async def episode() -> None:
        for _ in range(TURNS):
            if swept:
                await bounded.wait_for(request(), 1000.0, "generation")
                await bounded.wait_for(clock.sleep(rng.random() * 3), 1000.0, "environment step")
            else:
                await request()
                await clock.sleep(rng.random() * 3)

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            await episode()

    cpu = time.process_time()
    await asyncio.gather(*(worker() for _ in range(CONCURRENT)))
    cpu = time.process_time() - cpu
    bounded.close()
    return cpu


def main() -> None:
    episodes = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
    gc.collect()
    gc.freeze()
    gc.set_threshold(32 * episodes)  # as PIPE sets workflow.gc_threshold: no young collections to speak of
    for variant in ("bare", "swept"):
        cpu = run_virtual(lambda clock, v=variant: _measure(clock, episodes, v == "swept"))  # type: ignore[misc]
        print(f"{variant}: {cpu / episodes * 1e6:.0f} us per episode of {TURNS} turns, "
              f"{cpu / episodes / TURNS * 1e6:.1f} us per turn")


if __name__ == "__main__":
    main()
