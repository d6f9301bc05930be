"""What a job says about its turn on a shared cluster: its priority, whether it may be
preempted, and how. The values as the inventory gives them; rules/priority.py
turns a class name into a number with the team's policy."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

DEFAULT_PRIORITY = "normal"
DEFAULT_GRACE_S = 120


class PreemptSignal(StrEnum):
    """The signals a task may be asked to stop with: a fixed list, so no inventory value
    reaches a unit file or a kill command as text of its own."""

    SIGTERM = "SIGTERM"
    SIGINT = "SIGINT"
    SIGHUP = "SIGHUP"
    SIGQUIT = "SIGQUIT"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"


@dataclass(frozen=True)
class Scheduling:
    # An integer, or a class name of the team's policy (`low`, `normal`, `high` by default).
    priority: int | str = DEFAULT_PRIORITY
    # None: the default for the kind of work (a study's trials yes, a plain job no).
    preemptible: bool | None = None
    grace_s: int = DEFAULT_GRACE_S
    signal: PreemptSignal = PreemptSignal.SIGTERM

    def may_be_preempted(self, trial: bool) -> bool:
        return trial if self.preemptible is None else self.preemptible


@dataclass(frozen=True)
class PreemptMark:
    """A preemption's mark as a host keeps it (host/preempt.py writes it, untrusted when it
    comes back): on the victim's ledger entry (who preempted it, the preemptor's heartbeat,
    whether the job's own side stopped it there: `follows`) and in its Preempted end marker
    (who, when, the deadline, what it held). Parsed once, here: no reader looks into the
    dict. Fields a host left out, or wrote as something else, are their defaults."""

    by: str = ""  # the preemptor's job
    who: str = ""  # its owner
    priority: int | None = None
    priority_name: str = ""
    at: float | None = None  # the host's clock: when it was preempted
    deadline: float | None = None  # ... and when its grace ends
    gpus: tuple[int, ...] = ()  # what it held on the host
    need: int | None = None
    follows: str = ""  # the host whose preemption this host's stop follows (the job's own side)
    host: str = ""  # the preemptor's controller, and its process and last word (its reservation)
    pid: int | None = None
    updated: float | None = None

    @classmethod
    def parse(cls, d: object) -> PreemptMark | None:
        """The mark in `d` (a ledger entry's "preempted", an end marker's), None when none."""
        if not isinstance(d, dict):
            return None
        gpus = d.get("gpus")
        return cls(
            by=_text(d.get("by")),
            who=_text(d.get("who")),
            priority=_int(d.get("priority")),
            priority_name=_text(d.get("priority_name")),
            at=_num(d.get("at")),
            deadline=_num(d.get("deadline")),
            gpus=tuple(g for g in gpus if isinstance(g, int) and not isinstance(g, bool))
            if isinstance(gpus, list)
            else (),
            need=_int(d.get("need")),
            follows=_text(d.get("follows")),
            host=_text(d.get("host")),
            pid=_int(d.get("pid")),
            updated=_num(d.get("updated")),
        )

    @classmethod
    def of_marker(cls, marker: object, preempt_phase: str) -> PreemptMark | None:
        """The mark of a job's end marker that says Preempted (`preempt_phase`), else None."""
        if not isinstance(marker, dict) or marker.get("phase") != preempt_phase:
            return None
        return cls.parse(marker.get("preempted"))

    @classmethod
    def of_entry(cls, entry: object) -> PreemptMark | None:
        """The mark on a ledger entry, else None."""
        return cls.parse(entry.get("preempted")) if isinstance(entry, dict) else None


def _text(v: object) -> str:
    return v if isinstance(v, str) else ""


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
