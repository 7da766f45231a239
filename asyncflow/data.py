"""Datasets: reading prompt rows (jsonl, parquet, a saved `datasets` folder) and tokenizing prompts.

Plain-text prompts are tokenized as they are (the tokenizer's own defaults, as TRL does); a chat
template is applied only to conversational prompts (a list of {"role", "content"} messages). Prompts
are tokenized once, here; nothing downstream ever re-tokenizes decoded text.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError


class Rows(list):  # type: ignore[type-arg]
    """Rows read from a JSON-lines file, with each row's line number (1-based, blank lines counted)
    in `lines`, so a message can name the line an editor shows; or a subset of rows of another
    source, with each row's index in it (`row_at`)."""

    lines: list[int]
    row_at: list[int]


_IMMUTABLE = (str, int, float, bool, bytes, type(None))


def private_copy(value: Any) -> Any:
    """`value` itself when immutable (strings and numbers: the usual column), else a deep copy: what a
    reward function, an environment or an agent is handed of a dataset row, so changing it changes
    nothing stored (the row serves every later epoch and the evaluation)."""
    return value if isinstance(value, _IMMUTABLE) else copy.deepcopy(value)


def row_copy(row: dict[str, Any]) -> dict[str, Any]:
    """A copy of a dataset row that shares no mutable value with it (see `private_copy`)."""
    return {k: private_copy(v) for k, v in row.items()}


def subset(rows: Sequence[dict[str, Any]], indices: Sequence[int]) -> list[dict[str, Any]]:
    """Rows `indices` of `rows`, keeping where each came from (for messages): its line in a JSON-lines
    file, else its row in the source (a parquet or datasets row after the eval hold-out was named by
    its position among the rows left)."""
    out = Rows(rows[i] for i in indices)
    lines = getattr(rows, "lines", None)
    if lines is not None:
        out.lines = [lines[i] for i in indices]
    else:
        at = getattr(rows, "row_at", None)
        out.row_at = [at[i] if at is not None else i for i in indices]
    return out


def where(rows: Sequence[Any], path: str | Path, i: int) -> str:
    """Where row `i` of `rows` (read from `path`) is, for a message: "FILE, line N" for JSON lines,
    else "FILE, row I" (counted from 0 in the source, as `datasets` and pandas index rows)."""
    lines = getattr(rows, "lines", None)
    if lines is not None:
        return f"{path}, line {lines[i]}"
    at = getattr(rows, "row_at", None)
    return f"{path}, row {at[i] if at is not None else i}"


def read_rows(path: str | Path, *, key: str = "dataset.path", config: str | None = None) -> list[dict[str, Any]]:
    """All rows of a jsonl / parquet file, a `datasets.save_to_disk` folder (JSON lines as `Rows`) or a
    Hub dataset id (`asyncflow.hub`; `config`: its configuration, dataset.config)."""
    from asyncflow.hub import hub_id, local_path

    repo = hub_id(str(path))
    if repo is not None:
        rows = _read_hub_dataset(repo, key, config)
        if not rows:
            raise UserError(f"{key}: {repo}: the dataset is empty")
        return rows
    p = local_path(str(path), key)
    if p.is_dir():
        rows = _read_datasets_dir(p, key)
    elif p.suffix.lower() in (".jsonl", ".json"):
        rows = _read_jsonl(p)
    elif p.suffix.lower() == ".parquet":
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
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a byte-order mark is no data)
            except UnicodeDecodeError as exc:
                raise UserError(f"{p}:{lineno}: not UTF-8 text (byte {exc.start} of the line: {exc.reason})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # (so an error's column is on this line, not past its end)
            except json.JSONDecodeError as exc:
                raise UserError(f"{p}:{lineno}: malformed JSON ({exc.msg}, column {exc.colno})") from None
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
    return _split_rows(ds, p, key)


def _read_hub_dataset(repo: str, key: str, config: str | None) -> list[dict[str, Any]]:
    """A Hub dataset's rows: its snapshot (`asyncflow.hub.snapshot`), read by `datasets.load_dataset`
    (the repository's configurations and split files as the Hub lays them out)."""
    try:
        import datasets
    except ImportError:
        raise UserError(f"{key}: {repo} is a Hub dataset id; reading one needs `pip install datasets`") from None
    from asyncflow.hub import snapshot

    folder = snapshot(repo, key, dataset=True)
    try:
        ds = datasets.load_dataset(str(folder), name=config)
    except Exception as exc:  # (a missing or unknown configuration, unreadable files)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        hint = "" if config is None else f" with dataset.config={config!r}"
        raise UserError(f"{key}: {repo} (Hub snapshot {folder}) cannot be read{hint}: {type(exc).__name__}: {first}"
                        " (a dataset of several configurations needs dataset.config)") from None
    return _split_rows(ds, repo, key)


def _split_rows(ds: Any, p: Path | str, key: str) -> list[dict[str, Any]]:
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        # dataset.path reads `train`, eval.path `test` then `validation` (it read `train` too: evaluation
        # ran on the training rows when both keys named one folder); a folder of one split gives that one
        wanted = ("test", "validation") if key == "eval.path" else ("train",)
        split = next((s for s in wanted if s in ds), None) or (next(iter(ds)) if len(ds) == 1 else None)
        if split is None:
            raise UserError(f"{key}: {p} holds splits {list(ds)} but no {' or '.join(repr(w) for w in wanted)}")
        ds = ds[split]
    # plain Python rows whatever format was saved with it (`set_format("numpy")` gave numpy labels to
    # the reward function; "pandas" refused text prompts)
    return ds.with_format(None).to_list()


# argument names a reward function is called with besides the dataset's columns (`rewards._kwargs`)
REWARD_ARGUMENTS = frozenset(("prompts", "completions", "completion_ids", "trainer_state"))


def check_columns(rows: list[dict[str, Any]], path: str, prompt_key: str, label_key: str | None,
                  reserved: frozenset[str] = frozenset()) -> str | None:
    """Every row has the prompt column (and the label column if one is configured), and no column
    named in `reserved` (a reward function's own arguments: such a column made every call fail with
    "got multiple values for keyword argument", or replaced `completion_ids` unseen). Returns where
    the first conversational row is (None: all prompts are text), for `check_chat_prompts`."""
    first_chat = None
    reserved = reserved - {prompt_key}  # (the prompt column is passed as `prompts`, not as a column)
    for i, row in enumerate(rows):
        if reserved and not reserved.isdisjoint(row):
            name = min(reserved.intersection(row))
            raise UserError(f"{where(rows, path, i)} has a column {name!r}, a name the reward function is called "
                            f"with for its own argument; rename the column")
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
        if label_key is not None and row[label_key] is None:  # (a parquet gap, a JSON null: every reward of
            # the row's samples was scored against None, i.e. failed or was 0, and the run trained on it)
            raise UserError(f"{where(rows, path, i)}: column {label_key!r} (dataset.label_key) is null; give the "
                            "row a label or drop it (dataset.label_key: null if rows need none)")
    return first_chat


def check_chat_prompts(first_chat: str | None, tokenizer: Any) -> None:
    """Conversational rows need the tokenizer's chat template: refused before the run starts (the
    template is applied only when a prompt is first tokenized, after the run folder exists).
    `first_chat`: where a dataset's first conversational row is (`check_columns`' answer)."""
    if first_chat is not None and getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{first_chat} is a chat conversation, but the tokenizer (model.path) has no chat "
                        "template; give text prompts or a model folder whose tokenizer has one")


def _folder_json(model_dir: str | Path, name: str) -> dict[str, Any]:
    """A JSON object file of a model folder (`config.json`, `generation_config.json`); {} when it is
    missing, unreadable or not an object."""
    try:
        value = json.loads((Path(model_dir) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def model_positions(model_dir: str | Path) -> int | None:
    """How many positions the model in `model_dir` was built for (its config.json's
    `max_position_embeddings`, or GPT-2's `n_positions`); None when it does not say, or when it
    scales its rotary positions (`rope_scaling`, e.g. YaRN: the stored number is not its limit)."""
    config = _folder_json(model_dir, "config.json")
    if config.get("rope_scaling"):
        return None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def model_vocab_size(model_dir: str | Path) -> int | None:
    """Rows of the model's embedding (its config.json's `vocab_size`; None when it does not say)."""
    value = _folder_json(model_dir, "config.json").get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def generation_stop_ids(model_dir: str | Path, eos_token_id: int) -> tuple[int, ...]:
    """The ids besides the tokenizer's EOS that end a generation: the model folder's
    generation_config.json `eos_token_id` (an id or a list: an instruct model's end-of-turn token,
    e.g. Llama-3's `<|eot_id|>` beside `<|end_of_text|>`), as transformers' `generate`, vLLM and TRL
    stop on them; ids past the model's vocabulary are left out. Empty when the file names none."""
    value = _folder_json(model_dir, "generation_config.json").get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    vocab = model_vocab_size(model_dir)
    out: list[int] = []
    for i in ids:
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i != eos_token_id and i not in out \
                and (vocab is None or i < vocab):
            out.append(i)
    return tuple(out)


def check_prompts_fit(sources: Sequence[tuple[Sequence[Any], str | Path]], prompt_key: str, tokenizer: Any,
                      max_new_tokens: int, positions: int | None, vocab: int | None = None) -> None:
    """Every prompt must tokenize to at least one token (a tokenizer that knows none of its
    characters gives none, and generation cannot start from nothing: it failed mid-run with a
    tensor-shape traceback), and with `rollout.max_new_tokens` it must fit the model's positions:
    past them a model with learned position embeddings fails mid-run (an index error) and a rotary
    one degrades without a word. `sources`: (rows, file) pairs; each refusal is one line naming the
    file and line. (Multi-turn episodes: this checks the dataset prompt only; as observations extend
    it turn by turn, `run_episode` caps each turn at the positions left, `EpisodeSettings.max_context`.)
    With `vocab` (the model's embedding rows), a prompt holding a token id past it (a token added to
    the tokenizer but not to the model) is refused too: it failed mid-run in the embedding lookup."""
    if positions is not None and max_new_tokens >= positions:
        raise UserError(f"rollout.max_new_tokens: {max_new_tokens} leaves no room for a prompt in the model's "
                        f"{positions} positions (model.path's config.json)")
    room = math.inf if positions is None else positions - max_new_tokens
    over, longest = 0, (0, "", "")
    for rows, path in sources:
        prompts = [r[prompt_key] for r in rows]
        text_at = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        lengths: dict[int, tuple[int, int]] = {}  # row -> (tokens, largest id)
        for k in range(0, len(text_at), 4096):  # in chunks, lengths only: one call for the whole dataset
            chunk = text_at[k:k + 4096]         # held every encoding at once (2.2 GB for 100k prompts)
            ids = tokenizer([prompts[i] for i in chunk], return_attention_mask=False)["input_ids"]
            lengths.update(zip(chunk, ((len(x), max(x, default=-1)) for x in ids), strict=True))
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                x = tokenize_prompt(tokenizer, p)
                lengths[i] = (len(x), max(x, default=-1))
        for i, (n, top) in sorted(lengths.items()):
            if n == 0:
                raise UserError(f"{where(rows, path, i)}: column {prompt_key!r} ({_shown(prompts[i])!r}) has no "
                                "tokens with model.path's tokenizer (it knows none of its characters)")
            if vocab is not None and top >= vocab:
                raise UserError(f"{where(rows, path, i)}: column {prompt_key!r} ({_shown(prompts[i])!r}) has token id "
                                f"{top}, past the model's {vocab}-token vocabulary (config.json vocab_size): the "
                                "tokenizer has tokens the model's embedding lacks")
            if n > room:
                over += 1
                if n > longest[0]:
                    longest = (n, where(rows, path, i), _shown(prompts[i]))
    if over:
        raise UserError(
            f"rollout.max_new_tokens: {over} prompt(s) leave less room than {max_new_tokens} new tokens in the "
            f"model's {positions} positions; the longest has {longest[0]} tokens ({longest[1]}: {longest[2]!r}); "
            "lower rollout.max_new_tokens or drop the long prompts")


def _shown(prompt: Any) -> str:
    shown = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False, default=str)
    return shown if len(shown) <= 60 else shown[:57] + "..."


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
