"""Is a job progressing: what shows it on its hosts, how long it may go without, and whether
it has. Pure.

What the probe reads (kept bounded and cheap: one `stat` per path, no log read, at most
MAX_PROGRESS_PATHS a host): for each task of a job with `progress:` on the host, the
modification time of its heartbeat (PROVISION_HEARTBEAT, which the task may touch) and,
for a trial, of its hypertune metric file; and once per host the job's checkpoint
directory (AIP_CHECKPOINT_DIR: a new file or a rename in it moves its time). Log lines are
not read by the rounds: a job that shows progress only by its logs is looked at once (its
last line's time, run/progress.py) when the files say nothing within its bound.

The bound: `progress: {timeout: 10m}`, or `auto`: AUTO_FACTOR times the median of the
intervals seen between two signs of progress, never under AUTO_FLOOR_S (AUTO_START_S until
AUTO_SAMPLES intervals were seen). Ages are taken on the host's clock (its mtimes against
its own `now`) and moved to this machine's: a host's clock ahead or behind changes nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypedDict

from provision.core.model import Inventory
from provision.core.recovery import (
    AUTO_FACTOR,
    AUTO_FLOOR_S,
    AUTO_SAMPLES,
    AUTO_START_S,
    SETTLE_S,
    STARTUP_S,
    ProgressSpec,
)
from provision.host import layout
from provision.host.protocol import MAX_PROGRESS_PATHS, ProbeReport
from provision.render.clusterenv import OUTPUT_DIRS

KEEP_INTERVALS = 32  # the intervals `auto` learns from: the last ones


class Sign(StrEnum):
    HEARTBEAT = "heartbeat"
    METRICS = "metrics"
    CHECKPOINT = "checkpoint"
    LOG = "log"  # its last log line (looked at only when the files say nothing)


@dataclass(frozen=True)
class Watched:
    """One path the probe stats for a job: what it shows, and whose (a task, or "" for the
    job's checkpoint directory)."""

    path: str
    sign: Sign
    task: str = ""


def checkpoint_dir(inv: Inventory) -> str | None:
    """AIP_CHECKPOINT_DIR on every host (`outputs:`), without its trailing slash."""
    if inv.outputs is None:
        return None
    sub = dict(OUTPUT_DIRS)["AIP_CHECKPOINT_DIR"]
    return f"{inv.outputs}/{sub}"


def watched(inv: Inventory, tasks: Iterable[str]) -> list[Watched]:
    """What the probe stats on a host for the job's `tasks` there: nothing for a job
    without `progress:`."""
    out: list[Watched] = []
    if inv.progress is not None:
        for t in sorted(tasks):
            out.append(Watched(layout.heartbeat_path(inv.job, t), Sign.HEARTBEAT, t))
            if inv.tune is not None and inv.tf_config.trial is not None:
                out.append(Watched(layout.metric_file(inv.job, t), Sign.METRICS, t))
    ck = checkpoint_dir(inv)
    if ck is not None and inv.progress is not None and list(tasks):
        out.append(Watched(ck, Sign.CHECKPOINT))
    return out[:MAX_PROGRESS_PATHS]


@dataclass(frozen=True)
class Seen:
    """A job's progress as one look saw it, on this machine's clock: its latest sign (None:
    none seen), its newest checkpoint, each task's latest own sign, and the hosts that
    answered with what they hold of it."""

    latest: float | None = None
    checkpoint: float | None = None
    tasks: Mapping[str, float] = field(default_factory=dict)
    hosts: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, object]:
        return {
            "latest": self.latest,
            "checkpoint": self.checkpoint,
            "tasks": dict(sorted(self.tasks.items())),
            "hosts": sorted(self.hosts),
        }


def seen(paths: Mapping[str, Sequence[Watched]], reports: Mapping[str, ProbeReport], now: float) -> Seen:
    """`paths`: host -> what was asked there; `reports`: the hosts that answered, each with
    its `progress` mtimes and its clock; `now`: this machine's clock at the look."""
    latest: float | None = None
    ck: float | None = None
    tasks: dict[str, float] = {}
    hosts = set()
    for host, asked in paths.items():
        rep = reports.get(host)
        if rep is None or rep.progress is None:
            continue
        hosts.add(host)
        host_now = rep.now if rep.now is not None else now
        for w in asked:
            m = rep.progress.get(w.path)
            if m is None:
                continue
            at = now - max(0.0, host_now - m)  # its age on the host's clock, moved to this one
            latest = at if latest is None else max(latest, at)
            if w.sign is Sign.CHECKPOINT:
                ck = at if ck is None else max(ck, at)
            elif w.task:
                tasks[w.task] = max(tasks.get(w.task, at), at)
    return Seen(latest, ck, tasks, frozenset(hosts))


def bound(spec: ProgressSpec, intervals: Sequence[float], learnt: float | None = None) -> float:
    """How long the job may go without a sign of progress (module docstring); `learnt`:
    the `auto` bound the service's rounds learnt, for a look that has no intervals."""
    if spec.timeout_s is not None:
        return float(spec.timeout_s)
    if len(intervals) < AUTO_SAMPLES:
        return max(AUTO_FLOOR_S, learnt) if learnt is not None else AUTO_START_S
    return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(intervals))


def learnt_bound(spec: ProgressSpec | None, intervals: Sequence[float]) -> float | None:
    """What the rounds learnt of an `auto` bound, to keep in the job's state (None: nothing
    learnt yet, or the bound is fixed)."""
    if spec is None or not spec.auto or len(intervals) < AUTO_SAMPLES:
        return None
    return bound(spec, intervals)


def bound_moved(kept: float | None, now: float | None) -> bool:
    """Is the bound learnt now worth writing over the kept one (a fifth apart or more: the
    job's state is not written every round)?"""
    return now is not None and (kept is None or abs(now - kept) > 0.2 * kept)


def learnt(intervals: Sequence[float], before: float | None, after: float | None) -> tuple[float, ...]:
    """The intervals with the one between two signs added (when the sign moved on)."""
    if before is None or after is None or after <= before:
        return tuple(intervals)
    return (*intervals, after - before)[-KEEP_INTERVALS:]


@dataclass(frozen=True)
class Stall:
    """A job that has not progressed for longer than its bound: since when (its last sign,
    or its run's start when it never showed one), and the bound."""

    since: float
    bound: float

    def words(self) -> str:
        at = time.strftime("%H:%M:%S", time.localtime(self.since))
        return f"no progress since {at} (bound {int(self.bound)} s)"


def stalled(
    spec: ProgressSpec,
    intervals: Sequence[float],
    last: float | None,
    started: float | None,
    now: float,
    learnt: float | None = None,
) -> Stall | None:
    """Has the job gone past its bound without progress (`last`: its latest sign, `started`:
    when its run started, on this machine's clock)? None when not, or when nothing is known.
    A run with no sign of its own yet (none SETTLE_S after its start) has its start-up too
    (STARTUP_S)."""
    base = max(x for x in (last, started) if x is not None) if (last is not None or started is not None) else None
    if base is None:
        return None
    b = bound(spec, intervals, learnt)
    if started is not None and (last is None or last <= started + SETTLE_S):
        b = max(b, STARTUP_S)
    return Stall(base, b) if now - base > b else None


class ProgressJson(TypedDict):
    """`status --json`'s `progress` (ProgressView.to_json)."""

    last: str | None
    checkpoint: str | None
    bound_seconds: int
    auto: bool
    stalled: bool
    learnt: bool  # `auto`: the bound is the service's learnt one (else its start, 10m)


@dataclass(frozen=True)
class ProgressView:
    """What `status` says of a job's progress: its latest sign and newest checkpoint (this
    machine's clock), its bound, and whether it went past it."""

    last: float | None
    checkpoint: float | None
    bound: float
    auto: bool
    stalled: bool
    learnt: bool = False

    def to_json(self) -> ProgressJson:
        return {
            "last": iso(self.last),
            "checkpoint": iso(self.checkpoint),
            "bound_seconds": int(self.bound),
            "auto": self.auto,
            "stalled": self.stalled,
            "learnt": self.learnt,
        }


def iso(t: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t is not None else None
