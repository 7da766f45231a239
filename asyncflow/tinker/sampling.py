"""The sampling clients of a Tinker service: a sampler is a frozen snapshot of a training client's
adapter (or the base model), served by one of the pool's engines (`sampler_engines.py`: asyncflow's
`HFEngine` with the adapter merged in, vLLM, or an OpenAI-compatible server; here or in Ray actors).

Engines are few and reused: a sampling session takes an idle engine and loads its snapshot there
(the adapter merged onto the base weights the engine keeps), so an RL loop that makes a session per
step loads the model once. A new engine is built only while all are busy, up to `max_engines`; an
engine is never reloaded while it serves a request, so every sample comes from its session's snapshot.

    asample ──► job thread ──► engine of the snapshot ──generate x num_samples──► SampleResponse (protobuf)
    compute_logprobs (asample with prompt_logprobs) ──► the same, plus score(prompt)
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from asyncflow.engines.base import GenRequest, GenResult, pick_device
from asyncflow.engines.hf import HFEngine
from asyncflow.errors import UserError, WaitTimeout
from asyncflow.tinker.futures import resolved
from asyncflow.tinker.sampler_engines import HFSampler, SamplerEngine, cut_at_stop, ends_at_stop
from asyncflow.tinker.settings import MAX_BATCH, MAX_ENGINES
from asyncflow.tinker.stability import Record, SequenceRecords
from asyncflow.tinker.wire import Sequence, sample_response

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
    version: int | None = None  # streaming: the training client's weights version (optim steps applied)
    behind: int = 0  # streaming: how many versions the client had asked for beyond `version`


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


@dataclass
class _Slot:
    """An engine and the sampling session whose snapshot it holds (None: none yet, or forgotten)."""

    engine: SamplerEngine
    session: str | None
    ready: cf.Future[float]  # its snapshot's weights in use
    users: int = 0  # sample requests running on it: a slot in use is never rebound


class SamplingPool:
    """Snapshots by sampling session id, and the engines that serve them: an engine whose requests have
    all finished takes the next session's snapshot in place (its adapter merged onto the kept base
    weights), so a loop that makes a sampling session per step reuses one engine rather than loading
    the model again. A new engine is built only while every engine is busy, up to `max_engines`."""

    def __init__(self, model_dir: Path, tokenizer: Any, eos_ids: list[int], pad_id: int, *, max_engines: int = MAX_ENGINES,
                 max_sessions: int = MAX_SESSIONS, max_batch: int = MAX_BATCH, workers: int = 16,
                 records: SequenceRecords | None = None, device: str = "cpu",
                 make_engine: Callable[[int], SamplerEngine] | None = None) -> None:
        """`records`: where samples asked with `record_stability_info` are recorded, by sequence id;
        `device`: cpu, cuda or auto, as `model.device` (engines spread over the GPUs this process sees);
        `make_engine(i)`: engine number i, holding the base model (None: an `HFEngine` here on `device`)."""
        self.model_dir, self.tokenizer, self.eos_ids, self.pad_id = model_dir, tokenizer, eos_ids, pad_id
        self.max_engines, self.max_batch = max_engines, max_batch
        self.max_sessions, self.device = max_sessions, device
        self.make_engine = make_engine or self._hf_engine
        self.records = records if records is not None else SequenceRecords()
        self.snapshots: OrderedDict[str, Snapshot] = OrderedDict()
        self.counts = {"engines_built": 0, "snapshot_loads": 0}
        self._slots: list[_Slot] = []  # least recently used first
        self._cv = threading.Condition()
        self._uids = itertools.count()
        self._versions = itertools.count(1)  # (each load is a new engine weights version)
        self._jobs = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tinker-sample")

    def add(self, session_id: str, snapshot: Snapshot) -> None:
        with self._cv:
            self.snapshots[session_id] = snapshot
            while len(self.snapshots) > self.max_sessions:
                old, _ = self.snapshots.popitem(last=False)
                for slot in self._slots:
                    if slot.session == old:
                        slot.session = None

    def get(self, session_id: str) -> Snapshot:
        with self._cv:
            if session_id not in self.snapshots:
                raise UserError(f"sampling_session_id {session_id!r}: no such sampling session (only the newest "
                                f"{self.max_sessions} are kept)")
            return self.snapshots[session_id]

    def acquire(self, session_id: str) -> _Slot:
        """An engine holding the session's snapshot, counted as in use until `release`: the session's own,
        else the least recently used idle one, loaded with the snapshot, else a new one. An engine found
        dead while loading (a killed Ray actor) is dropped, and the session tries once more."""
        snapshot = self.get(session_id)
        for attempt in range(2):
            slot = self._take(session_id, snapshot)
            try:
                wait(slot.ready, LOAD_TIMEOUT_S, f"sampling session {session_id}: loading its weights into an engine")
            except BaseException:
                self.release(slot)
                if attempt == 0 and slot.engine.error is not None:
                    continue
                raise
            return slot
        raise AssertionError("unreachable")

    def _take(self, session_id: str, snapshot: Snapshot) -> _Slot:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        with self._cv:
            while True:
                self._slots = [s for s in self._slots if s.engine.error is None or s.users]
                slot = next((s for s in self._slots if s.session == session_id), None)
                if slot is None:
                    slot = self._bind(session_id, snapshot)
                if slot is not None:
                    break
                if not self._cv.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise WaitTimeout(f"tinker-serve: sampling session {session_id}: all {self.max_engines} sampling "
                                      f"engines stayed busy for {LOAD_TIMEOUT_S:g} s")
            slot.users += 1
            self._slots.remove(slot)
            self._slots.append(slot)
            return slot

    def _bind(self, session_id: str, snapshot: Snapshot) -> _Slot | None:
        """Give the snapshot an idle engine or a new one (under the lock); None while none can be had."""
        idle = next((s for s in self._slots if s.users == 0), None)
        if idle is None and len(self._slots) >= self.max_engines:
            return None
        if idle is None:
            idle = _Slot(self.make_engine(len(self._slots)), None, resolved(0.0))
            self._slots.append(idle)
            self.counts["engines_built"] += 1
            if snapshot.adapter is None:  # (a new engine holds the base model already)
                idle.session = session_id
                return idle
        idle.session = session_id
        idle.ready = idle.engine.load(snapshot.adapter, next(self._versions))
        self.counts["snapshot_loads"] += 1
        return idle

    def _hf_engine(self, index: int) -> SamplerEngine:
        return HFSampler(HFEngine(self.model_dir, eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                  max_batch=self.max_batch, device=pick_device(self.device, index),
                                  name=f"sampler {index}"))

    def release(self, slot: _Slot) -> None:
        with self._cv:
            slot.users -= 1
            self._cv.notify_all()

    def submit(self, request: dict[str, Any], sequence_ids: list[str] | None = None) -> cf.Future[bytes]:
        """Run one asample request (JSON body) on a job thread; the future gives the SampleResponse bytes.
        `sequence_ids`: one per sample, the ids its sequences are recorded under (`record_stability_info`)."""
        self.get(str(request.get("sampling_session_id")))  # (an unknown session fails the POST, not the future)
        return self._jobs.submit(self._sample, request, sequence_ids)

    def _sample(self, request: dict[str, Any], sequence_ids: list[str] | None = None) -> bytes:
        slot = self.acquire(str(request["sampling_session_id"]))
        try:
            return self._generate(slot.engine, request, sequence_ids)
        finally:
            self.release(slot)

    def _generate(self, engine: SamplerEngine, request: dict[str, Any], sequence_ids: list[str] | None) -> bytes:
        prompt = [int(t) for c in request["prompt"]["chunks"] for t in c.get("tokens", [])]
        if not prompt:
            raise UserError("asample: the prompt is empty (encoded_text chunks with tokens expected)")
        params = request.get("sampling_params") or {}
        stop_ids, stop_texts = _stop_check(params.get("stop"), self.tokenizer)
        n = int(request.get("num_samples", 1))
        seed = params.get("seed")
        futures = [engine.generate(self._request(prompt, params, stop_ids, stop_texts, engine.stops_early,
                                                 None if seed is None else int(seed) + i)) for i in range(n)]
        scores = engine.score(prompt) if request.get("prompt_logprobs") and len(prompt) > 1 else None
        results = [wait(f, SAMPLE_TIMEOUT_S, f"a sample of {len(prompt)} prompt tokens") for f in futures]
        if not engine.stops_early and (stop_ids or stop_texts):
            results = [cut_at_stop(r, stop_ids, stop_texts, self.tokenizer) for r in results]
        prompt_lp = None
        if request.get("prompt_logprobs"):
            prompt_lp = wait(scores, SAMPLE_TIMEOUT_S, "the prompt's log-probs") if scores is not None else []
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
                 stops_early: bool, seed: int | None) -> GenRequest:
        generated: list[int] = []

        def on_token(token: int, logprob: float, version: int, top: Any) -> bool:
            generated.append(token)
            return ends_at_stop(generated, stop_ids, stop_texts, self.tokenizer)

        top_k = int(params.get("top_k", -1))
        return GenRequest(uid=next(self._uids), prompt_ids=prompt,
                          max_new_tokens=int(params.get("max_tokens") or DEFAULT_MAX_TOKENS),
                          temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                          top_k=max(0, top_k), seed=seed,
                          on_token=on_token if stops_early and (stop_ids or stop_texts) else None)

    @staticmethod
    def _sequence(result: GenResult) -> Sequence:
        return Sequence(list(result.response_ids), list(result.behavior_logprobs), result.finish_reason == "stop")

    def shutdown(self) -> None:
        self._jobs.shutdown(wait=False, cancel_futures=True)
        with self._cv:
            for slot in self._slots:
                slot.engine.shutdown()
            self._slots.clear()
