"""MODEL: one real model (`--set model.path=DIR`) through asyncflow's engines on this machine: how
fast the rollout engine generates, how much of the machine's matmul peak the trainer turns into a
train step, and what a weight publication costs.

Rows, per dtype (`dtypes`, default bfloat16 and float32):

- `generate`: `prompts` questions x `n` samples each (a GRPO batch: the n requests of a prompt arrive
  together), `max_new_tokens` at temperature 1, through the HF engine (`engine: hf`); beside it
  (`baseline_tokens_per_s`) plain `model.generate` on the same prompts, the same n samples each
  (`num_return_sequences`), the same length and dtype. Tokens are the generated ones up to and with
  the EOS. Both run in a thread of their own with `threads` torch threads.
- `train`: `repeats` train steps (the median) of the torch trainer on `batch_size` of the generated
  samples, micro-batches of `micro_batch_size`: `tokens_per_s` (real tokens), `flops_per_s` (useful
  FLOPs, `model_flops.train_flops`), `peak_flops_per_s` (the model's matmuls timed here in the same
  dtype and threads, `model_flops.gemm_peak`), `mfu` (their ratio) and `peak_rss_bytes` (this
  process's peak so far: the engine's weights and the trainer's, masters and AdamW included).
- `sync`: a publication of the trainer's weights into the idle engine (the export, then the load),
  the median of `repeats` after a first: `seconds`, `bytes`, and `bound_s`, two memory copies of the
  bytes at this machine's copy speed measured in the same run (the export's cast and the engine's
  load; `weights.copy_seconds`); `engine: lora` the same for a LoRA adapter (r=16, all-linear).

The prompts are `chat_arith`'s held-out questions, as chat messages when the tokenizer has a chat
template, else as plain text.
"""

from __future__ import annotations

import resource
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from asyncflow.errors import UserError

T = TypeVar("T")
_KNOWN = ("model.path", "dtypes", "prompts", "n", "max_new_tokens", "batch_size", "micro_batch_size", "repeats",
          "threads", "phases")
PHASES = ("generate", "train", "sync")


def run_model(overrides: list[str], report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """The rows above, each reported as it is measured."""
    opts = parse(overrides)
    import torch

    torch.set_num_threads(1)  # (this thread keeps no OpenMP pool: asyncflow.compute_thread says why)
    rows: list[dict[str, Any]] = []
    for dtype in opts["dtypes"]:
        for row in ModelBench(opts, getattr(torch, dtype)).rows():
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def in_thread(fn: Callable[..., T], threads: int, *args: Any) -> T:
    """`fn(*args)` in a new thread with `threads` torch threads, which ends with it; its result."""
    from asyncflow.compute_thread import with_threads

    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(_outcome(with_threads, threads, fn, *args)))
    worker.start()
    worker.join()
    result, error = out[0]
    if error is not None:
        raise error
    return result  # type: ignore[no-any-return]


def _outcome(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(*args), None
    except BaseException as exc:  # (re-raised in the caller's thread)
        return None, exc


class ModelBench:
    """The rows of one dtype: an engine, a trainer and the samples the engine generated."""

    def __init__(self, opts: dict[str, Any], dtype: Any) -> None:
        from transformers import AutoTokenizer

        self.opts, self.dtype = opts, dtype
        self.name = str(dtype).removeprefix("torch.")
        self.dir = opts["model.path"]
        self.tok = AutoTokenizer.from_pretrained(self.dir)
        self.prompt_ids = _prompts(self.tok, opts["prompts"])
        self.samples: list[tuple[list[int], Any]] = []

    def rows(self) -> list[dict[str, Any]]:
        out = []
        phases = self.opts["phases"]
        if "generate" in phases or "train" in phases:
            row = self.generate()
            if "generate" in phases:
                out.append(row)
        if "train" in phases:
            out.append(self.train())
        if "sync" in phases:
            out += [self.sync(lora=False), self.sync(lora=True)]
        return out

    def _engine(self) -> Any:
        from transformers import AutoModelForCausalLM

        from asyncflow.engines.hf import HFEngine

        model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=self.dtype)
        eos = self.tok.eos_token_id
        return HFEngine(model, eos_token_id=eos, pad_token_id=self.tok.pad_token_id or eos, dtype=self.dtype,
                        threads=self.opts["threads"], seed=0)

    def generate(self) -> dict[str, Any]:
        from asyncflow.engines.base import GenRequest

        o = self.opts
        engine = self._engine()
        try:
            engine.generate_many([GenRequest(-1, self.prompt_ids[0], 4)])  # (warm)
            requests = [GenRequest(i, p, o["max_new_tokens"], temperature=1.0, seed=i)
                        for i, p in enumerate(p for p in self.prompt_ids for _ in range(o["n"]))]
            t0 = time.perf_counter()
            results = engine.generate_many(requests)
            seconds = time.perf_counter() - t0
            model = engine.model
        finally:
            engine.shutdown()
        self.samples = [(r.prompt_ids, res) for r, res in zip(requests, results, strict=True)]
        tokens = sum(len(r.response_ids) for r in results)
        base_tokens, base_s = in_thread(_plain_generate, o["threads"], model, self.tok, self.prompt_ids, o["n"],
                                        o["max_new_tokens"])
        return {"phase": "generate", "engine": "hf", "dtype": self.name, "requests": len(requests), "tokens": tokens,
                "seconds": seconds, "tokens_per_s": tokens / seconds, "baseline_tokens_per_s": base_tokens / base_s,
                "baseline_seconds": base_s, "speedup": (tokens / seconds) / (base_tokens / base_s)}

    def train(self) -> dict[str, Any]:
        from asyncflow.algorithms.losses import LossSettings, make_loss_fn
        from asyncflow.bench.model_flops import Shape, gemm_peak, train_flops
        from asyncflow.engines.torch_train import TorchTrainEngine

        o = self.opts
        batch = self._batch()
        trainer = TorchTrainEngine(self.dir, lr=1e-7, dtype=self.dtype, micro_batch_size=o["micro_batch_size"])
        loss = make_loss_fn(LossSettings())
        in_thread(trainer.train_step, o["threads"], batch, loss, 1.0)  # (warm)
        times = []
        for _ in range(o["repeats"]):
            t0 = time.perf_counter()
            in_thread(trainer.train_step, o["threads"], batch, loss, 1.0)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        lengths = [int(x) for x in batch.attention_mask.sum(-1).tolist()]
        trained = int(batch.response_mask.sum())
        shape = Shape.of(trainer.model.config)
        parts = -(-len(lengths) // o["micro_batch_size"])
        peak = in_thread(gemm_peak, o["threads"], shape, sum(lengths) // parts, min(trained // parts, 1024), self.dtype)
        flops = train_flops(shape, lengths, trained) / seconds
        return {"phase": "train", "engine": "torch", "dtype": self.name, "samples": len(lengths), "tokens": sum(lengths),
                "trained_tokens": trained, "seconds": seconds, "tokens_per_s": sum(lengths) / seconds,
                "flops_per_s": flops, "peak_flops_per_s": peak, "mfu": flops / peak,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    def _batch(self) -> Any:
        import torch

        from asyncflow.workflow.batch import build_train_batch

        if not self.samples:
            raise UserError("bench model --set phases: train needs the generate phase's samples (add generate)")
        picked = self.samples[: self.opts["batch_size"]]
        adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(picked))])
        return build_train_batch([p for p, _ in picked], [r.response_ids for _, r in picked],
                                 [r.behavior_logprobs for _, r in picked], adv, [True] * len(picked),
                                 self.tok.pad_token_id or self.tok.eos_token_id)

    def sync(self, *, lora: bool) -> dict[str, Any]:
        from asyncflow.bench.weights import copy_seconds
        from asyncflow.config_schema import LoraConfig
        from asyncflow.engines.base import state_bytes
        from asyncflow.engines.torch_train import TorchTrainEngine

        trainer = TorchTrainEngine(self.dir, lr=1e-7, dtype=self.dtype, lora=LoraConfig() if lora else None)
        engine = self._engine()
        try:
            times = []
            for version in range(1, self.opts["repeats"] + 2):
                t0 = time.perf_counter()
                state = in_thread(trainer.export_weights, self.opts["threads"])
                engine.request_weights(state, version, "swap").result(timeout=600)
                times.append(time.perf_counter() - t0)
        finally:
            engine.shutdown()
        nbytes = state_bytes(state) or 0
        bound = 2 * copy_seconds(nbytes)
        seconds = statistics.median(times[1:])
        return {"phase": "sync", "engine": "lora" if lora else "full", "dtype": self.name, "bytes": nbytes,
                "seconds": seconds, "first_seconds": times[0], "bound_s": bound, "ratio_to_bound": seconds / bound}


def _plain_generate(model: Any, tok: Any, prompt_ids: list[list[int]], n: int, max_new_tokens: int) -> tuple[int, float]:
    """Tokens `model.generate` gives the prompts (n samples each, up to and with each EOS) and its seconds."""
    import torch

    width = max(len(p) for p in prompt_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=pad)
    seconds = time.perf_counter() - t0
    tokens = 0
    for row in out[:, width:].tolist():
        tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return tokens, seconds


def _prompts(tok: Any, count: int) -> list[list[int]]:
    """`count` of chat_arith's held-out questions as token ids (chat messages where the tokenizer has
    a chat template)."""
    from asyncflow.tasks.chat_arith import make_splits

    rows = make_splits(seed=0)[1][:count]
    if getattr(tok, "chat_template", None):
        return [list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]) for r in rows]
    return [list(tok(r["prompt"][0]["content"])["input_ids"]) for r in rows]


def parse(overrides: list[str]) -> dict[str, Any]:
    """`--set key=value` items; a bad one is a one-line `UserError` naming the key."""
    from asyncflow.bench.options import names, positive, read_sets
    from asyncflow.config_schema import usable_cores
    from asyncflow.model_folder import check_model_dir

    raw = read_sets("model", overrides, _KNOWN)
    if "model.path" not in raw:
        raise UserError("bench model: --set model.path=DIR is required (a Hugging Face model folder: "
                        "asyncflow prepare smollm2 --out DIR makes one)")
    opts: dict[str, Any] = {"model.path": str(check_model_dir(Path(raw["model.path"]).expanduser(), key="model.path"))}
    opts["dtypes"] = names("model", raw, "dtypes", "bfloat16,float32", ("bfloat16", "float32"))
    opts["phases"] = names("model", raw, "phases", ",".join(PHASES), PHASES)
    defaults = {"prompts": 8, "n": 8, "max_new_tokens": 48, "batch_size": 32, "micro_batch_size": 8, "repeats": 3,
                "threads": usable_cores()}
    for key, default in defaults.items():
        opts[key] = positive("model", key, raw.get(key, str(default)), int)
    return opts
