"""Tool calls parsed back from a model's text, one parser per chat-template family, for the agent
proxy's `tools`: the template renders the tools into the prompt, the model writes its calls in the
family's format, and the reply gives them as OpenAI `message.tool_calls` (the recorded token ids are
the generated ids either way). A leaf module.

- Qwen 2.5/3 and Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  text around them is the message content.
- Llama 3.1-3.3: the whole reply is one JSON object `{"name": ..., "parameters": {...}}` (several
  separated by `;`), optionally after `<|python_tag|>`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

# text -> (content or None, tool calls as OpenAI objects)
ToolParser = Callable[[str], "tuple[str | None, list[dict[str, Any]]]"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name or not isinstance(arguments, (dict, str)):
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Qwen/Hermes `<tool_call>` blocks; a block that is not a JSON call stays in the content."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _HERMES.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            continue
        call = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
        if call is not None:
            calls.append(call)
            kept.append(text[last:match.start()])
            last = match.end()
    content = ("".join(kept) + text[last:]).strip()
    return (content or None) if calls else text, calls


def parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3.x JSON calls: the reply is `{"name", "parameters"}` objects (`;`-separated), or text."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text, []
    try:
        parts = [json.loads(body)]
    except ValueError:  # (several calls)
        parts = body.split(";")
    calls = []
    for part in parts:
        try:
            obj = json.loads(part) if isinstance(part, str) else part
        except ValueError:
            return text, []
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments"))) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    return (None, calls) if calls else (text, [])


def tool_parser(chat_template: str | None) -> ToolParser | None:
    """The parser for the family this chat template belongs to, or None (a template without tools)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return parse_hermes
    if "<|start_header_id|>" in template and "parameters" in template:
        return parse_llama3
    return None
