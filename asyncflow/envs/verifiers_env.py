"""verifiers environments as asyncflow agents (`rollout.agent: verifiers:[ENV_ID+]TASKSET_ID`), unchanged.

```
 dataset (default)  the taskset's tasks, one row each: {prompt, verifiers_task: the task's wire data}
                                         │
 one asyncflow agent episode (its own loop and thread, `workflow/agent_thread.py`)
   VerifiersAgent(base_url, row, seed)
     verifiers Env (load_environment: the taskset's own Env, or ENV_ID's; else SingleAgentEnv)
       env.serving(): verifiers' interception server on loopback
       env.run_episode(task, ModelContext(client = base_url))   ── seats play through
         AsyncflowChatHarness (in process) ─► interception ─► base_url: asyncflow's recording endpoint
       task.score / Env.finalize ─► trace.rewards
     reward = the trainable trace's `trace.reward` (the weighted sum of its rewards)
```

What is trained is what the recording endpoint recorded: the exact token ids and log-probs of every
call (the stitcher keeps the calls that extend one context, `workflow/agent.py`). The reward is
verifiers' own: `Task` `@reward` methods, plugged rewards and judges, and an `Env.finalize` that
records rewards across the episode's traces. An episode must end `ok` with exactly one trainable
trace, else it ends with an error (kept out of the loss): one asyncflow sample is one trajectory,
so several trainable attempts in one episode (best-of-n) are refused; use `rollout.n` for them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from asyncflow.errors import UserError

PREFIX = "verifiers:"
TASK_COLUMN = "verifiers_task"
HARNESS_ID = "asyncflow_chat_harness"  # (`top_level_alias` of envs/verifiers_harness.py)
MODEL_NAME = "asyncflow-policy"
API_KEY_VAR = "ASYNCFLOW_AGENT_API_KEY"  # (the endpoint takes any key; verifiers reads one from a variable)


def is_verifiers_spec(spec: str | None) -> bool:
    return spec is not None and spec.startswith(PREFIX)


def _import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise UserError("rollout.agent: verifiers environments need the verifiers package "
                        "(pip install 'asyncflow[verifiers]')") from None
    return vf


def parse_spec(spec: str) -> tuple[str, str]:
    """(env id, taskset id) of `verifiers:[ENV+]TASKSET` (env id "": the taskset's own). Each part is
    an installed package's name, as verifiers resolves ids, or a `.py` file (loaded by its path and
    given a top-level module name verifiers' loader finds)."""
    body = spec.removeprefix(PREFIX).strip()
    env_part, _, taskset_part = body.rpartition("+")
    if not taskset_part:
        raise UserError(f"rollout.agent: {spec!r} names no taskset; write verifiers:TASKSET or verifiers:ENV+TASKSET")
    return (_plugin_id(env_part) if env_part else ""), _plugin_id(taskset_part)


def _plugin_id(part: str) -> str:
    if not part.endswith(".py"):
        return part
    from asyncflow.user_code import load_file

    module = load_file(part, "rollout.agent")
    return top_level_alias(module, "asyncflow_vf_" + hashlib.sha256(str(module.__file__).encode()).hexdigest()[:12])


def top_level_alias(module: ModuleType, name: str) -> str:
    """`name`, made a top-level module name for `module`: verifiers' loader imports a plugin id as
    `verifiers.v1.<kind>.<id>` or `<id>`, which a dotted module path or a file cannot be."""
    sys.modules.setdefault(name, module)
    return name


def env_config(spec: str) -> Any:
    """The verifiers env config of `spec`, every seat played by asyncflow's in-process chat harness
    in a local subprocess runtime, one interception server. Bad ids are a UserError."""
    vf = _import_verifiers()
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.interception import InterceptionServerConfig
    from verifiers.v1.runtimes import SubprocessConfig

    env_id, taskset_id = parse_spec(spec)
    try:
        config = vf.resolve_env_config({"id": env_id, "taskset": {"id": taskset_id}})
    except Exception as exc:  # (a module that is not installed, or not a taskset: the library says which)
        raise UserError(f"rollout.agent: {spec!r}: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    seats = {name: seat.model_copy(update={"harness": _harness_config(), "runtime": SubprocessConfig()})
             for name, seat in agent_config_fields(config).items()}
    return config.model_copy(update={**seats, "interception": InterceptionServerConfig()})


def _harness_config() -> Any:
    from asyncflow.envs import verifiers_harness

    return verifiers_harness.AsyncflowChatHarnessConfig(id=top_level_alias(verifiers_harness, HARNESS_ID))


def taskset_rows(spec: str) -> list[dict[str, Any]]:
    """One row per task of the taskset (in `load()` order): `prompt` (its text) and the task's wire
    data, from which the episode rebuilds the task."""
    vf = _import_verifiers()
    config = env_config(spec)
    taskset = vf.load_taskset(config.taskset)
    if not taskset.bounded:
        raise UserError(f"rollout.agent: the taskset of {spec!r} is infinite; give dataset.path with rows that "
                        f"carry a {TASK_COLUMN!r} column")
    return [{"prompt": _row_prompt(task.data), TASK_COLUMN: task.data.model_dump(mode="json", exclude_none=True)}
            for task in taskset]


def _row_prompt(data: Any) -> str:
    """The row's prompt column: the task's prompt text (a task without one, whose user opens the
    conversation: its name, id or index; the column names the sample, the task's data drives it)."""
    return str(data.prompt_text or data.name or data.id or f"task {data.idx}")


def taskset_rows_file(spec: str, cache_root: Path) -> Path:
    """The taskset's rows as a jsonl file in the cache (named by their content: written once)."""
    rows = taskset_rows(spec)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.removeprefix(PREFIX))
    path = cache_root / "verifiers-tasks" / f"{name}-{digest}.jsonl"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


class VerifiersAgent:
    """`rollout.agent` for a verifiers environment: `await agent(base_url, row, seed)` plays one
    verifiers episode of the row's task against `base_url` and returns its reward (see the module
    doc). Built in every process that runs episodes (on Ray: the rollout actors)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.config = env_config(spec)
        vf = _import_verifiers()
        self.task_cls = vf.load_taskset(self.config.taskset).task_type()
        self.task_config = self.task_cls.config_type()()

    def task(self, row: dict[str, Any]) -> Any:
        data = row.get(TASK_COLUMN)
        if not isinstance(data, dict):
            raise ValueError(f"the row has no {TASK_COLUMN!r} object (the task's wire data)")
        return self.task_cls(self.task_cls.data_type().model_validate(data), self.task_config)

    async def __call__(self, base_url: str, row: dict[str, Any], seed: int) -> dict[str, Any]:
        vf = _import_verifiers()
        from verifiers.v1.clients import EvalClientConfig

        os.environ.setdefault(API_KEY_VAR, "asyncflow")
        env = vf.load_environment(self.config)
        ctx = vf.ModelContext(model=MODEL_NAME, client=EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR))
        async with env.serving():
            episode = await env.run_episode(self.task(row), ctx)
        return {"reward": episode_reward(episode)}


def episode_reward(episode: Any) -> float:
    """The reward of an episode's one trainable trace; ValueError for an episode that failed or does
    not have exactly one trainable trace."""
    if not episode.ok:
        errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
        first = errors[0] if errors else None
        raise ValueError("the verifiers episode failed" + (f": {first.type}: {first.message}" if first else ""))
    trainable = [t for t in episode.traces if t.agent.trainable]
    if len(trainable) != 1:
        raise ValueError(f"the verifiers episode has {len(trainable)} trainable traces; asyncflow trains one "
                         "trajectory per episode (use rollout.n for independent attempts)")
    return float(trainable[0].reward)
