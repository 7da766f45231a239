"""Inference over a transformers causal LM with continuous batching and a KV cache.

Why not `model.generate`: static generation holds a batch until its longest response ends, and queue
scheduling needs free slots to be refilled at once. Why not transformers' `generate_batch`: at the
tiny-model sizes this project tests on, its fixed overhead dominates (measured 6.8 s vs 0.03 s for 64
prompts x 8 tokens). So this module runs its own decode loop in a dedicated thread:

    waiting ──prefill (batched)──► running rows ──decode step──► finished (future resolved)
                   ▲                    │   (one token per row per step; rows join/leave between steps)
                   └── abort: re-prefill prompt + tokens so far with the new weights

The running batch shares one KV cache, always left-padded: a joining row (or the batch) is padded on
the left to the longer length, finished rows are dropped, and columns that are padding in every row
are trimmed. Position ids are explicit per row, so padding never shifts positions.

Weight updates (`load_weights`): `swap` loads between two decode steps and keeps the KV cache;
`drain` stops admitting, lets running rows finish on the old weights, then loads; `abort` evicts
running rows, loads, and re-admits them first, re-prefilling their prompt plus the tokens generated so
far. Every token records the version that sampled it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from asyncflow.engines import lora as lora_adapter
from asyncflow.engines.attention_choice import pick_attention
from asyncflow.engines.base import EngineOutOfMemory, GenRequest, GenResult, InferenceEngine, WeightUpdateMode
from asyncflow.engines.head_logprobs import right_pad, token_logprobs
from asyncflow.engines.kv_cache import returned_cache, with_cache
from asyncflow.engines.sampling import SAMPLING_EPS, sample_tokens, top_alternatives, truncate_logits
from asyncflow.engines.weight_delta import HeldParams, HeldWeights, Publication, ResyncNeeded
from asyncflow.engines.weight_sync import WeightsRefused, aliases
from asyncflow.errors import RunFailed, UserError

IDLE_EXIT_S = 0.2  # the decode thread ends after this long with nothing to do (see `_wake`)
MAX_PREFILL_TOKENS = 8192  # padded tokens (rows x longest context) one prefill may take (vLLM: max_num_batched_tokens)
_OOM = (torch.OutOfMemoryError, MemoryError)  # out of memory for one batch: its requests fail, the engine goes on


@dataclass
class _Row:
    """One request in the engine."""

    req: GenRequest
    future: cf.Future[GenResult]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cancelled: bool = False
    gen: torch.Generator | None = None  # the request's own (per-request seed)
    top: list[list[tuple[int, float]]] = field(default_factory=list)  # alternatives per token, when asked
    stop_hit: bool = False  # its token callback ended it (a stop string)

    def context(self) -> list[int]:
        """Tokens that must be in the KV cache before the next token is sampled."""
        return self.req.prompt_ids + self.tokens[:-1] if self.tokens else list(self.req.prompt_ids)

    def resolve(self, reason: str) -> None:
        """Give the caller its result, unless it abandoned the request: a cancelled future (its
        awaiting task timed out or stopped) takes no result, and must not take this thread down."""
        with contextlib.suppress(cf.InvalidStateError):  # cancelled by the caller meanwhile
            extra: dict[str, Any] = {"top_logprobs": self.top} if self.req.top_logprobs > 0 else {}
            self.future.set_result(GenResult(self.req.uid, self.tokens, self.logprobs, self.versions, reason,  # type: ignore[arg-type]
                                             extra))


@dataclass
class _Score:
    rows: list[list[int]]
    temperature: float
    future: cf.Future[list[list[float]]]


@dataclass
class _PendingWeights:
    state: dict[str, torch.Tensor] | Publication | None  # None: a `fill` writes the weights in place
    version: int
    mode: WeightUpdateMode
    done: cf.Future[float]
    requested_at: float
    claimed: bool = False  # the decode thread is loading it: it can no longer be withdrawn
    fill: Callable[[dict[str, torch.Tensor]], None] | None = None


def _state_mismatch(model: Any, state: dict[str, torch.Tensor]) -> str | None:
    """Why `state` cannot load strictly into `model` (missing or unexpected names, other shapes), or None."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    shapes = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
    parts = [f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}"
             for what, names in (("missing", missing), ("unexpected", extra), ("other shape", shapes)) if names]
    return "; ".join(parts) or None


def _check_decoder(model: Any, device: torch.device) -> None:
    """Refuse a model that returns no KV cache (an encoder such as BERT behind a causal-LM class): the
    decode loop needs one, and without this check the first request failed inside it (AssertionError)."""
    with torch.no_grad():
        out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=True)
    if returned_cache(out) is None:
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        raise UserError(f"model.path: {name} ({type(model).__name__}) returned no KV cache: it is not a causal "
                        "decoder (an encoder-only model such as BERT?); a causal language model is needed")


class HFEngine(InferenceEngine):
    """Continuous-batching generation over a transformers model (CPU or one GPU)."""

    def __init__(
        self,
        model: PreTrainedModel | str | Path,
        *,
        eos_token_id: int | list[int],
        pad_token_id: int = 0,
        max_batch: int = 256,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        version: int = 0,
        name: str = "rollout",
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
        threads: int | None = None,
    ) -> None:
        """`threads`: torch threads of the decode thread (None: the process default)."""
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.device = torch.device(device)
        _check_decoder(self.model, self.device)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos = frozenset(eos)  # (a Python set, read every decode step: no copy from a GPU each time)
        self.pad_token_id = pad_token_id
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.version = version
        self.name = name
        self.threads = threads
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self._cv = threading.Condition()
        self._waiting: deque[_Row] = deque()
        self._rows: list[_Row] = []
        self._pending: _PendingWeights | None = None
        self._fills: deque[_PendingWeights] = deque()  # in-place loads, in order (each one a collective)
        self._torn = False  # a fill failed midway: no decoding until a whole load replaces the mixed weights
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None  # [B, T] 1 where the cache holds a real token
        self._stop = False
        self.error: BaseException | None = None
        self._admitting: list[_Row] = []
        self._busy = 0.0
        self.steps = 0
        self.counts = {"prefills": 0, "prefill_rows": 0, "decode_rows": 0, "out_of_memory": 0}  # diagnostics
        self._lora_base: dict[str, torch.Tensor] = {}  # LoRA: base weights of the adapted modules (lora.merge_into)
        self.held = HeldWeights()  # the publication these weights are (delta weight sync)
        self._thread: threading.Thread | None = None  # the decode thread, while one runs (see `_wake`)
        self._scores: deque[_Score] = deque()  # scoring passes asked for (`submit_score`)
        with self._cv:
            self._wake()

    # ------------------------------------------------------------------ public API (any thread)

    @property
    def capacity(self) -> int:
        return self.max_batch

    def submit(self, request: GenRequest) -> cf.Future[GenResult]:
        """Queue a request; the future resolves when it finishes."""
        if not request.prompt_ids:  # (refused here, for this request: in the decode thread it stopped the engine)
            raise ValueError(f"request {request.uid}: empty prompt (nothing to condition on)")
        row = _Row(req=request, future=cf.Future())
        if request.seed is not None:
            row.gen = torch.Generator(device=self.device).manual_seed(request.seed)
        with self._cv:
            if self._stop:
                raise RuntimeError(f"engine {self.name} is closed" + (f" after an error: {self.error!r}" if self.error else ""))
            self._waiting.append(row)
            self._wake()
        return row.future

    def submit_score(self, rows: list[list[int]], temperature: float = 1.0) -> cf.Future[list[list[float]]]:
        """Queue a scoring pass: each row's log-probs of its tokens 1.. under softmax(logits /
        `temperature`), on the weights in use (the decode thread runs it between two decode steps,
        never during a load)."""
        if not rows or any(len(r) < 2 for r in rows):
            raise ValueError("submit_score: every row needs at least 2 tokens (the first is only conditioned on)")
        job = _Score(rows, temperature, cf.Future())
        with self._cv:
            if self._stop:
                raise RuntimeError(f"engine {self.name} is closed")
            self._scores.append(job)
            self._wake()
        return job.future

    async def generate(self, request: GenRequest) -> GenResult:
        return await self.start_generate(request)

    def start_generate(self, request: GenRequest) -> asyncio.Future[GenResult]:
        """The request's own future (no task per request); cancelling it cancels the request's
        `concurrent.futures.Future`, which the decode thread then skips."""
        return asyncio.wrap_future(self.submit(request))

    def generate_many(self, requests: list[GenRequest], timeout: float | None = None) -> list[GenResult]:
        """Blocking helper: run a list of requests through the engine and wait for all."""
        futures = [self.submit(r) for r in requests]
        return [f.result(timeout=timeout) for f in futures]

    def request_weights(self, state: dict[str, torch.Tensor] | Publication, version: int,
                        mode: WeightUpdateMode) -> cf.Future[float]:
        """Ask the decode thread to load `state` (a state dict, or a publication: full or a delta) as
        `version`; the future gives seconds until in use."""
        done: cf.Future[float] = cf.Future()
        with self._cv:
            if self._stop:  # no decode thread will pick it up: say why now, not at the caller's timeout
                reason = f"after an error: {self.error!r}" if self.error is not None else "(shut down)"
                done.set_exception(RuntimeError(f"engine {self.name} is closed {reason}; cannot load version {version}"))
                return done
            if self._pending is not None:  # a newer version supersedes one not yet loaded
                with contextlib.suppress(cf.InvalidStateError):  # (its caller stopped waiting)
                    self._pending.done.set_result(0.0)
            self._pending = _PendingWeights(state, version, mode, done, time.monotonic())
            self._wake()
        return done

    def request_fill(self, fill: Callable[[dict[str, torch.Tensor]], None], version: int,
                     mode: WeightUpdateMode) -> cf.Future[float]:
        """Ask the decode thread to call `fill(params)` at `mode`'s load point, `params` being the
        model's own tensors by state-dict name, which `fill` overwrites in place (a broadcast
        received straight into them: no second copy of the weights). Fills run in request order
        and none supersedes another (each is a collective its group waits for); the future gives
        seconds until in use; one whose future is cancelled before it begins is skipped. A fill that
        fails other than by `WeightsRefused` may leave the weights mixed: the engine then stops
        decoding until a whole load (`request_weights`) comes."""
        done: cf.Future[float] = cf.Future()
        with self._cv:
            if self._stop:
                done.set_exception(RuntimeError(f"engine {self.name} is closed; cannot load version {version}"))
                return done
            self._fills.append(_PendingWeights(None, version, mode, done, time.monotonic(), fill=fill))
            self._wake()
        return done

    def withdraw_weights(self, done: cf.Future[float]) -> bool:
        """Withdraw the load whose future is `done` if the decode thread has not begun it (its caller
        gave up waiting: it must not take effect after the caller was told it did not); True if withdrawn."""
        with self._cv:
            pending = self._pending
            if pending is None or pending.done is not done or pending.claimed:
                return False
            self._pending = None
        done.cancel()
        return True

    async def load_weights(self, state: dict[str, torch.Tensor] | Publication, version: int,  # type: ignore[override]
                           mode: WeightUpdateMode) -> float:
        return await asyncio.wrap_future(self.request_weights(state, version, mode))

    def cancel_older_than(self, min_version: int) -> int:
        """Mark every request whose first token is older than `min_version` cancelled: running, being
        prefilled, or queued (an abort-mode load puts all running rows back in the queue, which is
        exactly when the pipeline calls this). Queued ones end without another prefill."""
        n = 0
        with self._cv:
            for row in (*self._rows, *self._admitting, *self._waiting):
                if row.versions and row.versions[0] < min_version and not row.cancelled and row.req.uid >= 0:
                    row.cancelled = True
                    n += 1
        return n

    def load(self) -> int:
        with self._cv:
            return len(self._rows) + len(self._waiting)

    def busy_seconds(self) -> float:
        return self._busy

    def stats(self) -> dict[str, float]:
        return {"decode_steps": float(self.steps), **{k: float(v) for k, v in self.counts.items()}}

    def shutdown(self) -> None:
        """Stop the decode thread; unfinished requests end as cancelled."""
        with self._cv:
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=30)
        else:  # (no thread ran: rows held back by a torn load end here)
            self._fail_all(None)

    def _wake(self) -> None:
        """New work (under `self._cv`): the decode thread sees it, or one starts for it. The thread ends
        after `IDLE_EXIT_S` with nothing to do, so its OpenMP pool does not slow the trainer's passes
        meanwhile (asyncflow.compute_thread says why); a new one starts with the next work."""
        if self._thread is not None:
            self._cv.notify()
        elif not self._stop:
            self._thread = threading.Thread(target=self._loop, name=f"asyncflow-{self.name}", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    # ------------------------------------------------------------------ decode thread

    def _loop(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            while True:
                with self._cv:
                    while not self._stop and self._idle():
                        if not self._cv.wait(timeout=IDLE_EXIT_S) and self._idle():
                            self._thread = None  # (under the lock: the next `_wake` starts another)
                            return
                    if self._stop:
                        break
                    pending = self._fills[0] if self._fills else self._pending
                    admit = self._take_admissions(pending)
                    self._admitting = admit  # (under the lock: cancel_older_than sees every row)
                    scores, self._scores = list(self._scores), deque()
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for job in scores:
                        self._score(job)
                    if pending is not None:
                        self._maybe_load(pending)
                    try:
                        if admit:
                            self._prefill(admit)
                        self._admitting = []
                        if self._rows and not self._torn:
                            self._decode_step()
                    except _OOM as exc:  # in a merge or decode step: the running batch's cache is unusable
                        self._fail_oom([*self._rows, *(r for r in admit if r not in self._rows)], exc)
                        self._rows, self._cache, self._mask, self._admitting = [], None, None, []
                self._busy += time.perf_counter() - t0
        except BaseException as exc:  # fail every request loudly rather than hang callers
            self.error = exc
            with self._cv:
                self._stop = True
            self._fail_all(exc)
            return
        self._fail_all(None)

    def _idle(self) -> bool:
        """Nothing to do (under `self._cv`): no load asked for, and no row to decode or admit."""
        return self._pending is None and not self._fills and not self._scores and (
            self._torn or (not self._rows and not self._waiting))

    def _score(self, job: _Score) -> None:
        """A scoring pass, in chunks of at most `max_prefill_tokens` padded tokens (right-padded rows)."""
        if job.future.cancelled():
            return
        if self._torn:
            job.future.set_exception(RuntimeError(f"engine {self.name}: its weights are mid-load (a failed fill)"))
            return
        out: list[list[float]] = []
        try:
            start = 0
            while start < len(job.rows):
                width = len(job.rows[start])
                end = start + 1
                while end < len(job.rows) and (end - start + 1) * max(width, len(job.rows[end])) <= self.max_prefill_tokens:
                    width = max(width, len(job.rows[end]))
                    end += 1
                out += self._score_chunk(job.rows[start:end], width, job.temperature)
                start = end
        except Exception as exc:  # (this job's failure, e.g. out of memory: the engine serves on)
            with contextlib.suppress(cf.InvalidStateError):
                job.future.set_exception(exc)
            return
        with contextlib.suppress(cf.InvalidStateError):
            job.future.set_result(out)

    def _score_chunk(self, rows: list[list[int]], width: int, temperature: float) -> list[list[float]]:
        ids, mask = right_pad(rows, self.pad_token_id, width)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pick_attention(self.model, self.device, width, width)
        lp, _ = token_logprobs(self.model, ids, mask, mask[:, 1:].float(), temperature)
        return [lp[i, : len(r) - 1].tolist() for i, r in enumerate(rows)]

    def _take_admissions(self, pending: _PendingWeights | None) -> list[_Row]:
        if self._torn or (pending is not None and pending.mode == "drain"):
            return []  # drain: no new work until the running rows finish and weights load
        free = self.max_batch - len(self._rows)
        admit: list[_Row] = []
        width = 0  # the prefill is padded to its longest context: it costs rows x width tokens
        while self._waiting and len(admit) < free:
            row = self._waiting[0]
            length = len(row.req.prompt_ids) + max(len(row.tokens) - 1, 0)
            if admit and (len(admit) + 1) * max(width, length) > self.max_prefill_tokens:
                break  # (the next step takes it; one context longer than the budget is prefilled alone)
            self._waiting.popleft()
            if row.cancelled:  # cancelled while queued (e.g. parked by an abort): ends with the tokens it has
                row.resolve("cancelled")
            elif not row.future.cancelled():  # abandoned before it started: never prefilled
                admit.append(row)
                width = max(width, length)
        return admit

    def _maybe_load(self, pending: _PendingWeights) -> None:
        if pending.fill is not None and pending.done.cancelled():  # its caller gave up before it began
            with self._cv:
                self._fills.remove(pending)
            return
        if pending.mode == "drain" and self._rows:
            return
        with self._cv:
            if pending.fill is None and self._pending is not pending:
                return  # withdrawn by its caller (or superseded) since this step began
            pending.claimed = True
        if pending.mode == "abort" and self._rows:
            evicted = self._rows
            self._rows, self._cache, self._mask = [], None, None
            with self._cv:
                self._waiting.extendleft(reversed(evicted))  # re-prefilled first, with tokens so far
        error = self._fill(pending) if pending.fill is not None else self._load_state(pending)
        if error is None:
            self.version = pending.version
            self._torn = False
        with self._cv:
            if pending.fill is not None:
                self._fills.remove(pending)
            elif self._pending is pending:
                self._pending = None
        with contextlib.suppress(cf.InvalidStateError):  # the caller stopped waiting (a publish timed out)
            if error is None:
                pending.done.set_result(time.monotonic() - pending.requested_at)
            else:
                pending.done.set_exception(error)

    def _load_state(self, pending: _PendingWeights) -> BaseException | None:
        """Copy a whole state dict (or merge an adapter) into the model, or apply a publication; why
        not, or None."""
        assert pending.state is not None
        if isinstance(pending.state, Publication):
            return self._load_publication(pending.state, pending.version)
        self.held.forget()
        return self._load_dict(pending.state, pending.version)

    def _load_dict(self, state: dict[str, torch.Tensor], version: int) -> BaseException | None:
        adapter = lora_adapter.is_adapter(state)
        problem = (lora_adapter.adapter_mismatch if adapter else _state_mismatch)(self.model, state)
        if problem is not None:  # refused before any tensor is copied: the engine keeps serving the old weights
            return ValueError(f"engine {self.name}: version {version}'s weights do not fit the model: {problem}")
        if adapter:  # a LoRA publication: merged onto the kept base weights of the modules it adapts
            lora_adapter.merge_into(self.model, state, self._lora_base)
        else:
            # a tied weight is copied in once, through its first name (the check above saw every name)
            tied = aliases(self.model.state_dict())
            self.model.load_state_dict({k: v for k, v in state.items() if k not in tied}, strict=not tied)
            self._lora_base.clear()  # (full weights replace the base an adapter merges onto)
        return None

    def _load_publication(self, pub: Publication, version: int) -> BaseException | None:
        """A delta written in place where it applies to the weights held and its checksum holds;
        else the full weights (`ResyncNeeded` where they did not come with it: nothing loaded)."""
        held = self.held
        if held.applies(pub):
            adapter = held.mirror is not None
            try:
                ok = held.write_delta(pub, held.mirror if held.mirror is not None else self.model.state_dict())
            except WeightsRefused as exc:  # (nothing written)
                return exc
            if ok:
                if held.mirror is not None:
                    lora_adapter.merge_into(self.model, held.mirror, self._lora_base)
                self.counts["delta_loads"] = self.counts.get("delta_loads", 0) + 1
                return None
            self.counts["checksum_mismatches"] = self.counts.get("checksum_mismatches", 0) + 1
            held.forget()
            if pub.full is None:
                self._torn = not adapter  # (an adapter's mirror was written, the model not yet)
                return ResyncNeeded(f"engine {self.name}: version {version}: the checksum after the delta differs "
                                    "from the trainer's; the full weights of this version are needed", pub.seq)
        try:
            full = pub.full_state()
        except ResyncNeeded as exc:
            return exc
        error = self._load_dict(full, version)
        if error is not None:
            held.forget()
            return error
        self.counts["full_loads"] = self.counts.get("full_loads", 0) + 1
        held.mirror = ({k: v.detach().to("cpu", copy=True) for k, v in full.items()}
                       if lora_adapter.is_adapter(full) else None)  # (a delta of an adapter updates its copy)
        if not held.verify_full(pub, held.mirror if held.mirror is not None else self.model.state_dict()):
            held.forget()
            self._torn = True
            return RuntimeError(f"engine {self.name}: version {version}: the checksum of the full weights loaded "
                                f"differs from the trainer's (publication {pub.seq})")
        return None

    def _fill(self, pending: _PendingWeights) -> BaseException | None:
        """Let the pending fill write the model's tensors in place; why it failed, or None."""
        assert pending.fill is not None
        try:  # (detached tensors sharing the parameters' memory, and the publication they hold)
            pending.fill(HeldParams(self.model.state_dict(), self.held))
        except WeightsRefused as exc:  # nothing was written: the old weights stay whole
            return exc
        except Exception as exc:  # (a broadcast that failed midway: some tensors new, some old)
            self._torn = True
            self.held.forget()
            return exc
        self._lora_base.clear()
        return None

    def _prefill(self, rows: list[_Row]) -> None:
        """Prefill `rows` together; rows with the same context (a prompt's `rollout.n` samples, admitted
        together) share one: it is computed once and its cache copied to each of them."""
        self.counts["prefills"] += 1
        self.counts["prefill_rows"] += len(rows)
        first: dict[tuple[int, ...], int] = {}
        which = [first.setdefault(tuple(r.context()), len(first)) for r in rows]  # row -> its distinct context
        contexts = list(first)
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            mask[i, width - len(ctx) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        pick_attention(self.model, self.device, width, width)
        # logits of the last position only (all of them: [rows, width, vocabulary] floats, tens of GiB for a
        # full batch of long prompts); a cache of plain full layers, which `_merge` and `_retire` can pad and
        # trim: a model's own cache may hold sliding-window layers that keep only the window, and with rows
        # of different lengths those fell out of step with the mask (the model's mask still slides)
        try:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1,
                             **with_cache(self.model, DynamicCache()))
            cache = _spread(returned_cache(out), which, self.device) if len(contexts) < len(rows) else returned_cache(out)
        except _OOM as exc:  # only these rows' prefill: the running batch is untouched
            self._fail_oom(rows, exc)
            return
        if len(contexts) < len(rows):
            index = torch.tensor(which, device=self.device)
            mask, out.logits = mask[index], out.logits[index]
        fresh = [not r.tokens for r in rows]
        # rows re-prefilled after an abort already hold their next input token: no new sample
        logits = out.logits[:, -1, :]
        self._merge(rows, cache, mask)
        new_idx = [len(self._rows) - len(rows) + i for i, f in enumerate(fresh) if f]
        if new_idx:
            sel = torch.tensor([i for i, f in enumerate(fresh) if f], device=self.device)
            self._sample_into([self._rows[i] for i in new_idx], logits[sel])
        self._retire()

    def _merge(self, rows: list[_Row], cache: DynamicCache, mask: torch.Tensor) -> None:
        if self._cache is None or not self._rows:
            self._rows, self._cache, self._mask = list(rows), cache, mask
            return
        assert self._mask is not None
        width = max(self._mask.shape[1], mask.shape[1])
        old_mask, new_mask = _left_pad(self._mask, width), _left_pad(mask, width)
        old_layers: list[Any] = list(self._cache.layers)
        new_layers: list[Any] = list(cache.layers)
        for old_layer, new_layer in zip(old_layers, new_layers, strict=True):
            assert old_layer.keys is not None and new_layer.keys is not None
            assert old_layer.values is not None and new_layer.values is not None
            old_layer.keys = torch.cat([_left_pad(old_layer.keys, width, dim=2), _left_pad(new_layer.keys, width, dim=2)])
            old_layer.values = torch.cat(
                [_left_pad(old_layer.values, width, dim=2), _left_pad(new_layer.values, width, dim=2)]
            )
        self._mask = torch.cat([old_mask, new_mask])
        self._rows.extend(rows)

    def _decode_step(self) -> None:
        assert self._cache is not None and self._mask is not None
        last = torch.tensor([[r.tokens[-1]] for r in self._rows], dtype=torch.long, device=self.device)
        pos = self._mask.sum(-1, keepdim=True)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        pick_attention(self.model, self.device, 1, self._mask.shape[1])
        out = self.model(input_ids=last, attention_mask=self._mask, position_ids=pos,
                         **with_cache(self.model, self._cache))
        self._cache = returned_cache(out)
        self._sample_into(self._rows, out.logits[:, -1, :])
        self.steps += 1
        self.counts["decode_rows"] += len(self._rows)
        self._retire()

    def _sample_into(self, rows: list[_Row], logits: torch.Tensor) -> None:
        temps = torch.tensor([r.req.temperature for r in rows], dtype=torch.float32, device=logits.device)
        greedy = temps < SAMPLING_EPS  # (a tiny temperature overflows logits / t to inf: NaN probabilities)
        scaled = logits.float() / torch.where(greedy, torch.ones_like(temps), temps).unsqueeze(-1)
        scaled = truncate_logits(scaled, [r.req.top_p for r in rows], [r.req.top_k for r in rows])
        logp = torch.log_softmax(scaled, dim=-1)
        if not bool(logp.amax(-1).isfinite().all()):  # (NaN or inf logits: a row's most likely token is not finite)
            raise RunFailed(f"{self.name}: the policy of version {self.version} gives NaN or inf logits: its "
                            "weights diverged (train.lr too high?); the run cannot go on")
        sampled = sample_tokens(logp.exp(), self._gen, [r.gen for r in rows])
        tokens = torch.where(greedy, scaled.argmax(-1), sampled)
        chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        tops = top_alternatives(logp, [r.req.top_logprobs for r in rows])
        for row, tok, lp, top in zip(rows, tokens.tolist(), chosen.tolist(), tops, strict=True):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(self.version)
            if top is not None:
                row.top.append(top)
            if row.req.on_token is not None:
                try:
                    row.stop_hit = bool(row.req.on_token(tok, lp, self.version, top))
                except Exception:  # (a broken callback ends its own request, not the engine)
                    row.cancelled = True

    def _retire(self) -> None:
        """Resolve finished rows and drop them (and all-padding columns) from the running batch."""
        eos = self.eos
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            reason = None
            if row.cancelled or row.future.cancelled():  # (the latter: abandoned by its caller)
                reason = "cancelled"
            elif row.stop_hit or (row.tokens and row.tokens[-1] in eos):
                reason = "stop"
            elif len(row.tokens) >= row.req.max_new_tokens:
                reason = "length"
            if reason is None:
                keep.append(i)
            else:
                row.resolve(reason)
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._cache, self._mask = None, None
            return
        assert self._cache is not None and self._mask is not None
        idx = torch.tensor(keep, device=self.device)
        mask = self._mask[idx]
        first = int(mask.any(0).nonzero()[0])
        self._mask = mask[:, first:]
        layers: list[Any] = list(self._cache.layers)
        for layer in layers:
            assert layer.keys is not None and layer.values is not None
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]

    def _fail_oom(self, rows: list[_Row], exc: BaseException) -> None:
        """Fail `rows` with `EngineOutOfMemory` and free what the failed step held; the engine goes on."""
        self.counts["out_of_memory"] += 1
        error = EngineOutOfMemory(f"engine {self.name} ran out of memory for a batch of {len(rows)} sequences "
                                  f"({type(exc).__name__})")
        for row in rows:
            with contextlib.suppress(cf.InvalidStateError):  # done, or cancelled by the caller meanwhile
                row.future.set_exception(error)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _fail_all(self, exc: BaseException | None) -> None:
        with self._cv:
            rows = self._admitting + self._rows + list(self._waiting)
            self._rows, self._waiting, self._admitting = [], deque(), []
            pending, self._pending = self._pending, None
            fills, self._fills = list(self._fills), deque()
            scores, self._scores = list(self._scores), deque()
        for job in scores:
            with contextlib.suppress(cf.InvalidStateError):
                job.future.set_exception(exc or RuntimeError(f"engine {self.name} closed before scoring"))
        for row in rows:
            if row.future.done():
                continue
            if exc is None:
                row.resolve("cancelled")
            else:
                with contextlib.suppress(cf.InvalidStateError):  # cancelled by the caller meanwhile
                    row.future.set_exception(exc)
        for load in [*fills, *([pending] if pending is not None else [])]:
            with contextlib.suppress(cf.InvalidStateError):  # done, or cancelled by the caller meanwhile
                load.done.set_exception(exc or RuntimeError(f"engine {self.name} closed before loading weights"))


def _spread(cache: Any, which: list[int], device: torch.device) -> Any:
    """`cache`, of one row per distinct context, as one row per request (`which`: each request's context)."""
    index = torch.tensor(which, device=device)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
    return cache


def _left_pad(t: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """Pad `t` with zeros on the left of `dim` up to `width`."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)
