"""Checking a Hugging Face model folder (config.json, weight files) before torch or transformers load it.

Why: a wrong `model.path` is the most common bad input of a run, and transformers reports it (after
seconds of imports) as a multi-line traceback from deep inside `from_pretrained`. Everything here is
plain Python — JSON and the safetensors header layout — so a missing folder, a folder without
config.json, absent weights or a truncated/corrupt weight file costs milliseconds and ends with one
line naming the file. A tokenizer is only checked for a vocabulary file here (transformers quietly
builds an empty one from a folder without any); whether it loads is checked where it is loaded
(`tokenizer.load_tokenizer`).
"""

from __future__ import annotations

import json
import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError

# bytes per element of the safetensors dtypes (format spec: github.com/huggingface/safetensors)
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


def check_model_dir(path: str | Path, *, key: str = "model.path") -> Path:
    """The folder, if it holds a readable config.json and complete weight files; else `UserError`."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{key}: {p} does not exist")
    if not p.is_dir():
        raise UserError(f"{key}: {p} is a file, not a Hugging Face model folder")
    config = p / "config.json"
    if not config.is_file():
        raise UserError(f"{key}: {p} is not a Hugging Face model folder (no config.json)")
    data = _read_json(config, key)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise UserError(f"{key}: {config} has no 'model_type' (not a transformers model config)")
    _check_weights(p, key)
    _check_tokenizer_files(p, key)
    return p


# files that hold a vocabulary; transformers builds an *empty* tokenizer from a folder without any
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _check_tokenizer_files(folder: Path, key: str) -> None:
    if any((folder / name).is_file() for name in _VOCAB_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise UserError(f"{key}: {folder} has no tokenizer ({', '.join(_VOCAB_FILES[:3])}, ...); save the "
                    "tokenizer into the model folder")


def _read_json(path: Path, key: str) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{key}: {path}:{exc.lineno}: malformed JSON ({exc.msg})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{key}: {path}: cannot be read ({exc})") from None


def _check_weights(folder: Path, key: str) -> None:
    """Single-file or sharded safetensors (preferred by transformers), else PyTorch .bin files."""
    for index_name, check in (("model.safetensors.index.json", check_safetensors),
                              ("pytorch_model.bin.index.json", _check_torch_bin)):
        index = folder / index_name
        if index.is_file():
            data = _read_json(index, key)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{key}: {index} has no 'weight_map'")
            for shard in sorted(set(map(str, weight_map.values()))):
                shard_path = folder / shard
                if not shard_path.is_file():
                    raise UserError(f"{key}: {shard_path} is listed in {index_name} but missing")
                check(shard_path, key)
            return
    if (folder / "model.safetensors").is_file():
        check_safetensors(folder / "model.safetensors", key)
        return
    if (folder / "pytorch_model.bin").is_file():
        _check_torch_bin(folder / "pytorch_model.bin", key)
        return
    raise UserError(f"{key}: {folder} has no weights (model.safetensors, pytorch_model.bin or a sharded index)")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [folder / s for s in sorted(set(map(str, weight_map.values())))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, Any] = json.loads(fh.read(n))
    header.pop("__metadata__", None)
    return header


def check_weights_match_config(path: str | Path, *, key: str = "model.path") -> None:
    """Every parameter the folder's config.json implies is in its safetensors files with that shape.

    Needs transformers and torch (the model is built on the meta device: no memory, milliseconds), so
    it runs after the file checks. Without it a weight file of another model fails deep inside
    `from_pretrained` with a traceback, or — a parameter missing from the file — is silently left at
    its random initialisation. Tied parameters are checked once (under the first name); names saved
    without the base model's prefix are found as such (transformers adds it on load); a file with no
    tensor, or none of the model's names, is refused (transformers initialised the whole model at
    random); for a model type whose names transformers converts on load (MoE) only the names both
    have are checked.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    files = _safetensors_files(folder)
    if not files:
        return  # PyTorch .bin weights: transformers checks them
    try:
        config = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # the config itself is the problem: name it, one line
        raise UserError(f"{key}: {folder / 'config.json'} does not describe a causal LM transformers can build: "
                        f"{type(exc).__name__}: {exc}") from None
    expected = {name: list(p.shape) for name, p in model.named_parameters()}  # tied parameters once
    found: dict[str, tuple[list[int], Path]] = {}
    for f in files:
        for name, info in _header(f).items():
            found[name] = ([int(d) for d in info["shape"]], f)
    if not found:  # (from_pretrained initialised every parameter at random, without a word)
        raise UserError(f"{key}: {folder}'s weights ({', '.join(f.name for f in files)}) hold no tensors")
    renamed = _renames_on_load(config.model_type)
    # a checkpoint saved without the base model's prefix ("layers.0..." for "model.layers.0...", the
    # head keeping its name) gets the prefix from transformers on load: its names are looked up both ways
    prefix = f"{getattr(model, 'base_model_prefix', '') or '-'}."
    stored = {name: name if name in found else name.removeprefix(prefix) for name in expected}
    if not any(n in found for n in stored.values()):
        if renamed:
            return  # (names converted on load: left to transformers)
        # another model's weights: from_pretrained served and trained the model at random weights
        raise UserError(f"{key}: {folder}'s weights share no tensor name with the {config.model_type!r} model "
                        f"its config.json describes (e.g. {min(found)!r}, where it has {min(expected)!r}); "
                        "the weights are of another model")
    for name, shape in expected.items():
        if stored[name] not in found:
            if renamed:  # (MoE experts: stored per expert, fused into one parameter when loaded)
                continue
            raise UserError(f"{key}: {folder} has no tensor {name!r}, which its config.json implies "
                            f"(shape {shape}); the weights are of another model or incomplete")
        got, f = found[stored[name]]
        if got != shape:
            raise UserError(f"{key}: {f}: tensor {stored[name]!r} has shape {got}, but config.json implies {shape}; "
                            "the weights are of another model")


def _renames_on_load(model_type: str) -> bool:
    """Whether transformers converts this model type's checkpoint names on load (Mixtral, Qwen2-MoE,
    OLMoE, DeepSeek-V3: per-expert tensors become fused parameters). Their names then differ from
    the model's by design: only the names both have are compared (every such folder was refused)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # (transformers before 5: no renaming on load)
        return False
    try:
        return bool(get_checkpoint_conversion_mapping(model_type))
    except Exception:
        return True  # unknown: do not refuse what transformers may well load


def check_safetensors(path: Path, key: str = "model.path") -> None:
    """The file's header parses and its tensors exactly fill the data that follows (no truncation)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise UserError(f"{key}: {path} is corrupt (shorter than a safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n == 0 or n > _MAX_HEADER_BYTES or 8 + n > size:
            raise UserError(f"{key}: {path} is corrupt (header length {n} does not fit a {size}-byte file)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{key}: {path} is corrupt (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise UserError(f"{key}: {path} is corrupt (its header is not a JSON object)")
    data_bytes = size - 8 - n
    end_max = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
            dtype = str(info["dtype"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{key}: {path} is corrupt (bad header entry for tensor {name!r})") from None
        itemsize = _DTYPE_BYTES.get(dtype)
        if not 0 <= begin <= end or (itemsize is not None and end - begin != math.prod(shape) * itemsize):
            raise UserError(f"{key}: {path} is corrupt (tensor {name!r}: offsets {begin}..{end} do not match "
                            f"{dtype}{shape})")
        end_max = max(end_max, end)
    if end_max != data_bytes:
        raise UserError(f"{key}: {path} is corrupt or truncated (header describes {end_max} bytes of tensors, "
                        f"the file holds {data_bytes})")


def _check_torch_bin(path: Path, key: str) -> None:
    """A `torch.save` file: a zip archive (the format since PyTorch 1.6) or a legacy pickle."""
    if zipfile.is_zipfile(path):
        return
    with path.open("rb") as fh:
        if fh.read(1) == b"\x80":  # pickle protocol marker of the legacy format
            return
    raise UserError(f"{key}: {path} is corrupt (neither a torch.save archive nor a pickle)")
