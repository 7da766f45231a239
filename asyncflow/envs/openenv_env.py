"""OpenEnv environments as asyncflow environments (`rollout.env: openenv:...`), used as their authors wrote them.

```
 rollout.env                          one episode (asyncflow Env)            the OpenEnv environment
 openenv:pkg.mod:MyEnvironment   ──►  reset(row, seed) ── in process ──────►  MyEnvironment().reset_async(...)
 openenv+server:pkg.mod:app      ──►  step(text)       ── WebSocket /ws ───►  a local server this process
                                                          (GenericEnvClient)   starts and stops (`openenv_server`)
 openenv:http://host:8000        ──►                   ── WebSocket /ws ───►  a server at that URL
```

An OpenEnv environment speaks pydantic `Action` / `Observation(done, reward)`; asyncflow's turn loop
speaks text. The mapping, the same for all three:
- the model's turn becomes the action: an action with one text field (besides `metadata`) gets the
  turn's text in it; any other action is read from the turn as a JSON object. A turn that is not a
  valid action is answered with the validation error as the observation (reward 0, not done), so
  the model sees its mistake and the episode goes on.
- an observation becomes text: its one text field (besides `done`, `reward`, `metadata`), else
  its fields as JSON. `reward` (None: 0) is the step's reward, `done` ends the episode.
- `reset` gets the episode's seed and the dataset row's columns that its signature names (the
  server filters them the same way), so a dataset can choose each episode's task.

Concurrency as the environment declares it: `SUPPORTS_CONCURRENT_SESSIONS = False` lets one episode
of a worker run at a time (later ones wait in `reset`, within `rollout.env_timeout_s`). A server that
dies or hangs fails the episodes that were using it (`EnvError`: their samples carry the error and
stay out of the loss); a local server that died is started again for the next episode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncflow.clock import Clock
from asyncflow.envs.base import Env, EnvError, EnvStep
from asyncflow.envs.openenv_types import (
    environment_class,
    environment_types,
    import_openenv,
    session_limit,
    text_field,
)

PREFIX = "openenv:"
SERVER_PREFIX = "openenv+server:"
_SKIP_OBS = ("done", "reward", "metadata")


def is_openenv_spec(spec: str) -> bool:
    return spec.startswith((PREFIX, SERVER_PREFIX))


def action_payload(text: str, field: str | None) -> dict[str, Any]:
    """The action dict for one turn (`ValueError` when a structured action is not a JSON object)."""
    if field is not None:
        return {field: text}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the action must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"the action must be a JSON object, not {type(value).__name__}")
    return value


def observation_text(observation: dict[str, Any]) -> str:
    """An observation's text: its one text field, else its fields (no done/reward/metadata) as JSON."""
    rest = {k: v for k, v in observation.items() if k not in _SKIP_OBS}
    if len(rest) == 1 and isinstance(next(iter(rest.values())), str):
        return str(next(iter(rest.values())))
    return json.dumps(rest, sort_keys=True, default=str) if rest else ""


def step_of(observation: dict[str, Any], reward: Any, done: Any) -> EnvStep:
    value = 0.0 if reward is None else float(reward)
    return EnvStep(observation_text(observation), reward=value, done=bool(done),
                   info={"openenv_reward": reward})


class SessionGate:
    """At most `limit` episodes of one factory at once, per event loop (the rollout worker's and the
    evaluator's loops never share an asyncio primitive)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._sems: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = \
            weakref.WeakKeyDictionary()

    async def enter(self) -> bool:
        """Wait for a place (True: one was taken, `leave` it); no wait without a limit (False)."""
        if self.limit is None:
            return False
        loop = asyncio.get_running_loop()
        sem = self._sems.get(loop)
        if sem is None:
            sem = self._sems[loop] = asyncio.Semaphore(self.limit)
        await sem.acquire()
        return True

    def leave(self) -> None:
        sem = self._sems.get(asyncio.get_running_loop())
        if sem is not None:
            sem.release()


class OpenEnvEpisode(Env):
    """One episode of an OpenEnv environment; `session` does the calls (in process or over /ws)."""

    def __init__(self, session: Any, gate: SessionGate, name: str, max_turns: int) -> None:
        self.session, self.gate, self.name, self.max_turns = session, gate, name, max_turns
        self._held = False

    async def reset(self, row: dict[str, Any], seed: int) -> str:
        self._held = await self.gate.enter()
        observation, _, _ = await self.session.reset(row, seed)
        return observation_text(observation)

    async def step(self, action: str) -> EnvStep:
        try:
            payload = action_payload(action, self.session.text_field)
        except ValueError as exc:
            return EnvStep(f"invalid action: {exc}", info={"invalid_action": True})
        try:
            observation, reward, done = await self.session.step(payload)
        except InvalidAction as exc:
            return EnvStep(f"invalid action: {exc}", info={"invalid_action": True})
        return step_of(observation, reward, done)

    async def close(self) -> None:
        try:
            await self.session.close()
        finally:
            if self._held:
                self._held = False
                self.gate.leave()


class AtCapacity(Exception):
    """The server has as many sessions as it allows."""


def _closed_error() -> type[Exception]:
    from websockets.exceptions import ConnectionClosedOK

    return ConnectionClosedOK  # type: ignore[no-any-return]


class InvalidAction(Exception):
    """The environment's action class refused the turn (a pydantic validation error)."""


def reset_kwargs(fn: Callable[..., Any], row: dict[str, Any], seed: int) -> dict[str, Any]:
    """`seed`, a fresh `episode_id` and the row's columns that `fn`'s signature names (all of them
    for one taking **kwargs), as OpenEnv's server passes a reset request's fields."""
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    given = {**row, "seed": seed, "episode_id": uuid.uuid4().hex}
    named = {k: v for k, v in given.items() if k in params}
    if var_kw:
        named.update({k: v for k, v in row.items() if k not in ("prompt",)})
    return named


class InProcessSession:
    """Calls a fresh instance of the environment class in this process. A sync `reset`/`step` runs
    in a worker thread (as OpenEnv's server runs it), never on the rollout worker's loop; all in one
    thread of its own for an environment that declares `REQUIRES_SINGLE_THREAD_EXECUTOR`."""

    def __init__(self, make: Callable[[], Any], action_cls: Any) -> None:
        self.make: Callable[[], Any] = make
        self.env: Any = None
        self.action_cls = action_cls
        self.text_field = text_field(action_cls.model_json_schema())
        one = isinstance(make, type) and getattr(make, "REQUIRES_SINGLE_THREAD_EXECUTOR", False)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="openenv") if one else None

    async def _sync(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.thread is None:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.thread, functools.partial(fn, *args, **kwargs))

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        core = import_openenv()
        overridden = getattr(type(self.env), f"{name}_async") is not getattr(core.Environment, f"{name}_async")
        if overridden:
            return await getattr(self.env, f"{name}_async")(*args, **kwargs)
        return await self._sync(getattr(self.env, name), *args, **kwargs)

    async def reset(self, row: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any, Any]:
        self.env = await self._sync(self.make)  # (inside reset's bound: construction may be slow)
        obs = await self._call("reset", **reset_kwargs(self.env.reset, row, seed))
        return _dumped(obs)

    async def step(self, payload: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        from pydantic import ValidationError

        try:
            action = self.action_cls.model_validate(payload)
        except ValidationError as exc:
            raise InvalidAction(_first_error(exc)) from None
        return _dumped(await self._call("step", action))

    async def close(self) -> None:
        try:
            if self.env is not None:
                await self._sync(self.env.close)
        finally:
            if self.thread is not None:
                self.thread.shutdown(wait=False)


def _dumped(obs: Any) -> tuple[dict[str, Any], Any, Any]:
    if not hasattr(obs, "model_dump"):
        raise EnvError(f"the environment returned {type(obs).__name__}, not an openenv Observation")
    data = obs.model_dump()
    return data, data.get("reward"), data.get("done", False)


def _first_error(exc: Any) -> str:
    errors = exc.errors()
    if not errors:
        return str(exc).splitlines()[0]
    e = errors[0]
    where = ".".join(str(p) for p in e.get("loc", ())) or "action"
    return f"{where}: {e.get('msg', 'invalid')}"


class RemoteSession:
    """One WebSocket session (OpenEnv's own `GenericEnvClient`) with a server at `url`."""

    def __init__(self, url: str, field: str | None, timeout_s: float) -> None:
        core = import_openenv()
        self.client = core.GenericEnvClient(base_url=url, connect_timeout_s=min(timeout_s, 30.0),
                                            message_timeout_s=timeout_s)
        self.text_field = field
        self.url = url

    async def reset(self, row: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any, Any]:
        """Open a session and reset it; while the server is at its session limit, try again (a
        server closes a refused session: the refusal may arrive as the close). Bounded by the
        episode's reset timeout (`rollout.env_timeout_s`)."""
        kwargs = {k: v for k, v in row.items() if k != "prompt" and _jsonable(v)}
        wait = 0.05
        while True:
            try:
                result = await self._call(self.client.reset(**kwargs, seed=seed))
                return result.observation, result.reward, result.done
            except (AtCapacity, _closed_error()):
                await self.client.close()
                await asyncio.sleep(wait)
                wait = min(2 * wait, 1.0)

    async def step(self, payload: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        result = await self._call(self.client.step(payload))
        return result.observation, result.reward, result.done

    async def _call(self, aw: Any) -> Any:
        try:
            return await aw
        except RuntimeError as exc:  # the server's error reply (the library raises RuntimeError)
            message = str(exc)
            if "VALIDATION_ERROR" in message:
                raise InvalidAction(message) from None
            if "CAPACITY_REACHED" in message:
                raise AtCapacity(message) from None
            raise EnvError(f"openenv server {self.url}: {message}") from None

    async def close(self) -> None:
        await self.client.close()


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def make_openenv_factory(spec: str, *, max_turns: int, timeout_s: float) -> OpenEnvFactory:
    """`rollout.env: openenv:...` -> a factory of one `OpenEnvEpisode` per episode (see the module doc).
    A spec that names nothing importable is bad input here, before the run starts."""
    if spec.startswith(SERVER_PREFIX):
        from asyncflow.envs.openenv_server import LocalServer

        server = LocalServer(spec.removeprefix(SERVER_PREFIX))
        server.start()
        remote = RemoteTarget(server, timeout_s)
        return OpenEnvFactory(lambda: LazyRemote(remote), SessionGate(server.sessions),
                              f"openenv server {server.target}", max_turns, server)
    target = spec.removeprefix(PREFIX)
    if target.startswith(("http://", "https://", "ws://", "wss://")):
        url = target.rstrip("/")
        remote = RemoteTarget(url, timeout_s)
        # (the server enforces its own session limit: a session it refuses is asked for again)
        return OpenEnvFactory(lambda: LazyRemote(remote), SessionGate(None), f"openenv {url}", max_turns)
    cls = environment_class(target, "rollout.env")
    action_cls, _ = environment_types(cls)
    gate = SessionGate(None if session_limit(cls) > 1 else 1)
    return OpenEnvFactory(lambda: InProcessSession(cls, action_cls), gate, f"openenv {cls.__name__}", max_turns)


class OpenEnvFactory:
    """`factory(clock)` -> one episode's `OpenEnvEpisode`; `server`: the local server it runs, if any."""

    def __init__(self, session: Callable[[], Any], gate: SessionGate, name: str, max_turns: int,
                 server: Any = None) -> None:
        self.session, self.gate, self.name, self.max_turns, self.server = session, gate, name, max_turns, server

    def __call__(self, clock: Clock) -> Env:
        return OpenEnvEpisode(self.session(), self.gate, self.name, self.max_turns)


class RemoteTarget:
    """Where a factory's episodes connect: a URL, or a local server (started, or restarted after it
    died, when an episode first needs it); the action's text field is read once from `/schema`."""

    def __init__(self, where: Any, timeout_s: float) -> None:
        self.where, self.timeout_s = where, timeout_s
        self._fields: dict[str, str | None] = {}

    async def resolve(self) -> tuple[str, str | None]:
        from asyncflow.envs.openenv_server import action_text_field

        url = self.where if isinstance(self.where, str) else await self.where.url()
        if url not in self._fields:
            self._fields[url] = await action_text_field(url)
        return url, self._fields[url]


class LazyRemote:
    """A `RemoteSession` opened at the episode's reset (inside its timeout)."""

    def __init__(self, target: RemoteTarget) -> None:
        self.target = target
        self.session: RemoteSession | None = None
        self.text_field: str | None = None

    async def reset(self, row: dict[str, Any], seed: int) -> tuple[dict[str, Any], Any, Any]:
        url, self.text_field = await self.target.resolve()
        self.session = RemoteSession(url, self.text_field, self.target.timeout_s)
        return await self.session.reset(row, seed)

    async def step(self, payload: dict[str, Any]) -> tuple[dict[str, Any], Any, Any]:
        assert self.session is not None
        return await self.session.step(payload)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
