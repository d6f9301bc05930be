"""What a trial's worker (run/trialrun.py) posts to the study loop (run/tune.py), which
alone asks, tells and decides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from provision.core.trialend import Ended
from provision.core.tuning import Report
from provision.placement.tasks import Slot


@dataclass(frozen=True)
class Started:
    """The trial's job is on its hosts (where each task runs: for `fetch --trial`)."""

    number: int
    hosts: dict[str, str]


@dataclass(frozen=True)
class Waiting:
    """The trial waits for room (None: it no longer does)."""

    number: int
    why: str | None


@dataclass(frozen=True)
class SettingUp:
    """The trial's setup runs on these hosts before its tasks start (found room: planned)."""

    number: int
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Reported:
    """Every report the trial's metric has so far. `final`: read once its job ended (its
    last reports, which the study keeps whatever the early-stopping rule said before)."""

    number: int
    reports: tuple[Report, ...]
    final: bool = False


@dataclass(frozen=True)
class Paused:
    """The trial's job was preempted: its GPUs are free, it is not told; it
    waits in the queue at its priority and resumes as the same trial (Started again)."""

    number: int
    why: str  # "preempted by X (ana, priority high); resumes when 1 GPU is free"


@dataclass(frozen=True)
class JobEnded:
    """The trial's job ended (its GPUs are free from now): record and tell it. `slots`:
    where its tasks ran (the next trial is placed there: no placement to find again)."""

    number: int
    ended: Ended
    slots: Mapping[str, Slot] = field(default_factory=dict)


@dataclass(frozen=True)
class Removed:
    """The worker is done: the trial is gone from the hosts (or, `left`, runs on for the next tune)."""

    number: int
    ended: Ended
    left: bool = False


@dataclass(frozen=True)
class Freed:
    """The trial's only task ended and its unit holds nothing any more (the host's wait
    saw it settle): its place goes to the next trial now, before the look that says how
    it ended (JobEnded, told then)."""

    number: int
    slots: Mapping[str, Slot]


Post = Started | Waiting | SettingUp | Reported | Paused | Freed | JobEnded | Removed
