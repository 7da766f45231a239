"""The training runs a Tinker service knows (its training clients), as the SDK's REST calls list them:
base model, LoRA rank, the `user_metadata` given when created, and when.

Without a folder they live in this process's memory. With one (`--state-dir`), each run is also a
small JSON file there, written when the client is created, so a restarted service still answers for
the runs whose checkpoints it finds:

    DIR/runs/<model id>.json    {"base_model", "lora_rank", "user_metadata", "created"}
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from asyncflow.atomic_files import is_temporary, write_text_atomic


@dataclass(frozen=True)
class Run:
    run_id: str
    base_model: str
    lora_rank: int | None
    user_metadata: dict[str, str] | None
    created: float  # Unix seconds


def metadata(value: Any) -> dict[str, str] | None:
    """A request's `user_metadata` as the SDK's responses type it (string values), or None."""
    if not isinstance(value, dict):
        return None
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in value.items()}


class RunStore:
    """Runs by model id: in memory, and (`folder`) each in a file under folder/runs."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = None if folder is None else folder / "runs"
        self._runs: dict[str, Run] = {}
        self._lock = threading.Lock()

    def add(self, run_id: str, base_model: str, lora_rank: int | None, user_metadata: dict[str, str] | None) -> Run:
        run = Run(run_id, base_model, lora_rank, user_metadata, time.time())
        with self._lock:
            self._runs[run_id] = run
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            fields = {k: v for k, v in asdict(run).items() if k != "run_id"}
            write_text_atomic(self.folder / (quote(run_id, safe="") + ".json"), json.dumps(fields))
        return run

    def get(self, run_id: str) -> Run | None:
        with self._lock:
            if run_id in self._runs:
                return self._runs[run_id]
        if self.folder is None:
            return None
        return self._read(self.folder / (quote(run_id, safe="") + ".json"))

    def all(self) -> list[Run]:
        """Every run, oldest first: this process's and, with a folder, those of earlier processes."""
        with self._lock:
            runs = dict(self._runs)
        if self.folder is not None and self.folder.is_dir():
            for file in self.folder.glob("*.json"):
                if is_temporary(file):
                    continue
                run = self._read(file)
                if run is not None:
                    runs.setdefault(run.run_id, run)
        return sorted(runs.values(), key=lambda r: (r.created, r.run_id))

    @staticmethod
    def _read(file: Path) -> Run | None:
        """The run in `file`, or None where there is none or it cannot be read (not written here)."""
        try:
            data = json.loads(file.read_text())
            rank = data.get("lora_rank")
            return Run(unquote(file.name.removesuffix(".json")), str(data["base_model"]),
                       None if rank is None else int(rank), metadata(data.get("user_metadata")),
                       float(data["created"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
