"""`asyncflow bench pipeline`: PIPE — the real workflow at cluster scale, on a virtual clock.

What is real and what is simulated: the `Pipeline` (feeder, staleness gate, per-sample queue
scheduling in the rollout workers, multi-turn episodes, reward stage, trainer batch assembly, weight
publication and cancellation) and the `TransferQueue` are the code a training run uses. The devices
are simulated: each rollout device is a `SimEngine` (a continuous-batching server: up to `slots`
sequences decode together at `step_s` per step), the trainer a `SimTrainer` (`train_token_s`
device-seconds per trained token, spread over its devices), the agentic environment a `SimEnv` with
lognormal step latency. All of it runs on a `VirtualTimeLoop`, so a thousand devices working for
hours take seconds of this machine's time, and the real code's CPU cost is measured on the side.

Modes (DESIGN.md, PIPE):
- `sync`: colocated. Every device generates, then every device trains; switching costs `switch_s`
  each way (into training: in the train step; back: as the weight load). Same code at staleness 0.
- `async`: devices split between rollout and training (the split that best balances their
  throughputs); weights sync in `weight_sync_s` with in-flight `swap` loads; staleness bound
  `max_staleness` (the async ratio).

The ideal is every device busy all the time: devices / (generation + training device-seconds per
sample), from the profile's expected tokens per sample; efficiency = measured / ideal. Measured =
trained samples per virtual second over steps `warmup_steps+1 .. steps` (start-up excluded).
`scheduler_us_per_sample`: process CPU time of the run minus the CPU time inside simulation code
(engines, trainer, environments, the `async` verifier stand-in), per sample whose rollout finished
(`produced`, trained or not) — what the real store, scheduler, gate and their event loop cost on
this machine. `scheduler_us_per_request`: the same CPU time per generation request the engines
ended. For `rlvr` a request is a sample; an `agentic` sample is an episode of 5-20 requests
(turns), each awaited by the episode's own task, so its per-sample cost is that many turns' worth.
`--set split=true` adds that total's shares in the parts a Ray run puts in different processes:
`store_us_per_sample` (the store controller), `workers_us_per_sample` (rollout and reward workers,
episodes included), `trainer_us_per_sample` (feeder, gate, trainer loop) and `loop_us_per_sample`
(the event loop's own iteration); see `SplitMeter`.
`--set group_timeout_s=T` runs with `rollout.group_timeout_s` (stragglers aborted, their groups
trained partial); rows then count `stragglers_aborted` and `groups_partial`, and `token_efficiency`
says what `efficiency` does in trained tokens rather than samples (aborted responses are the long ones).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import gc
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError


@dataclass
class PipeSpec:
    """PIPE's pinned parameters (DESIGN.md); each can be overridden with `--set key=value`."""

    profiles: str = "rlvr,agentic"
    devices: str = "64,256,1024"
    modes: str = "sync,async"
    slots: int = 64  # sequences one rollout device decodes at once
    step_s: float = 0.03  # one decode step
    n: int = 8  # samples per prompt
    prompts_per_device: int = 32  # prompts per device per train step
    train_token_s: float = 0.15e-3  # device-seconds of training per response token
    switch_s: float = 5.0  # sync (colocated): generation <-> training, each way
    weight_sync_s: float = 2.0  # async: one weight sync
    max_staleness: int = 2  # async ratio
    steps: int = 5
    warmup_steps: int = 2
    seed: int = 0
    reward: str = "async"  # the verifier stand-in: async (awaited on the loop, as a remote verifier) or thread
    trace: str = ""  # a folder: write one trace.json per row there (first 200,000 spans)
    split: str = "false"  # true: also say where the scheduler's CPU goes (store, workers, trainer, loop; `SplitMeter`)
    group_timeout_s: float = 0.0  # rollout.group_timeout_s: abort stragglers past it (0: off)
    group_min_samples: int = 2  # rollout.group_min_samples


@dataclass(frozen=True)
class Profile:
    """How long responses are and what happens between turns."""

    name: str
    lengths: Callable[[random.Random], int]  # tokens of one generation request (one turn)
    max_new_tokens: int
    mean_tokens: float  # expected generated tokens per sample (all turns)
    turns: Callable[[random.Random], int] | None = None  # agentic: LLM turns per episode
    env_latency: Callable[[random.Random], float] | None = None


Z99 = 2.3263478740408408  # standard normal 99th percentile


def _lognormal_sigma(p99_over_median: float) -> float:
    return math.log(p99_over_median) / Z99


def _capped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X lognormal with this median and sigma."""
    mu = math.log(median)
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    below = math.exp(mu + sigma**2 / 2) * phi((math.log(cap) - mu - sigma**2) / sigma)
    return below + cap * (1 - phi((math.log(cap) - mu) / sigma))


def make_profile(name: str) -> Profile:
    if name == "rlvr":
        sigma, cap = _lognormal_sigma(20.0), 16_384
        return Profile("rlvr", lambda rng: min(cap, max(1, round(rng.lognormvariate(math.log(1000), sigma)))), cap,
                       _capped_lognormal_mean(1000, sigma, cap))
    if name == "agentic":
        lat_sigma = _lognormal_sigma(15.0)  # median 2 s, p99 30 s
        return Profile("agentic", lambda rng: rng.randint(100, 300), 300, 12.5 * 200,
                       turns=lambda rng: rng.randint(5, 20),
                       env_latency=lambda rng: rng.lognormvariate(math.log(2.0), lat_sigma))
    raise UserError(f"bench pipeline --set profiles: unknown profile {name!r}; use rlvr, agentic")


def split_devices(devices: int, gen_s: float, train_s: float) -> tuple[int, int]:
    """(rollout, train) devices that best balance rollout and training throughput."""
    best = max(range(1, devices), key=lambda t: min((devices - t) / gen_s, t / train_s))
    return devices - best, best


def _run_one(spec: PipeSpec, profile: Profile, devices: int, mode: str) -> dict[str, Any]:
    import asyncflow.workflow.pipeline  # noqa: F401  (imported, and the config's first load done, outside the
    from asyncflow.config import load_config  # measured window: ~0.1 s, ~2 us a sample of a first row)
    from asyncflow.engines.sim import meter_overhead_s
    from asyncflow.virtual_loop import run_virtual

    load_config(None, ["task=arith"])
    overhead = meter_overhead_s()

    gen_s = profile.mean_tokens * spec.step_s / spec.slots  # device-seconds per sample, slots full
    train_s = profile.mean_tokens * spec.train_token_s
    ideal = devices / (gen_s + train_s)
    rollout_dev, train_dev = (devices, devices) if mode == "sync" else split_devices(devices, gen_s, train_s)
    tmp = Path(tempfile.mkdtemp(prefix="asyncflow-pipe-"))
    gc.collect()
    gc.freeze()  # what exists now (imports, the previous row's leftovers) is never scanned again
    try:
        cpu0 = time.process_time()
        wall0 = time.monotonic()
        result = run_virtual(lambda clock: _simulate(spec, profile, devices, mode, rollout_dev, train_dev, clock, tmp))
        cpu = time.process_time() - cpu0
        wall = time.monotonic() - wall0
    finally:
        gc.unfreeze()
        shutil.rmtree(tmp, ignore_errors=True)
    rate = result["window_samples"] / result["window_s"]
    # the run's CPU less the simulation's, less the meter's own reads outside its sections
    sched = cpu - result["sim_cpu_s"] - result["meter_entries"] * overhead
    parts = {} if result["split"] is None else result["split"].parts(sched, result["samples_seen"])
    return {
        "profile": profile.name, "devices": devices, "runtime": "virtual", "mode": mode,
        "rollout_devices": rollout_dev, "train_devices": train_dev,
        "samples_per_s": round(rate, 3), "ideal_samples_per_s": round(ideal, 3), "efficiency": round(rate / ideal, 4),
        "rollout_busy_frac": round(result["rollout_busy_frac"], 4), "train_busy_frac": round(result["train_busy_frac"], 4),
        "scheduler_us_per_sample": round(sched / max(result["samples_seen"], 1) * 1e6, 1),
        "scheduler_us_per_request": round(sched / max(result["requests"], 1) * 1e6, 1),
        "max_staleness": 0 if mode == "sync" else spec.max_staleness, "staleness_max": result["staleness_max"],
        "steps": spec.steps, "samples": result["samples"], "dropped": result["dropped"],
        "group_timeout_s": spec.group_timeout_s, "groups_partial": result["groups_partial"],
        "stragglers_aborted": result["stragglers_aborted"], "aborted": result["aborted"],
        "mean_tokens_profile": round(profile.mean_tokens, 1), "mean_tokens_trained": round(result["mean_tokens"], 1),
        # trained tokens per second over the ideal's: what efficiency says when the trained samples
        # are shorter than the profile's (aborted stragglers are the long ones)
        "token_efficiency": round(rate / ideal * result["mean_tokens"] / profile.mean_tokens, 4),
        "virtual_s": round(result["virtual_s"], 1), "wall_s": round(wall, 1), **parts,
    }


async def _simulate(spec: PipeSpec, profile: Profile, devices: int, mode: str, rollout_dev: int, train_dev: int,
                    clock: Any, tmp: Path) -> dict[str, Any]:
    from asyncflow.engines.sim import CpuMeter, SimEngine, SimTrainer
    from asyncflow.telemetry.runlog import RunLog, Tracer
    from asyncflow.workflow.gate import StalenessGate
    from asyncflow.workflow.trainer import StepResult

    batch = devices * spec.prompts_per_device * spec.n
    sync = mode == "sync"
    cfg = _sim_config(spec, profile, mode, batch)
    meter = CpuMeter()
    load_s = spec.switch_s if sync else spec.weight_sync_s
    engines = [SimEngine(clock, lengths=profile.lengths, capacity=spec.slots, step_s=spec.step_s, load_s=load_s,
                         seed=spec.seed * 100_003 + i, meter=meter) for i in range(rollout_dev)]
    trainer = SimTrainer(clock, token_s=spec.train_token_s, devices=train_dev, overhead_s=spec.switch_s if sync else 0.0)
    env_factory = None
    if profile.turns is not None:
        env_factory = _env_factory(profile, meter)
    rows = [{"prompt": i} for i in range(4096)]
    log = RunLog(tmp, metrics=False)
    tracer = Tracer(now=clock.now, max_events=200_000 if spec.trace else 0)
    marks: list[tuple[float, int, float, float]] = []  # (time, trained, rollout busy, train busy) per step

    async def on_step(result: StepResult) -> None:
        marks.append((clock.now(), pipeline.counters.trained, sum(e.busy_seconds() for e in engines), trainer.busy))

    # Steady state: the gate admits as if the run went on past `steps` (a finite run's last steps
    # would otherwise starve the rollout devices: no prompt is admitted for a step that never comes).
    gps = batch // spec.n
    k = cfg.staleness
    gate = StalenessGate(gps, k, spec.steps + k + 2, clock)
    pipeline = sim_pipeline(
        cfg, rows=rows, tokenizer=_SimTokenizer(), reward_fn=_reward_async(meter) if spec.reward == "async" else _reward,
        engines=engines, trainer=trainer, meter=meter, clock=clock, log=log, tracer=tracer, on_step=on_step,
        env_factory=env_factory, gate=gate,
    )
    split = SplitMeter(meter) if spec.split == "true" else None
    try:
        await _run_pipeline(pipeline, split, clock)
    finally:
        log.close()
        for e in engines:
            await e.close()
    if spec.trace:
        Path(spec.trace).mkdir(parents=True, exist_ok=True)
        tracer.write(Path(spec.trace) / f"pipe-{profile.name}-{devices}-{mode}.json")
    return {**_window(spec, marks, pipeline, clock, rollout_dev), **_totals(pipeline, engines, meter), "split": split}


def _sim_config(spec: PipeSpec, profile: Profile, mode: str, batch: int) -> Any:
    """The run's config: the real pipeline's, with PIPE's sizes and timeouts no simulated run reaches."""
    from asyncflow.config import load_config

    sync = mode == "sync"
    settings = [
        "logging.progress=false", f"rollout.n={spec.n}", f"train.batch_size={batch}", f"train.max_steps={spec.steps}",
        f"rollout.max_new_tokens={profile.max_new_tokens}", f"rollout.max_batch={spec.slots}",
        f"workflow.mode={mode}", f"workflow.weight_update={'drain' if sync else 'swap'}", f"seed={spec.seed}",
        "workflow.step_timeout_s=100000", "rollout.request_timeout_s=100000", "workflow.lease_timeout_s=100000",
        "reward.timeout_s=1000",
        # a step's worth of tracked objects (~25 per sample) between young collections
        f"workflow.gc_threshold={32 * batch}",
    ]
    if not sync:
        settings.append(f"workflow.max_staleness={spec.max_staleness}")
    if spec.group_timeout_s > 0:
        settings += [f"rollout.group_timeout_s={spec.group_timeout_s}", f"rollout.group_min_samples={spec.group_min_samples}"]
    cfg, _ = load_config(None, ["task=arith", *settings])
    if profile.turns is not None:  # its environments come from _env_factory, not rollout.env (20 turns at most)
        cfg.rollout.env_timeout_s = 1000.0
    return cfg


async def _run_pipeline(pipeline: Any, split: SplitMeter | None, clock: Any) -> None:
    """Run the pipeline to its end, its CPU split by `split` where given."""
    if split is None:
        await pipeline.run()
        return
    split.start()
    try:
        split.meter_store(pipeline.store)
        clock.loop.run_handle = split.run_handle
        await pipeline.run(worker_context=worker_context())
    finally:
        clock.loop.run_handle = None
        split.stop()


def _window(spec: PipeSpec, marks: list[tuple[float, int, float, float]], pipeline: Any, clock: Any,
            rollout_dev: int) -> dict[str, Any]:
    """Samples, time and device busy fractions over the measured window: steps `warmup_steps+1 ..
    steps` (from the run's start when there is no warm-up)."""
    w = min(spec.warmup_steps, len(marks) - 1)
    (t0, n0, r0, tr0), (t1, n1, r1, tr1) = marks[w - 1] if w > 0 else (pipeline.t_start, 0, 0.0, 0.0), marks[-1]
    return {
        "window_samples": n1 - n0, "window_s": t1 - t0, "virtual_s": clock.now() - pipeline.t_start,
        "rollout_busy_frac": (r1 - r0) / ((t1 - t0) * rollout_dev), "train_busy_frac": (tr1 - tr0) / (t1 - t0),
    }


def _totals(pipeline: Any, engines: Sequence[Any], meter: Any) -> dict[str, Any]:
    """The whole run's counts, and the CPU time spent inside simulation code."""
    c = pipeline.counters
    return {
        "samples": c.trained, "dropped": c.dropped_stale + c.cancelled + c.filtered,
        "groups_partial": c.groups_partial, "stragglers_aborted": c.stragglers_aborted, "aborted": c.aborted,
        "samples_seen": c.produced, "requests": sum(e.requests for e in engines),
        "staleness_max": pipeline.trainer.learner.staleness_max, "sim_cpu_s": meter.seconds, "meter_entries": meter.entries,
        "mean_tokens": c.tokens / max(c.trained, 1),
    }


# Set (True) in the rollout and reward worker tasks of a PIPE run; their child tasks and callbacks
# inherit it (asyncio runs every callback in the context it was scheduled from).
_WORKER: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncflow_pipe_worker", default=False)

# The store's synchronous entry points (the async `put`, `take` and `take_each` spend their CPU in
# the `_..._or_wait` they call, once per try): every call the pipeline makes lands in one of these.
_STORE_CALLS = ("_put_or_wait", "_take_or_wait", "_take_each_or_wait", "write", "complete", "complete_and_take",
                "ack", "release", "renew", "remove", "metrics", "lease_live")


class SplitMeter:
    """Where the scheduler's CPU goes (`--set split=true`), in the four parts a Ray run puts in
    different processes (runtime/ray_runtime.py):

    - `store`: inside the `TransferQueue`'s calls: the store controller's work, the one process
      every sample's metadata passes through (under Ray, plus the RPCs this run does not make);
    - `workers`: the rollout and reward worker tasks (multi-turn episodes included) and every task
      and callback they start, outside store calls: the per-worker loop that Ray spreads over one
      process per worker;
    - `trainer`: every other callback: feeder and staleness gate, trainer loop, weight publication
      (under Ray: the feeder actor and the driver);
    - `loop`: the event loop's own iteration between callbacks (its ready queue, timer heap, I/O
      polls): under Ray each process pays it for its own callbacks.

    Sampled, not timed: a CPU-time timer (`ITIMER_PROF`) interrupts every `interval_s` of the
    process's CPU (in practice at the kernel's scheduler tick, ~4 ms on the dev VM: ~1,400 ticks in
    an rlvr 64 row, so a share is known to a few percent) and the tick goes to the part running
    then; simulation code, known from its `CpuMeter`, is left out. Timing each callback instead
    takes two `thread_time` reads (a system call, ~0.75 us each there) per callback, which doubled
    the rlvr row's total. Here a callback costs a call and two attribute writes
    (`VirtualTimeLoop.run_handle`) and a store call a wrapper. That still shows: a split run's
    total reads a few percent above a plain run's at 64 devices and up to a third above at 1,024
    (docs/performance.md), so the parts are its total's shares by tick count."""

    def __init__(self, sim: Any, interval_s: float = 0.0005) -> None:
        self.sim = sim
        self.interval_s = interval_s
        self.ticks = {"sim": 0, "store": 0, "workers": 0, "trainer": 0, "loop": 0}
        self._part = "loop"  # the part of the callback running now ("loop" between callbacks)
        self._depth = 0
        self._previous: Any = None
        self._previous_timer: tuple[float, float] = (0.0, 0.0)

    def run_handle(self, handle: Any) -> None:
        self._part = "workers" if handle._context.get(_WORKER, False) else "trainer"
        try:
            handle._run()
        finally:
            self._part = "loop"

    def _tick(self, signum: int, frame: Any) -> None:
        self.ticks["sim" if self.sim.depth else "store" if self._depth else self._part] += 1

    def start(self) -> None:
        import signal

        if not hasattr(signal, "setitimer"):
            raise UserError("bench pipeline --set split=true: needs setitimer (Linux or macOS)")
        self._previous = signal.signal(signal.SIGPROF, self._tick)
        self._previous_timer = signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)

    def stop(self) -> None:
        """The timer and handler as they were (a profiler's own, if one ran the benchmark)."""
        import signal

        signal.setitimer(signal.ITIMER_PROF, *self._previous_timer)
        # (None: a handler installed from C, which Python cannot put back; the default is the nearest)
        signal.signal(signal.SIGPROF, signal.SIG_DFL if self._previous is None else self._previous)

    def meter_store(self, store: Any, names: Sequence[str] = _STORE_CALLS) -> None:
        """Mark `store`'s entry points (instance attributes shadow its methods, its own calls included)."""
        for name in names:
            setattr(store, name, self._marked(getattr(store, name)))

    def _marked(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def marked(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            try:
                return call(*args, **kwargs)
            finally:
                self._depth -= 1

        return marked

    def parts(self, sched_s: float, samples: int) -> dict[str, float]:
        """The row's split keys: `sched_s` (the measured total) in shares of the non-simulation ticks."""
        t = self.ticks
        ours = t["store"] + t["workers"] + t["trainer"] + t["loop"]
        per = sched_s * 1e6 / max(samples, 1) / max(ours, 1)
        out: dict[str, float] = {f"{k}_us_per_sample": round(t[k] * per, 1) for k in ("store", "workers", "trainer", "loop")}
        out["split_ticks"] = ours
        return out


def _reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
    """A verifier stand-in: 0 or 1 from the prompt and the completion's position (deterministic).
    Called in a reward worker thread (`--set reward=thread`)."""
    return [float((hash(str(p)) + i) % 2) for i, p in enumerate(prompts)]


def _reward_async(meter: Any) -> Callable[..., Any]:
    """The same verifier as an `async def` (the default, `--set reward=async`): awaited on the event
    loop, as a remote verifier service or a judge would be, so no thread hop per batch of groups.
    Its work is the verifier's, not the scheduler's: metered as simulation. (The thread variant is
    not: the meter is read on the loop's thread only.)"""

    async def reward(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float]:
        with meter:
            return _reward(prompts, completions)

    return reward


class _SimTokenizer:
    """Token ids for simulated text: prompts are 64 tokens; environment text is empty."""

    eos_token_id = 1
    pad_token_id = 0

    def __init__(self) -> None:
        from asyncflow.runs import Runs

        self._prompt = Runs([(5, 64)])

    def prompt_ids(self, prompt: Any) -> Sequence[int]:
        return self._prompt

    def encode(self, text: str) -> list[int]:
        return [9] * len(text.split())

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def completions(self, responses: Sequence[Sequence[int]], conversational: bool) -> list[str]:
        return [""] * len(responses)


def _env_factory(profile: Profile, meter: Any) -> Callable[[Any], Any]:
    from asyncflow.envs.base import Env, EnvStep

    assert profile.turns is not None and profile.env_latency is not None
    turns_of, latency_of = profile.turns, profile.env_latency

    class SimEnv(Env):
        """An environment whose steps take lognormal time; the episode lasts `turns` LLM turns."""

        name = "sim"
        max_turns = 20

        def __init__(self, clock: Any) -> None:
            self.clock = clock

        async def reset(self, row: dict[str, Any], seed: int) -> str:
            with meter:
                self.rng = random.Random(seed)
                self.turns, self.turn = turns_of(self.rng), 0
            return ""

        async def step(self, action: str) -> EnvStep:
            with meter:
                latency = latency_of(self.rng)
                self.turn += 1
                done = self.turn >= self.turns
            await self.clock.sleep(latency)
            return EnvStep("", reward=float(self.rng.random() < 0.5) if done else 0.0, done=done)

    return SimEnv


class SimLearner:
    """PIPE's optimizer step (a `Learner`): the simulated trainer's time for the batch's trained
    tokens; records the largest staleness trained (`staleness_max`)."""

    def __init__(self, sim_trainer: Any, meter: Any = None) -> None:
        """`meter`: the run's CpuMeter (the batch's token count is simulation, not scheduling)."""
        self.sim_trainer = sim_trainer
        self.meter = contextlib.nullcontext() if meter is None else meter
        self.staleness_max = 0

    async def step(self, samples: list[Any], valid: list[bool], rewards: list[float],
                   version: int) -> tuple[dict[str, Any], int]:
        from asyncflow.workflow.episode import generated_tokens

        with self.meter:
            tokens = sum(
                generated_tokens(s.fields["loss_mask"]) if "loss_mask" in s.fields else len(s.fields["response_ids"])
                for s, ok in zip(samples, valid, strict=True) if ok
            )
            stale = max((version - s.fields["behavior_version"] for s in samples), default=0)
            self.staleness_max = max(self.staleness_max, stale)
        await self.sim_trainer.train(tokens)
        return {"loss": 0.0, "entropy": 0.0, "grad_norm": 0.0}, tokens


def sim_pipeline(cfg: Any, *, trainer: Any, meter: Any = None, **parts: Any) -> Any:
    """The real pipeline (`build_pipeline`) with PIPE's simulated trainer (`trainer`, a SimTrainer)
    as its train engine and optimizer step (`SimLearner`); `parts`: the rest of build_pipeline's
    arguments (rows, tokenizer, engines, clock, log, tracer, reward_fn, ...)."""
    from asyncflow.workflow.build import build_pipeline

    parts.pop("loss_fn", None)  # (the simulated step has no loss)
    return build_pipeline(cfg, train_engine=trainer, learner=SimLearner(trainer, meter), **parts)


def worker_context() -> contextvars.Context:
    """The context PIPE runs the rollout and reward loops in: their callbacks carry `_WORKER`."""
    ctx = contextvars.copy_context()
    ctx.run(_WORKER.set, True)
    return ctx


# Bounds on the numeric `--set` keys, checked before anything runs: (key, lowest, whether the lowest
# itself is allowed). A zero decode or train time divides by zero in the ideal and the device split;
# negative times or counts give negative rates or measure the wrong window instead of failing.
_BOUNDS: tuple[tuple[str, float, bool], ...] = (
    ("slots", 1, True), ("n", 1, True), ("prompts_per_device", 1, True), ("steps", 1, True),
    ("warmup_steps", 0, True), ("max_staleness", 0, True), ("seed", 0, True),
    ("step_s", 0, False), ("train_token_s", 0, False), ("switch_s", 0, True), ("weight_sync_s", 0, True),
    ("group_timeout_s", 0, True), ("group_min_samples", 1, True),
)


def parse_spec(overrides: list[str]) -> PipeSpec:
    """The spec from `--set key=value` items, every value checked here (one line naming the key),
    so a bad value fails before the simulation, not as a crash, a hang or wrong numbers after it."""
    spec = PipeSpec()
    types = {f.name: f.type for f in dataclasses.fields(PipeSpec)}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise UserError(f"bench pipeline --set: expected key=value with key one of {', '.join(types)}; got {item!r}")
        kind = {"int": int, "float": float, "str": str}[str(types[key])]
        try:
            setattr(spec, key, kind(value))
        except ValueError:
            raise UserError(f"bench pipeline --set {key}: expected {types[key]}, got {value!r}") from None
        if kind is float and not math.isfinite(getattr(spec, key)):
            raise UserError(f"bench pipeline --set {key}: expected a finite number, got {value!r}")
    for key, lo, inclusive in _BOUNDS:
        v = getattr(spec, key)
        if v < lo or (v == lo and not inclusive):
            raise UserError(f"bench pipeline --set {key}: must be {'>=' if inclusive else '>'} {lo}, got {v}")
    if spec.steps <= spec.warmup_steps:
        raise UserError(f"bench pipeline --set steps: must exceed warmup_steps ({spec.warmup_steps}), got {spec.steps}")
    if spec.split not in ("true", "false"):
        raise UserError(f"bench pipeline --set split: use true or false, got {spec.split!r}")
    if spec.split == "true" and spec.reward == "thread":  # (its CPU would be ticked to whatever the loop does then)
        raise UserError("bench pipeline --set split=true: needs reward=async (a verifier thread's CPU cannot be "
                        "attributed: the profiling ticks reach the event loop's thread only)")
    if spec.reward not in ("async", "thread"):
        raise UserError(f"bench pipeline --set reward: use async or thread, got {spec.reward!r}")
    if spec.trace:  # a folder made after the simulation: a path that cannot become one is refused now
        from asyncflow.run_folder import check_folder_path

        check_folder_path(Path(spec.trace), "bench pipeline --set trace")
        try:  # (a folder it may not write, e.g. under /proc: a traceback after the first row)
            Path(spec.trace).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"bench pipeline --set trace: cannot create {spec.trace}: {exc.strerror or exc}") from None
        if not os.access(spec.trace, os.W_OK):
            raise UserError(f"bench pipeline --set trace: {spec.trace} is not writable")
    return spec


def run_pipeline(overrides: list[str], report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every (profile, devices, mode) of the spec; one row each."""
    spec = parse_spec(overrides)
    try:
        devices = [int(d) for d in spec.devices.split(",")]
    except ValueError:
        raise UserError(f"bench pipeline --set devices: expected comma-separated integers, got {spec.devices!r}") from None
    if any(d < 2 for d in devices):
        raise UserError("bench pipeline --set devices: each must be >= 2 (async splits rollout and training)")
    for d in devices:  # checked before any row runs: found at its row, the rows before were lost with it
        if d * spec.prompts_per_device * spec.n > 2**20:
            raise UserError(f"bench pipeline --set devices: {d} x prompts_per_device {spec.prompts_per_device} x n "
                            f"{spec.n} = {d * spec.prompts_per_device * spec.n} samples a step, above the "
                            f"{2**20} train.batch_size allows")
    modes = spec.modes.split(",")
    if set(modes) - {"sync", "async"}:
        raise UserError(f"bench pipeline --set modes: use sync, async; got {spec.modes!r}")
    profiles = [make_profile(p) for p in spec.profiles.split(",")]
    rows = []
    for profile in profiles:
        for d in devices:
            for mode in modes:
                rows.append(_run_one(spec, profile, d, mode))
                if report is not None:
                    report(rows[-1])
        _speedups(rows)
    return rows


def _speedups(rows: list[dict[str, Any]]) -> None:
    """Add `speedup_vs_sync` to async rows that have a sync row of the same profile and devices."""
    sync = {(r["profile"], r["devices"]): r["samples_per_s"] for r in rows if r["mode"] == "sync"}
    for r in rows:
        base = sync.get((r["profile"], r["devices"]))
        if r["mode"] == "async" and base:
            r["speedup_vs_sync"] = round(r["samples_per_s"] / base, 3)
