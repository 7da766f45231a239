"""The configuration's entry point: YAML loading, `--set` overrides, typing them into the config tree
(its fields, defaults and bounds are in asyncflow/config_schema.py), then validation (config_checks.py).

Precedence (lowest first): the schema's defaults < the task pack's defaults < the YAML file < `--set`.
Validation happens before torch/transformers/ray are imported, so a typo costs milliseconds: an
unknown key is an error that suggests the closest known key, and a wrong type, an out-of-range value
or a contradictory pair of settings names the key. Nothing is ever silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from asyncflow.config_checks import ENV_NAMES, missing_packages, validate
from asyncflow.config_effective import effective_dict, effective_yaml
from asyncflow.config_hints import alias_hint
from asyncflow.config_reference import field_docs, reference_markdown
from asyncflow.config_schema import (
    LORA_LR,
    MAX_TIMEOUT_S,
    AlgorithmConfig,
    CheckpointConfig,
    Config,
    DatasetConfig,
    DistillConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RuntimeConfig,
    TrainConfig,
    WorkflowConfig,
    episodic,
    max_generated_tokens,
    section_type,
    type_name,
)
from asyncflow.errors import UserError

# What the package, tests and docs import from here (some of it is defined in the modules above).
__all__ = [
    "ENV_NAMES",
    "AlgorithmConfig",
    "CheckpointConfig",
    "Config",
    "DatasetConfig",
    "DistillConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "RewardConfig",
    "RolloutConfig",
    "RuntimeConfig",
    "TrainConfig",
    "WorkflowConfig",
    "dump_yaml",
    "effective_dict",
    "episodic",
    "field_docs",
    "from_dict",
    "load_config",
    "max_generated_tokens",
    "merge",
    "missing_packages",
    "parse_set",
    "read_yaml",
    "reference_markdown",
    "task_defaults",
    "to_dict",
    "validate",
    "value_notes",
]


# --------------------------------------------------------------------------------------------------
# loading


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `over` into a copy of `base` (dicts merge, everything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_set(items: list[str]) -> dict[str, Any]:
    """Turn `["a.b=1", "c=x"]` into a nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"--set {item!r}: empty key segment")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r}: {part} is set both as a value and as a section")
        node[parts[-1]] = value
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error: the plain loader keeps
    the last one without a word, and a config never ignores what it was given."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key must be a plain value, got {type(key).__name__}", key_node.start_mark) from None
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one section", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict, with clear errors."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a folder; give the config's YAML file")
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read the config file: {exc.strerror or exc}") from None
    try:
        data = _load_yaml(p, text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise UserError(f"{p}:{where}: {problem}") from None
    if data is None:
        if not text.strip():  # (comments only is a choice; no text at all looks like a file cut short)
            raise UserError(f"{p}: the config file is empty; write the settings into it (for the built-in default "
                            "run: `asyncflow demo`)")
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping of config sections at the top level")
    return data


def value_notes(cfg: Config, explicit: set[str]) -> dict[str, str]:
    """The dotted keys whose value came neither from the schema's default nor from the user (the task
    pack's defaults; train.lr with model.lora), each with the note `asyncflow config` prints beside it."""
    notes = {key: f"from task {cfg.task}" for key in _leaves(task_defaults(cfg.task)) if key not in explicit}
    if cfg.model.lora is not None and "train.lr" not in explicit and "train.lr" not in notes:
        notes["train.lr"] = "the default with model.lora"
    return notes


def _leaves(d: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the values in nested dicts `d` (sections are not keys of their own)."""
    out: list[str] = []
    for key, value in d.items():
        out += _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return out


def task_defaults(task: str | None) -> dict[str, Any]:
    """The task pack's config defaults (light import: no torch)."""
    if task is None:
        return {}
    from asyncflow.tasks import TASK_NAMES, task_default_config

    if task not in TASK_NAMES:
        hint = _closest(task, list(TASK_NAMES))
        raise UserError(f"task: unknown task pack {_shown(task)}{hint}; known: {', '.join(TASK_NAMES)}")
    return task_default_config(task)


MAX_YAML_VALUES = 1_000_000  # values a config may hold once its aliases are expanded
MAX_YAML_DEPTH = 64  # nesting levels a config may have (it needs a handful)


def _load_yaml(p: Path, text: str) -> Any:
    """The YAML document, refused (one line) when its aliases expand past `MAX_YAML_VALUES`: a few
    hundred bytes of nested aliases ("billion laughs") expand to a structure whose every walk or
    repr (an error message) costs gigabytes."""
    loader = _UniqueKeyLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # (PyYAML composes nested collections recursively)
            raise UserError(f"{p}: nested over {MAX_YAML_DEPTH} levels deep; a config is a few levels deep") from None
        if node is None:
            return None
        _check_nesting(p, node)
        if _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise UserError(f"{p}: its YAML aliases expand to over {MAX_YAML_VALUES:,} values; write the values out")
        try:
            return loader.construct_document(node)
        except ValueError as exc:  # e.g. an integer past Python's digit limit for int(str)
            raise UserError(f"{p}: a value YAML cannot read: {str(exc).split(';')[0]}") from None
    finally:
        loader.dispose()


def _check_nesting(p: Path, root: yaml.Node) -> None:
    """Refuse a document nested over `MAX_YAML_DEPTH` levels, or whose alias points at a collection
    that holds it (`a: &x {b: *x}`): every walk of such a value recurses without end. Each node is
    walked once (`height`: levels from a finished node down), so an alias bomb costs its size."""
    height: dict[int, int] = {}
    open_nodes: set[int] = set()  # (the collections on the current path)
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, finished = stack.pop()
        children = _children(node)
        if finished:
            open_nodes.discard(id(node))
            height[id(node)] = 1 + max((height[id(c)] for c in children), default=0)
            continue
        if id(node) in open_nodes:
            raise UserError(f"{p}: line {node.start_mark.line + 1}: a YAML alias refers to a section that holds "
                            "it; the value would never end")
        if depth + height.get(id(node), 1) - 1 > MAX_YAML_DEPTH:
            raise UserError(f"{p}: line {node.start_mark.line + 1}: nested over {MAX_YAML_DEPTH} levels deep; "
                            "a config is a few levels deep")
        if id(node) in height or not children:
            height.setdefault(id(node), 1)
            continue
        open_nodes.add(id(node))
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Values under `node` with every alias expanded, counted once per node (`sizes`), so the count
    costs the document's size, not its expansion's."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1  # (an alias to a node being counted, a cycle, is one value)
    total = 1
    for child in _children(node):
        total += _expanded_size(child, sizes)
        if total > MAX_YAML_VALUES:
            break
    sizes[id(node)] = total
    return total


def _shown(value: Any, limit: int = 200) -> str:
    """`repr(value)` for a message, at most `limit` characters and built without walking more than
    that of the value (a nested or huge one would make a message of megabytes)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxtuple, _REPR.maxset = 3, 8, 8, 8, 8
_REPR.maxstring, _REPR.maxother = 200, 200


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, *,
                require_packages: bool = True, sources: bool = True) -> tuple[Config, set[str]]:
    """Build the resolved config. Returns it with the set of dotted keys the user set explicitly.
    `require_packages=False`: an optional package the config needs may be missing (`missing_packages`
    lists them); everything else is checked as for a run. `sources=False`: no prompts or rewards are
    required (a service's clients bring them: `validate`)."""
    user = read_yaml(path) if path is not None else {}
    cli = parse_set(overrides or [])
    _check_sections(user, cli)
    explicit = merge(user, cli)
    task = explicit.get("task", Config.task)
    if task is not None and not isinstance(task, str):
        raise UserError(f"task: expected a task name or null, got {_shown(task)}")
    train = explicit.get("train")
    if isinstance(train, dict) and "lr" in train and train["lr"] is None:
        # `lr: null`: as if not given (the task pack's rate, else the default)
        explicit = {**explicit, "train": {k: v for k, v in train.items() if k != "lr"}}
    raw = merge(task_defaults(task), explicit)
    cfg = from_dict(raw)
    if cfg.model.lora is not None and "lr" not in raw.get("train", {}):
        cfg.train.lr = LORA_LR  # (train.lr's doc: an adapter wants a larger rate than full fine-tuning)
    for section, key in _PATH_KEYS:  # `~/data.jsonl` means the home folder, as in a shell
        holder = getattr(cfg, section)
        value = getattr(holder, key)
        if isinstance(value, str) and value.startswith("~"):
            setattr(holder, key, os.path.expanduser(value))
    validate(cfg, _flatten(explicit), require_packages=require_packages, sources=sources)
    return cfg, _flatten(explicit)


_PATH_KEYS = (("model", "path"), ("model", "cache_dir"), ("dataset", "path"), ("eval", "path"), ("rollout", "sync_dir"))


def _check_sections(user: dict[str, Any], cli: dict[str, Any], prefix: str = "") -> None:
    """A `--set` into a section the file gives as something else (`train: 5`) would replace it
    silently; refuse it, naming the file's value, as it is refused without the `--set`."""
    for key, value in cli.items():
        if isinstance(value, dict) and key in user:
            if isinstance(user[key], dict):
                _check_sections(user[key], value, f"{prefix}{key}.")
            elif user[key] is not None:
                raise UserError(f"{prefix}{key}: expected a mapping, got {_shown(user[key])}")


def _flatten(d: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key, value in d.items():
        name = f"{prefix}{key}"
        out.add(name)
        if isinstance(value, dict):
            out |= _flatten(value, name + ".")
    return out


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def from_dict(raw: dict[str, Any]) -> Config:
    """Build a Config from nested dicts, checking keys, types and bounds."""
    return typing.cast(Config, _build(Config, raw, ""))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping, got {_shown(raw)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            hint = alias_hint(f"{prefix}{key}", raw[key]) or _closest(str(key), list(fields))
            raise UserError(f"{prefix}{key}: unknown key{hint}")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        section = section_type(tp)
        if section is not None and raw[name] is None and section is not tp:  # an optional section: null is off
            values[name] = None
        elif section is not None:
            values[name] = _build(section, raw[name], f"{prefix}{name}.")
        else:
            values[name] = _check_value(f"{prefix}{name}", raw[name], tp, f.metadata)
    return cls(**values)


def _check_value(key: str, value: Any, tp: Any, meta: Any) -> Any:
    value = _coerce(key, value, tp)
    lo, hi = meta.get("lo"), meta.get("hi")
    if "timeout" in key.rsplit(".", 1)[-1]:  # every timeout: past it, waits overflow (Event.wait(1e308))
        hi = MAX_TIMEOUT_S if hi is None else min(hi, MAX_TIMEOUT_S)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if lo is not None and value < lo:
            raise UserError(f"{key}: {value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise UserError(f"{key}: {value} is above the maximum {hi}")
    return value


def _yaml_text(value: Any) -> str:
    """A value as YAML writes it (true, null, 2024-01-01), a string in quotes: messages speak the
    config's language, not Python's (`True`, `datetime.date(...)`)."""
    if value is None or isinstance(value, (bool, int, float)) or hasattr(value, "isoformat"):
        return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    return repr(value)


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """`value` as a field of type `tp` takes it, else a one-line error naming `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(key, value, tp)
    if origin is Literal:
        return _coerce_literal(key, value, tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"{key}: expected a list, got {_shown(value)}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        quoted = " (a string: remove the quotes)" if isinstance(value, str) and value.lower() in ("true", "false") else ""
        raise UserError(f"{key}: expected true or false, got {_yaml_text(value)}{quoted}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"{key}: expected an integer, got {_shown(value)}")
    if tp is float:
        return _coerce_float(key, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"{key}: expected a string, got {_yaml_text(value)} (YAML reads it as a {type(value).__name__}: "
                        f"quote it)")
    raise TypeError(f"config type {tp} of {key} is not supported")


def _coerce_union(key: str, value: Any, tp: Any) -> Any:
    """The first member type that takes `value` (null where the type allows it)."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(key, value, arg)
        except UserError as exc:
            errors.append(str(exc))
    raise UserError(errors[0] if len(errors) == 1 else f"{key}: {_shown(value)} is not valid here ({type_name(tp)})")


def _coerce_literal(key: str, value: Any, tp: Any) -> Any:
    """One of the choices, type included (`1` is not `true`); else the closest choice is suggested."""
    choices = typing.get_args(tp)
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return value
    shown = ", ".join(_yaml_text(c) for c in choices)
    hint = _closest(str(value), [_yaml_text(c).strip("'") for c in choices]) if isinstance(value, str) else ""
    raise UserError(f"{key}: {_yaml_text(value)} is not one of {shown}{hint}")


def _coerce_float(key: str, value: Any) -> float:
    """A finite float; an int, or a string that is clearly a number, is taken as one."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # (an int beyond a float's range: a traceback)
            raise UserError(f"{key}: expected a finite number, got an integer of {len(str(value))} digits") from None
    elif isinstance(value, str):  # PyYAML reads `3e-4` (no dot) as a string: accept what is clearly a number
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None:
        raise UserError(f"{key}: expected a number, got {_shown(value)}")
    # nan passes every bound (nan < lo is False) and an infinite timeout is no timeout: no key takes either
    if not math.isfinite(number):
        raise UserError(f"{key}: expected a finite number, got {_shown(value)}")
    return number


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain nested dicts (for config.yaml)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, notes: dict[str, str] | None = None) -> str:
    """The resolved config as YAML (config.yaml, `asyncflow config`): effective values, no key the run
    does not read, loadable back (config_effective.py); `notes` (dotted key: text) become trailing
    comments on their keys' lines."""
    return effective_yaml(cfg, notes)
