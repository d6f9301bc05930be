"""A study as `provision tune --status --json` prints it (docs/tuning.md documents the shape),
and the dashboard serves it. Pure: built from the study's rows and its `tune:`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from provision.core.tuning import TrialJson, TrialRow, TrialState, Tune, Value, best

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
    """The dashboard's study: the status and its parameters."""

    space: list[ParamJson]


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
