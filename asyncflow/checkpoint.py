"""Checkpoints and resume: `RUN_DIR/checkpoints/step_N/` is a Hugging Face folder plus run state.

```
checkpoints/step_N/
  config.json, model.safetensors, generation_config.json, tokenizer files   # the policy at version N
  (model.lora: adapter_config.json + adapter_model.safetensors instead: the adapter; the base is the run's)
  optimizer.pt     # the trainer's optimizer state
  store.pt         # the TransferQueue's live samples (fields, versions, priorities, consumed marks)
  rng.pt           # torch and Python RNG states of the driver
  state.json       # step, policy version, data position, counters, eval history, log offsets, rows' fingerprint (last)
```

A checkpoint is taken at a step boundary: the step's samples are acked and its weights published,
and the trainer is not training. Everything in it describes that one moment:

- **data position**: `next_group_id`, one past the highest group id the store was ever given. The
  feeder numbers groups in the order it draws prompts from a seeded stream, so a resumed feeder
  skips exactly that many draws and goes on: no prompt is skipped or drawn twice.
- **in-flight samples**: every sample admitted and not yet trained or dropped is in `store.pt`
  with what it has so far (a prompt; a response and its per-token versions; a reward). Leases are
  not saved: a sample that was being generated or scored is simply available again, and is
  generated or scored once more after the resume. Samples already logged (trained, dropped,
  filtered) were removed from the store before the snapshot.
- **admission**: the staleness gate is rebuilt from the snapshot: `version = N`, admitted =
  `N x groups_per_step` trained groups + the live groups in the store.
- **logs**: the byte sizes of `metrics.jsonl` and `samples.jsonl` at that moment. A resume cuts
  both back to them, so rows of steps after N (which are redone) never appear twice.

The folder is written as `.step_N.partial` and renamed when complete (`state.json` last), so a crash
while saving leaves the previous checkpoint as the newest complete one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.atomic_files import fsync_path
from asyncflow.errors import UserError

STATE_FORMAT = 1
CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
LOGS = ("metrics.jsonl", "samples.jsonl")

# Settings a resumed run must share with the run it continues: they decide which prompt every group
# id stands for and what the saved samples are (prompt ids, group size, kind of episode).
# `train.engine`: torch and fsdp write different optimizer.pt layouts. `rollout.affinity`: decides the
# rollout stages the saved samples are routed to (and `rollout.workers` with it on; see below).
MUST_MATCH = ("seed", "task", "model.path", "model.cache_dir", "model.task_seed", "dataset.", "rollout.n", "train.batch_size",
              "rollout.env", "rollout.agent", "rollout.max_turns", "train.engine", "rollout.affinity")


@dataclass
class Resume:
    """What a resumed run starts from."""

    path: Path  # the checkpoint folder (also the policy's model folder)
    step: int
    version: int
    state: dict[str, Any]
    changed: list[str]  # settings that differ from the run being resumed (allowed ones; for a note)

    @property
    def store(self) -> Any:
        return load_safely(self.path / "store.pt")


def step_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step_{step}"


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `out`, oldest first."""
    root = out / CHECKPOINTS
    found = []
    if root.is_dir():
        for p in root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / "state.json").is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def log_offsets(out: Path) -> dict[str, int]:
    """The logs' sizes, flushed to the disk first: a resume cuts them back to these sizes, which a
    power loss must not leave longer than what the disk holds."""
    for name in LOGS:
        fsync_path(out / name)
    return {name: (out / name).stat().st_size if (out / name).exists() else 0 for name in LOGS}


def load_safely(path: Path) -> Any:
    """A checkpoint's `store.pt` or `rng.pt`, loaded with `weights_only=True`: containers, numbers,
    strings and tensors only. A pickle naming any other object (a run folder from someone else
    whose `__reduce__` would run code) is refused with a one-line `ValueError`, unexecuted."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line),
                      str(exc).splitlines()[0] if str(exc) else "")
        raise ValueError(f"{path} holds objects a checkpoint never contains ({detail[:200]}); refused, not loaded: "
                         "loading it could run code") from None


def write_checkpoint(out: Path, step: int, *, save_policy: Any, state: dict[str, Any], store_state: dict[str, Any],
                     keep: int, protect: Path | None = None) -> Path:
    """Write checkpoint `step` (blocking; call it in a worker thread). `save_policy(folder)` writes the
    HF folder and `optimizer.pt` into `folder`. Older checkpoints beyond `keep` are deleted after,
    except `protect` (see `prune_checkpoints`)."""
    import torch

    final = step_dir(out, step)
    tmp = final.parent / f".step_{step}.partial"
    # every partial folder (a write cut short, of this step or one the resumed run never checkpoints
    # again): the run folder's lock means no other writer; each was a whole model and optimizer
    for partial in final.parent.glob(".step_*.partial"):
        shutil.rmtree(partial, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(str(tmp))
    torch.save(store_state, tmp / "store.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
    for f in tmp.iterdir():  # on disk before state.json marks the folder complete (a power loss must
        fsync_path(f)            # not leave a "complete" checkpoint of empty files)
    body = json.dumps({"format": STATE_FORMAT, **state}, indent=1)
    (tmp / "state.json.tmp").write_text(body)
    fsync_path(tmp / "state.json.tmp")
    os.replace(tmp / "state.json.tmp", tmp / "state.json")
    fsync_path(tmp)
    if final.exists():  # a step redone after a resume: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(final.parent)
    prune_checkpoints(out, keep, protect)
    return final


def _finished_steps(out: Path) -> int | None:
    """The steps of the finished run in `out` (its `summary.json`), None when it did not finish."""
    try:
        steps = json.loads((out / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def prune_checkpoints(out: Path, keep: int, protect: Path | None = None) -> None:
    """Delete complete checkpoints beyond the newest `keep`, but not `protect`: the checkpoint a Ray
    run resumed from, which its rollout and reward actors are built from again when Ray restarts
    one (deleted, the restart failed and ended the run). The run prunes once more at its end."""
    for _, old in complete_checkpoints(out)[:-keep]:
        if protect is None or old.resolve() != protect.resolve():
            shutil.rmtree(old, ignore_errors=True)


def find_resume(out: Path, cfg: Any) -> Resume:
    """The newest complete checkpoint of the run in `out`, checked against `cfg`; one-line errors.
    A run whose `summary.json` (written last, once `final/` is saved) says it reached
    `train.max_steps` is finished: its newest checkpoint may be older when `max_steps` is not a
    multiple of `checkpoint.every`, and resuming from it redid the last steps and replaced `final/`."""
    finished = _finished_steps(out)
    found = complete_checkpoints(out)
    if finished is not None and finished >= cfg.train.max_steps:
        how = "raise train.max_steps to continue" if found else \
            "it has no checkpoint to continue from (checkpoint.every was 0): start again in a new --out"
        raise UserError(f"checkpoint.resume: the run in {out} finished at step {finished} (its summary.json), and "
                        f"train.max_steps is {cfg.train.max_steps}: nothing left to train; {how}")
    if not found:
        raise UserError(
            f"checkpoint.resume: {out} holds a run but no complete checkpoint (was checkpoint.every 0, or did it stop "
            f"before the first?); start again in a new --out"
        )
    step, path = found[-1]
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"checkpoint.resume: cannot read {path / 'state.json'}: {exc}") from None
    if not isinstance(state, dict):
        raise UserError(f"checkpoint.resume: {path / 'state.json'} is not a JSON object")
    if state.get("format") != STATE_FORMAT:
        raise UserError(f"checkpoint.resume: {path} has state format {state.get('format')!r}, expected {STATE_FORMAT}")
    _check_checkpoint(path, state)
    # at max_steps exactly (and not finished, above): the run died after its last checkpoint, before
    # `final/` and summary.json were written (in the final evaluation, say); the resume finishes it
    if step > cfg.train.max_steps:
        raise UserError(
            f"checkpoint.resume: the newest checkpoint ({path}) is at step {step}, and train.max_steps is "
            f"{cfg.train.max_steps}: nothing left to train; raise train.max_steps to continue"
        )
    return Resume(path, int(state["step"]), int(state["version"]), state, _changed_settings(out, cfg))


_STATE_TYPES: dict[str, type | tuple[type, ...]] = {
    "step": int, "version": int, "logs": dict, "eval_history": list, "counters": dict,
    "elapsed_s": (int, float), "next_group_id": int}


def damaged_hint(path: Path) -> str:
    """The end of every message about an unreadable checkpoint file: what to do about it."""
    return f"(a damaged checkpoint: remove {path} to resume from the one before)"


def _check_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Everything a resume reads from the checkpoint is there and readable, checked before anything
    is written (the logs are cut only once the run is built): a damaged file ended the resume in a
    traceback, after the logs were cut when it was `store.pt`. One line naming the file."""
    import zipfile

    from asyncflow.model_folder import check_model_dir

    damaged = damaged_hint(path)
    missing = [k for k in _STATE_TYPES if k not in state]
    if missing:
        raise UserError(f"checkpoint.resume: {path / 'state.json'} lacks {', '.join(missing)} {damaged}")
    for key, kind in _STATE_TYPES.items():
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise UserError(f"checkpoint.resume: {path / 'state.json'}: {key!r} is {state[key]!r} {damaged}")
    if not all(isinstance(v, int) for v in state["logs"].values()) or not state["eval_history"] \
            or not all(isinstance(r, dict) for r in state["eval_history"]):
        raise UserError(f"checkpoint.resume: {path / 'state.json'}: 'logs' or 'eval_history' is malformed {damaged}")
    adapter = [path / "adapter_config.json", path / "adapter_model.safetensors"]  # (a LoRA run's: model.lora)
    if adapter[0].is_file():
        if not adapter[1].is_file():
            raise UserError(f"checkpoint.resume: {path} has no {adapter[1].name} {damaged}")
    else:
        try:
            check_model_dir(path, key="checkpoint.resume")
        except UserError as exc:
            raise UserError(f"{exc} {damaged}") from None
    for name in ("optimizer.pt", "store.pt", "rng.pt"):  # torch.save files: zip archives
        f = path / name
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip() if name == "rng.pt" else None  # (small: every byte checked)
        except FileNotFoundError:
            raise UserError(f"checkpoint.resume: {path} has no {name} {damaged}") from None
        except (OSError, zipfile.BadZipFile, EOFError) as exc:
            raise UserError(f"checkpoint.resume: {f} cannot be read ({exc}) {damaged}") from None
        if bad is not None:
            raise UserError(f"checkpoint.resume: {f} is corrupt (member {bad}) {damaged}")
    try:  # (small: a foreign pickle is refused here, before anything is written, as store.pt is)
        load_safely(path / "rng.pt")
    except ValueError as exc:
        raise UserError(f"checkpoint.resume: {exc} {damaged}") from None


def rows_fingerprint(rows: list[dict[str, Any]], keys: tuple[str | None, ...]) -> str:
    """"COUNT:HASH" of the training rows' prompt and label columns, in order: a saved sample names its
    prompt by row index, so a resume must see the same rows (`check_rows`)."""
    import hashlib

    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r.get(k) for k in keys if k is not None], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return f"{len(rows)}:{h.hexdigest()[:16]}"


def check_rows(resume: Resume, fingerprint: str) -> None:
    """Refuse a resume whose training rows differ from the run's (a checkpoint that does not record
    them, from an older version, is not checked)."""
    saved = resume.state.get("train_rows")
    if saved is not None and saved != fingerprint:
        raise UserError(
            f"checkpoint.resume: the training rows differ from the run's ({saved.split(':')[0]} rows then, "
            f"{fingerprint.split(':')[0]} now, or other prompts): a changed dataset file, eval.path or eval.size "
            "(which rows are held out for eval) would score saved samples against other prompts; keep them")


def _leaves(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _changed_settings(out: Path, cfg: Any) -> list[str]:
    """Keys whose value differs from the run being resumed; a change that would alter what the saved
    samples and the data position mean (`MUST_MATCH`) is refused."""
    import yaml

    from asyncflow.config import effective_dict, from_dict

    try:
        raw = yaml.safe_load((out / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"checkpoint.resume: cannot read {out / 'config.yaml'}: {exc}") from None
    with contextlib.suppress(UserError):  # as this version writes it (older runs recorded nulls and every key)
        raw = effective_dict(from_dict(raw))
    old, new = _leaves(raw), _leaves(effective_dict(cfg))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    routed = bool(old.get("rollout.affinity")) or bool(new.get("rollout.affinity"))
    for key in changed:
        if any(key == m or (m.endswith(".") and key.startswith(m)) for m in MUST_MATCH) \
                or (key == "rollout.workers" and routed):  # samples routed to a worker that no longer exists
            raise UserError(
                f"checkpoint.resume: {key} is {new.get(key)!r} but the run in {out} used {old.get(key)!r}; "
                f"a resumed run must keep it (it decides which prompts and samples the checkpoint holds)"
            )
    return changed


def cut_logs(out: Path, offsets: dict[str, int]) -> None:
    """Cut the run's logs back to what they held at the checkpoint (rows of redone steps go)."""
    for name in LOGS:
        p = out / name
        if p.exists() and p.stat().st_size > offsets.get(name, 0):
            os.truncate(p, offsets.get(name, 0))


def restore_rng(path: Path) -> None:
    import torch

    rng = load_safely(path / "rng.pt")
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
