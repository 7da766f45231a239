"""Datasets: reading prompt rows (jsonl, parquet, a saved `datasets` folder) and tokenizing prompts.

Plain-text prompts are tokenized as they are (the tokenizer's own defaults, as TRL does); a chat
template is applied only to conversational prompts (a list of {"role", "content"} messages). Prompts
are tokenized once, here; nothing downstream ever re-tokenizes decoded text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError


class Rows(list):  # type: ignore[type-arg]
    """Rows read from a JSON-lines file, with each row's line number (1-based, blank lines counted)
    in `lines`, so a message can name the line an editor shows."""

    lines: list[int]


def where(rows: list[dict[str, Any]], path: str | Path, i: int) -> str:
    """Where row `i` of `rows` (read from `path`) is, for a message: "FILE, line N" for JSON lines,
    else "FILE, row I" (counted from 0, as `datasets` and pandas index rows)."""
    lines = getattr(rows, "lines", None)
    return f"{path}, line {lines[i]}" if lines is not None else f"{path}, row {i}"


def read_rows(path: str | Path, *, key: str = "dataset.path") -> list[dict[str, Any]]:
    """All rows of a jsonl / parquet file or a `datasets.save_to_disk` folder (JSON lines as `Rows`)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{key}: {p} does not exist")
    if p.is_dir():
        rows = _read_datasets_dir(p, key)
    elif p.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(p)
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as exc:
            raise UserError(f"{p}: not a readable parquet file ({exc})") from None
    else:
        raise UserError(f"{key}: {p} must be .jsonl, .parquet or a saved datasets folder")
    if not rows:
        raise UserError(f"{p}: the dataset is empty")
    return rows


def _read_jsonl(p: Path) -> Rows:
    rows = Rows()
    rows.lines = []
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{p}:{lineno}: not UTF-8 text (byte {exc.start} of the line: {exc.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{p}:{lineno}: malformed JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise UserError(f"{p}:{lineno}: expected a JSON object per line")
            rows.append(row)
            rows.lines.append(lineno)
    return rows


def _read_datasets_dir(p: Path, key: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{key}: {p} is a folder; reading saved datasets needs `pip install datasets`") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as exc:
        raise UserError(f"{key}: {p} is not a saved datasets folder ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{key}: {p} holds splits {list(ds)} but no 'train'")
        ds = ds["train"]
    return list(ds)


def check_columns(rows: list[dict[str, Any]], path: str, prompt_key: str, label_key: str | None) -> str | None:
    """Every row has the prompt column (and the label column if one is configured). Returns where the
    first conversational row is (None: all prompts are text), for `check_chat_prompts`."""
    first_chat = None
    for i, row in enumerate(rows):
        if prompt_key not in row:
            raise UserError(f"{where(rows, path, i)} has no column {prompt_key!r} (dataset.prompt_key); "
                            f"columns: {sorted(row)}")
        prompt = row[prompt_key]
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(isinstance(m, dict) for m in prompt)):
            raise UserError(f"{where(rows, path, i)}: column {prompt_key!r} must be text or a list of chat messages")
        if not prompt:  # an empty prompt has no token to condition on: generation cannot start from it
            raise UserError(f"{where(rows, path, i)}: column {prompt_key!r} is empty")
        if isinstance(prompt, list):
            for j, m in enumerate(prompt):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise UserError(f"{where(rows, path, i)}: column {prompt_key!r} message {j} needs a text 'role' "
                                    f"and 'content'; it has keys {sorted(m)}")
            if first_chat is None:
                first_chat = where(rows, path, i)
        if label_key is not None and label_key not in row:
            raise UserError(f"{where(rows, path, i)} has no column {label_key!r} (dataset.label_key); "
                            f"columns: {sorted(row)}")
    return first_chat


def check_chat_prompts(first_chat: str | None, tokenizer: Any) -> None:
    """Conversational rows need the tokenizer's chat template: refused before the run starts (the
    template is applied only when a prompt is first tokenized, after the run folder exists).
    `first_chat`: where a dataset's first conversational row is (`check_columns`' answer)."""
    if first_chat is not None and getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{first_chat} is a chat conversation, but the tokenizer (model.path) has no chat "
                        "template; give text prompts or a model folder whose tokenizer has one")


def model_positions(model_dir: str | Path) -> int | None:
    """How many positions the model in `model_dir` was built for (its config.json's
    `max_position_embeddings`, or GPT-2's `n_positions`); None when it does not say, or when it
    scales its rotary positions (`rope_scaling`, e.g. YaRN: the stored number is not its limit)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("rope_scaling"):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_prompts_fit(prompts: list[Any], tokenizer: Any, max_new_tokens: int, positions: int | None) -> None:
    """Every prompt plus `rollout.max_new_tokens` must fit the model's positions: past them a model
    with learned position embeddings fails mid-run (an index error) and a rotary one degrades
    without a word. One line naming the longest prompt and how many do not fit. (Multi-turn
    episodes: this checks the dataset prompt only, not the environment's observations that extend
    it turn by turn.)"""
    if positions is None:
        return
    if max_new_tokens >= positions:
        raise UserError(f"rollout.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
                        f"{positions} positions (model.path's config.json)")
    texts = [p for p in prompts if isinstance(p, str)]
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]] if texts else []
    chats = [p for p in prompts if not isinstance(p, str)]
    lengths += [len(tokenize_prompt(tokenizer, c)) for c in chats]
    room = positions - max_new_tokens
    over = sum(n > room for n in lengths)
    if over:
        longest, prompt = max(zip(lengths, [*texts, *chats], strict=True), key=lambda t: t[0])
        shown = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise UserError(
            f"rollout.max_new_tokens: {over} prompt(s) leave less room than {max_new_tokens} new tokens in the "
            f"model's {positions} positions; the longest has {longest} tokens ({shown!r}); lower "
            "rollout.max_new_tokens or drop the long prompts")


def tokenize_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Token ids of a prompt: text as it is, chat messages through the chat template."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("dataset: conversational prompts need a tokenizer with a chat template")
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
