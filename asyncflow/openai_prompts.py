"""A request's prompts as both OpenAI-compatible servers (`asyncflow serve`, the agent proxy) take
them: judged by their counts and lengths before they are converted, then converted to token ids.

Converting is the expensive part (tokenizing, rendering a chat template), and a 64 MiB body can
hold millions of prompts or one text of millions of tokens; so a request is refused from what can be
counted without converting it: how many prompts, how long each token-id list, how many characters
each text. A text's bound is sound for the tokenizers of causal LMs (byte-level BPE, SentencePiece):
no token stands for more characters than its longest vocabulary entry (`longest_token_chars`).
"""

from __future__ import annotations

import functools
from typing import Any

from asyncflow.openai_wire import RequestError, flatten_content


def prompt_list(prompt: Any) -> list[Any]:
    """A completion request's prompts as they came (nothing converted): one text or token-id list
    (told by its first item), or a non-empty list of those; each one's items are checked as it is
    converted, so a list too long to fit is refused without a look at them."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestError("prompt: expected text, a list of token ids, or a non-empty list of those", param="prompt")
    return prompt


def longest_token_chars(tok: Any) -> int | None:
    """The most characters one token of `tok` stands for: its longest vocabulary entry (a byte-level
    entry spells each byte as one character, and a text has no more characters than bytes); None for
    a tokenizer whose vocabulary cannot be read (its texts are then not judged by length)."""
    if not callable(getattr(tok, "get_vocab", None)):
        return None
    try:
        return _longest_entry(tok)
    except TypeError:  # (a tokenizer that cannot be a cache key)
        return _longest_entry.__wrapped__(tok)


@functools.lru_cache(maxsize=8)
def _longest_entry(tok: Any) -> int:
    return max((len(str(entry)) for entry in tok.get_vocab()), default=1)


def fits(prompt: str | list[Any], room: int, chars_per_token: int | None) -> bool:
    """Whether a prompt may fit `room` tokens, judged without converting it: a token-id list by its
    length, a text by its characters (`longest_token_chars`; None: any text may fit)."""
    if isinstance(prompt, str):
        return chars_per_token is None or len(prompt) <= max(room, 0) * chars_per_token
    return len(prompt) <= room


def chat_messages(messages: Any, room: int | None = None) -> list[dict[str, Any]]:
    """A chat request's messages, checked, each one's content parts as one text; more messages than
    `room` tokens are refused before any is looked at (a chat template renders each message to one
    token at least: its role)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content} objects", param="messages")
    if room is not None and len(messages) > max(room, 0):
        raise RequestError(f"messages: {len(messages)} messages cannot fit the {room} tokens the model's context "
                           "leaves", param="messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise RequestError("messages: expected a non-empty list of {role, content} objects", param="messages")
    return [flatten_content(m, i) for i, m in enumerate(messages)]


def chat_ids(tok: Any, messages: list[dict[str, Any]], *, generation_prompt: bool, room: int | None = None,
             chars_per_token: int | None = None, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The token ids of `messages` rendered with `tok`'s chat template; a conversation whose text
    cannot fit `room` tokens is refused before it is tokenized. The characters of its strings are
    counted first; only when they pass the bound is the text rendered to be measured (a template may
    leave some out), so the usual request renders once."""
    extra = {"tools": tools} if tools else {}
    try:
        if room is not None and chars_per_token is not None and \
                text_chars([messages, tools]) > max(room, 0) * chars_per_token:
            text = str(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                               **extra))
            if not fits(text, room, chars_per_token):
                raise RequestError(f"messages: the conversation ({len(text)} characters) cannot fit the {room} tokens "
                                   f"the model's context leaves (a token here is at most {chars_per_token} characters)",
                                   param="messages")
        ids = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **extra)
    except RequestError:
        raise
    except Exception as exc:
        raise RequestError(f"messages: the chat template failed: {exc}", param="messages") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def text_chars(value: Any) -> int:
    """The characters of all strings in a parsed JSON value (keys included), without recursion."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            count += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count
