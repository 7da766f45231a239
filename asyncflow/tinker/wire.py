"""Tinker's binary wire format: forward_backward requests in, ForwardBackwardOutput and SampleResponse
out, through the SDK's own generated protobuf module (`tinker.proto.tinker_public_pb2`: the SDK's wire
format is what it defines, so the server reads and writes exactly that).

Conventions the SDK writes and reads (tinker/proto/request_conv.py, response_conv.py): token lists are
little-endian int32 bytes; a Tensor is dense bytes in its dtype (float32 or int64) with a shape, or a
CSR triple padded with 0; an output field is one BatchedTensor per record whose `offsets` are byte
offsets per datum (num_datums + 1 of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncflow.errors import UserError

try:
    from tinker.proto import tinker_public_pb2 as pb
except ImportError as exc:  # (the `tinker` extra)
    raise ImportError("asyncflow tinker-serve needs the `tinker` package: pip install 'asyncflow[tinker]'") from exc

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True)
class Span:
    """One provenance run: `length` datum positions that are positions `[offset, offset + length)` of the
    named sequence's sampled tokens (`sampled`) or of its sampling request's prompt."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: the input tokens and its loss inputs, each as long as the input."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    input_spans: list[Span] | None = None  # provenance of each input token (`Datum.with_provenance`), tiling it
    target_spans: list[Span] | None = None  # provenance of each target token, tiling target_tokens


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float]
    data: list[Datum]


def _tensor(name: str, t: Any) -> np.ndarray:
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise UserError(f"forward_backward: loss_fn_inputs[{name!r}] has dtype {t.dtype} (float32 or int64 expected)")
    shape = [int(d) for d in t.shape]
    if t.WhichOneof("encoding") == "sparse_csr":  # (2-D only: rows by crow_indices, columns by col_indices)
        dense = np.zeros(shape, dtype=dtype)
        values = np.frombuffer(t.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        for r in range(len(crow) - 1):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense
    arr = np.frombuffer(t.dense, dtype=dtype)
    return arr.reshape(shape) if shape else arr


def _spans(messages: Any, length: int, where: str) -> list[Span]:
    """ProvenanceSpan messages as `Span`s, checked to tile a field of `length` positions."""
    spans = []
    for m in messages:
        arm = m.WhichOneof("span")
        if arm is None:
            raise UserError(f"forward_backward: {where} has a span that is neither prompt_tokens nor sampled_tokens")
        s = getattr(m, arm)
        if not s.sequence_id or s.length < 0 or s.offset < 0:
            raise UserError(f"forward_backward: {where} has a span with no sequence_id or a negative length/offset")
        spans.append(Span(arm == "sampled_tokens", s.sequence_id, int(s.offset), int(s.length)))
    total = sum(s.length for s in spans)
    if total != length:
        raise UserError(f"forward_backward: {where} cover {total} positions, the field has {length}")
    return spans


def parse_forward_backward(body: bytes) -> FwdBwdRequest:
    """A ForwardBackwardRequest body (uncompressed protobuf) as plain Python and numpy values."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # (protobuf's DecodeError)
        raise UserError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})") from None
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # (v2 wins; text values are not used by the built-in losses)
        if value.WhichOneof("value") == "number":
            config[key] = float(value.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise UserError(f"forward_backward: datum {i} has a {chunk.WhichOneof('chunk')} chunk (text only)")
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist()
        datum = Datum(tokens, {k: _tensor(k, v) for k, v in d.loss_fn_inputs.items()})
        if len(d.model_input_spans) or len(d.loss_fn_input_spans):
            targets = datum.inputs.get("target_tokens")
            datum.input_spans = _spans(d.model_input_spans, len(tokens), f"datum {i} model_input_spans")
            datum.target_spans = _spans(d.loss_fn_input_spans, len(tokens) if targets is None else len(targets),
                                        f"datum {i} loss_fn_input_spans")
        data.append(datum)
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, bool(msg.forward_only), config, data)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """ForwardBackwardOutput: one ArrayRecord whose `logprobs` field holds each datum's float32 array."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in logprobs]
    field_ = record.fields["logprobs"]
    field_.dtype = pb.DTYPE_FLOAT32
    field_.data = b"".join(a.tobytes() for a in arrays)
    field_.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    if arrays and arrays[0].ndim > 1:
        field_.trailing_shape.extend(arrays[0].shape[1:])
    for key, value in metrics.items():
        out.metrics[key] = float(value)
    return bytes(out.SerializeToString())


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # a stop token, stop string or EOS ended it (else its length limit)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None,
                    last_n: int | None = None) -> bytes:
    """SampleResponse: the sequences (generated tokens only) and, when asked, the prompt's log-probs
    (NaN at position 0, which nothing predicts, and, with `last_n`, everywhere before the last n)."""
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = np.asarray([math.nan, *prompt_logprobs], dtype=np.float32)
        if last_n is not None:
            values[: max(0, len(values) - last_n)] = math.nan
        out.prompt_logprobs = values.tobytes()
    return bytes(out.SerializeToString())
