"""A submission's life: work handed to the service (`tune --detach`, `apply --queue --detach`),
its states, the transitions allowed between them, and its options. Pure; the store
(io/servicestore.py) makes each transition a compare-and-set that says whether it took.

    WAITING ──claim──▶ RUNNING ──▶ WATCHING ──claim (a round says look)──▶ RUNNING
       │                 │  ▲          │
       │                 │  └─admit─ QUEUED (no room: a row, no process)
       │                 ▼             ▼
       └──take back──▶ CANCELLED    DONE · FAILED   (finished: nothing moves on)

- WAITING: handed over, no service took it yet (a cancel takes it back at once);
- RUNNING: a worker of the leading service drives it (a dead leader's: the next takes it);
- QUEUED: an apply that found no room: it waits as a row, with no worker; the service
  admits it again when a round says it may fit (or preempt) now;
- WATCHING: applied; the service's rounds watch its run, no worker of its own;
- DONE, FAILED, CANCELLED: finished.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class Status(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    QUEUED = "queued"
    WATCHING = "watching"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (Status.DONE, Status.FAILED, Status.CANCELLED)


LIVE = tuple(s for s in Status if not s.finished)

# to -> the states it may come from (the store's compare-and-set: WHERE status IN these).
MOVES: Mapping[Status, frozenset[Status]] = {
    Status.RUNNING: frozenset({Status.WAITING, Status.RUNNING, Status.QUEUED, Status.WATCHING}),
    Status.QUEUED: frozenset({Status.RUNNING}),
    Status.WATCHING: frozenset({Status.RUNNING}),
    Status.DONE: frozenset({Status.RUNNING, Status.WATCHING}),
    Status.FAILED: frozenset({Status.WAITING, Status.RUNNING, Status.QUEUED, Status.WATCHING}),
    Status.CANCELLED: frozenset({Status.WAITING, Status.RUNNING, Status.QUEUED, Status.WATCHING}),
}


def may_move(frm: Status, to: Status) -> bool:
    return frm in MOVES.get(to, frozenset())


class Kind(StrEnum):
    TUNE = "tune"
    APPLY = "apply"


class BadRow(ValueError):
    """A submission's row that this version cannot read (set aside, never run)."""


# A submission's id names its work directory and log: letters, digits, '-', '_' only (no
# '.', no '/'), so a row written by hand cannot walk out of the service's directory.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def valid_id(sid: str) -> bool:
    return bool(_ID.fullmatch(sid))


OPTIONS_VERSION = 1


@dataclass(frozen=True)
class Options:
    """What was asked with the work, as the flags said it at `--detach`."""

    priority: int = 500  # the level the submitter's policy gave it (rules/priority.level)
    take_over: bool = False  # apply: --take-over
    rerun: bool = False  # apply: --rerun
    timeout: float | None = None  # apply: --timeout (seconds of waiting for room)
    skip_checks: bool = False  # apply: --skip-checks
    seed: int | None = None  # tune: --seed
    poll: float = 1.0  # tune: seconds between looks
    version: int = field(default=OPTIONS_VERSION)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Options:
        """The options of a row; BadRow when they are not ones this version knows. Rows
        written before options had a version carry the same keys as plain values."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise BadRow(f"options: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise BadRow("options: not an object")
        version = d.get("version", OPTIONS_VERSION)
        if version != OPTIONS_VERSION:
            raise BadRow(f"options: version {version!r}, this provision reads {OPTIONS_VERSION}")
        return cls(
            priority=_int(d, "priority", 500),
            take_over=_bool(d, "take_over"),
            rerun=_bool(d, "rerun"),
            timeout=_num(d, "timeout"),
            skip_checks=_bool(d, "skip_checks"),
            seed=_opt_int(d, "seed"),
            poll=_num(d, "poll") or 1.0,
        )


def _bool(d: Mapping[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRow(f"options.{key}: expected true or false, got {v!r}")
    return v


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRow(f"options.{key}: expected an integer, got {v!r}")
    return v


def _int(d: Mapping[str, Any], key: str, default: int) -> int:
    v = _opt_int(d, key)
    return default if v is None else v


def _num(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
        raise BadRow(f"options.{key}: expected a number >= 0, got {v!r}")
    return float(v)
