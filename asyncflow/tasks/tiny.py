"""Pieces every built-in task pack shares: a char-level tokenizer, a tiny Qwen2, an SFT loop and an
atomic folder writer.

Why one module: each pack (`arith`, `calc`) differs in its problems, transcripts and warm-start
data, not in how its model is built or saved. Keeping the shared parts here means a fix (say, to
the tokenizer shape transformers reloads, or to the atomic rename) lands in every pack at once.
Heavy libraries (torch, transformers, tokenizers) are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Log = Callable[[str], None]


SHIPPED_DIR = Path(__file__).parent / "base_models"
"""Prepared task folders shipped inside the package (built by `scripts/build_base_models.py`)."""
MANIFEST = "asyncflow_task.json"
"""A prepared folder's manifest: the task, seed and warm start, the base model's greedy eval score,
the library versions it was built with and the sha256 of every other file. Written last."""


def default_cache_dir() -> Path:
    """`$ASYNCFLOW_CACHE`, else `~/.cache/asyncflow`."""
    env = os.environ.get("ASYNCFLOW_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "asyncflow"


def char_tokenizer(chars: str, specials: Sequence[str], max_positions: int) -> Any:
    """A character-level `PreTrainedTokenizerFast`: one id per char, no BOS added, decode concatenates.

    `specials` are pad, eos, bos, unk in that order and take ids 0-3. Built as a byte-level BPE with
    a one-char-per-token vocab and no merges, i.e. exactly the shape of a Qwen2 tokenizer:
    transformers 5 loads any `qwen2` folder with its own `Qwen2Tokenizer` (rebuilt from
    `tokenizer.json`'s vocab and merges), and this shape survives that unchanged. A space is stored
    as the byte-level symbol `\u0120`; chars outside the vocab are dropped.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pad, eos, bos, unk = specials
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in chars:
        vocab.setdefault(byte_level.pre_tokenize_str(ch)[0][0], len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = byte_level
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=pad,
        eos_token=eos,
        bos_token=bos,
        unk_token=unk,  # named so a reload as Qwen2Tokenizer adds no default unk token
        clean_up_tokenization_spaces=False,
        model_max_length=max_positions,
    )


def tiny_qwen2(
    tokenizer: Any, *, seed: int, hidden: int, layers: int, max_positions: int, max_new_tokens: int
) -> Any:
    """A tiny float32 Qwen2 with tied embeddings and 4 heads, freshly initialised from `seed`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return model


def pad_batch(pairs: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any]:
    """Right-pad `(ids, labels)` pairs into two `[B, T]` long tensors (labels padded with -100)."""
    import torch

    width = max(len(ids) for ids, _ in pairs)
    ids_t = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    lab_t = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (s, y) in enumerate(pairs):
        ids_t[i, : len(s)] = torch.tensor(s)
        lab_t[i, : len(y)] = torch.tensor(y)
    return ids_t, lab_t


def sft(
    model: Any,
    make_batch: Callable[[random.Random], tuple[Any, Any]],
    *,
    steps: int,
    seed: int,
    lr: float,
    name: str,
    attention_mask_pad: int | None = None,
    log: Log | None = None,
) -> float:
    """Teacher-forced AdamW warm start: `steps` batches from `make_batch(rng)` (rng seeded `seed + 1`),
    20-step linear warm-up, grad-norm clip 1.0. With `attention_mask_pad`, positions holding that id
    are masked out of attention. Logs every ~3 s under `name`; returns the last loss; leaves the
    model in eval mode."""
    import torch

    rng = random.Random(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    start = last_log = time.monotonic()
    loss_value = float("nan")
    for step in range(1, steps + 1):
        ids, lab = make_batch(rng)
        kwargs = {} if attention_mask_pad is None else {"attention_mask": (ids != attention_mask_pad).long()}
        loss = model(input_ids=ids, labels=lab, **kwargs).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_value = loss.item()
        now = time.monotonic()
        if log is not None and (now - last_log >= 3.0 or step == steps):
            log(f"{name} warm start: step {step}/{steps} loss {loss_value:.3f} ({now - start:.1f}s)")
            last_log = now
    model.eval()
    return loss_value


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with torch at `n` threads (capped by the CPU count), restoring the count after:
    a run calls `prepare` after choosing its own thread count."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, os.cpu_count() or 1)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_jsonl(path: Path, rows: list[Row]) -> None:
    with path.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` but the manifest, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def built_with() -> dict[str, str]:
    """The versions of the libraries whose numerics a prepared model depends on."""
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


def write_task_folder(
    out: Path, model: Any, tokenizer: Any, train: list[Row], evals: list[Row], meta: dict[str, Any]
) -> Path:
    """Save the HF model folder plus `train.jsonl`, `eval.jsonl` and the manifest (`meta` with
    `built_with` and `files`) to `out`, atomically: built in a sibling temp dir and renamed into place
    (an existing `out` is replaced), so a half-written folder is never mistaken for a finished one. An
    `out` that is a symbolic link keeps it: the folder it points to is the one built (rmtree refuses a
    link)."""
    if out.is_symlink():
        out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_jsonl(tmp / "train.jsonl", train)
        write_jsonl(tmp / "eval.jsonl", evals)
        meta = {**meta, "built_with": built_with(), "files": file_hashes(tmp)}
        (tmp / MANIFEST).write_text(json.dumps(meta, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def folder_name(task: str, version: int, seed: int, sft_steps: int, default_sft_steps: int) -> str:
    """`TASK-v<version>-seed<seed>[-sft<steps>]`: a prepared folder's name, shipped or cached (a
    non-default `sft_steps` gets its own name: a short warm start is never served as the default)."""
    return f"{task}-v{version}-seed{seed}" + ("" if sft_steps == default_sft_steps else f"-sft{sft_steps}")


def shipped(name: str) -> Path | None:
    """The folder `name` shipped inside the package, or None if it is not shipped."""
    out = SHIPPED_DIR / name
    return out if (out / MANIFEST).is_file() else None


def cached(root: str | Path | None, name: str, build: Callable[[Path], Path]) -> Path:
    """The folder `name`: the one shipped inside the package if there is one, else
    `<root or default cache>/<name>`, built by `build(path)` only when not already complete
    (complete = its manifest exists, which `write_task_folder` writes last)."""
    ship = shipped(name)
    if ship is not None:
        return ship
    out = (Path(root) if root is not None else default_cache_dir()) / name
    if (out / MANIFEST).is_file():
        return out
    return build(out)
