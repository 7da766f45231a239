"""The configuration reference (docs/configuration.md), generated from the typed tree's field docs."""

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
        "Generated from `asyncflow/config_schema.py` (`python -c \"from asyncflow.config import reference_markdown as r; print(r(), end='')\" > docs/configuration.md`).",
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
        shown = "null" if default is None else repr(default) if isinstance(default, str) else str(default).lower() if isinstance(default, bool) else str(default)
        lines.append(f"| `{key}` | {type_text} | `{shown}` | {doc} |")
    return "\n".join(lines) + "\n"
