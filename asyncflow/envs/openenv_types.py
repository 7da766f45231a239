"""What an OpenEnv environment declares, read for asyncflow: its Action and Observation classes, whether
its action is one text field, how many sessions it allows (`envs/openenv_env.py` uses them)."""

from __future__ import annotations

import typing
from typing import Any

from asyncflow.errors import UserError
from asyncflow.user_code import load_attr

MAX_SESSIONS = 64  # sessions a local server allows for an environment that supports concurrent ones


def import_openenv() -> Any:
    try:
        import openenv.core as core
    except ImportError:
        raise UserError("rollout.env: openenv environments need the openenv-core package "
                        "(pip install 'asyncflow[openenv]')") from None
    return core


def environment_types(cls: type) -> tuple[Any, Any]:
    """(Action class, Observation class) of an `Environment[ActT, ObsT, StateT]` subclass, from its
    generic parameters; the base classes when it does not name them."""
    core = import_openenv()
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is core.Environment:
                args = typing.get_args(base)
                if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                    return args[0], args[1]
    return core.Action, core.Observation


def environment_class(spec: str, key: str) -> type:
    core = import_openenv()
    found = load_attr(spec, key, "Environment class")
    if not (isinstance(found, type) and issubclass(found, core.Environment)):
        raise UserError(f"{key}: {spec!r} is not an openenv.core.Environment subclass")
    return found


def text_field(schema: dict[str, Any]) -> str | None:
    """The one string property of an action's JSON schema besides `metadata`, if it has exactly one
    property (a one-field text action: the turn's text goes into it)."""
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    if len(props) == 1:
        name, prop = next(iter(props.items()))
        if prop.get("type") == "string":
            return name
    return None


def session_limit(cls: type) -> int:
    """Sessions at once: `MAX_SESSIONS` for an environment that supports concurrent sessions, else one."""
    return MAX_SESSIONS if getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
