"""Ray actor deaths and failures as the run's one-line errors: which actor of the run died (the
run's actors are registered here by their Ray actor id), why, and the error the run ends with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from asyncflow.errors import RunFailed, TrainerDied, UserError


class TrainerHandle(Protocol):
    """What a death message asks of the trainer's driver-side handle (`RemoteTrainEngine`)."""

    def died(self, exc: BaseException, what: str) -> TrainerDied: ...


@dataclass
class _Known:
    """An actor of a running `RayWorkers`, for messages about its death."""

    label: str  # "rollout/0", "trainer", "store controller", ...
    name: str  # its Ray name
    trainer: TrainerHandle | None = None


_KNOWN: dict[str, _Known] = {}  # Ray actor id (hex) -> what it is


def remember(handle: Any, label: str, name: str, trainer: TrainerHandle | None = None) -> None:
    """Register an actor of the run (`label`, Ray `name`; `trainer`: the trainer actor's handle)."""
    _KNOWN[actor_id(handle)] = _Known(label, name, trainer)


def forget(handle: Any) -> None:
    """Unregister an actor of the run (it is being killed)."""
    _KNOWN.pop(actor_id(handle), None)


def actor_id(handle: Any) -> str:
    return str(handle._actor_id.hex())


def one_line(text: str, limit: int = 400) -> str:
    line = " ".join(part.strip() for part in text.splitlines() if part.strip())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def why_died(exc: BaseException) -> str:
    """Why a Ray actor error says its actor died, in a few words."""
    import ray

    text = str(exc)
    kind = type(exc).__name__
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        detail = text.split("temporarily unavailable:", 1)[-1].split(". ")[0].strip()
        return f"{kind}: {detail.removeprefix('IOError: ')}"
    if "killed by `ray.kill`" in text:
        return f"{kind}: killed by ray.kill"
    for marker in ("Worker exit detail: ", "The actor is dead because "):
        if marker in text:
            text = text.split(marker, 1)[1]
            break
    if " Some common causes include" in text:
        text = text.split(" Some common causes include")[0] + " (the OOM killer, a crash or `ray stop`?)"
    return f"{kind}: {one_line(text, 300)}"


def who_died(exc: BaseException) -> str:
    """'the trainer actor (asyncflow-1a2b3c4d-trainer)': the actor a Ray actor error is about."""
    return _who(exc)[0]


def _who(exc: BaseException) -> tuple[str, _Known | None]:
    """'the trainer actor (asyncflow-1a2b3c4d-trainer)', and what the actor is if this run knows it."""
    known = _KNOWN.get(str(getattr(exc, "actor_id", None)))
    if known is not None:
        return f"the {known.label} actor ({known.name})", known
    fields = dict(
        line.strip().split(": ", 1) for line in str(exc).splitlines() if line.startswith("\t") and ": " in line
    )
    if "class_name" in fields:
        return f"the {fields['class_name']} actor" + (f" ({fields['name']})" if "name" in fields else ""), None
    return "a Ray actor", None


def dead_actor_error(exc: BaseException) -> BaseException | None:
    """The `RayActorError` in `exc` (itself, or the cause of a task error), or None."""
    import ray

    cause = getattr(exc, "cause", None)
    if isinstance(exc, ray.exceptions.RayTaskError) and isinstance(cause, ray.exceptions.RayActorError):
        return cause
    return exc if isinstance(exc, ray.exceptions.RayActorError) else None


def actor_death(exc: BaseException) -> str | None:
    """One line saying which actor died and why, for a Ray actor error (or a task error caused by
    one; e.g. the store controller's death seen through a store call); None for anything else."""
    err = dead_actor_error(exc)
    if err is None:
        return None
    who, _ = _who(err)
    return f"{who} died ({why_died(err)})"


def death_error(exc: BaseException, context: str = "") -> RunFailed:
    """The run's error for an actor's death: `TrainerDied` for the trainer, else `RunFailed`."""
    err = dead_actor_error(exc) or exc
    _, known = _who(err)
    if known is not None and known.trainer is not None:
        return known.trainer.died(err, "export its weights")
    return RunFailed(f"{context}{actor_death(err) or one_line(str(err))}")


def stage_error(stage: str, exc: Any) -> Exception:
    """A remote stage's error: its user error as itself, another actor's death or a failure as one line."""
    cause = exc.cause
    if isinstance(cause, UserError):
        return cause
    if dead_actor_error(cause) is not None:  # e.g. the store controller died under the stage
        return death_error(cause, f"Ray stage {stage} stopped: ")
    return RunFailed(f"Ray stage {stage} failed: {type(cause).__name__}: {one_line(str(cause))}")
