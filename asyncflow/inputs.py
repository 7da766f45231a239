"""A run's inputs, resolved from the config before anything heavy loads: the model folder, the train
and eval rows (a held-out slice of the dataset when no eval set is given) and the reward function."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncflow.config import Config, episodic
from asyncflow.envs.verifiers_env import is_verifiers_spec
from asyncflow.errors import UserError
from asyncflow.eval_set import draw_held_out, first_prompts, rows_by_prompt
from asyncflow.run_folder import check_folder_path

if TYPE_CHECKING:
    from asyncflow.tasks import TaskPack


@dataclass
class Inputs:
    """Everything resolved from the config before training starts."""

    model_dir: Path
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    reward_fn_path: str | list[str]  # `reward.fn`: one function or several
    first_chat: str | None = None  # where the first conversational prompt is (None: all are text)
    train_path: str = ""  # the files the rows came from (for messages naming a row)
    eval_path: str = ""
    fingerprint: str = ""  # of the training rows (`checkpoint.rows_fingerprint`), saved with each checkpoint
    positions: int | None = None  # the model's positions (`data.model_positions`; None: unknown)
    lenient_fn_path: str | None = None  # `eval.lenient_fn`, resolved (None: no second look)


def resolve_inputs(cfg: Config, log: Callable[[str], None], saved_rows: str | None = None) -> Inputs:
    """Model folder, train/eval rows and reward function: from the config, else from the task pack.
    The eval rows are every copy of the first `eval.size` distinct prompts (`eval_set`).

    Given paths are checked without torch (a bad model folder or dataset costs milliseconds); only
    preparing a task pack's own model imports it. `saved_rows`: the training rows' fingerprint a
    resumed checkpoint recorded (`checkpoint.check_rows` refuses a resume whose rows differ).
    """
    from asyncflow.checkpoint import rows_fingerprint
    from asyncflow.data import REWARD_ARGUMENTS, check_columns, model_positions, read_rows, subset
    from asyncflow.rewards import absolute_reward_path

    task = None
    if cfg.task is not None:
        from asyncflow.tasks import get_task

        task = get_task(cfg.task)
    model_dir = _model_dir(cfg, task, log)
    if cfg.rollout.sync_dir is not None:  # the openai engine writes weights there: a file would fail late
        check_folder_path(Path(cfg.rollout.sync_dir), "rollout.sync_dir")
    data_path, task_eval = _data_paths(cfg, task, model_dir, log)
    rows = read_rows(data_path, config=cfg.dataset.config)
    _note_hub(log, "dataset.path", data_path)
    reserved = frozenset() if episodic(cfg) else REWARD_ARGUMENTS  # (an environment gets the row as it is)
    chats = [check_columns(rows, data_path, cfg.dataset.prompt_key, cfg.dataset.label_key, reserved)]
    if cfg.eval.path is not None or task_eval is not None:
        eval_path = cfg.eval.path if cfg.eval.path is not None else str(task_eval)
        eval_rows = read_rows(eval_path, key="eval.path", config=cfg.dataset.config)
        _note_hub(log, "eval.path", eval_path)
        chats.append(check_columns(eval_rows, eval_path, cfg.dataset.prompt_key, cfg.dataset.label_key, reserved))
    else:  # a held-out slice of the dataset: whole prompts (all their copies), at most 10% of its prompts
        eval_path = data_path
        rows, eval_rows = _hold_out(cfg, rows, data_path, log, saved_rows)
    fn = cfg.reward.fn
    reward_path: str | list[str] = (task.reward_fn_path if task is not None else "") if not fn else \
        absolute_reward_path(fn) if isinstance(fn, str) else [absolute_reward_path(f) for f in fn]
    # the task's looser check goes with the task's own reward only (it looks at the same answers)
    lenient = cfg.eval.lenient_fn or (task.lenient_fn_path if task is not None and not fn else "")
    first_chat = next((c for c in chats if c is not None), None)
    eval_rows = subset(eval_rows, first_prompts(rows_by_prompt(eval_rows, cfg.dataset.prompt_key), cfg.eval.size))
    return Inputs(model_dir, rows, eval_rows, reward_path, first_chat, data_path, eval_path,
                  lenient_fn_path=absolute_reward_path(lenient) if lenient else None,
                  fingerprint=rows_fingerprint(rows, (cfg.dataset.prompt_key, cfg.dataset.label_key)),
                  positions=model_positions(model_dir))


def resolve_model_dir(cfg: Config, log: Callable[[str], None]) -> Path:
    """The policy's model folder alone (what `resolve_inputs` finds first): `model.path` checked, or
    the task pack's model prepared."""
    task = None
    if cfg.task is not None:
        from asyncflow.tasks import get_task

        task = get_task(cfg.task)
    return _model_dir(cfg, task, log)


def _note_hub(log: Callable[[str], None], key: str, path: str) -> None:
    """Say so where `key`'s rows were read from the Hugging Face Hub."""
    from asyncflow.hub import hub_id, hub_note

    repo = hub_id(path)
    if repo is not None:
        log(hub_note(key, repo))


def _data_paths(cfg: Config, task: TaskPack | None, model_dir: Path,
                log: Callable[[str], None]) -> tuple[str, Path | None]:
    """`dataset.path`, else the task's training prompts (its model folder's train.jsonl, or what its
    `data` writes into the cache); and the task's eval prompts where `dataset.path` is not given."""
    if cfg.dataset.path is not None:
        return cfg.dataset.path, None
    if is_verifiers_spec(cfg.rollout.agent):  # a verifiers environment's own tasks (no eval split: a held-out slice)
        from asyncflow.envs.verifiers_env import taskset_rows_file

        assert cfg.rollout.agent is not None
        return str(taskset_rows_file(cfg.rollout.agent, _cache_root(cfg))), None
    if (model_dir / "train.jsonl").is_file():
        held = model_dir / "eval.jsonl"
        return str(model_dir / "train.jsonl"), held if held.is_file() else None
    if task is not None and task.data is not None:
        train, held = task.data(_cache_root(cfg), seed=cfg.model.task_seed, log=log)
        return str(train), held
    # (the message named a dataset.path the user never set)
    raise UserError(f"dataset.path: not set, and model.path ({model_dir}) has no train.jsonl to default to; "
                    "set dataset.path")


def _model_dir(cfg: Config, task: TaskPack | None, log: Callable[[str], None]) -> Path:
    """`model.path`, checked (a GGUF file: its converted folder, converted once into the cache); else
    the task pack's model folder, prepared (its cache folder checked first)."""
    from asyncflow.gguf_folder import is_gguf_path
    from asyncflow.hub import hub_id, hub_note, local_path, snapshot
    from asyncflow.model_folder import check_model_dir

    if cfg.model.path is not None and is_gguf_path(cfg.model.path):
        from asyncflow.gguf_folder import cached_folder, check_gguf_file

        gguf = check_gguf_file(cfg.model.path)
        return check_model_dir(cached_folder(gguf, _cache_root(cfg), log))
    if cfg.model.path is not None:
        repo = hub_id(cfg.model.path)
        if repo is None:
            return check_model_dir(local_path(cfg.model.path, "model.path"))
        folder = snapshot(repo, "model.path")
        log(hub_note("model.path", repo, folder))
        return check_model_dir(folder)
    assert task is not None
    if task.shipped(cfg.model.task_seed) is None:  # (a shipped one: no cache is read or written)
        _cache_root(cfg)  # (checked before minutes of preparing)
    return task.prepare(cfg.model.cache_dir, seed=cfg.model.task_seed, log=log)


def _cache_root(cfg: Config) -> Path:
    """`model.cache_dir`, else $ASYNCFLOW_CACHE, else ~/.cache/asyncflow; checked to be a folder path."""
    from asyncflow.tasks.tiny import default_cache_dir

    if cfg.model.cache_dir is not None:
        check_folder_path(Path(cfg.model.cache_dir), "model.cache_dir")
        return Path(cfg.model.cache_dir).expanduser()
    env = "ASYNCFLOW_CACHE" if os.environ.get("ASYNCFLOW_CACHE") else "model.cache_dir (default)"
    check_folder_path(default_cache_dir(), env)
    return default_cache_dir()


def _hold_out(cfg: Config, rows: list[dict[str, Any]], data_path: str, log: Callable[[str], None],
              saved_rows: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The dataset split into training rows and a held-out eval slice of whole prompts (every copy, so
    an eval prompt is never trained on): up to eval.size distinct prompts, at most 10% of them, their
    copies at most 20% of the rows (room for a random draw of 10% of the prompts to have more copies
    than the average, not for a prompt that is a large part of the data)."""
    from asyncflow.checkpoint import rows_fingerprint
    from asyncflow.data import subset

    groups = rows_by_prompt(rows, cfg.dataset.prompt_key)
    held = draw_held_out(groups, min(cfg.eval.size, len(groups) // 10), len(rows) // 5, cfg.seed + 1)

    def training(held: list[int]) -> list[dict[str, Any]]:
        out = set(held)
        return subset(rows, [i for i in range(len(rows)) if i not in out])

    keys = (cfg.dataset.prompt_key, cfg.dataset.label_key)
    if saved_rows is not None and rows_fingerprint(training(held), keys) != saved_rows:
        # a checkpoint saved while eval.size counted rows trained on the rows left by a slice of up to
        # eval.size rows (10% of them at most): it resumes on that slice, its saved samples' prompts
        by_rows = draw_held_out(groups, len(groups), min(cfg.eval.size, len(rows) // 10), cfg.seed + 1)
        if rows_fingerprint(training(by_rows), keys) == saved_rows:
            log(f"[asyncflow] note: the checkpoint's run held out {len(by_rows)} rows of {data_path} for eval "
                "(eval.size counted rows then); resuming on that slice")
            held = by_rows
    train, eval_rows = training(held), subset(rows, held)
    if not eval_rows:  # under 10 distinct prompts (or none fits in 20% of the rows): evaluate on the training prompts, and say so
        eval_rows = train
        log(f"[asyncflow] note: {data_path} has {len(rows)} rows of {len(groups)} distinct prompt(s), too few to "
            "hold out an eval set; evaluating on the training prompts (give eval.path for a held-out set)")
    return train, eval_rows
