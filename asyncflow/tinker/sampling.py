"""The sampling clients of a Tinker service: a sampler is a frozen snapshot of a training client's
adapter (or the base model), served by an `HFEngine` whose weights are the base model with that adapter
merged in (`lora.merge_into`, through the engine's own `request_weights`).

One engine per snapshot: simple and exact (a sampler keeps its weights while its training client moves
on), and cheap only because the models this serves on CPU are small. At most `max_engines` are kept;
the least recently used one is shut down and rebuilt from its snapshot when sampled again.

    asample ──► job thread ──► engine of the snapshot ──submit x num_samples──► SampleResponse (protobuf)
    compute_logprobs (asample with prompt_logprobs) ──► the same, plus submit_score(prompt)
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow.engines.base import GenRequest, GenResult
from asyncflow.engines.hf import HFEngine
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.tinker.stability import Record, SequenceRecords
from asyncflow.tinker.wire import Sequence, sample_response

MAX_ENGINES = 4
MAX_SESSIONS = 256  # sampling sessions kept (an RL loop makes one per step); the oldest is forgotten first
LOAD_TIMEOUT_S = 120.0  # an engine taking its snapshot's adapter
SAMPLE_TIMEOUT_S = 600.0  # one sample request's generation
DEFAULT_MAX_TOKENS = 64  # where a request names no max_tokens
T = TypeVar("T")


@dataclass
class Snapshot:
    """What a sampling session samples from."""

    base_model: str
    adapter: dict[str, torch.Tensor] | None  # a published adapter (`lora.adapter_state`); None: the base model
    model_path: str | None = None


def _stop_check(stop: Any, tokenizer: Any) -> tuple[Any, list[str]]:
    """Token-id stops as a set, string stops as a list (either may be empty)."""
    if stop is None:
        return frozenset(), []
    items = [stop] if isinstance(stop, str) else list(stop)
    ids = frozenset(int(s) for s in items if isinstance(s, int))
    texts = [s for s in items if isinstance(s, str) and s]
    if texts and tokenizer is None:
        raise UserError("asample: stop strings need the model folder's tokenizer, which did not load")
    return ids, texts


def wait(future: cf.Future[T], timeout_s: float, what: str) -> T:
    """`future`'s result within `timeout_s`, else `WaitTimeout` saying what was waited for."""
    try:
        return future.result(timeout=timeout_s)
    except cf.TimeoutError:
        raise WaitTimeout(f"tinker-serve: {what} did not finish within {timeout_s:g} s") from None


class SamplingPool:
    """Snapshots by sampling session id, and the engines that serve them."""

    def __init__(self, model_dir: Path, tokenizer: Any, eos_ids: list[int], pad_id: int, *, max_engines: int = MAX_ENGINES,
                 max_sessions: int = MAX_SESSIONS, max_batch: int = 64, workers: int = 16,
                 records: SequenceRecords | None = None) -> None:
        """`records`: where samples asked with `record_stability_info` are recorded, by sequence id."""
        self.model_dir, self.tokenizer, self.eos_ids, self.pad_id = model_dir, tokenizer, eos_ids, pad_id
        self.max_engines, self.max_batch = max_engines, max_batch
        self.max_sessions = max_sessions
        self.records = records if records is not None else SequenceRecords()
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self._engines: OrderedDict[str, tuple[HFEngine, cf.Future[float]]] = OrderedDict()
        self._lock = threading.Lock()
        self._uids = itertools.count()
        self._jobs = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tinker-sample")

    def add(self, session_id: str, snapshot: Snapshot) -> None:
        with self._lock:
            self.snapshots[session_id] = snapshot
            while len(self.snapshots) > self.max_sessions:
                old, _ = self.snapshots.popitem(last=False)
                if old in self._engines:
                    self._engines.pop(old)[0].shutdown()

    def get(self, session_id: str) -> Snapshot:
        with self._lock:
            if session_id not in self.snapshots:
                raise UserError(f"sampling_session_id {session_id!r}: no such sampling session (only the newest "
                                f"{self.max_sessions} are kept)")
            return self.snapshots[session_id]

    def engine(self, session_id: str) -> HFEngine:
        """The snapshot's engine, built (and its adapter merged, once) on first use."""
        snapshot = self.get(session_id)
        with self._lock:
            if session_id in self._engines:
                self._engines.move_to_end(session_id)
                engine, ready = self._engines[session_id]
            else:
                engine = HFEngine(self.model_dir, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                  max_batch=self.max_batch, name=f"sampler {session_id}")
                ready = cf.Future()
                if snapshot.adapter is None:
                    ready.set_result(0.0)
                else:
                    ready = engine.request_weights(snapshot.adapter, 1, "swap")
                self._engines[session_id] = (engine, ready)
                while len(self._engines) > self.max_engines:
                    _, (old, _) = self._engines.popitem(last=False)
                    old.shutdown()
        wait(ready, LOAD_TIMEOUT_S, f"sampling session {session_id}: merging its adapter into its engine")
        return engine

    def submit(self, request: dict[str, Any], sequence_ids: list[str] | None = None) -> cf.Future[bytes]:
        """Run one asample request (JSON body) on a job thread; the future gives the SampleResponse bytes.
        `sequence_ids`: one per sample, the ids its sequences are recorded under (`record_stability_info`)."""
        self.get(str(request.get("sampling_session_id")))  # (an unknown session fails the POST, not the future)
        return self._jobs.submit(self._sample, request, sequence_ids)

    def _sample(self, request: dict[str, Any], sequence_ids: list[str] | None = None) -> bytes:
        engine = self.engine(str(request["sampling_session_id"]))
        prompt = [int(t) for c in request["prompt"]["chunks"] for t in c.get("tokens", [])]
        if not prompt:
            raise UserError("asample: the prompt is empty (encoded_text chunks with tokens expected)")
        params = request.get("sampling_params") or {}
        stop_ids, stop_texts = _stop_check(params.get("stop"), self.tokenizer)
        n = int(request.get("num_samples", 1))
        seed = params.get("seed")
        futures = [engine.submit(self._request(prompt, params, stop_ids, stop_texts,
                                               None if seed is None else int(seed) + i)) for i in range(n)]
        scores = engine.submit_score([prompt]) if request.get("prompt_logprobs") and len(prompt) > 1 else None
        results = [wait(f, SAMPLE_TIMEOUT_S, f"a sample of {len(prompt)} prompt tokens") for f in futures]
        prompt_lp = None
        if request.get("prompt_logprobs"):
            prompt_lp = wait(scores, SAMPLE_TIMEOUT_S, "the prompt's log-probs")[0] if scores is not None else []
        last_n = request.get("prompt_logprobs_last_n")
        sequences = [self._sequence(r) for r in results]
        if request.get("record_stability_info") and sequence_ids:
            self._record(prompt, sequences, sequence_ids)
        return sample_response(sequences, prompt_lp, None if last_n is None else int(last_n))

    def _record(self, prompt: list[int], sequences: list[Sequence], sequence_ids: list[str]) -> None:
        prompt_arr = np.asarray(prompt, dtype=np.int64)  # (one array, shared by the request's samples)
        for sequence_id, s in zip(sequence_ids, sequences, strict=True):
            self.records.add(sequence_id, Record(prompt_arr, np.asarray(s.tokens, dtype=np.int64),
                                                 np.asarray(s.logprobs, dtype=np.float32)))

    def _request(self, prompt: list[int], params: dict[str, Any], stop_ids: Any, stop_texts: list[str],
                 seed: int | None) -> GenRequest:
        generated: list[int] = []

        def on_token(token: int, logprob: float, version: int, top: Any) -> bool:
            generated.append(token)
            if token in stop_ids:
                return True
            if stop_texts:
                text = self.tokenizer.decode(generated)
                return any(text.endswith(s) for s in stop_texts)
            return False

        top_k = int(params.get("top_k", -1))
        return GenRequest(uid=next(self._uids), prompt_ids=prompt,
                          max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
                          temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                          top_k=max(0, top_k), seed=seed, on_token=on_token if stop_ids or stop_texts else None)

    @staticmethod
    def _sequence(result: GenResult) -> Sequence:
        return Sequence(list(result.response_ids), list(result.behavior_logprobs), result.finish_reason == "stop")

    def shutdown(self) -> None:
        self._jobs.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for engine, _ in self._engines.values():
                engine.shutdown()
            self._engines.clear()
