"""Builds a run from a resolved config and runs it: the local runtime's composition root.

This is the only module that knows every component: it resolves the task pack, loads model,
tokenizer, data and reward function (`inputs`), creates engines and the trainer, writes the run
folder (`run_folder`), runs the pipeline with periodic greedy evaluation (`step_hooks`), and saves
`final/`. Components never import it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import write_dir_atomic, write_text_atomic
from asyncflow.config import Config, episodic
from asyncflow.config_checks import is_server_teacher
from asyncflow.config_schema import clip_defaults, torch_threads
from asyncflow.engines.http_client import HTTPError
from asyncflow.errors import RunFailed, UserError, WaitTimeout
from asyncflow.inputs import Inputs, resolve_inputs
from asyncflow.run_folder import FAILED_FILE, RunFolder, check_out_dir, resume_hint
from asyncflow.runtime.base import RuntimeSetup, runtime_class
from asyncflow.tokenizer import load_tokenizer


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, a scheduler's preemption, `docker stop`) ends the run as Ctrl-C does: its
    default action killed the process at once, so `trace.json`, the "it can go on from" line and the
    metric sinks' closing never happened. Main thread only, and only over the default handler."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _as_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _as_sigint(signum: int, frame: Any) -> None:
    """SIGTERM's handler: what SIGINT's handler does (asyncio's, which cancels the run's main task),
    called directly. It sent the process a SIGINT, which a process started with `&` from a script
    ignores (the shell starts it with SIGINT ignored): SIGTERM then did nothing and the run went on."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (no asyncio handler installed): Ctrl-C's plain effect
        raise KeyboardInterrupt


def train(cfg: Config, out: Path, *, progress_enabled: bool | None = None,
          explicit: Collection[str] = ()) -> dict[str, Any]:
    """Run training as configured; returns a summary (final eval accuracy, samples/s, ...).
    `explicit`: the dotted keys the user set (`load_config`'s second value), for the checks that
    need the loaded reward function."""
    resume = check_out_dir(out, cfg)
    from asyncflow.telemetry.progress import Progress

    show = cfg.logging.progress if progress_enabled is None else progress_enabled
    progress = Progress(cfg.train.max_steps, enabled=show)
    try:
        # bad input fails here, before torch loads (except for the tokenizer) and before the run
        # folder is written, so a mistake never leaves a half-made "run" that a retry would refuse
        inputs, reward_fn, hf_tok, episodes = _load_checked(cfg, resume, explicit, progress.message)
        if resume is None and cfg.checkpoint.every == 0:  # (said before any work a crash would lose)
            progress.message("[asyncflow] no checkpoints (checkpoint.every: 0): this run cannot be resumed")
        if resume is not None:
            changed = resume.changed
            progress.message(f"[asyncflow] resuming from {resume.path} (step {resume.step}, policy version "
                             f"{resume.version})" + (f"; changed settings: {', '.join(changed)}" if changed else ""))
        # Ray: the folder's absolute path, which actors are given (those of a joined cluster start in its
        # raylet's directory: a relative folder put the trainer's weights and checkpoints there)
        folder = RunFolder(out.resolve() if runtime_class(cfg.runtime.kind).absolute_folder else out, cfg, resume)
        try:
            with _sigterm_as_interrupt():
                return asyncio.run(_train(cfg, folder, progress, inputs, reward_fn, hf_tok, resume, episodes))
        except BaseException as exc:
            # a fresh run that ends (bad input, a cluster that cannot start, Ctrl-C) before it recorded
            # anything leaves nothing to keep: its files go, so the same command, retried, is not
            # refused as "already holds a run"; any other is kept, marked failed
            kept = folder.abandon(_error_line(exc))
            _raise_failed(exc, out, kept)
            raise
        finally:
            folder.close()
    finally:
        progress.close()


def _error_line(exc: BaseException) -> str:
    """What a kept run folder's `failed.json` says of why the run ended."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C or SIGTERM)"
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if isinstance(exc, (UserError, RunFailed, WaitTimeout)) else f"{type(exc).__name__}: {text}"


def _raise_failed(exc: BaseException, out: Path, kept: bool) -> None:
    """The error a failed run ends with: bad input in one line (naming the kept folder, when the run
    recorded samples before it showed: a reward function that always raises); a run that failed
    otherwise says where it can go on from. Returns for an error raised as it is."""
    if isinstance(exc, UserError):
        if kept:
            raise UserError(f"{exc}; the run folder {out} is kept, marked failed ({FAILED_FILE}), with each "
                            "recorded sample's error in samples.jsonl") from None
        return  # one line, no hint
    if isinstance(exc, WaitTimeout):  # a bounded wait ran out: one line with the key that bounds it
        raise RunFailed(f"{exc}; {resume_hint(out)}") from exc
    if isinstance(exc, HTTPError):  # an inference server refused or failed a call (rollout.engine: openai)
        raise RunFailed(f"inference server error: {exc}; {resume_hint(out)}") from exc
    if isinstance(exc, RunFailed):  # a worker the run needs died: say where it can go on from
        raise type(exc)(f"{exc}; {resume_hint(out)}") from exc
    if isinstance(exc, KeyboardInterrupt):  # (Ctrl-C: the CLI then says "interrupted", exit 130)
        print(f"[asyncflow] the run was interrupted; {resume_hint(out)}", file=sys.stderr)
    elif isinstance(exc, Exception):
        print(f"[asyncflow] the run failed; {resume_hint(out)}", file=sys.stderr)


def lenient_fn(inputs: Inputs) -> Any:
    """`eval.lenient_fn`'s function (None: none); its module is imported once, later calls find it."""
    from asyncflow.rewards import load_reward_fn

    if inputs.lenient_fn_path is None:
        return None
    return load_reward_fn(inputs.lenient_fn_path, key="eval.lenient_fn")


def _load_checked(cfg: Config, resume: Any, explicit: Collection[str],
                  log: Callable[[str], None]) -> tuple[Inputs, Any, Any, Any]:
    """The inputs, the reward function, the tokenizer and the environment factory, each checked
    (bad input fails here): with `resume`, against the checkpoint too."""
    from asyncflow.rewards import is_async_reward_fn, load_run_reward

    inputs = resolve_inputs(cfg, log, saved_rows=None if resume is None else resume.state.get("train_rows"))
    if resume is not None:
        from asyncflow.checkpoint import check_rows

        check_rows(resume, inputs.fingerprint)
    # multi-turn episodes are scored by their environment: no reward function is loaded
    reward_fn = None if episodic(cfg) else load_run_reward(cfg, inputs.reward_fn_path)
    lenient_fn(inputs)  # (a looser check that cannot be imported is bad input too, before the run starts)
    if reward_fn is not None and "reward.concurrency" in explicit and not is_async_reward_fn(reward_fn):
        raise UserError(f"reward.concurrency: applies to an async def reward function; {inputs.reward_fn_path} "
                        "is a plain function, called one batch at a time in a worker thread (remove the key)")
    hf_tok = load_tokenizer(inputs.model_dir, log=log)
    from asyncflow.engines.base import quiet_transformers

    quiet_transformers()
    from asyncflow.data import check_chat_prompts, check_prompts_fit, model_vocab_size

    check_chat_prompts(inputs.first_chat, hf_tok)
    if cfg.rollout.agent is None:  # (an agent writes its own prompts)
        check_prompts_fit([(inputs.train_rows, inputs.train_path), (inputs.eval_rows, inputs.eval_path)],
                          cfg.dataset.prompt_key, hf_tok, cfg.rollout.max_new_tokens, inputs.positions,
                          model_vocab_size(inputs.model_dir))
    from asyncflow.workflow.build import episode_components

    # (an environment or agent plugin that cannot be imported is bad input, before the run starts)
    episodes = episode_components(cfg)
    from asyncflow.model_folder import check_weights_match_config

    # (a LoRA checkpoint holds the adapter alone: the policy's weights are the base model's)
    check_weights_match_config(inputs.model_dir if resume is None or cfg.model.lora is not None else resume.path)
    distill = cfg.algorithm.distill
    if distill is not None and distill.teacher is not None and not is_server_teacher(distill.teacher):
        from asyncflow.engines.teacher import KEY, check_teacher_folder

        check_weights_match_config(check_teacher_folder(distill.teacher, inputs.model_dir), key=KEY)
    return inputs, reward_fn, hf_tok, episodes


async def _train(cfg: Config, folder: RunFolder, progress: Any, inputs: Inputs, reward_fn: Any, hf_tok: Any,
                 resume: Any = None, episodes: Any = (None, None)) -> dict[str, Any]:
    import torch

    from asyncflow.tokenizer import Tokenizer

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # this thread (the event loop, loading, the store) runs torch with one thread, so it never keeps an
    # OpenMP pool: the engines' decode threads and the trainer's passes, each with runtime.torch_threads,
    # are the only ones (asyncflow.compute_thread says why)
    torch.set_num_threads(1)
    tok = Tokenizer.of(hf_tok, inputs.model_dir)
    # a resumed run's policy (trainer and engines) starts from the checkpoint's HF folder, at its version;
    # the reference model and the tokenizer stay the base model's
    policy_dir = inputs.model_dir if resume is None or cfg.model.lora is not None else resume.path
    version = 0 if resume is None else resume.version
    runtime_cls = runtime_class(cfg.runtime.kind)
    if runtime_cls.opens_folder_first and resume is None:
        # A runtime whose actors open the folder (samples.jsonl, to append) gets it claimed first; a
        # resumed run cuts its logs back only once they are up (in `_run`), so actors that fail to
        # start leave it as it was. Cutting after they opened the file is safe: it is truncated in
        # place and they append through O_APPEND, which writes at its end as it is then.
        folder.open()
    runtime = await runtime_cls.launch(RuntimeSetup(
        cfg, policy_dir, inputs.model_dir, inputs.train_rows, folder.out, inputs.reward_fn_path, tok,
        torch_threads(cfg), version, progress.message, steps=0 if resume is None else resume.step))
    try:
        if resume is not None:
            from asyncflow.checkpoint import damaged_hint, restore_rng

            try:
                runtime.trainer.load_optimizer(str(resume.path))  # (LoRA: the checkpoint's adapter too)
                restore_rng(resume.path)
            except Exception as exc:  # (checked as archives in find_resume; a damaged member shows only now)
                raise UserError(f"checkpoint.resume: {resume.path}: the optimizer or RNG state cannot be loaded "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) "
                                f"{damaged_hint(resume.path)}") from None
        if resume is not None and cfg.model.lora is not None:
            await _publish_adapter(runtime, version)
        return await _run(cfg, folder, progress, inputs, reward_fn, hf_tok, tok, runtime, resume, episodes)
    finally:
        runtime.shutdown()


async def _publish_adapter(runtime: Any, version: int) -> None:
    """LoRA resume: the engines were built from the base model; the checkpoint's adapter (in the
    trainer since `load_optimizer`) is loaded into them as `version` before any request."""
    trainer = runtime.trainer
    # Ray: an object-store copy (export_weights counts a new version, and may broadcast it as one)
    state = trainer.stored_weights() if hasattr(trainer, "stored_weights") else trainer.export_weights()
    await asyncio.gather(*(e.load_weights(state, version, "drain") for e in runtime.engines))


def loss_settings(cfg: Config) -> Any:
    """The loss knobs of `cfg.algorithm` (Dr.GRPO's constant defaults to the longest possible response)."""
    from asyncflow.algorithms.losses import LossSettings
    from asyncflow.config import max_generated_tokens

    a = cfg.algorithm
    low, high = clip_defaults(a.loss)  # (null: validate resolves them at load; a config built otherwise may not)
    return LossSettings(
        loss=a.loss, clip_low=low if a.clip_low is None else a.clip_low,
        clip_high=high if a.clip_high is None else a.clip_high, dual_clip=a.dual_clip, is_level=a.is_level,
        is_cap=a.is_cap, is_mode=a.is_mode, agg=a.agg, norm_length=float(a.norm_length or max_generated_tokens(cfg)),
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, m2_threshold=a.m2_threshold, icepop_low=a.icepop_low,
        icepop_high=a.icepop_high,
    )


async def _run(cfg: Config, folder: RunFolder, progress: Any, inputs: Inputs, reward_fn: Any, hf_tok: Any, tok: Any,
               runtime: Any, resume: Any = None, episodes: Any = (None, None)) -> dict[str, Any]:
    """The run on a started runtime: the first evaluation, the pipeline, the final one, `final/`."""
    from asyncflow.algorithms.losses import make_loss_fn
    from asyncflow.clock import RealClock
    from asyncflow.evaluation import Evaluator
    from asyncflow.step_hooks import StepHooks, evaluates_again
    from asyncflow.telemetry.runlog import Tracer
    from asyncflow.workflow.build import build_pipeline

    engines, trainer = list(runtime.engines), runtime.trainer
    await _probe_logprobs(cfg, engines, trainer, inputs, tok)  # (before the run folder is written)
    ref_fn = _reference_model(cfg, runtime, inputs.model_dir) if cfg.algorithm.kl_coef > 0 else None
    teacher_fn = _teacher(cfg, runtime)
    saved_store = None if resume is None else _saved_store(resume)  # (read before the logs are cut)
    out = folder.open()  # the run is built: from here on it writes its folder
    redo_eval = resume is not None and evaluates_again(cfg, resume.step, resume.state["eval_history"])
    log = _run_log(cfg, out, resume, redo_eval)
    clock = RealClock()
    tracer = Tracer(now=clock.now, path=out / "trace.json")  # (streamed: a killed run keeps its spans)
    evaluator = None
    try:  # whatever fails from here (the step-0 evaluation, a resume's, the run) closes what the run opened:
        # the metric sinks (a W&B run left "running", TensorBoard's last events unflushed), the engines'
        # connections and threads, the reward threads, and the trace of what ran
        evaluator = Evaluator(cfg, inputs.eval_rows, tok, reward_fn, engines[0], log, tracer, episodes[0], clock,
                              lenient_fn=lenient_fn(inputs), agent=episodes[1])
        evaluator.max_context = inputs.positions
        # Ray actors that restart are built from the folder the run started from: keep it while they may
        actors_from = resume.path if resume is not None and runtime.restarts_from_start else None
        hooks = StepHooks(cfg, evaluator, engines=engines, runtime=runtime, log=log, tracer=tracer, clock=clock,
                          progress=progress, out=out, trainer=trainer, hf_tok=hf_tok, fingerprint=inputs.fingerprint,
                          protect=actors_from)
        await hooks.first_eval(resume, redo_eval)
        pipeline = build_pipeline(
            cfg, rows=inputs.train_rows, tokenizer=tok, reward_fn=reward_fn, engines=engines, train_engine=trainer,
            loss_fn=make_loss_fn(loss_settings(cfg)), clock=clock, log=log, tracer=tracer,
            ref_logprobs=ref_fn, teacher_logprobs=teacher_fn, on_step=hooks.on_step, on_trained=hooks.on_trained, store=runtime.store, gate=runtime.gate,
            env_factory=episodes[0], agent=episodes[1], collect_ahead=runtime.collect_ahead,
            stages_elsewhere=runtime.stages_elsewhere, max_context=inputs.positions,
        )
        hooks.pipeline = pipeline
        if resume is not None:
            assert saved_store is not None
            _restore(pipeline, runtime, resume, saved_store)
        placement: dict[str, Any] = {}
        try:
            await pipeline.run(remote=runtime.stages(), remote_stacks=runtime.remote_stacks)
            train_seconds = clock.now() - pipeline.t_start  # a resumed run's includes the time before the checkpoint
            final_eval = await hooks.final_eval()
        finally:
            await hooks.cancel_eval()  # (one still running: the run failed while it ran)
            runtime.collect(tracer, pipeline.counters)
            placement = runtime.summary()
    finally:  # (each step whatever the one before did: the log, with its W&B run, is closed last, always)
        await _close(evaluator, engines, tracer, log, out)
    summary = _summary(pipeline, evaluator, final_eval, train_seconds, placement)
    _write_final(out, trainer, hf_tok, summary)
    if actors_from is not None:  # the actors are gone: the kept starting checkpoint may go now
        from asyncflow.checkpoint import prune_checkpoints

        prune_checkpoints(out, cfg.checkpoint.keep)
    progress.message(
        f"[asyncflow] done: {summary['samples']} samples in {train_seconds:.1f} s "
        f"({summary['samples_per_s']:.0f}/s); eval accuracy {summary['eval_accuracy_before']:.3f} -> "
        f"{summary['eval_accuracy_after']:.3f}; run folder {out}"
    )
    return summary


def _write_final(out: Path, trainer: Any, hf_tok: Any, summary: dict[str, Any]) -> None:
    """`final/` and then `summary.json` (which marks the run finished), each whole or not at all: a
    crash while saving leaves the previous `final/` (a resumed run's) and no summary.json."""
    def fill(folder: Path) -> None:
        trainer.save(str(folder), with_optimizer=False)
        hf_tok.save_pretrained(str(folder))

    write_dir_atomic(out / "final", fill)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=1))


def _reference_model(cfg: Config, runtime: Any, model_dir: Path) -> Any:
    """The frozen base model the KL term is taken against (`algorithm.kl_coef` > 0)."""
    import torch

    if cfg.model.lora is not None:  # the trainer's own base model, its adapter off: no second copy
        return functools.partial(runtime.trainer.reference_logprobs, temperature=cfg.rollout.temperature)

    from asyncflow.engines.torch_train import ReferenceModel

    return ReferenceModel(model_dir, temperature=cfg.rollout.temperature,
                          micro_batch_size=cfg.train.micro_batch_size, dtype=getattr(torch, cfg.model.dtype),
                          device=_driver_model_device(cfg, runtime))


def _driver_model_device(cfg: Config, runtime: Any, setting: str = "auto") -> str:
    """Where a model the driver runs (the KL reference, a teacher folder) goes: `setting`, or with
    auto beside the torch trainer on its device (model.device); on the CPU with Ray (the driver is
    given no GPU; the actors hold them), with fsdp (an unsharded copy on rank 0's GPU is what
    sharding saves) and with local vllm (it holds its GPU's memory)."""
    from asyncflow.engines.base import pick_device

    if setting != "auto":
        return pick_device(setting)
    beside_trainer = runtime.trainer_here and cfg.train.engine == "torch" and cfg.rollout.engine != "vllm"
    return pick_device(cfg.model.device) if beside_trainer else "cpu"


def _teacher(cfg: Config, runtime: Any) -> Any:
    """The distillation teacher's log-probs (`algorithm.distill`; None: off): a server, or a folder
    run in this process as the KL reference is."""
    d = cfg.algorithm.distill
    if d is None or d.teacher is None:
        return None
    if is_server_teacher(d.teacher):
        from asyncflow.engines.teacher import ServerTeacher

        return ServerTeacher(d.teacher, timeout_s=d.timeout_s, token=os.environ.get(d.token_env) if d.token_env else None)
    import torch

    from asyncflow.engines.torch_train import ReferenceModel

    return ReferenceModel(d.teacher, temperature=cfg.rollout.temperature, micro_batch_size=cfg.train.micro_batch_size,
                          dtype=getattr(torch, cfg.model.dtype), device=_driver_model_device(cfg, runtime, d.device))


def _saved_store(resume: Any) -> Any:
    """The checkpoint's store state, checked. Read before the logs are cut: a damaged store.pt leaves
    the run as it was."""
    from asyncflow.checkpoint import damaged_hint
    from asyncflow.transfer_queue.store import check_state

    try:
        saved_store = resume.store
        check_state(saved_store)  # (what it holds, too: a damaged one failed the resume with a traceback)
    except Exception as exc:
        raise UserError(f"checkpoint.resume: {resume.path / 'store.pt'} cannot be loaded ({type(exc).__name__}: "
                        f"{exc}) {damaged_hint(resume.path)}") from None
    return saved_store


def _run_log(cfg: Config, out: Path, resume: Any, redo_eval: bool) -> Any:
    """The run's log, with the metric sinks the config names (TensorBoard, W&B)."""
    from asyncflow.config import effective_dict
    from asyncflow.telemetry.runlog import RunLog, make_sinks

    return RunLog(out, sinks=make_sinks(out, tensorboard=cfg.logging.tensorboard,
                                        wandb_project=cfg.logging.wandb_project if cfg.logging.wandb else None,
                                        config=effective_dict(cfg), resume_step=None if resume is None else resume.step,
                                        redo_eval=redo_eval))


def _restore(pipeline: Any, runtime: Any, resume: Any, store_state: Any) -> None:
    """A resumed run's store, trainer counters and feeder as its checkpoint left them."""
    st = resume.state
    live_groups = len({d["group_id"] for d in store_state["samples"]})
    pipeline.store.load_state_dict(store_state)
    pipeline.restore(resume.step, resume.version, st["counters"], st["elapsed_s"])
    admitted = resume.step * pipeline.trainer.settings.groups_per_step + live_groups
    runtime.restore_feeder(pipeline, st["next_group_id"], resume.version, admitted)


async def _probe_logprobs(cfg: Config, engines: list[Any], trainer: Any, inputs: Inputs, tok: Any) -> None:
    """`rollout.engine: openai` at temperature != 1: refuse a server whose log-probs ignore the
    temperature (workflow/logprob_probe.py)."""
    from asyncflow.workflow.logprob_probe import check_server_logprobs, probe_needed

    if not probe_needed(cfg.rollout.engine, cfg.rollout.temperature) or not inputs.train_rows:
        return
    prompt = tok.prompt_ids(inputs.train_rows[0][cfg.dataset.prompt_key])
    try:
        for e in engines:
            await check_server_logprobs(e, trainer, prompt, cfg.rollout.temperature)
    except BaseException:
        for e in engines:
            await e.close()
        raise


async def _close(evaluator: Any, engines: list[Any], tracer: Any, log: Any, out: Path) -> None:
    """Close what the run opened: the evaluator and the engines, then the trace is ended, then the log."""
    try:
        try:
            if evaluator is not None:
                evaluator.close()
            for e in engines:
                await e.close()
        finally:
            tracer.close()
    finally:
        log.close()


def _summary(pipeline: Any, evaluator: Any, final_eval: dict[str, Any], train_seconds: float,
             placement: dict[str, Any]) -> dict[str, Any]:
    """The run's `summary.json`."""
    return {
        "steps": pipeline.last_step,
        "samples": pipeline.counters.trained,
        "train_seconds": train_seconds,
        "samples_per_s": pipeline.counters.trained / max(train_seconds, 1e-9),
        "eval_accuracy_before": evaluator.history[0]["eval_accuracy"],
        "eval_accuracy_after": final_eval["eval_accuracy"],
        "dropped_stale": pipeline.counters.dropped_stale,
        "filtered": pipeline.counters.filtered,
        "reward_errors": pipeline.counters.reward_errors,
        # where every admitted sample went (samples.jsonl statuses, or still in the store); lost must be 0
        "accounting": pipeline.final_accounting,
        # the runtime's: `restarts` by stage (Ray actors that died and were brought back), `actors`
        # (where each ran at the end: [{role, index, node_id, pid}]), Ray's `weight_sync` counts
        "restarts": {},
        **placement,
    }
