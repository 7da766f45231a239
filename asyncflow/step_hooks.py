"""What runs between train steps (the pipeline's `on_step`): the step's metrics row, a checkpoint when
one is due, and the greedy evaluations beside training (periodic, the first and the final one, and
the early stop when eval accuracy has flattened)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.config import Config
from asyncflow.evaluation import Evaluator, eval_flattened

if TYPE_CHECKING:
    from asyncflow.workflow.pipeline import Pipeline
    from asyncflow.workflow.trainer import StepResult


def engine_batching(engines: list[Any]) -> dict[str, float]:
    """Mean decode batch and mean rows per prefill over all engines so far (how well requests batch)."""
    total: dict[str, float] = {}
    for e in engines:
        for k, v in e.stats().items():
            total[k] = total.get(k, 0.0) + v
    if not total.get("decode_steps") or not total.get("prefills"):
        return {}
    return {"engine/decode_batch_mean": total["decode_rows"] / total["decode_steps"],
            "engine/prefill_rows_mean": total["prefill_rows"] / total["prefills"]}


def evaluates_again(cfg: Config, step: int, history: list[dict[str, Any]]) -> bool:
    """Whether a run resumed from the checkpoint of `step` logs an evaluation at that step again: the
    one due there (it begins after the checkpoint, so the checkpoint's history never holds it), or
    the final one when the checkpoint is of the last step."""
    if step >= cfg.train.max_steps:
        return True
    return cfg.eval.every > 0 and step % cfg.eval.every == 0 and history[-1]["step"] != step


class StepHooks:
    """The pipeline's `on_step` and the evaluations it schedules. At most one evaluation runs beside
    training (`pending_eval`); `last_eval` is the newest finished one, for the progress line.
    `pipeline` is set once the pipeline is built (it is built with `on_step`)."""

    pipeline: Pipeline

    def __init__(self, cfg: Config, evaluator: Evaluator, *, engines: list[Any], runtime: Any, log: Any,
                 tracer: Any, clock: Any, progress: Any, out: Path, trainer: Any, hf_tok: Any, fingerprint: str,
                 protect: Path | None) -> None:
        self.cfg, self.evaluator, self.engines, self.runtime = cfg, evaluator, engines, runtime
        self.log, self.tracer, self.clock, self.progress = log, tracer, clock, progress
        self.out, self.trainer, self.hf_tok = out, trainer, hf_tok
        self.fingerprint, self.protect = fingerprint, protect  # (protect: the checkpoint rotation keeps it)
        self.pending_eval: asyncio.Task[dict[str, float]] | None = None
        self.store_read: asyncio.Future[dict[str, float]] | None = None  # the step's store metrics (`on_trained`)
        self.last_eval: dict[str, Any] = {}
        self.eval_skip_told = False

    async def first_eval(self, resume: Any, redo_eval: bool) -> None:
        """The evaluation before training; a resumed run's history up to its checkpoint instead."""
        evaluator = self.evaluator
        if resume is None:
            self.last_eval = await evaluator.run(step=0)
            error = self.last_eval.get("eval_error")
            self.progress.message(f"[asyncflow] eval before training: accuracy={self.last_eval['eval_accuracy']:.3f}"
                                  + (f" (eval_error: {error})" if error else ""))
        else:  # the evaluations logged up to the checkpoint; one due at its step runs now (it may have been cut)
            evaluator.history = list(resume.state["eval_history"])
            # (at max_steps: the run died before its end; the final evaluation below is that step's)
            due = redo_eval and resume.step < self.cfg.train.max_steps
            self.last_eval = await evaluator.run(step=resume.step) if due else evaluator.history[-1]

    def on_trained(self) -> None:
        """The step's samples are acked and its weights about to be published: read the store for the
        step's row now. One read, not awaited here: a store in another process (Ray) answers it while
        the engines load, not as a round trip of its own between the publication and the next batch."""
        self.store_read = self._read_store()
        # (its error taken: a failed publication never awaits it)
        self.store_read.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _read_store(self) -> asyncio.Future[dict[str, float]]:
        """The store's metrics: one awaitable call (a blocking one would hold the event loop for a
        store's round trip); the in-process store reads them now."""
        return asyncio.ensure_future(self.pipeline.store.metrics_async())

    async def on_step(self, result: StepResult) -> None:
        cfg = self.cfg
        read, self.store_read = self.store_read, None
        store = await (read if read is not None else self._read_store())  # (None: no `on_trained` came)
        row = self.train_row(result, store)
        self.log.metric(row)
        if cfg.checkpoint.every > 0 and result.step % cfg.checkpoint.every == 0:
            if self.pending_eval is not None:  # its row goes into this checkpoint's logs: a resume lost it
                await self.pending_eval
            await self.save_checkpoint(result.step)
        stopping = self._stop_if_flat()
        due = (cfg.eval.every > 0 and result.step % cfg.eval.every == 0 and result.step < cfg.train.max_steps
               and not stopping)  # (the final evaluation follows this step)
        if due:
            self._start_eval(result.step)
        self.progress.update(
            result.step,
            {"samples/s": row["samples_per_s"], "reward": row["reward_mean"], "stale": row["staleness_mean"],
             "eval": self.last_eval["eval_accuracy"], "in_store": int(store["samples"])},
        )

    def train_row(self, result: StepResult, store: dict[str, float]) -> dict[str, Any]:
        """The step's `kind: "train"` row of metrics.jsonl (`store`: the store's metrics now)."""
        pipeline = self.pipeline
        c = pipeline.counters
        now = self.clock.now()
        rollout_busy, train_busy = pipeline.busy_fractions()
        return {
            "kind": "train",
            "step": result.step,
            "policy_version": result.version,
            "samples": c.trained,
            "tokens": c.tokens,
            "time_s": now - pipeline.t_start,
            "samples_per_s": c.trained / max(now - pipeline.t_start, 1e-9),
            "lr": self.cfg.train.lr,  # the configured rate; a train engine's own `lr` metric (a schedule) wins
            **{k: v for k, v in result.metrics.items()},
            "kl": result.metrics.get("kl", 0.0),
            **engine_batching(self.engines),
            "rollout_busy_frac": rollout_busy,
            "train_busy_frac": train_busy,
            "dropped_stale": c.dropped_stale,
            "filtered": c.filtered,
            "filter_overflow": c.filter_overflow,
            **{f"response_len/{k}": c.response_tokens[k] / n for k, n in c.response_count.items() if n},
            "reward_errors": c.reward_errors,
            "cancelled": c.cancelled,
            "groups_partial": c.groups_partial,
            "stragglers_aborted": c.stragglers_aborted,
            **self.runtime.row_fields(),
            **{f"store/{k}": v for k, v in store.items()},
        }

    def _stop_if_flat(self) -> bool:
        """Take a finished evaluation's result; stop the run early when eval accuracy has flattened."""
        if self.pending_eval is None or not self.pending_eval.done():
            return False
        self.last_eval, self.pending_eval = self.pending_eval.result(), None  # (the progress line shows it from now on)
        cfg = self.cfg
        if not eval_flattened([h["eval_accuracy"] for h in self.evaluator.history], cfg.eval.patience,
                              cfg.eval.min_delta):
            return False
        last = self.pipeline.stop_early()  # (the step training while this row is written, if any)
        self.progress.message(f"[asyncflow] eval accuracy has not risen by more than {cfg.eval.min_delta:g} in "
                              f"{cfg.eval.patience} evaluations (eval.patience): stopping after step {last}")
        return True

    def _start_eval(self, step: int) -> None:
        """Start the evaluation due at `step` beside training, unless one is still running."""
        if self.pending_eval is None:
            self.pending_eval = asyncio.create_task(self.evaluator.run(step=step))
        elif not self.eval_skip_told:  # evaluations run beside training: one still running means this
            self.eval_skip_told = True  # one is skipped; said once
            self.progress.message(f"[asyncflow] note: the evaluation due at step {step} is skipped: the previous "
                                  "one is still running (eval.every is shorter than an evaluation takes; raise it or "
                                  "lower eval.size). Later skips are not reported one by one.")

    async def save_checkpoint(self, step: int) -> None:
        """At a step boundary (this step's samples acked, its weights published, the trainer idle):
        snapshot the store and the counters at once, then write the folder in a worker thread while
        rollout goes on."""
        from asyncflow.checkpoint import log_offsets, write_checkpoint

        pipeline, clock = self.pipeline, self.clock
        start = clock.now()
        store_state = pipeline.store.state_dict()
        state = {
            "step": step, "version": pipeline.version, "next_group_id": store_state["next_group_id"],
            "counters": asdict(pipeline.counters), "elapsed_s": clock.now() - pipeline.t_start,
            "eval_history": list(self.evaluator.history), "logs": log_offsets(self.out),
            "train_rows": self.fingerprint,
        }

        def save_policy(folder: str) -> None:
            self.trainer.save(folder, with_optimizer=True)
            self.hf_tok.save_pretrained(folder)

        path = await asyncio.to_thread(write_checkpoint, self.out, step, save_policy=save_policy, state=state,
                                       store_state=store_state, keep=self.cfg.checkpoint.keep, protect=self.protect)
        self.tracer.span("trainer", f"checkpoint step {step}", start, clock.now())
        self.progress.message(f"[asyncflow] checkpoint {path} ({len(store_state['samples'])} in-flight samples, "
                              f"{clock.now() - start:.1f} s)")

    async def final_eval(self) -> dict[str, Any]:
        """The evaluation after the last step (once the one still running, if any, has ended)."""
        if self.pending_eval is not None:
            await self.pending_eval
        return await self.evaluator.run(step=self.pipeline.last_step)

    async def cancel_eval(self) -> None:
        """Cancel the evaluation still running (the run failed while it was running)."""
        if self.pending_eval is not None and not self.pending_eval.done():
            self.pending_eval.cancel()
            await asyncio.wait([self.pending_eval], timeout=10)
