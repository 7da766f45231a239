"""Stability info of a Tinker service: what `stable_reinforce` needs of each sequence sampled with
`record_stability_info`, kept by `sequence_id`, and the resolution of a training datum's provenance
spans against it.

A record is the request's prompt, the sampled tokens and the sampler's log-prob of each. A datum's
`loss_fn_input_spans` name, for every target position, the recorded sequence (and position in it) that
the target reproduces; resolving them gives the loss the sampler's own log-prob at each sampled target
(`RECORDED_LOGPROBS`) and which targets were sampled (`SAMPLED`). Prompt runs carry no loss.

Bounded: the newest `max_sequences` records are kept, each for a day (`TTL_S`) after it was recorded
or last named, and a training request that names one makes it the newest again; a datum naming one no
longer (or never) kept is a one-line `UserError`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from asyncflow.errors import UserError
from asyncflow.tinker.wire import Datum, Span

MAX_SEQUENCES = 65_536
TTL_S = 86_400.0  # a record is forgotten a day after it was recorded or last named
RECORDED_LOGPROBS = "recorded_logprobs"  # the loss inputs a resolution adds (float32, one per target)
SAMPLED = "sampled"


@dataclass(frozen=True)
class Record:
    prompt: np.ndarray  # int64 tokens of the sampling request's prompt
    tokens: np.ndarray  # int64 sampled tokens
    logprobs: np.ndarray  # float32, the sampler's log-prob of each sampled token


class SequenceRecords:
    """Recorded sequences by sequence id, newest last (thread-safe: sampling jobs add, requests read)."""

    def __init__(self, max_sequences: int = MAX_SEQUENCES, ttl_s: float = TTL_S) -> None:
        self.max_sequences, self.ttl_s = max_sequences, ttl_s
        self._records: OrderedDict[str, tuple[Record, float]] = OrderedDict()  # id -> (record, last use)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, sequence_id: str, record: Record) -> None:
        with self._lock:
            self._records[sequence_id] = (record, time.monotonic())
            self._expire()

    def _expire(self) -> None:
        """Drop the oldest records past the count or the age bound (under the lock)."""
        old = time.monotonic() - self.ttl_s
        while self._records and (len(self._records) > self.max_sequences or next(iter(self._records.values()))[1] < old):
            self._records.popitem(last=False)

    def get(self, sequence_id: str, where: str) -> Record:
        """The record, made the newest again; an unknown id is a `UserError` saying `where` it was named."""
        with self._lock:
            self._expire()
            entry = self._records.get(sequence_id)
            if entry is None:
                raise UserError(f"{where}: sequence_id {sequence_id!r} has no stability info here (sample with "
                                f"record_stability_info=True; only the newest {self.max_sequences} sequences are kept, "
                                f"each for {self.ttl_s / 3600:g} h after its last use)")
            self._records[sequence_id] = (entry[0], time.monotonic())
            self._records.move_to_end(sequence_id)
            return entry[0]


def _run(record: Record, span: Span, where: str) -> np.ndarray:
    source = record.tokens if span.sampled else record.prompt
    if span.offset + span.length > len(source):
        kind = "sampled tokens" if span.sampled else "prompt"
        raise UserError(f"{where}: a span of sequence {span.sequence_id!r} covers positions {span.offset}.."
                        f"{span.offset + span.length - 1} of its {kind}, which has {len(source)}")
    return source[span.offset: span.offset + span.length]


def add_stability_inputs(data: list[Datum], records: SequenceRecords) -> None:
    """Give every datum the loss inputs its provenance resolves to (`RECORDED_LOGPROBS`, `SAMPLED`);
    a datum without provenance is a `UserError`."""
    for i, d in enumerate(data):
        where = f"forward_backward: datum {i}"
        if d.input_spans is None or d.target_spans is None:
            raise UserError(f"{where} has no provenance; loss_fn 'stable_reinforce' needs Datum.with_provenance "
                            "naming the sampled sequences")
        if "target_tokens" not in d.inputs:
            raise UserError(f"{where}: loss_fn 'stable_reinforce' needs loss_fn_inputs['target_tokens']")
        check_input_spans(d.input_spans, d.tokens, records, where)
        d.inputs.update(resolve_targets(d.target_spans, np.asarray(d.inputs["target_tokens"]).reshape(-1), records,
                                        where))


def check_input_spans(spans: list[Span], tokens: list[int], records: SequenceRecords, where: str) -> None:
    """Every model_input position's token is the one its span names."""
    position = 0
    for span in spans:
        expected = _run(records.get(span.sequence_id, where), span, where)
        got = np.asarray(tokens[position: position + span.length], dtype=np.int64)
        if not np.array_equal(got, expected):
            raise UserError(f"{where}: model_input positions {position}..{position + span.length - 1} are not the "
                            f"tokens that their span of sequence {span.sequence_id!r} names")
        position += span.length


def resolve_targets(spans: list[Span], targets: np.ndarray, records: SequenceRecords,
                    where: str) -> dict[str, np.ndarray]:
    """The recorded log-prob of every sampled target (0 elsewhere) and the sampled-target mask; a sampled
    target that is not the recorded token is a `UserError` (its recorded log-prob would be another's)."""
    recorded = np.zeros(len(targets), dtype=np.float32)
    sampled = np.zeros(len(targets), dtype=np.float32)
    position = 0
    for span in spans:
        record = records.get(span.sequence_id, where)
        if span.sampled:
            expected = _run(record, span, where)
            got = targets[position: position + span.length].astype(np.int64)
            if not np.array_equal(got, expected):
                raise UserError(f"{where}: target_tokens {position}..{position + span.length - 1} are not the "
                                f"tokens sampled as sequence {span.sequence_id!r} (positions {span.offset}..)")
            recorded[position: position + span.length] = record.logprobs[span.offset: span.offset + span.length]
            sampled[position: position + span.length] = 1.0
        position += span.length
    return {RECORDED_LOGPROBS: recorded, SAMPLED: sampled}
