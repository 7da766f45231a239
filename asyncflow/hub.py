"""Hugging Face Hub ids in `model.path`, `dataset.path` and `eval.path`, resolved to a local snapshot.

A local path that exists wins; a value shaped like `org/name` that is not one is a Hub id, fetched by
`huggingface_hub.snapshot_download` into its cache (`HF_HOME` / `HF_HUB_CACHE`), or found there when
`HF_HUB_OFFLINE=1`. It is resolved once, in the driver: every worker gets the snapshot's local path.
Without network and without a cached copy the error is one line saying so (a DNS failure returns in
about a second; huggingface_hub's `HF_HUB_ETAG_TIMEOUT` bounds a silent network).
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncflow.errors import UserError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt", ".py", ".yaml")  # a missing file, not an id
# weight formats asyncflow never reads (a repository can hold the same weights in several), and code:
# asyncflow never runs a repository's own code (no trust_remote_code), so a snapshot holds none
_IGNORED = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "*.gguf", "*.tflite", "original/*", "onnx/*",
            "*.py", "*.pyc", "*.so"]


def hub_id(value: str) -> str | None:
    """`value` if it is a Hub id (`org/name`, not an existing local path), else None."""
    if not _HUB_ID.match(value) or value.lower().endswith(_FILE_SUFFIXES) or Path(value).expanduser().exists():
        return None
    return value


def snapshot(repo_id: str, key: str, *, dataset: bool = False) -> Path:
    """The local snapshot folder of Hub repository `repo_id` (downloaded, or from the cache)."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    kind = "dataset" if dataset else "model"
    where = f"Hugging Face Hub {kind} id"
    try:
        return Path(huggingface_hub.snapshot_download(
            repo_id, repo_type=kind, ignore_patterns=None if dataset else _IGNORED))
    except errors.LocalEntryNotFoundError:
        cache = constants.HF_HUB_CACHE
        if constants.HF_HUB_OFFLINE:
            raise UserError(f"{key}: {repo_id} is not a local path; as a {where} it is not cached in {cache}, and "
                            "HF_HUB_OFFLINE is set (offline): download it once with network access") from None
        raise UserError(f"{key}: {repo_id} is not a local path; as a {where} it is not cached in {cache}, and the "
                        "Hub is not reachable (no network?): download it once with network access, or set "
                        "HF_HOME / HF_HUB_CACHE to a cache that holds it") from None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError) as exc:
        raise UserError(f"{key}: {repo_id} is not a local path, nor a {where} this machine may read "
                        f"({type(exc).__name__}: no such repository, or a private or gated one: log in with "
                        "`hf auth login`)") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{key}: {repo_id}: the {where} could not be fetched ({type(exc).__name__}: {first})") from None
