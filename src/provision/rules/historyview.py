"""The service's history as the pages show it: which rows a page asks for (HistoryQuery), each
row with how it ended in one word and why, its GPU-hours, and a job's timeline. Pure: rows
in, the pages' JSON out (docs/dashboard.md documents the shapes)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from provision.rules.usage import HOLDING

HISTORY_FORMAT = 1
KINDS = ("run", "trial", "study", "wait", "incident")
# How a row ended, in one word, from its words ("Failed: chief-0 exited 1", "succeeded, 0.25",
# "stopped by ann", "done: ..."): the first of these its words begin with, else the first it
# names (a terminal job's end is the event's sentence: "job bert was destroyed while it ran").
STATES = (
    ("stopped early", "stopped early"),
    ("recovered", "recovered"),  # an incident's row (serve/recovery.py)
    ("succeeded", "succeeded"),
    ("done", "succeeded"),
    ("fitted", "fitted"),
    ("failed", "failed"),
    ("gave up", "gave up"),
    ("preempted", "preempted"),
    ("cancelled", "cancelled"),
    ("taken back", "cancelled"),
    ("stopped", "stopped"),
    ("destroyed", "destroyed"),
    ("ended", "ended"),
)
SHOWN_STATES = tuple(dict.fromkeys(s for _, s in STATES))


@dataclass(frozen=True)
class HistoryQuery:
    """Which history rows a page lists: an owner's, of kinds, ended in a state (STATES'
    words), that ended (or still run) since `since` (epoch seconds); `finished`: ended ones
    only; `job`: a part of the job's name; a page of `limit` rows from `offset`."""

    owner: str = ""
    kinds: tuple[str, ...] = ()
    state: str = ""
    since: float | None = None
    finished: bool = False
    job: str = ""
    limit: int = 50
    offset: int = 0

    def words(self) -> tuple[str, ...]:
        """The beginnings of `how` that mean `state` (the store matches them)."""
        return tuple(w for w, s in STATES if s == self.state) if self.state else ()


class HistoryRowJson(TypedDict):
    """A history row as `provision history --json` and the pages give it, with what the pages add."""

    kind: str
    job: str
    owner: str
    started: str  # ISO 8601, UTC
    ended: str | None  # null: it still runs (or waits)
    seconds: float  # how long it ran (or waited), until now for an open one
    state: str  # how it ended in one word (STATES), "running" or "waiting" while open
    how: str  # its words
    hosts: list[str]
    gpus: int
    gpu_hours: float  # 0 for a wait (it held nothing)
    submission: str


class HistoryDoc(TypedDict):
    format_version: int
    rows: list[HistoryRowJson]
    total: int  # rows the query picks in all
    as_of: str


class RowIn(TypedDict):
    """What a row holds (io/servicehistory.HistoryRow's fields, as plain values)."""

    kind: str
    job: str
    owner: str
    started: float
    ended: float | None
    how: str
    hosts: Sequence[str]
    gpus: int
    submission: str


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def state_of(kind: str, how: str, ended: float | None) -> str:
    """How a row ended, in one word (STATES); "running" or "waiting" while it is open."""
    if ended is None:
        return "waiting" if kind == "wait" else "running"
    words = how.strip().lower()
    for start, state in STATES:
        if words.startswith(start):
            return state
    found = [(words.find(start), state) for start, state in STATES if start in words]
    return min(found)[1] if found else "ended"


def why_of(how: str) -> str:
    """The words after how it ended ("Failed: chief-0 exited 1" -> "chief-0 exited 1")."""
    head, sep, rest = how.partition(": ")
    return rest if sep and len(head) <= 20 else how


def row_json(r: RowIn, now: float) -> HistoryRowJson:
    end = r["ended"] if r["ended"] is not None else now
    seconds = max(0.0, end - r["started"])
    held = r["kind"] in HOLDING and r["gpus"] > 0
    return {
        "kind": r["kind"],
        "job": r["job"],
        "owner": r["owner"],
        "started": iso(r["started"]),
        "ended": iso(r["ended"]) if r["ended"] is not None else None,
        "seconds": round(seconds, 1),
        "state": state_of(r["kind"], r["how"], r["ended"]),
        "how": r["how"],
        "hosts": list(r["hosts"]),
        "gpus": r["gpus"],
        "gpu_hours": round(r["gpus"] * seconds / 3600.0, 3) if held else 0.0,
        "submission": r["submission"],
    }


# ------------------------------------------------------------------ the GPU-hours chart


def by_owner_over_days(
    days: Iterable[Mapping[str, object]], top: int = 8, axis: Sequence[str] = ()
) -> tuple[list[str], list[str], dict[str, list[float]]]:
    """The Usage days ({"day", "owner", "gpu_hours"}) as a chart's series: the days (`axis`,
    else those with GPU-hours; oldest first), the owners drawn (the `top` with the most
    GPU-hours, then "others"), and each owner's GPU-hours per day."""
    per: dict[str, dict[str, float]] = {}
    labels: set[str] = set()
    for d in days:
        day, owner, hours = str(d.get("day")), str(d.get("owner")), d.get("gpu_hours")
        if not isinstance(hours, int | float):
            continue
        labels.add(day)
        per.setdefault(owner, {})[day] = per.get(owner, {}).get(day, 0.0) + float(hours)
    order = sorted(per, key=lambda o: (-sum(per[o].values()), o))
    shown, rest = order[:top], order[top:]
    series = {o: per[o] for o in shown}
    if rest:
        others: dict[str, float] = {}
        for o in rest:
            for day, h in per[o].items():
                others[day] = others.get(day, 0.0) + h
        series["others"] = others
    shown = list(axis) or sorted(labels)
    return shown, list(series), {o: [series[o].get(d, 0.0) for d in shown] for o in series}
