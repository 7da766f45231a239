"""Hugging Face Hub ids in `model.path`, `dataset.path` and `eval.path`, resolved to a local snapshot.

A local path that exists wins. A Hub id is exactly `org/name` (two parts, no file suffix) with no
local match; anything else that does not exist (`./org/name`, `../x`, an absolute path, three parts)
is a missing local path, one line naming the absolute path looked for, never a download. A Hub id
is fetched by `huggingface_hub.snapshot_download` into its cache (`HF_HOME` / `HF_HUB_CACHE`), or
found there when `HF_HUB_OFFLINE=1`. It is resolved once, in the driver: every worker gets the
snapshot's local path. Without network and without a cached copy the error is one line saying so (a
DNS failure returns in about a second; huggingface_hub's `HF_HUB_ETAG_TIMEOUT` bounds a silent network).
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncflow.errors import UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".py", ".yaml")  # a missing file, not an id
# weight formats asyncflow never reads (a repository can hold the same weights in several), and code:
# asyncflow has no trust_remote_code and never runs a repository's own code, so a snapshot holds none
_IGNORED = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.gguf", "*.tflite", "original/*", "onnx/*",
            "*.py", "*.pyc", "*.so"]


def hub_id(value: str) -> str | None:
    """`value` if it is a Hub id (`org/name`, not an existing local path), else None."""
    if not _HUB_ID.match(value) or value.lower().endswith(_FILE_SUFFIXES) or Path(value).expanduser().exists():
        return None
    return value


def local_path(value: str, key: str) -> Path:
    """`value` as a local path that exists (for a value that is not a Hub id); else one line naming
    the absolute path looked for and why `value` was not taken as a Hub id."""
    path = Path(value)
    if path.exists():
        return path
    raise UserError(f"{key}: {value} does not exist (looked for {path.resolve()}); not taken as a Hugging Face "
                    f"Hub id: {_why_not_an_id(value)} (a Hub id is org/name, with no local folder of that name)")


def _why_not_an_id(value: str) -> str:
    if value.startswith(("./", "../")) or value in (".", ".."):
        return f"it starts with {value.split('/')[0] + '/'!r}, a local path"
    if Path(value).is_absolute():
        return "it is an absolute path"
    suffix = next((s for s in _FILE_SUFFIXES if value.lower().endswith(s)), None)
    if suffix is not None:
        return f"it ends in {suffix}, a file name"
    parts = value.strip("/").split("/")
    if len(parts) != 2:
        return f"it has {len(parts)} part{'s' if len(parts) > 1 else ''}"
    return "it has characters no Hub id has"


def hub_note(key: str, repo_id: str, folder: Path | None = None) -> str:
    """The line a run logs for a value read from the Hub (there is no local path of that name)."""
    where = f" into {folder}" if folder is not None else ""
    return (f"[asyncflow] {key}: {repo_id} is read from the Hugging Face Hub{where} (no local path "
            f"{Path(repo_id).resolve()})")


def snapshot(repo_id: str, key: str, *, dataset: bool = False) -> Path:
    """The local snapshot folder of Hub repository `repo_id` (downloaded, or from the cache)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    kind = "dataset" if dataset else "model"
    where = f"Hugging Face Hub {kind} id"
    missing = f"{repo_id} is not a local path (no {Path(repo_id).resolve()})"
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, repo_type=kind, ignore_patterns=None if dataset else _IGNORED))
    except errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{key}: {missing}; as a {where} it is not cached in {cache}, and "
                            "HF_HUB_OFFLINE is set (offline): download it once with network access") from None
        raise UserError(f"{key}: {missing}; as a {where} it is not cached in {cache}, and the "
                        "Hub is not reachable (no network?): download it once with network access, or set "
                        "HF_HOME / HF_HUB_CACHE to a cache that holds it") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as exc:
        raise UserError(f"{key}: {missing}, nor a {where} this machine may read "
                        f"({type(exc).__name__}: no such repository, or a private or gated one: log in with "
                        "`hf auth login`)") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{key}: {repo_id}: the {where} could not be fetched ({type(exc).__name__}: {first})") from None
