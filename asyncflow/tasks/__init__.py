"""Built-in task packs: a data generator, a verifier, default settings and a tiny base model each.

Why a registry of names: a config says `task: arith` and the CLI validates it before any heavy
library loads, so this module only names the packs; `get_task` imports one (and torch) on demand.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASK_NAMES: tuple[str, ...] = ("arith", "calc", "chat_arith")


@dataclass(frozen=True)
class TaskPack:
    """What a built-in task supplies to a run that does not say otherwise."""

    name: str
    """The name a config's `task:` key uses."""
    prepare: Callable[..., Path]
    """`prepare(cache_dir, *, seed, log) -> Path`: the HF model folder with train/eval jsonl (shipped
    inside the package, else built once into the cache)."""
    shipped: Callable[[int], Path | None] = lambda seed: None
    """`shipped(seed)`: the prepared folder for `seed` shipped inside the package, or None."""
    defaults: dict[str, Any] = field(default_factory=dict)
    """Nested config overrides suited to this task's model (below the YAML file in precedence)."""
    reward_fn_path: str = ""
    """`module:function` of the TRL-signature reward."""
    lenient_fn_path: str = ""
    """`module:function` of `eval.lenient_fn`'s default (a looser check of the same answers; "": none)."""
    data: Callable[..., tuple[Path, Path]] | None = None
    """`data(cache_dir, *, seed, log) -> (train.jsonl, eval.jsonl)`: the task's prompts, written into the
    cache, for a task whose model is a pretrained one (`model.path` may name any folder of it); None:
    they lie in the task's model folder."""
    description: str = ""
    """One line for `--help` and error messages."""


def get_task(name: str) -> TaskPack:
    """The task pack called `name`, imported on first use; `KeyError` names the known tasks."""
    if name not in TASK_NAMES:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    task = importlib.import_module(f"asyncflow.tasks.{name}").TASK
    assert isinstance(task, TaskPack)
    return task


def task_default_config(name: str) -> dict[str, Any]:
    """A copy of the task pack's config defaults (its module imports no heavy library at load)."""
    import copy

    return copy.deepcopy(get_task(name).defaults)
