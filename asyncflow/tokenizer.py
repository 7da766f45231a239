"""The model folder's tokenizer, loaded with its checks, and the few facts of it the workflow uses.

A leaf: the runner, the Ray actors, `asyncflow serve` and the stages all load and describe the
tokenizer the same way from here (transformers is imported inside `load_tokenizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.data import generation_stop_ids, model_vocab_size, tokenize_prompt
from asyncflow.errors import UserError


def load_tokenizer(model_dir: Path, log: Callable[[str], None] | None = None, key: str = "model.path") -> Any:
    """The model folder's tokenizer, with a pad token.

    A tokenizer without a pad token gets its EOS token as pad, with a logged note (as TRL does):
    padding here is always masked out by attention and loss masks, so the pad token never counts in
    the model's output or the loss, and EOS stays an ordinary, trained action. Padding is still
    looked up in the embedding, so an EOS or pad id past the model's vocabulary is refused.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # any failure is the folder's: name it, one line
        raise UserError(f"{key}: cannot load a tokenizer from {model_dir}: {type(exc).__name__}: {exc}") from None
    if len(tok) < 2:
        raise UserError(f"{key}: the tokenizer in {model_dir} loaded with an empty vocabulary ({len(tok)} tokens)")
    if tok.eos_token_id is None:
        raise UserError(f"{key}: the tokenizer in {model_dir} has no EOS token; generation could never stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
        if log is not None:
            log(f"[asyncflow] note: the tokenizer in {model_dir} has no pad token; using EOS "
                f"({tok.eos_token!r}, id {tok.eos_token_id}) as pad (padding is masked out)")
    vocab = model_vocab_size(model_dir)
    for role, token, tid in (("EOS", tok.eos_token, tok.eos_token_id), ("pad", tok.pad_token, tok.pad_token_id)):
        if vocab is not None and tid >= vocab:  # (padding is masked, but still looked up in the embedding:
            # the engine's decode thread died of an IndexError and every request failed)
            raise UserError(f"{key}: the tokenizer's {role} token {token!r} has id {tid}, past the model's {vocab}-token "
                            f"vocabulary (config.json vocab_size); resize the model's embeddings to the tokenizer "
                            "(model.resize_token_embeddings(len(tokenizer))) or use the model's own tokenizer")
    return tok


@dataclass
class Tokenizer:
    """The few tokenizer facts the workflow needs (kept apart so tests can pass a plain object)."""

    hf: Any
    eos_token_id: int
    pad_token_id: int
    # other ids that end a generation (generation_config.json's, `data.generation_stop_ids`)
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.ends = frozenset((self.eos_token_id, *self.stop_ids))  # what a finished response ends with

    @classmethod
    def of(cls, hf: Any, model_dir: str | Path) -> Tokenizer:
        """The facts of `hf` (a `load_tokenizer` tokenizer), with the stop ids of `model_dir`."""
        eos = int(hf.eos_token_id)
        return cls(hf, eos, int(hf.pad_token_id), generation_stop_ids(model_dir, eos))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=True))

    def prompt_ids(self, prompt: Any) -> list[int]:
        """Token ids of a dataset prompt (text as it is, chat messages through the chat template)."""
        return tokenize_prompt(self.hf, prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of environment text (no special tokens), appended at the id level: generated
        tokens are never re-tokenized."""
        return [int(i) for i in self.hf(text, add_special_tokens=False)["input_ids"]] if text else []

    def completions(self, responses: Sequence[Sequence[int]], conversational: bool) -> list[Any]:
        """Completions as a TRL reward function receives them: text without the final EOS (or other
        stop token), or for conversational prompts a one-message assistant turn."""
        ends = self.ends
        texts = [self.decode(ids[:-1] if len(ids) and ids[-1] in ends else ids) for ids in responses]
        return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
