"""The configuration reference (docs/configuration.md), generated from the typed tree's field docs and
the task packs' defaults."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from asyncflow.config_schema import Config, section_type, type_name


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf field: the generated configuration reference."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        section = section_type(tp)
        if section is not None and section is not tp:  # an optional section: its own row, then its keys
            rows.append((f"{prefix}{f.name}", "mapping or null", None, f.metadata.get("doc", "")))
        if section is not None:
            rows += field_docs(section, f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", type_name(tp), f.default, f.metadata.get("doc", "")))
    return rows


def reference_markdown() -> str:
    """docs/configuration.md, generated from the typed config (a test keeps the file in sync)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `asyncflow/config_schema.py` and the task packs in `asyncflow/tasks/` (`python -c \"from asyncflow.config import reference_markdown as r; print(r(), end='')\" > docs/configuration.md`).",
        "Precedence: built-in defaults < the task pack's defaults < the YAML file < `--set key.path=value`.",
        "Unknown keys, wrong types, out-of-range values and contradictory settings are refused (exit 2).",
        "",
    ]
    section = None
    for key, type_text, default, doc in field_docs():
        head = key.split(".")[0] if "." in key else "(top level)"
        if head != section:
            section = head
            lines += ["", f"## {head}", "", "| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        lines.append(f"| `{key}` | {type_text} | `{_shown(default)}` | {doc} |")
    return "\n".join(lines + task_pack_lines()) + "\n"


def task_pack_lines() -> list[str]:
    """The reference's last section: what each task pack sets, generated from the packs themselves."""
    from asyncflow.tasks import TASK_NAMES, get_task

    lines = [
        "",
        "## Task packs",
        "",
        "`task: NAME` names a built-in task pack (docs/tasks.md). With `model.path`, `dataset.path` and `reward.fn` "
        "null it supplies its own model, prompts and verifier; and each key below that the YAML file and `--set` do "
        "not give takes the pack's value instead of the default in the tables above. `asyncflow config` marks those "
        "values `# from task NAME`. With `task: null` (the default) no pack applies.",
    ]
    for name in TASK_NAMES:
        pack = get_task(name)
        lines += ["", f"### {name}", "", pack.description, "", "| key | value |", "| --- | --- |"]
        lines += [f"| `{key}` | `{_shown(value)}` |" for key, value in _leaf_items(pack.defaults)]
    return lines


def _leaf_items(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in d.items():
        out += _leaf_items(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out


def _shown(value: Any) -> str:
    """A value as the reference's tables write it (YAML's spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)
