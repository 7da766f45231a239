"""A GGUF file (llama.cpp's format) turned into an ordinary Hugging Face model folder, once.

Why a folder: every part of a run (rollout engines, the trainer, FSDP ranks, Ray actors, the server)
loads `from_pretrained(folder)`, and a model that transformers loads from a GGUF is marked quantized,
so `save_pretrained` on it refuses ("quantized with gguf ... not serializable") and training could
never write a checkpoint. The conversion dequantizes the weights once (transformers with the `gguf`
package), rebuilds a plain model from the cleaned config (no `quantization_config`), and saves it in
float32 with the GGUF's own tokenizer and chat template. `model.path: x.gguf` is converted into
`model.cache_dir`, keyed by the file's sha256, and the run uses that folder everywhere.

The file checks here (exists, GGUF magic) and the package check import neither torch nor gguf.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import create_dir_atomic
from asyncflow.errors import UserError

Log = Callable[[str], None]

GGUF_MAGIC = b"GGUF"
GGUF_EXTRA = "pip install 'asyncflow[gguf]'"
# what reading a GGUF needs beyond asyncflow's own dependencies: transformers reads it with `gguf`
# and refuses `from_pretrained(..., gguf_file=...)` without `accelerate`
GGUF_PACKAGES = ("gguf", "accelerate")
FORMAT = 1
"""Version of the conversion, part of a cached folder's name: a change to what is written re-converts."""
SOURCE_FILE = "asyncflow_source.json"
"""Written into a converted folder: the GGUF it came from (name, sha256) and the library versions."""
_DROPPED_CONFIG_KEYS = ("quantization_config", "_model_name_or_path")  # (the GGUF's marks, see above)


def is_gguf_path(value: str) -> bool:
    """Whether `model.path` names a GGUF file (by its suffix)."""
    return value.lower().endswith(".gguf")


def check_gguf_file(path: str | Path, key: str = "model.path") -> Path:
    """The path, if it is a readable file that starts with the GGUF magic bytes; else `UserError`."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{key}: {p} does not exist")
    if not p.is_file():
        raise UserError(f"{key}: {p} is a folder, not a GGUF file")
    try:
        with p.open("rb") as fh:
            head = fh.read(4)
    except OSError as exc:
        raise UserError(f"{key}: {p}: cannot be read ({exc.strerror or exc})") from None
    if head != GGUF_MAGIC:
        raise UserError(f"{key}: {p} is not a GGUF file (it starts with {head!r}, not {GGUF_MAGIC!r})")
    return p


def require_gguf_packages(what: str) -> None:
    """`UserError` naming the extra to install when a package reading GGUF files needs is missing."""
    missing = [name for name in GGUF_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"{what}: reading a GGUF file needs the {' and '.join(missing)} package"
                        f"{'s' if len(missing) > 1 else ''}: {GGUF_EXTRA}")


def sha256_file(path: Path) -> str:
    """The file's sha256, hex (read in 1 MiB blocks: about 1 GB/s here)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def cached_folder(gguf: Path, cache_root: Path, log: Log, key: str = "model.path") -> Path:
    """The Hugging Face folder converted from `gguf`, in `cache_root/gguf/`, converted on first use.

    Keyed by the file's content (sha256, about 0.1 s per 100 MB): a copied or renamed file finds its
    folder, and a file rewritten in place (even with its old size and mtime) never gets a stale one.
    A folder is complete once it exists (built beside it and renamed into place)."""
    require_gguf_packages(key)
    digest = sha256_file(gguf)
    out = cache_root / "gguf" / f"{digest[:24]}-f{FORMAT}"
    if out.is_dir():
        return out
    log(f"[asyncflow] {key}: converting {gguf} ({gguf.stat().st_size / 1e6:.0f} MB) into a Hugging Face folder, "
        f"once: {out}")
    start = time.monotonic()
    create_dir_atomic(out, lambda folder: convert_gguf(gguf, folder, log=log, key=key, sha256=digest))
    log(f"[asyncflow] {key}: converted in {time.monotonic() - start:.0f} s")
    return out


def convert_gguf(gguf: Path, folder: Path, *, log: Log, key: str = "model.path", sha256: str | None = None,
                 source: dict[str, Any] | None = None) -> None:
    """Write the Hugging Face folder of `gguf` into `folder` (an existing, empty one): config.json
    without the GGUF's quantization marks, float32 safetensors, generation_config.json (BOS, EOS and
    pad from the GGUF; pad defaults to EOS), the GGUF's tokenizer and chat template, and
    `asyncflow_source.json` (`source` adds to it). An architecture or quantization transformers cannot
    read is `UserError` naming `key`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    where, name = str(gguf.parent), gguf.name
    log(f"  reading the tokenizer and the weights of {name} (dequantized to float32) ...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32, **_dequantized())
    except (ValueError, NotImplementedError, KeyError, IndexError) as exc:  # (the file's content: bad input)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{key}: {gguf}: transformers cannot convert this GGUF ({type(exc).__name__}: {first}); "
                        "the architectures and quantizations it reads: docs/tasks.md") from None
    model = _plain_copy(loaded)
    del loaded
    _align_special_tokens(tokenizer, model.generation_config)
    tokenizer.model_max_length = getattr(model.config, "max_position_embeddings", tokenizer.model_max_length)
    log(f"  read {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({model.config.model_type}) in {time.monotonic() - start:.0f} s; saving")
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    info = {"gguf": name, "gguf_sha256": sha256 or sha256_file(gguf), "format": FORMAT,
            "built_with": _versions(), **(source or {})}
    (folder / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _dequantized() -> dict[str, Any]:
    """`from_pretrained` arguments that make transformers unpack every weight (where it can also keep a
    GGUF's blocks packed, with the `kernels` package, it would otherwise, and those cannot be saved)."""
    try:
        from transformers import GgufConfig  # type: ignore[attr-defined]
    except ImportError:  # (transformers before GgufConfig: always dequantized)
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _plain_copy(loaded: Any) -> Any:
    """A model built from `loaded`'s config without the GGUF's marks, holding `loaded`'s float32 tensors
    (shared, not copied), tied weights tied again, and a generation config of the GGUF's special ids.
    For saving only: built on the meta device, its non-persistent buffers (rotary frequencies) stay
    there, and `from_pretrained` of the saved folder rebuilds them."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    data = {k: v for k, v in loaded.config.to_dict().items() if k not in _DROPPED_CONFIG_KEYS}
    config = type(loaded.config).from_dict(data)
    state = loaded.state_dict()
    bad = sorted(k for k, v in state.items() if not v.is_floating_point())
    if bad:  # (blocks kept packed: a transformers that ignores the dequantize request)
        raise RuntimeError(f"transformers left GGUF weights packed ({bad[0]}, ...); they cannot be saved")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else eos
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=pad)
    return model.eval()


def _align_special_tokens(tokenizer: Any, generation: Any) -> None:
    """The tokenizer's BOS, EOS and pad tokens set to the GGUF's ids (`tokenizer.ggml.*_token_id`, which
    the model's config holds): transformers' GGUF tokenizer converter has named other tokens (5.10 gave
    SmolLM2 `<|im_start|>` as EOS, where the file says `<|im_end|>`)."""
    for attr, token_id in (("bos_token", generation.bos_token_id), ("eos_token", generation.eos_token_id),
                           ("pad_token", generation.pad_token_id)):
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(token_id))


def _versions() -> dict[str, str]:
    import importlib.metadata

    return {name: importlib.metadata.version(name) for name in ("transformers", "torch", "gguf")}
