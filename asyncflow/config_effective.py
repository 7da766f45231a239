"""The config as a run records it (RUN_DIR/config.yaml) and `asyncflow config` prints it: effective
values, and a file that loads back as the same config.

A null that stands for a definite value is replaced by it (`workflow.max_staleness: null` is 1 in
async mode); a null whose value is decided elsewhere stays (`model.path`: the task pack's model;
`rollout.sync_dir`: under the run folder, so a copied file must not pin another run's folder). A key
the run does not read is left out (`runtime.rollout_gpus` with runtime.kind=local): given, it is
refused, and the file must load back.
No heavy imports: the CLI validates before torch loads.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

import yaml

from asyncflow.config_checks import validate
from asyncflow.config_hints import schema_keys
from asyncflow.config_schema import Config, clip_defaults, colocated, max_generated_tokens, torch_threads
from asyncflow.errors import UserError


def resolve_defaults(cfg: Config) -> Config:
    """A copy of `cfg` with every null that stands for a definite value replaced by that value."""
    out = copy.deepcopy(cfg)
    out.workflow.max_staleness = cfg.staleness
    out.runtime.torch_threads = torch_threads(cfg)  # (this machine's cores: null lets another machine choose)
    if cfg.runtime.kind == "ray":
        out.runtime.colocate = colocated(cfg)
    low, high = clip_defaults(cfg.algorithm.loss)
    out.algorithm.clip_low = low if cfg.algorithm.clip_low is None else cfg.algorithm.clip_low
    out.algorithm.clip_high = high if cfg.algorithm.clip_high is None else cfg.algorithm.clip_high
    if cfg.algorithm.agg == "dr_grpo" and cfg.algorithm.norm_length is None:
        out.algorithm.norm_length = max_generated_tokens(cfg)
    return out


def unused_keys(cfg: Config) -> set[str]:
    """The keys `validate` refuses when given with this config: keys of a feature that is off."""
    try:
        validate(copy.deepcopy(cfg), set(), require_packages=False)
    except UserError:  # (a config no longer valid as a whole: nothing can be told apart, keep every key)
        return set()
    out = set()
    for key in schema_keys():
        try:
            # (validate resolves some fields in place: a copy each time)
            validate(copy.deepcopy(cfg), {key}, require_packages=False)
        except UserError:
            out.add(key)
    return out


def effective_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as nested dicts, without the keys this run does not read."""
    resolved = resolve_defaults(cfg)
    data = dataclasses.asdict(resolved)
    for key in unused_keys(resolved):
        *sections, name = key.split(".")
        node = data
        for section in sections:
            node = node[section]
        node.pop(name, None)
    return data


def effective_yaml(cfg: Config, notes: dict[str, str] | None = None) -> str:
    """`effective_dict` as YAML, in the schema's key order; each `notes` entry (dotted key: text)
    a trailing comment on its key's line."""
    text = yaml.safe_dump(effective_dict(cfg), sort_keys=False)
    return annotated(text, notes) if notes else text


_KEY_LINE = re.compile(r"( *)([A-Za-z_][A-Za-z0-9_]*):(?: |$)")


def annotated(text: str, notes: dict[str, str]) -> str:
    """Block-style YAML `text` with `# note` after each line whose dotted key `notes` names; the path
    of a line is read from the indentation of the key lines above it."""
    path: list[tuple[int, str]] = []  # (indent, key) of the sections holding the current line
    lines = []
    for line in text.splitlines():
        match = _KEY_LINE.match(line)
        if match:
            indent = len(match.group(1))
            while path and path[-1][0] >= indent:
                path.pop()
            path.append((indent, match.group(2)))
            note = notes.get(".".join(key for _, key in path))
            if note:
                line = f"{line}  # {note}"
        lines.append(line)
    return "\n".join(lines) + "\n"
