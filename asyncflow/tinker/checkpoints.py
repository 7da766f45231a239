"""Where a Tinker service keeps its checkpoints: saved states (`save_state`, adapter tensors and AdamW
state) and named sampler weights (`save_weights_for_sampler(name)`), by their `tinker://` path.

Without a folder they live in this process's memory. With one (`--state-dir`), each is a file there,
written when saved (whole or not at all: a temporary file renamed over) and read back whenever its
path is named, so a restarted service finds what an earlier one saved.

    DIR/weights/<model id>/<name>.pt            {"rank", "layers", "tensors", "optimizer", "base_model"}
    DIR/sampler_weights/<model id>/<name>.pt    {"base_model", "adapter", "model_path"}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar
from urllib.parse import quote, unquote

import torch

from asyncflow.atomic_files import is_temporary, replace_file
from asyncflow.errors import UserError
from asyncflow.tinker.sampling import Snapshot
from asyncflow.tinker.training import SavedState

PREFIX = "tinker://"
KINDS = ("weights", "sampler_weights")
V = TypeVar("V")


@dataclass
class StoredState:
    """A saved state and the base model name its client was created with (what a new client from it
    reports when the request names none)."""

    saved: SavedState
    base_model: str


@dataclass(frozen=True)
class Entry:
    """One stored checkpoint as the listings show it: its path, when it was saved (Unix seconds) and
    its file's size (None in memory)."""

    path: str
    saved_at: float
    size_bytes: int | None


def _file(folder: Path, path: str) -> Path | None:
    """`tinker://MODEL_ID/KIND/NAME` -> folder/KIND/MODEL_ID/NAME.pt, the parts %-quoted (no '/'), or
    None for a path of another shape (nothing outside the folder is ever named)."""
    parts = path.removeprefix(PREFIX).split("/", 2) if path.startswith(PREFIX) else []
    if len(parts) != 3 or parts[1] not in KINDS or parts[0] in ("", ".", "..") or not parts[2]:
        return None
    model_id, kind, name = parts
    return folder / kind / quote(model_id, safe="") / (quote(name, safe="") + ".pt")


class PathStore(Generic[V]):
    """Values by `tinker://` path: in memory, or (`folder`) each in a file under it."""

    def __init__(self, folder: Path | None, encode: Callable[[V], dict[str, Any]],
                 decode: Callable[[dict[str, Any]], V]) -> None:
        self.folder, self._encode, self._decode = folder, encode, decode
        self._memory: dict[str, tuple[V, float]] = {}  # path -> (value, when saved)

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        if self.folder is None:
            return path in self._memory
        file = _file(self.folder, path)
        return file is not None and file.is_file()

    def __getitem__(self, path: str) -> V:
        if self.folder is None:
            return self._memory[path][0]
        file = _file(self.folder, path)
        if file is None:
            raise KeyError(path)
        try:
            data = torch.load(file, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, ValueError) as exc:  # (a file not written by this module, or damaged)
            raise UserError(f"{path}: cannot read its checkpoint file under {self.folder}: {type(exc).__name__}: {exc}") from None
        return self._decode(data)

    def __setitem__(self, path: str, value: V) -> None:
        if self.folder is None:
            self._memory[path] = (value, time.time())
            return
        target = _file(self.folder, path)
        if target is None:
            raise UserError(f"{path}: not a tinker://MODEL_ID/weights|sampler_weights/NAME path")
        target.parent.mkdir(parents=True, exist_ok=True)
        encoded = self._encode(value)
        replace_file(target, lambda tmp: torch.save(encoded, tmp))

    def __delitem__(self, path: str) -> None:
        """Forget `path` (its file removed); a KeyError where nothing is stored there."""
        if self.folder is None:
            del self._memory[path]
            return
        file = _file(self.folder, path)
        if file is None or not file.is_file():
            raise KeyError(path)
        file.unlink(missing_ok=True)

    def entries(self, kind: str) -> list[Entry]:
        """What is stored (`kind`: weights or sampler_weights, this store's), in memory or as files
        under the folder, whichever process wrote them."""
        if self.folder is None:
            return [Entry(path, saved_at, None) for path, (_, saved_at) in list(self._memory.items())]
        found = []
        for file in sorted((self.folder / kind).glob("*/*.pt")):
            if is_temporary(file):
                continue
            path = f"{PREFIX}{unquote(file.parent.name)}/{kind}/{unquote(file.name.removesuffix('.pt'))}"
            try:
                stat = file.stat()
            except OSError:  # (deleted while listing)
                continue
            found.append(Entry(path, stat.st_mtime, stat.st_size))
        return found


def _encode_state(state: StoredState) -> dict[str, Any]:
    s = state.saved
    return {"rank": s.rank, "layers": list(s.layers), "tensors": s.tensors, "optimizer": s.optimizer,
            "base_model": state.base_model}


def _decode_state(data: dict[str, Any]) -> StoredState:
    layers = (bool(data["layers"][0]), bool(data["layers"][1]))
    return StoredState(SavedState(int(data["rank"]), layers, data["tensors"], data["optimizer"]), str(data["base_model"]))


def _encode_snapshot(snapshot: Snapshot) -> dict[str, Any]:
    return {"base_model": snapshot.base_model, "adapter": snapshot.adapter, "model_path": snapshot.model_path}


def _decode_snapshot(data: dict[str, Any]) -> Snapshot:
    return Snapshot(str(data["base_model"]), data["adapter"], data["model_path"])


def make_stores(state_dir: Path | None) -> tuple[PathStore[StoredState], PathStore[Snapshot]]:
    """The saved-state store and the sampler-weights store, in memory or under `state_dir`."""
    return (PathStore(state_dir, _encode_state, _decode_state),
            PathStore(state_dir, _encode_snapshot, _decode_snapshot))
