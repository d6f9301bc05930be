"""What happened, as one stream of typed events (as `kubectl get events` is read).

An event is made in one of two places: rules/events.py, from two successive rounds of the
service (serve/rounds.py) and what the round before left (its `Seen`), or by a run that
knows its own end (a trial, a study, a handed-over submission). Both name the happening by
the same `key` (kind of happening, job, run): the store keeps the first and drops a repeat,
so one end is one event whoever saw it first, and a service killed between the end and
its record, restarted, records it once (io/servicestore.py: each event gets an id; each
subscriber reads after its cursor, so it sees every event at least once).

Kinds are dotted so that people and rules can pick them (`job.*`, `gpu.quarantined`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from typing import NotRequired, TypedDict

EVENTS_FORMAT = 1


class Kind(StrEnum):
    JOB_STARTED = "job.started"
    JOB_ENDED = "job.ended"  # with how: succeeded, failed, stopped, preempted, destroyed
    JOB_PREEMPTED = "job.preempted"
    JOB_RESUMED = "job.resumed"  # a new run after a preemption (PROVISION_RESUME=1)
    JOB_RECOVERED = "job.recovered"
    JOB_SCALED = "job.scaled"  # an elastic job's lost workers placed again and started (a scale-up)
    TASK_FAILED = "task.failed"
    HOST_UNREACHABLE = "host.unreachable"
    HOST_BACK = "host.back"
    TRIAL_ENDED = "trial.ended"
    STUDY_ENDED = "study.ended"
    STUDY_BEST = "study.best"  # a trial that beat every one before it (told by the study's runner)
    SUBMISSION_ENDED = "submission.ended"
    GPU_QUARANTINED = "gpu.quarantined"
    GPU_RELEASED = "gpu.released"
    HOST_DRAINED = "host.drained"  # a host's health keeps new work off it (draining, quarantined)
    HOST_RELEASED = "host.released"
    DEV_ENDING = "dev.ending"


KINDS = tuple(k.value for k in Kind)


class How(StrEnum):
    """How a job, trial, study or submission ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    DESTROYED = "destroyed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Event:
    kind: Kind
    key: str  # the happening: the same one made twice has the same key (the store keeps one)
    job: str = ""
    owner: str = ""
    host: str = ""
    words: str = ""  # what happened, in the words `status` would use
    how: How | None = None
    run: int | None = None
    hosts: tuple[str, ...] = ()  # a job's: the hosts it held something on
    gpus: int = 0  # a job's: the GPUs it held


class EventJson(TypedDict):
    id: int
    time: str
    kind: str
    job: str
    owner: str
    host: str
    words: str
    how: str | None
    run: int | None
    hosts: list[str]
    gpus: int


class EventsDoc(TypedDict):
    """`provision events --json`, and the dashboard's /api/v1/events with "after": the last
    id given (the next request's)."""

    format_version: int
    events: list[EventJson]
    after: NotRequired[int]


@dataclass(frozen=True)
class Stored:
    """An event as the store keeps it: its id (the order every reader sees) and when (the
    database's clock)."""

    id: int
    time: float
    event: Event

    def to_json(self) -> EventJson:
        e = self.event
        return {
            "id": self.id,
            "time": iso(self.time),
            "kind": e.kind.value,
            "job": e.job,
            "owner": e.owner,
            "host": e.host,
            "words": e.words,
            "how": e.how.value if e.how is not None else None,
            "run": e.run,
            "hosts": list(e.hosts),
            "gpus": e.gpus,
        }


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def ended_key(job: str, run: int | None) -> str:
    """The key of a job's (or a trial's) end: the round and the run that ended agree on it."""
    return f"end:{job}:{run if run is not None else '-'}"


def started_key(job: str, run: int | None) -> str:
    return f"start:{job}:{run if run is not None else '-'}"


def best_key(job: str, trial: int) -> str:
    """The key of a study's new best: one per trial number (a runner that adopts the study
    tells it again, and the store keeps one)."""
    return f"best:{job}:{trial}"


def parse_kinds(text: str) -> tuple[Kind, ...]:
    """`job.ended,trial.*` as kinds; a `*` after a dot matches every kind of that family.
    ValueError names the first word that is no kind."""
    out: list[Kind] = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if word.endswith(".*"):
            family = [k for k in Kind if k.value.startswith(word[:-1])]
            if not family:
                raise ValueError(word)
            out += family
        elif word in KINDS:
            out.append(Kind(word))
        else:
            raise ValueError(word)
    return tuple(dict.fromkeys(out))
