"""Reward functions: loading `module:function` plugins and calling them safely, one call per group.

The signature is TRL's, so TRL users' reward functions work unchanged:
`fn(prompts: list, completions: list, completion_ids: list[list[int]], **columns) -> list[float]` (a None fails its group),
where every dataset column is passed as a list aligned with the completions; a function that takes
`trainer_state` (or **kwargs) gets a `TrainerState` too. A plain function runs in a worker thread; an
`async def` one (a remote judge or verifier service) is awaited on the event loop. Several functions
(`reward.fn` a list, `reward.weights`) score as one `RewardFns`: the reward is their weighted sum.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import queue
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.data import private_copy
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.rewards.sandbox import require_layers
from asyncflow.rewards.verl import VERL_PREFIX, VerlScore, verl_compute_score
from asyncflow.user_code import load_attr
from asyncflow.user_frames import raised_at

if TYPE_CHECKING:
    from asyncflow.config_schema import Config

__all__ = ["RewardFns", "TrainerState", "VerlScore", "load_reward", "verl_compute_score"]

RewardFn = Callable[..., Sequence[Any]]


def load_reward_fn(path: str, *, key: str = "reward.fn") -> RewardFn:
    """Import `module:function` from `sys.path` as Python set it up, or load `path/to/file.py:function`
    by its path (a relative one from the working directory); no folder is put on `sys.path`
    (`asyncflow.user_code`). `key`: the config key that named it, for the one-line errors."""
    fn = load_attr(path, key)
    if not callable(fn):
        raise UserError(f"{key}: {path!r} is not a function")
    return fn  # type: ignore[no-any-return]


# plugins other components load, whose files are made absolute the same way (`rollout.env`, `rollout.agent`)
VERIFIERS_PREFIX = "verifiers:"
PLUGIN_PREFIXES = ("openenv+server:", "openenv:", VERIFIERS_PREFIX)


def absolute_reward_path(path: str) -> str:
    """`file.py:function` relative to the current directory made absolute (for Ray actors, whose
    working directory differs); anything else unchanged. A `verl:` prefix is kept, and so are the
    environment plugins' (`openenv:`, `openenv+server:`, `verifiers:`, whose files are made absolute too)."""
    prefix = next((p for p in (VERL_PREFIX, *PLUGIN_PREFIXES) if path.startswith(p)), "")
    body = path.removeprefix(prefix)
    if prefix == VERIFIERS_PREFIX:  # `[ENV+]TASKSET`, each part a package or a .py file (no attribute)
        return prefix + "+".join(_absolute_file(part) for part in body.split("+"))
    module_name, _, attr = body.rpartition(":")
    if module_name.endswith(".py"):
        return f"{prefix}{_absolute_file(module_name)}:{attr}"
    return path


def _absolute_file(name: str) -> str:
    """A relative `.py` path that names a file here, made absolute; anything else as it is."""
    if name.endswith(".py") and not Path(name).expanduser().is_absolute():
        here = Path.cwd() / name
        if here.is_file():
            return str(here.resolve())
    return name


@dataclass
class RewardOutcome:
    """Per-completion rewards of one call, or the error that marks all of its samples. `parts`
    (several reward functions): each function's own rewards, by name, before weighting."""

    rewards: list[float] | None
    error: str | None
    parts: dict[str, list[float]] | None = None


@dataclass(frozen=True)
class TrainerState:
    """What a reward function taking `trainer_state` gets (TRL passes its `TrainerState`, whose
    `global_step` curriculum rewards read). `global_step` = `step`: train steps done when the group's
    last token was generated (the newest policy version it came from); `version`: the oldest policy
    version of its tokens (samples.jsonl's `behavior_version`); `max_steps`: `train.max_steps`."""

    global_step: int
    step: int
    version: int
    max_steps: int


class RewardFns:
    """Several reward functions scored as one: each called with what it accepts, the reward their
    weighted sum (TRL's `reward_funcs` with `reward_weights`). A failing one fails the group."""

    def __init__(self, fns: Sequence[RewardFn], weights: Sequence[float]) -> None:
        self.fns, self.weights = list(fns), [float(w) for w in weights]
        # one name per function, unique: its metric is `reward/<name>`
        self.names = unique_names([getattr(f, "__name__", type(f).__name__) for f in self.fns])
        self._threads: _DaemonThreads | None = None  # a mixed list's plain functions, when the whole is awaited

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 trainer_state: TrainerState | None = None, **columns: list[Any]) -> list[float]:
        """The weighted sums, called as one plain function (the pipeline calls `call_reward_fn`)."""
        ids = completion_ids if completion_ids is not None else [[] for _ in completions]
        out = call_reward_fn(self, prompts, completions, ids, columns, trainer_state)
        if out.rewards is None:
            raise ValueError(out.error)
        return out.rewards

    def combine(self, outcomes: list[RewardOutcome]) -> RewardOutcome:
        """The weighted sum of the functions' outcomes (the first error, named, fails the group)."""
        for name, o in zip(self.names, outcomes, strict=True):
            if o.rewards is None:
                return RewardOutcome(None, f"{name}: {o.error}")
        parts = {name: o.rewards for name, o in zip(self.names, outcomes, strict=True) if o.rewards is not None}
        total = [math.fsum(w * p[i] for w, p in zip(self.weights, parts.values(), strict=True))
                 for i in range(len(next(iter(parts.values()))))]
        return RewardOutcome(total, None, parts)

    def threads(self) -> concurrent.futures.Executor:
        if self._threads is None:
            self._threads = _DaemonThreads(PLAIN_THREADS, "reward-mixed")
        return self._threads


def unique_names(names: list[str]) -> list[str]:
    """`names` with repeats made unique (`f`, `f_2`, ...)."""
    out: list[str] = []
    for name in names:
        candidate, k = name, 1
        while candidate in out:
            k += 1
            candidate = f"{name}_{k}"
        out.append(candidate)
    return out


def load_reward(fn: str | Sequence[str], weights: Sequence[float] | None = None, *,
                label_key: str | None = "answer", dataset_name: str | None = None) -> RewardFn:
    """The run's reward function: `reward.fn` (one path or a list) with `reward.weights`. One
    function without weights is returned as it is; else a `RewardFns`. A `verl:` prefixed path is a
    verl `compute_score`, wrapped (`asyncflow.rewards.verl`)."""
    paths = [fn] if isinstance(fn, str) else list(fn)
    if weights is not None and len(weights) != len(paths):
        raise UserError(f"reward.weights: {len(weights)} weights for {len(paths)} reward functions (reward.fn); "
                        "give one weight per function")
    fns: list[RewardFn] = []
    for path in paths:
        if path.startswith(VERL_PREFIX):
            fns.append(VerlScore(load_reward_fn(path[len(VERL_PREFIX):]), label_key=label_key,
                                 data_source=dataset_name))
        else:
            fns.append(load_reward_fn(path))
    if len(fns) == 1 and weights is None and not isinstance(fn, list):
        return fns[0]
    return RewardFns(fns, weights if weights is not None else [1.0] * len(fns))


def load_run_reward(cfg: Config, fn: str | Sequence[str]) -> RewardFn:
    """`load_reward` with the run's settings: `reward.weights`; for a verl function the label column
    and the dataset's name (its file's stem, else the task's name) as the default `data_source`."""
    name = Path(cfg.dataset.path).stem if cfg.dataset.path else cfg.task
    require_layers(cfg.reward.sandbox_require)  # for the code sandbox the function may call
    return load_reward(fn, cfg.reward.weights, label_key=cfg.dataset.label_key, dataset_name=name)


_PARAMS: dict[int, tuple[Any, frozenset[str] | None]] = {}  # id(fn) -> (fn, the names it accepts; None: any)


def _accepted(fn: Any) -> frozenset[str] | None:
    """The keyword names `fn` takes (None: it has **kwargs, or its signature cannot be read).
    Read once per function: `inspect.signature` costs more than a cheap verifier's whole call."""
    hit = _PARAMS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    names: frozenset[str] | None = None
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            names = frozenset(params)
    except (TypeError, ValueError):
        pass
    _PARAMS[id(fn)] = (fn, names)
    return names


def _kwargs(fn: Any, prompts: list[Any], completion_ids: list[list[int]],
            columns: dict[str, list[Any]], trainer_state: TrainerState | None) -> dict[str, Any]:
    """The call's keyword arguments. Prompts and column values are the dataset rows' own objects:
    each is handed over as a private copy (one per completion), so a function that changes one
    changes nothing stored."""
    names = _accepted(fn)
    kwargs: dict[str, Any] = {c: [private_copy(v) for v in vs] for c, vs in columns.items()
                              if names is None or c in names}
    if names is None or "completion_ids" in names:
        kwargs["completion_ids"] = completion_ids
    if trainer_state is not None and (names is None or "trainer_state" in names):
        kwargs["trainer_state"] = trainer_state
    kwargs["prompts"] = [private_copy(p) for p in prompts]
    return kwargs


def is_async_reward_fn(fn: Any) -> bool:
    """An `async def` function (or an object whose `__call__` is one; a `RewardFns` with one):
    awaited on the event loop instead of being called in a worker thread."""
    if isinstance(fn, RewardFns):
        return any(map(is_async_reward_fn, fn.fns))
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def call_reward_fn(
    fn: RewardFn, prompts: list[Any], completions: list[str], completion_ids: list[list[int]],
    columns: dict[str, list[Any]], trainer_state: TrainerState | None = None,
) -> RewardOutcome:
    """Call `fn` for one group and validate what it returns (one finite number per completion)."""
    if isinstance(fn, RewardFns):
        return fn.combine([call_reward_fn(f, prompts, completions, completion_ids, columns, trainer_state)
                           for f in fn.fns])
    kwargs = _kwargs(fn, prompts, completion_ids, columns, trainer_state)
    try:
        out = fn(completions=completions, **kwargs)
        return validate_rewards(out, len(completions))  # converting what it returned can raise too
    except BaseException as exc:  # the plugin failed, even with sys.exit(): mark its samples, never end the run
        return _raised(exc)


def _raised(exc: BaseException) -> RewardOutcome:
    """The error of a call that raised, naming where in the user's code (`file:line`) it raised."""
    where = raised_at(exc)
    return RewardOutcome(None, f"reward function raised {type(exc).__name__}{f' at {where}' if where else ''}: {exc}")


async def call_reward_fn_async(
    fn: Callable[..., Awaitable[Sequence[Any]]], prompts: list[Any], completions: list[str],
    completion_ids: list[list[int]], columns: dict[str, list[Any]], trainer_state: TrainerState | None = None,
) -> RewardOutcome:
    """`call_reward_fn` for an `async def` function: awaited on the running loop (the caller bounds
    it with `reward.timeout_s`; on expiry the coroutine is cancelled, unlike a thread). A `RewardFns`:
    its functions at once, the plain ones on threads of its own."""
    call = (prompts, completions, completion_ids, columns, trainer_state)
    if isinstance(fn, RewardFns):
        loop = asyncio.get_running_loop()
        return fn.combine(list(await asyncio.gather(*(
            call_reward_fn_async(f, *call) if is_async_reward_fn(f)
            else loop.run_in_executor(fn.threads(), call_reward_fn, f, *call) for f in fn.fns))))
    kwargs = _kwargs(fn, prompts, completion_ids, columns, trainer_state)
    try:
        out = await fn(completions=completions, **kwargs)
        return validate_rewards(out, len(completions))
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or getattr(task, "cancelling", lambda: 1)():  # Python 3.10 has no cancelling(): raise
            raise  # this call was cancelled (its timeout, the run's end): not the plugin's error
        return _raised(exc)  # the plugin raised CancelledError of its own (e.g. a cancelled inner request)
    except BaseException as exc:  # as in `call_reward_fn`
        return _raised(exc)


PLAIN_CALLS_PER_HOP = 8  # groups a plain function scores per thread hop (the reward stage's take; evaluation)
PLAIN_THREADS = 4  # threads a plain function's calls run on (per pipeline, per evaluator)


class _DaemonThreads(concurrent.futures.Executor):
    """Up to `n` daemon worker threads, started as work arrives. Daemon, unlike a
    `ThreadPoolExecutor`'s (joined at exit): a reward call that never returns must not keep the
    process alive after its run ended."""

    def __init__(self, n: int, name: str) -> None:
        self._n, self._name = n, name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._work.put((f, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._n:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return f

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            item = self._work.get()
            with self._lock:
                self._idle -= 1
            if item is None:
                return
            f, fn, args, kwargs = item
            if not f.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:  # (handed to the waiting caller)
                f.set_exception(exc)
            else:
                f.set_result(result)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ask idle threads to stop; never waits (a thread may be stuck in a call that never returns)."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._work.put(None)


class PlainCalls:
    """Runs a plain (blocking) reward function's calls, a list of groups per thread hop, bounded by
    `timeout` per call. A call past its time cannot be stopped (Python threads cannot be killed): its
    group and the ones after it in the hop are marked failed, the calls before it keep their scores,
    and its thread stays taken until the function returns. Calls run on threads of their own
    (`PLAIN_THREADS`), not asyncio's default executor, which the trainer's steps use: hung reward
    calls used to take those threads one by one until no train step could start and the run froze
    without an error. When every reward thread is held by a call that timed out, nothing can be
    scored any more: with `stop_when_full` (the reward stage) the run stops with a one-line error
    naming `reward.fn` (exit 2); without (evaluation: it must not cost a trained run its final
    save) the calls fail at once, each with that message."""

    def __init__(self, threads: int = PLAIN_THREADS, *, stop_when_full: bool = True) -> None:
        self.threads = threads
        self.stop_when_full = stop_when_full
        self._pool = _DaemonThreads(threads, "reward")
        self._lock = threading.Lock()
        self.running = 0  # calls running on the threads now, hung ones included

    async def score(self, calls: list[tuple[Any, ...]], wait_for: Callable[..., Awaitable[Any]], timeout: float,
                    what: str) -> list[RewardOutcome]:
        """`call_reward_fn(*call)` for each call, in one hop; `wait_for(aw, limit, what)` bounds it
        (the caller's clock) by `timeout` per call."""
        if self.running >= self.threads:  # every thread is held by a hung call: this hop would never start
            if self.stop_when_full:
                raise UserError(self._full(timeout))
            return [RewardOutcome(None, self._full(timeout))] * len(calls)
        done: list[RewardOutcome] = []
        abandoned = threading.Event()

        def work() -> None:
            with self._lock:
                self.running += 1
            try:
                for call in calls:
                    if abandoned.is_set():
                        return
                    done.append(call_reward_fn(*call))
            finally:
                with self._lock:
                    self.running -= 1

        try:
            await wait_for(asyncio.get_running_loop().run_in_executor(self._pool, work), timeout * len(calls), what)
            return done
        except WaitTimeout as exc:
            abandoned.set()
            kept = list(done)
            if self.running >= self.threads and self.stop_when_full:
                raise UserError(self._full(timeout)) from None
            return kept + [RewardOutcome(None, str(exc))] * (len(calls) - len(kept))

    def _full(self, timeout: float) -> str:
        return (f"reward.fn: {self.running} reward calls are still running after reward.timeout_s={timeout:g} s "
                f"and hold every reward thread (a thread cannot be stopped): make the function return within "
                f"its timeout, or make it `async def` (its calls are cancelled on timeout)")

    def close(self) -> None:
        self._pool.shutdown(wait=False)

_PLAIN_NUMBERS = frozenset((int, float))
_FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: the trainer's rewards and advantages are float32


def validate_rewards(out: Any, expected: int) -> RewardOutcome:
    """One finite float per completion, else an error message saying what was wrong."""
    if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
        return RewardOutcome(None, f"reward function returned {type(out).__name__}, expected a list of {expected} numbers")
    values = out.tolist() if hasattr(out, "tolist") else list(out)
    if not isinstance(values, list):  # a 0-d array or tensor (e.g. `.squeeze()` of a group of one)
        return RewardOutcome(None, f"reward function returned a 0-d {type(out).__name__}, expected a list of "
                                   f"{expected} numbers (a group of one needs a list of one)")
    if len(values) != expected:
        return RewardOutcome(None, f"reward function returned {len(values)} values for {expected} completions")
    # the usual case, checked in C: only (non-bool) ints and floats, all finite (once per group:
    # the per-value checks below cost ~1 us a value on the 2-core VM); else they find the first bad one
    try:
        if _PLAIN_NUMBERS.issuperset(map(type, values)) and all(map(math.isfinite, values)) \
                and (not values or (max(values) <= _FLOAT32_MAX and min(values) >= -_FLOAT32_MAX)):
            return RewardOutcome(list(map(float, values)), None)
    except OverflowError:  # an int too large for a float: named below
        pass
    rewards: list[float] = []
    for i, v in enumerate(values):
        if v is None:
            return RewardOutcome(None, f"reward function returned None for completion {i}")
        if isinstance(v, bool) or not isinstance(v, numbers.Real):  # (NumPy's number scalars are Real)
            return RewardOutcome(None, f"reward function returned {type(v).__name__} {v!r} for completion {i}, expected a number")
        try:
            f = float(v)
        except OverflowError:
            return RewardOutcome(None, f"reward function returned an int too large for a float for completion {i}")
        if not math.isfinite(f):
            return RewardOutcome(None, f"reward function returned {v} for completion {i}")
        if abs(f) > _FLOAT32_MAX:  # (rewards are float32 tensors: it became inf, and the group's advantages NaN)
            return RewardOutcome(None, f"reward function returned {v} for completion {i}, beyond float32's range "
                                       f"(±{_FLOAT32_MAX:.4g})")
        rewards.append(f)
    return RewardOutcome(rewards, None)
