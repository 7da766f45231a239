"""The read-and-delete part of Tinker's REST API (the SDK's `RestClient`), in the SDK's wire shapes:
server capabilities, training runs (the service's training clients), their checkpoints (listed and
deleted) and sessions. The rest of the REST API is refused with a 404 naming the SDK call.

Listings are newest first; paginated ones read `limit` and `offset` and answer a cursor.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qs, unquote

from asyncflow.errors import UserError
from asyncflow.tinker.checkpoints import KINDS, PREFIX, Entry, PathStore
from asyncflow.tinker.runs import Run, RunStore

CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler"}
CHECKPOINT = r"training_runs/[^/]+/checkpoints/[^/]+/[^/]+"  # (a checkpoint id is KIND/NAME)
# (method, route pattern) -> the SDK call it serves, for the REST calls this service does not support
UNSUPPORTED = [
    ("POST", CHECKPOINT + "/publish", "RestClient.publish_checkpoint_from_tinker_path"),
    ("DELETE", CHECKPOINT + "/publish", "RestClient.unpublish_checkpoint_from_tinker_path"),
    ("PUT", CHECKPOINT + "/ttl", "RestClient.set_checkpoint_ttl_from_tinker_path"),
    ("GET", CHECKPOINT + "/external_weights_urls", "RestClient.get_external_weights_urls"),
    ("POST", r"weights_info", "RestClient.get_weights_info_by_tinker_path"),
    ("POST", r"copy_weights", "RestClient.copy_weights"),
    ("POST", r"save_weights_external", "TrainingClient.save_weights_external"),
    ("PUT", r"sessions/[^/]+/project", "RestClient.assign_session_project"),
    ("GET", r"sessions/[^/]+/trace_export", "RestClient.export_session_trace"),
    ("POST", r"sessions/search", "RestClient.search_sessions"),
    ("GET", r"billing/usage/checkpoints/.*", "RestClient.get_current_checkpoint_storage_usage"),
    ("GET", r"billing/.*", "RestClient.get_billing_usage"),
    ("GET", r"audit", "RestClient.get_audit_log"),
]


class NotFound(Exception):
    """A 404 whose message is the detail."""


@dataclass
class Session:
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    sampler_ids: list[str] = field(default_factory=list)
    finished: bool = False


def unsupported_call(method: str, name: str) -> str | None:
    for verb, pattern, call in UNSUPPORTED:
        if verb == method and re.fullmatch(pattern, name):
            return call
    return None


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat()


def _page(items: list[Any], query: dict[str, list[str]], default_limit: int) -> tuple[list[Any], dict[str, int]]:
    try:
        limit = int(query.get("limit", [default_limit])[0])
        offset = int(query.get("offset", [0])[0])
    except ValueError:
        raise UserError("limit and offset must be integers") from None
    if limit < 0 or offset < 0:
        raise UserError(f"limit ({limit}) and offset ({offset}) must not be negative")
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


class RestApi:
    """Answers the REST routes from the service's runs, checkpoint stores and sessions."""

    def __init__(self, runs: RunStore, checkpoints: PathStore[Any], sampler_weights: PathStore[Any],
                 sessions: dict[str, Session], model_name: str) -> None:
        self.runs, self.sessions, self.model_name = runs, sessions, model_name
        self.stores: dict[str, PathStore[Any]] = {"weights": checkpoints, "sampler_weights": sampler_weights}

    def answer(self, method: str, name: str, query_string: str) -> Any | None:
        """The JSON answer to `method name` (the route under /api/v1), or None for a route not of the
        REST API. Raises NotFound (a 404: a call not supported, or no such run, checkpoint or session)
        or UserError (a bad parameter)."""
        query = parse_qs(query_string)
        parts = [unquote(p) for p in name.split("/")]
        call = unsupported_call(method, name)
        if call is not None:
            raise NotFound(f"{call} ({method} /api/v1/{name}) is not supported by asyncflow tinker-serve")
        if method == "GET" and name == "get_server_capabilities":
            return {"supported_models": [{"model_name": self.model_name, "trainable": True, "sampleable": True}]}
        if method == "GET" and name == "checkpoints":
            entries = sorted(self._entries(), key=lambda e: e.saved_at, reverse=True)
            page, cursor = _page([self._checkpoint(e) for e in entries], query, 100)
            return {"checkpoints": page, "cursor": cursor}
        if parts[0] == "training_runs":
            return self._training_runs(method, parts[1:], query)
        if parts[0] == "sessions" and method == "GET" and len(parts) <= 2:
            return self._sessions(parts[1:], query)
        return None

    def _training_runs(self, method: str, parts: list[str], query: dict[str, list[str]]) -> Any | None:
        if method == "GET" and not parts:
            runs = sorted(self.runs.all(), key=lambda r: r.created, reverse=True)
            page, cursor = _page(runs, query, 20)
            return {"training_runs": [self._run(r) for r in page], "cursor": cursor}
        if method == "GET" and len(parts) == 1:
            return self._run(self._known_run(parts[0]))
        if method == "GET" and parts[1:] == ["checkpoints"]:
            entries = self._entries(parts[0])
            if not entries:
                self._known_run(parts[0])
            return {"checkpoints": [self._checkpoint(e) for e in sorted(entries, key=lambda e: e.saved_at, reverse=True)]}
        if method == "DELETE" and len(parts) == 4 and parts[1] == "checkpoints":
            return self._delete(parts[0], parts[2], parts[3])
        return None

    def _delete(self, run_id: str, kind: str, name: str) -> dict[str, Any]:
        if kind not in KINDS:
            raise UserError(f"delete_checkpoint: checkpoint id {kind}/{name!r}: not weights/NAME or sampler_weights/NAME")
        path = f"{PREFIX}{run_id}/{kind}/{name}"
        try:
            del self.stores[kind][path]
        except KeyError:
            raise NotFound(f"delete_checkpoint: {path!r}: no such checkpoint") from None
        return {}

    def _sessions(self, parts: list[str], query: dict[str, list[str]]) -> Any:
        if not parts:
            page, _ = _page(list(self.sessions)[::-1], query, 20)
            return {"sessions": page}
        session = self.sessions.get(parts[0])
        if session is None:
            raise NotFound(f"get_session: {parts[0]!r}: no such session")
        runs = [r.run_id for r in self.runs.all() if r.run_id.startswith(f"{parts[0]}:train:")]
        return {"training_run_ids": runs, "sampler_ids": list(session.sampler_ids),
                "user_metadata": session.user_metadata, "display_name": session.display_name}

    def _known_run(self, run_id: str) -> Run:
        run = self.runs.get(run_id)
        if run is None:
            raise NotFound(f"get_training_run: {run_id!r}: no such training run")
        return run

    def _entries(self, run_id: str | None = None) -> list[Entry]:
        found = [e for kind, store in self.stores.items() for e in store.entries(kind)]
        return found if run_id is None else [e for e in found if _run_of(e.path) == run_id]

    def _run(self, run: Run) -> dict[str, Any]:
        entries = self._entries(run.run_id)

        def last(kind: str) -> Entry | None:
            return max((e for e in entries if _kind_of(e.path) == kind), key=lambda e: e.saved_at, default=None)

        training, sampler = last("weights"), last("sampler_weights")
        newest = max([run.created, *(e.saved_at for e in entries)])
        return {"training_run_id": run.run_id, "base_model": run.base_model, "model_owner": "asyncflow tinker-serve",
                "is_lora": True, "corrupted": False, "lora_rank": run.lora_rank, "last_request_time": _time(newest),
                "last_checkpoint": training and self._checkpoint(training),
                "last_sampler_checkpoint": sampler and self._checkpoint(sampler),
                "user_metadata": run.user_metadata}

    @staticmethod
    def _checkpoint(entry: Entry) -> dict[str, Any]:
        _, kind, name = entry.path.removeprefix(PREFIX).split("/", 2)
        return {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": CHECKPOINT_TYPES[kind],
                "time": _time(entry.saved_at), "tinker_path": entry.path, "size_bytes": entry.size_bytes,
                "public": False}


def _run_of(path: str) -> str:
    return path.removeprefix(PREFIX).split("/", 2)[0]


def _kind_of(path: str) -> str:
    return path.removeprefix(PREFIX).split("/", 2)[1]
