"""GPU-hours per owner, from the service's history (`provision history`).

A row counts its GPUs for the time it held them, clipped to the window asked for
([since, now]); a row still open (a run or trial that has not ended) counts until now. Queue
waits hold no GPU and count nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NotRequired, TypedDict

HOLDING = frozenset({"trial", "run"})  # kinds of rows whose GPUs were held (a trial, an applied job's run)


class UsageDay(TypedDict):
    day: str  # 2026-11-27 (UTC)
    owner: str
    gpu_hours: float


class UsageWeek(TypedDict):
    week: str  # 2026-W48 (ISO)
    owner: str
    gpu_hours: float


class IdleGpu(TypedDict):
    """A GPU held by a job and idle (rules/gpuuse.idle_since) for `idle_minutes`."""

    host: str
    gpu: int
    job: str
    owner: str | None
    idle_minutes: int


class UsageDoc(TypedDict):
    """The dashboard's usage: GPU-hours per owner per day and per ISO week, and GPUs held but
    idle; "as_of": when the service summed them."""

    format_version: int
    days: list[UsageDay]
    weeks: list[UsageWeek]
    idle: list[IdleGpu]
    as_of: NotRequired[str]


@dataclass(frozen=True)
class Use:
    owner: str
    kind: str
    gpus: int
    started: float
    ended: float | None  # None: still holding


def gpu_hours(uses: Iterable[Use], now: float, since: float | None = None) -> dict[str, float]:
    """owner -> GPU-hours in [since, now], owners sorted by name; owners who held no GPU are
    left out."""
    out: dict[str, float] = {}
    for u in uses:
        if u.kind not in HOLDING or u.gpus <= 0:
            continue
        start = u.started if since is None else max(u.started, since)
        end = min(now, u.ended if u.ended is not None else now)
        if end <= start:
            continue
        out[u.owner] = out.get(u.owner, 0.0) + u.gpus * (end - start) / 3600.0
    return dict(sorted(out.items()))


def since_seconds(text: str) -> float:
    """`7d`, `12h`, `30m`, `90s` (or a bare number of seconds) as seconds; ValueError else."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    t = text.strip().lower()
    if t and t[-1] in units:
        n, unit = t[:-1], units[t[-1]]
    else:
        n, unit = t, 1
    value = float(n)
    if value < 0 or value != value:
        raise ValueError(text)
    return value * unit
