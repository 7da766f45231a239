"""Checkpoints and resume: `RUN_DIR/checkpoints/step_N/` is a Hugging Face folder plus run state.

```
checkpoints/step_N/
  config.json, model.safetensors, generation_config.json, tokenizer files   # the policy at version N
  optimizer.pt     # the trainer's optimizer state
  store.pt         # the TransferQueue's live samples (fields, versions, priorities, consumed marks)
  rng.pt           # torch and Python RNG states of the driver
  state.json       # step, policy version, data position, counters, eval history, log offsets (written last)
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

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncflow.errors import UserError

STATE_FORMAT = 1
CHECKPOINTS = "checkpoints"
_STEP_DIR = re.compile(r"^step_(\d+)$")
LOGS = ("metrics.jsonl", "samples.jsonl")

# Settings a resumed run must share with the run it continues: they decide which prompt every group
# id stands for and what the saved samples are (prompt ids, group size, kind of episode).
MUST_MATCH = ("seed", "task", "model.path", "model.cache_dir", "dataset.", "rollout.n", "train.batch_size",
              "rollout.env", "rollout.agent", "rollout.max_turns")


@dataclass
class Resume:
    """What a resumed run starts from."""

    path: Path  # the checkpoint folder (also the policy's model folder)
    step: int
    version: int
    state: dict[str, Any]
    changed: list[str]  # settings that differ from the run being resumed (allowed ones; for a note)

    @property
    def store(self) -> dict[str, Any]:
        import torch

        loaded: dict[str, Any] = torch.load(self.path / "store.pt", weights_only=False)
        return loaded


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
    return {name: (out / name).stat().st_size if (out / name).exists() else 0 for name in LOGS}


def write_checkpoint(out: Path, step: int, *, save_policy: Any, state: dict[str, Any], store_state: dict[str, Any],
                     keep: int) -> Path:
    """Write checkpoint `step` (blocking; call it in a worker thread). `save_policy(folder)` writes the
    HF folder and `optimizer.pt` into `folder`. Older checkpoints beyond `keep` are deleted after."""
    import torch

    final = step_dir(out, step)
    tmp = final.parent / f".step_{step}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_policy(str(tmp))
    torch.save(store_state, tmp / "store.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
    body = json.dumps({"format": STATE_FORMAT, **state}, indent=1)
    (tmp / "state.json.tmp").write_text(body)
    os.replace(tmp / "state.json.tmp", tmp / "state.json")
    if final.exists():  # a step redone after a resume: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in complete_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def find_resume(out: Path, cfg: Any) -> Resume:
    """The newest complete checkpoint of the run in `out`, checked against `cfg`; one-line errors."""
    found = complete_checkpoints(out)
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
    missing = [k for k in ("step", "version", "logs", "eval_history", "counters", "elapsed_s", "next_group_id")
               if k not in state]
    if missing:
        raise UserError(f"checkpoint.resume: {path / 'state.json'} lacks {', '.join(missing)} (a damaged checkpoint)")
    if step >= cfg.train.max_steps:
        raise UserError(
            f"checkpoint.resume: the newest checkpoint ({path}) is at step {step}, and train.max_steps is "
            f"{cfg.train.max_steps}: nothing left to train; raise train.max_steps to continue"
        )
    return Resume(path, int(state["step"]), int(state["version"]), state, _changed_settings(out, cfg))


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

    from asyncflow.config import dump_yaml

    try:
        old = _leaves(yaml.safe_load((out / "config.yaml").read_text()) or {})
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"checkpoint.resume: cannot read {out / 'config.yaml'}: {exc}") from None
    new = _leaves(yaml.safe_load(dump_yaml(cfg)))
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    for key in changed:
        if any(key == m or (m.endswith(".") and key.startswith(m)) for m in MUST_MATCH):
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

    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
