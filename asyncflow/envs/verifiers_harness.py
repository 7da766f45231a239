"""The harness asyncflow plays verifiers seats with: verifiers' tool-less `null` chat loop, run in process.

verifiers' own chat harnesses (`null`, `bash`) launch a program in a runtime, prepared with `uv`
from the network; a harness may instead run its loop in process as long as every model call goes
through the interception endpoint it is given (verifiers' `Harness.launch` contract). This one does:

    messages (system prompt, the task's prompt or the accreted conversation)
      └─► chat completion at `endpoint` (bearer `secret`) ─► assistant message
            tool calls? ─► each called on the task's MCP tool servers (verifiers' own MCP client)
                           ─► tool messages ─► next completion ... until a reply without tool calls

Every call reaches asyncflow's per-episode recording endpoint through verifiers' interception
server, so the ids trained are the ids generated. No bash/edit/search tools (the model gets only
the task's toolsets), no context compaction.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from verifiers.v1.clients import ModelContext
from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

MCP_CONNECT_TIMEOUT_S = 60.0


class AsyncflowChatHarnessConfig(HarnessConfig):
    """No knobs: the loop ends at a reply without tool calls (or at the seat's `max_turns`)."""


class AsyncflowChatHarness(Harness[AsyncflowChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: ModelContext, trace: Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: TaskData, tool_interception_url: str | None = None
                     ) -> ProgramResult:
        from openai import AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        # (no retries: a refused call, such as the episode's max turns, ends the loop, not retried)
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                tools, dispatch, servers = await _connect(mcp_urls, self.config.tool_timeout, stack)
                await _chat_loop(client, ctx.model, messages, tools, dispatch, servers)
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")


async def _connect(mcp_urls: dict[str, str], timeout: Any, stack: AsyncExitStack) -> tuple[Any, Any, Any]:
    if not mcp_urls:
        return [], {}, {}
    import asyncio

    from verifiers.v1.harnesses.utils.mcp import connect_mcp

    config = {"mcpServers": {name: {"url": url, "timeout": timeout} for name, url in mcp_urls.items()}}
    return await asyncio.wait_for(connect_mcp(config, stack), MCP_CONNECT_TIMEOUT_S)


async def _chat_loop(client: Any, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                     dispatch: dict[str, Any], servers: dict[str, Any]) -> None:
    """Completions until a reply without tool calls; each call's result goes back as a tool message."""
    from openai import APIStatusError

    while True:
        try:
            completion = await client.chat.completions.create(model=model, messages=messages,
                                                              **({"tools": tools} if tools else {}))
        except APIStatusError as exc:
            if exc.status_code in (409, 429):  # the episode's turns or its staleness ran out: it ends here
                return
            raise
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": await _tool_result(call, dispatch, servers)})


async def _tool_result(call: Any, dispatch: dict[str, Any], servers: dict[str, Any]) -> Any:
    from verifiers.v1.harnesses.utils.mcp import call_mcp

    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: invalid JSON in tool arguments ({exc})"
    if not isinstance(arguments, dict):
        return f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
    if call.function.name not in dispatch:
        return f"error: unknown tool {call.function.name!r}"
    return await call_mcp(servers, dispatch, call.function.name, arguments)


__all__ = ["AsyncflowChatHarness", "AsyncflowChatHarnessConfig"]
