"""The store's checkpoint format: `snapshot` writes what `TransferQueue.state_dict` returns,
`check_state` refuses anything else before a restore begins, and `restore` reads it back into records."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncflow.transfer_queue.records import GroupRecord, SampleRecord

STATE_FORMAT = 1


def snapshot(samples: Iterable[SampleRecord], groups: dict[int, GroupRecord], bits: dict[str, int], next_uid: int,
             next_group: int, totals: dict[str, Any]) -> dict[str, Any]:
    """The state of a store holding `samples` and `groups` (`bits`: stage name -> its bit in a
    sample's marks); leases are not part of it."""
    return {
        "format": STATE_FORMAT,
        "next_uid": next_uid,
        "next_group_id": next_group,
        "samples": [
            {
                "uid": s.uid,
                "group_id": s.group_id,
                "priority": s.priority,
                "version": s.version,
                "fields": dict(s.fields),
                "consumed": sorted(name for name, bit in bits.items() if s.consumed & bit),
            }
            for s in samples
        ],
        "groups": [{"group_id": gid, "size": g.size, "put": g.put, "removed": g.removed} for gid, g in groups.items()],
        "totals": totals,
    }


@dataclass
class Restored:
    """What a checked state holds, as the store keeps it."""

    next_uid: int
    next_group: int
    bytes_put: int
    expired_leases: int
    wait_s: dict[str, float]  # stage name -> seconds its takes waited
    groups: dict[int, GroupRecord]
    samples: dict[int, SampleRecord]  # (each listed in its group's uids, in the state's order)
    max_group_size: int


def restore(state: dict[str, Any], bit: Callable[[str], int]) -> Restored:
    """The records of a state `check_state` accepted; `bit(name)` is the store's bit for stage
    `name` (a restored sample may name a stage registered later)."""
    totals = state.get("totals") or {}  # (absent from older checkpoints)
    next_group = int(state.get("next_group_id", 1 + max((g["group_id"] for g in state["groups"]), default=-1)))
    groups = {gs["group_id"]: GroupRecord(gs["size"], gs["put"], gs["removed"]) for gs in state["groups"]}
    samples: dict[int, SampleRecord] = {}
    for d in state["samples"]:
        s = SampleRecord(d["uid"], d["group_id"], d["priority"], dict(d["fields"]), d["version"])
        for name in d["consumed"]:
            s.consumed |= bit(name)
        g = groups[s.group_id]
        g.uids.append(s.uid)
        g.consumed.update(d["consumed"])
        samples[s.uid] = s
    return Restored(
        next_uid=int(state["next_uid"]),
        next_group=next_group,
        bytes_put=int(totals.get("bytes_put", 0)),
        expired_leases=int(totals.get("expired_leases", 0)),
        wait_s={name: float(waited) for name, waited in dict(totals.get("wait_s", {})).items()},
        groups=groups,
        samples=samples,
        max_group_size=max((g.size for g in groups.values()), default=1),
    )


def check_state(state: Any) -> None:
    """`ValueError` naming what is wrong unless `state` has the shape `TransferQueue.state_dict`
    writes. A checkpoint's `store.pt` that loads but holds something else (a damaged or foreign
    file) failed a resume with a KeyError or TypeError traceback, after the run's logs were cut."""

    def whole(v: Any, lo: int) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and int(v) >= lo

    if not isinstance(state, dict):
        raise ValueError(f"expected the transfer queue's state (a dict), got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown transfer queue state format {state.get('format')!r}")
    for key in ("next_uid", "next_group_id"):
        if (key in state or key == "next_uid") and not whole(state.get(key), 0):
            raise ValueError(f"{key} must be an int >= 0, got {state.get(key)!r}")
    groups, samples = state.get("groups"), state.get("samples")
    if not isinstance(groups, list) or not isinstance(samples, list):
        raise ValueError("groups and samples must be lists")
    sizes: dict[Any, int] = {}
    for g in groups:
        if not (isinstance(g, dict) and whole(g.get("group_id"), 0) and whole(g.get("size"), 1)
                and whole(g.get("put"), 0) and whole(g.get("removed"), 0)):
            raise ValueError(f"a group entry is not {{group_id, size, put, removed}} (ints): {g!r:.200}")
        sizes[g["group_id"]] = g["size"]
    uids: set[int] = set()
    for d in samples:
        if not (isinstance(d, dict) and whole(d.get("uid"), 0) and whole(d.get("group_id"), 0)
                and d.get("group_id") in sizes
                and isinstance(d.get("fields"), dict) and isinstance(d.get("consumed"), list)
                and all(isinstance(c, str) for c in d["consumed"])
                and isinstance(d.get("priority"), (int, float)) and not isinstance(d.get("priority"), bool)
                and (d.get("version") is None or whole(d.get("version"), -(2**63)))):
            raise ValueError(f"a sample entry is not {{uid, group_id (of a listed group), priority, version, fields, "
                             f"consumed}}: {d!r:.200}")
        if d["uid"] in uids:
            raise ValueError(f"sample uid {d['uid']} is listed twice")
        uids.add(d["uid"])
    totals = state.get("totals")  # (absent from older checkpoints)
    if totals is not None:
        wait_s = totals.get("wait_s", {}) if isinstance(totals, dict) else None
        if not (isinstance(totals, dict) and all(whole(totals.get(k, 0), 0) for k in ("bytes_put", "expired_leases"))
                and isinstance(wait_s, dict)
                and all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                        for k, v in wait_s.items())):
            raise ValueError(f"totals is not {{bytes_put, expired_leases (ints), wait_s (stage: seconds)}}: "
                             f"{totals!r:.200}")
