"""A hyperparameter study (`tune:`) and its trials, as values. Pure.

The inventory's `tune:` section becomes a `Tune` (inventory/tunespec.py); each trial is a job of
its own (inventory/trial.py derives it); the study's record lives in Optuna's storage
(run/study.py) and is read back as `TrialRow`s for the table, the JSON and the picture
(cli/tuneview.py). Enums, not free strings: their values are what users and --json see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypedDict

Value = str | int | float  # a parameter's value as the trial's code receives it
Curve = tuple[tuple[int, float], ...]  # a trial's reports (its learning curve): (step, value), by step


class Goal(StrEnum):
    MAXIMIZE = "maximize"
    MINIMIZE = "minimize"


class ParamType(StrEnum):
    DOUBLE = "double"
    INTEGER = "integer"
    CATEGORICAL = "categorical"
    DISCRETE = "discrete"  # numbers from a list, in increasing order (Vertex's DISCRETE)


class Scale(StrEnum):
    LINEAR = "linear"
    LOG = "log"


class Algorithm(StrEnum):
    BAYESIAN = "bayesian"  # Optuna's TPE (Vertex's default, Vizier, is Bayesian too)
    RANDOM = "random"
    GRID = "grid"  # integer, categorical and discrete parameters only


class Measurement(StrEnum):
    LAST = "last"  # the last value the trial reported (Vertex's LAST_MEASUREMENT)
    BEST = "best"  # the best of its reports (BEST_MEASUREMENT)


class EarlyStopping(StrEnum):
    NONE = "none"
    # Vertex's median rule: a trial whose best value so far is worse than the median of the
    # completed trials' running averages up to its step (rules/stopping.py).
    MEDIAN = "median"
    HYPERBAND = "hyperband"  # Optuna's HyperbandPruner
    ASHA = "asha"  # Optuna's SuccessiveHalvingPruner (asynchronous successive halving)

    @property
    def has_rungs(self) -> bool:
        """Successive halving's rules: a trial reaches rungs (its status says which)."""
        return self in (EarlyStopping.HYPERBAND, EarlyStopping.ASHA)


class TrialState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    STOPPED_EARLY = "stopped early"  # by the early-stopping rule (tune.early_stopping)
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self is not TrialState.RUNNING


DEFAULT_METRIC_TAG = "training/hptuning/metric"  # cloudml-hypertune's tag when none is given
DEFAULT_MAX_FAILED = 3


@dataclass(frozen=True)
class Param:
    name: str
    type: ParamType
    min: float | None = None  # double, integer
    max: float | None = None
    scale: Scale = Scale.LINEAR
    values: tuple[Value, ...] = ()  # categorical (strings), discrete (numbers)
    # Conditional: suggested only when the parent parameter took one of these values.
    parent: str | None = None
    parent_values: tuple[Value, ...] = ()

    def grid(self) -> tuple[Value, ...]:
        """The values a grid search walks through (integer, categorical, discrete)."""
        if self.type is ParamType.INTEGER and self.min is not None and self.max is not None:
            return tuple(range(int(self.min), int(self.max) + 1))
        return self.values


@dataclass(frozen=True)
class Metric:
    name: str
    goal: Goal
    # Katib's stdout collector: a regular expression over the chief's log lines, with a group
    # named `value` (or one group) and optionally a group named `step`.
    regex: str | None = None

    def better(self, a: float, b: float) -> bool:
        return a > b if self.goal is Goal.MAXIMIZE else a < b


@dataclass(frozen=True)
class Tune:
    metric: Metric
    params: tuple[Param, ...]
    max_trials: int
    parallel_trials: int = 1
    max_failed_trials: int = DEFAULT_MAX_FAILED
    algorithm: Algorithm = Algorithm.BAYESIAN
    early_stopping: EarlyStopping = EarlyStopping.NONE
    measurement: Measurement = Measurement.LAST
    storage: str | None = None  # None: a journal file beside the state; or a postgresql:// URL

    def param(self, name: str) -> Param | None:
        return next((p for p in self.params if p.name == name), None)


@dataclass(frozen=True)
class Report:
    """One line of a hypertune metric file, or one match in the chief's log."""

    step: int
    value: float
    timestamp: float = 0.0


def measured(reports: tuple[Report, ...] | list[Report], metric: Metric, which: Measurement) -> float | None:
    """The trial's value: its last report, or its best (None: it reported nothing)."""
    finite = [r for r in reports if math.isfinite(r.value)]
    if not finite:
        return None
    if which is Measurement.LAST:
        return finite[-1].value
    pick = max if metric.goal is Goal.MAXIMIZE else min
    return pick(r.value for r in finite)


VALUE_GROUP, STEP_GROUP = "value", "step"  # a metric regex's named groups


MAX_MATCHED_LINE = 4096  # characters of a log line the metric regex looks at


def metric_pattern(regex: str) -> Any:
    """`tune.metric.regex` compiled by RE2: linear in the line's length whatever the
    pattern (Python's `re` backtracks: a nested quantifier and a line of 40 digits hung
    `tune`). Raises re2.error. RE2 knows no backreferences or lookarounds, which a metric's
    number does not need."""
    # Local: the RE2 extension costs every command's start-up time and memory (3 MB: `logs` of
    # 500k lines has a bound); only validate with a metric.regex and the log collector use it.
    import re2

    options = re2.Options()
    options.log_errors = False  # the error comes back as the exception, not on stderr
    return re2.compile(regex, options)


def regex_problem(regex: str) -> str | None:
    """None when `regex` (`tune.metric.regex`) can collect a metric from log lines; else why
    not, in words. The one rule: validation and the log collector (rules/metrics.py) use it."""
    import re2  # (start-up, as metric_pattern says)

    try:
        pattern = metric_pattern(regex)
    except re2.error as e:
        why = e.args[0].decode("utf-8", "replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        return f"does not compile: {why} (RE2 syntax, matched in linear time: no backreferences or lookarounds)"
    names = pattern.groupindex
    if pattern.groups == 0:
        return "no group: add (?P<value>...) around the number, e.g. val_loss=(?P<value>\\S+)"
    if VALUE_GROUP not in names:
        if pattern.groups > 1:
            return f"{pattern.groups} groups and none named value: name the number's group (?P<value>...)"
        if STEP_GROUP in names:
            return "its only group is step: add (?P<value>...) around the metric's number"
    if pattern.search("") is not None:
        return "matches an empty line, so every line: anchor it on the metric's name, e.g. val_loss=(?P<value>\\S+)"
    return None


def format_value(v: Value) -> str:
    """A parameter's value as `--NAME=VALUE` carries it: floats in their shortest exact form."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return repr(v)
    return str(v)


class TrialJson(TypedDict):
    """A trial in `provision tune --status --json` (TrialRow.to_json)."""

    number: int
    job: str
    params: dict[str, Value]
    state: str
    value: float | None
    steps: int | None
    seconds: float | None
    why: str | None
    retry_of: int | None
    rung: int | None


@dataclass(frozen=True)
class TrialRow:
    """One trial as the table, the JSON and the picture show it."""

    number: int  # from 1, as TF_CONFIG's task.trial
    params: tuple[tuple[str, Value], ...]
    state: TrialState
    value: float | None = None  # the measurement that counts (tune.measurement)
    steps: int | None = None  # the last global_step reported
    seconds: float | None = None  # run time
    why: str = ""  # why it ended, in words
    job: str = ""  # the trial's job name on the hosts
    retry_of: int | None = None  # a lost or failed trial's parameters run again
    rung: int | None = None  # hyperband's and asha's: the highest rung it reached (from 0)
    hosts: tuple[str, ...] = ()  # where its tasks ran (the history's; not in the JSON)

    def to_json(self) -> TrialJson:
        return {
            "number": self.number,
            "job": self.job,
            "params": dict(self.params),
            "state": self.state.value,
            "value": self.value,
            "steps": self.steps,
            "seconds": round(self.seconds, 3) if self.seconds is not None else None,
            "why": self.why or None,
            "retry_of": self.retry_of,
            "rung": self.rung,
        }


def best(rows: list[TrialRow] | tuple[TrialRow, ...], metric: Metric) -> TrialRow | None:
    """The best succeeded trial (ties: the earlier)."""
    out: TrialRow | None = None
    for r in rows:
        if (
            r.state is TrialState.SUCCEEDED
            and r.value is not None
            and (out is None or metric.better(r.value, out.value or 0.0))
        ):
            out = r
    return out


def new_best(rows: list[TrialRow] | tuple[TrialRow, ...], row: TrialRow, metric: Metric) -> bool:
    """Whether `row` is the study's best now (it beat every trial before it: a tie is not)."""
    got = best(rows, metric)
    return got is not None and got.number == row.number


def trial_job(job: str, number: int) -> str:
    """The trial's job name: the study's job and its number (a DNS label)."""
    return f"{job}-t{number}"


def promoted_job(job: str, number: int) -> str:
    """The job `tune --promote N` writes: a name of its own, as long as the trial's. Not the
    study's: the study's `destroy` would remove it, and its destroy the study's shared
    setup (a host keeps a study's setup under the study's name). Not the trial's: the
    study's trials are its to remove."""
    return f"{job}-p{number}"
