"""A study as `provision tune --status --json` prints it (docs/tuning.md documents the shape),
and the dashboard serves it. Pure: built from the study's rows and its `tune:`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from provision.core.tuning import TrialJson, TrialRow, TrialState, Tune, Value, best
from provision.rules.status import StatusJson

# The order counts are given in (the table's last line, the JSON's "counts").
COUNTED = (TrialState.SUCCEEDED, TrialState.STOPPED_EARLY, TrialState.FAILED, TrialState.RUNNING)


class MetricJson(TypedDict):
    name: str
    goal: str


class StudyJson(TypedDict):
    """`provision tune --status --json` (docs/tuning.md)."""

    format_version: int
    job: str
    metric: MetricJson
    max_trials: int
    parallel_trials: int
    max_failed_trials: int
    algorithm: str
    early_stopping: str
    measurement: str
    trials: list[TrialJson]
    best: TrialJson | None
    counts: dict[str, int]
    ended: str | None
    picture: str | None


class ParamJson(TypedDict):
    """A parameter as the dashboard draws it (space_json)."""

    name: str
    type: str
    scale: str
    min: float | None
    max: float | None
    values: list[Value]


class StudyDoc(StudyJson):
    """The dashboard's study: the status and its parameters (and, where Optuna could weigh
    them, each parameter's importance: their shares of the value's variation, adding to 1)."""

    space: list[ParamJson]
    importance: NotRequired[dict[str, float]]


@dataclass(frozen=True)
class StudyCurves:
    """Each trial's reports (step, value) by trial number: its learning curve (not sent as
    JSON with the study: a trial's page and /api/v1/jobs/STUDY-tN carry its own)."""

    curves: Mapping[int, tuple[tuple[int, float], ...]] = field(default_factory=dict)


CANCELLED = "cancelled"


def shown_state(t: TrialJson) -> str:
    """A trial's state as the pages name it: a study cancelled stops its running trials as
    early stopping does (their state "stopped early", why "cancelled by ..."): cancelled."""
    if t["state"] == TrialState.STOPPED_EARLY.value and (t.get("why") or "").startswith("cancelled"):
        return CANCELLED
    return t["state"]


def shown_counts(trials: Sequence[TrialJson], counted: Mapping[str, int]) -> dict[str, int]:
    """The study's counts as the pages name its trials' states (shown_state): its cancelled
    trials apart from those stopped early."""
    cancelled = sum(1 for t in trials if shown_state(t) == CANCELLED)
    out = {s: n - cancelled if s == TrialState.STOPPED_EARLY.value else n for s, n in counted.items()}
    return {**out, CANCELLED: cancelled} if cancelled else out


_PHASES = {TrialState.SUCCEEDED: "Succeeded", TrialState.FAILED: "Failed", TrialState.STOPPED_EARLY: "Stopped"}


def ended_trial_status(row: TrialRow) -> StatusJson:
    """An ended trial as its job's status says it once its runner removed it from the hosts:
    its phase from how it ended, why, and no tasks (they are gone; their logs were kept)."""
    return {
        "format_version": 2,
        "job": row.job,
        "phase": _PHASES.get(row.state, "Unknown"),
        "reason": row.why or None,
        "unreachable": [],
        "tasks": [],
        "left_behind": [],
        "health": [],
        "owner": None,
        "run": None,
        "setup_lines": {},
    }


def counts(rows: Sequence[TrialRow]) -> dict[str, int]:
    return {s.value: sum(1 for r in rows if r.state is s) for s in COUNTED}


def study_json(job: str, tune: Tune, rows: Sequence[TrialRow], *, ended: str | None, picture: str | None) -> StudyJson:
    """`provision tune --status --json` (docs/tuning.md documents it)."""
    top = best(tuple(rows), tune.metric)
    return {
        "format_version": 1,
        "job": job,
        "metric": {"name": tune.metric.name, "goal": tune.metric.goal.value},
        "max_trials": tune.max_trials,
        "parallel_trials": tune.parallel_trials,
        "max_failed_trials": tune.max_failed_trials,
        "algorithm": tune.algorithm.value,
        "early_stopping": tune.early_stopping.value,
        "measurement": tune.measurement.value,
        "trials": [r.to_json() for r in rows],
        "best": top.to_json() if top is not None else None,
        "counts": counts(rows),
        "ended": ended,  # null while the study can go on
        "picture": picture,
    }


def space_json(tune: Tune) -> list[ParamJson]:
    """The study's parameters as the dashboard draws them (a log axis for scale log)."""
    return [
        {
            "name": p.name,
            "type": p.type.value,
            "scale": p.scale.value,
            "min": p.min,
            "max": p.max,
            "values": list(p.values),
        }
        for p in tune.params
    ]
