"""The inventory's `tune:` section → `core.tuning.Tune`, every problem named by its key path.

Also what a study needs of the rest of the inventory: its trials' job names must stay DNS
labels, and a metric read from the log needs the chief's log (the chief or worker 0).
"""

from __future__ import annotations

import math
import re
from typing import Any

from provision.core.tuning import (
    DEFAULT_MAX_FAILED,
    Algorithm,
    EarlyStopping,
    Goal,
    Measurement,
    Metric,
    Param,
    ParamType,
    Scale,
    Tune,
    Value,
    regex_problem,
    trial_job,
)
from provision.inventory.statebackend import problem as url_problem
from provision.inventory.yamldoc import Checker, KeyPath, show_value, show_values

TUNE_KEYS = (
    "metric",
    "parameters",
    "algorithm",
    "max_trials",
    "parallel_trials",
    "max_failed_trials",
    "early_stopping",
    "measurement",
    "storage",
)
PARAM_KEYS = ("type", "min", "max", "scale", "values", "when")
# A parameter's name becomes `--NAME=VALUE` on the trial's command line.
PARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
METRIC_NAME = re.compile(r"^[A-Za-z0-9_./:-]{1,128}$")
# A categorical value is any text, as the services allow ('1024 512 256'): it reaches the
# trial as one argv element (ExecStart= quotes it, no shell reads it), never a shell word.
MAX_CATEGORY = 1024
MAX_TRIALS = 10000


def parse_tune(c: Checker, value: Any, job: str | None) -> Tune | None:
    path: KeyPath = ("tune",)
    m = c.mapping(value, path)
    if not m:
        return None
    c.keys(m, path, TUNE_KEYS, required=("metric", "parameters", "max_trials"))
    metric = _metric(c, m.get("metric"), path + ("metric",))
    params = _params(c, m.get("parameters"), path + ("parameters",))
    max_trials = c.integer(m.get("max_trials"), path + ("max_trials",), 1, MAX_TRIALS) if "max_trials" in m else None
    parallel = c.integer(m.get("parallel_trials", 1), path + ("parallel_trials",), 1, 1000)
    max_failed = c.integer(m.get("max_failed_trials", DEFAULT_MAX_FAILED), path + ("max_failed_trials",), 0)
    algorithm = _enum(c, m, path, "algorithm", Algorithm, Algorithm.BAYESIAN)
    stopping = _enum(c, m, path, "early_stopping", EarlyStopping, EarlyStopping.NONE)
    measurement = _enum(c, m, path, "measurement", Measurement, Measurement.LAST)
    storage = m.get("storage")
    if storage is not None:
        why = url_problem(storage) if str(storage) != "local" else "storage: give a postgresql:// URL, or leave it out"
        if why:
            c.add(path + ("storage",), why.replace("state:", "storage:"))
            storage = None
    if job and max_trials is not None and len(trial_job(job, max_trials)) > 40:
        c.add(
            ("job",),
            f"with tune, trials are jobs named {trial_job(job, max_trials)!r}: keep the job's name to at most {40 - len(trial_job('', max_trials))} characters",
        )
    if algorithm is Algorithm.GRID:
        for p in params:
            if p.type is ParamType.DOUBLE:
                c.add(
                    path + ("parameters", p.name),
                    "a grid search takes integer, discrete and categorical parameters, not double",
                )
    if None in (metric, max_trials, parallel, max_failed) or not params:
        return None
    assert metric is not None and max_trials is not None and parallel is not None and max_failed is not None
    return Tune(metric, tuple(params), max_trials, parallel, max_failed, algorithm, stopping, measurement, storage)


def _enum(c: Checker, m: dict[str, Any], path: KeyPath, key: str, kind: Any, default: Any) -> Any:
    got = c.choice(m.get(key, default.value), path + (key,), tuple(e.value for e in kind))
    return kind(got) if got is not None else default


def _metric(c: Checker, value: Any, path: KeyPath) -> Metric | None:
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, ("name", "goal", "regex"), required=("name", "goal"))
    name = (
        c.string(m["name"], path + ("name",), pattern=METRIC_NAME, what="a metric name such as val_loss")
        if "name" in m
        else None
    )
    goal = c.choice(m["goal"], path + ("goal",), tuple(g.value for g in Goal)) if "goal" in m else None
    regex = None
    if "regex" in m:
        regex = c.string(m["regex"], path + ("regex",))
        why = regex_problem(regex) if regex is not None else None
        if why:
            c.add(path + ("regex",), why)
            regex = None
    if name is None or goal is None:
        return None
    return Metric(name, Goal(goal), regex)


def _params(c: Checker, value: Any, path: KeyPath) -> list[Param]:  # noqa: C901  one check per key of a parameter
    m = c.mapping(value, path)
    if m is None:
        return []
    if not m:
        c.add(path, "expected at least one parameter, such as learning_rate: {type: double, min: 0.0001, max: 0.1}")
        return []
    out: list[Param] = []
    for name, spec in m.items():
        p = _param(c, name, spec, path + (name,))
        if p is not None:
            out.append(p)
    known = {p.name: p for p in out}
    for p in out:
        if p.parent is None:
            continue
        parent = known.get(p.parent)
        where = path + (p.name, "when")
        if parent is None:
            c.add(where, f"no parameter named {p.parent!r} (a condition names a parameter listed before this one)")
        elif list(known).index(p.parent) > list(known).index(p.name):
            c.add(where, f"{p.parent!r} must be listed before {p.name!r}")
        elif parent.type is ParamType.DOUBLE:
            c.add(where, f"{p.parent!r} is a double: a condition needs an integer, discrete or categorical parent")
        elif any(v not in parent.grid() for v in p.parent_values):
            c.add(
                where,
                f"values not among {p.parent!r}'s: {show_values([v for v in p.parent_values if v not in parent.grid()])}",
            )
    return out


def _param(c: Checker, name: Any, value: Any, path: KeyPath) -> Param | None:
    if not isinstance(name, str) or not PARAM_NAME.fullmatch(name):
        c.add(path, f"a parameter name becomes --NAME=VALUE: letters, digits, '_', '.', '-', got {show_value(name)}")
        return None
    m = c.mapping(value, path)
    if m is None:
        return None
    c.keys(m, path, PARAM_KEYS, required=("type",))
    kind = c.choice(m.get("type"), path + ("type",), tuple(t.value for t in ParamType)) if "type" in m else None
    if kind is None:
        return None
    t = ParamType(kind)
    parent, parent_values = _when(c, m.get("when"), path + ("when",))
    if t in (ParamType.DOUBLE, ParamType.INTEGER):
        return _ranged(c, name, t, m, path, parent, parent_values)
    if "values" not in m:
        c.add(path, "missing required key 'values'")
        return None
    for key in ("min", "max", "scale"):
        if key in m:
            c.add(path + (key,), f"a {t.value} parameter takes values, not {key}")
    values = _values(c, t, m["values"], path + ("values",))
    return Param(name, t, values=values, parent=parent, parent_values=parent_values) if values else None


def _ranged(
    c: Checker,
    name: str,
    t: ParamType,
    m: dict[str, Any],
    path: KeyPath,
    parent: str | None,
    parent_values: tuple[Value, ...],
) -> Param | None:
    if "values" in m:
        c.add(path + ("values",), f"a {t.value} parameter takes min and max; for a list of numbers use type: discrete")
    bounds = []
    for key in ("min", "max"):
        v = m.get(key)
        if key not in m:
            c.add(path, f"missing required key '{key}'")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            c.add(path + (key,), f"expected a number, got {show_value(v)}")
        elif t is ParamType.INTEGER and not float(v).is_integer():
            c.add(path + (key,), f"expected an integer, got {show_value(v)}")
        else:
            bounds.append(float(v))
    scale = c.choice(m.get("scale", "linear"), path + ("scale",), tuple(s.value for s in Scale))
    if len(bounds) != 2 or scale is None:
        return None
    lo, hi = bounds
    if lo > hi:
        c.add(path, f"min {lo:g} is above max {hi:g}")
        return None
    if scale == Scale.LOG.value and lo <= 0:
        c.add(path + ("min",), f"a log scale needs a positive range, got min {lo:g}")
        return None
    return Param(name, t, lo, hi, Scale(scale), parent=parent, parent_values=parent_values)


def _values(c: Checker, t: ParamType, value: Any, path: KeyPath) -> tuple[Value, ...]:
    if not isinstance(value, list) or not value:
        c.add(path, f"expected a non-empty list, got {show_value(value)}")
        return ()
    out: list[Value] = []
    for i, v in enumerate(value):
        if t is ParamType.CATEGORICAL:
            s = c.string(v, path + (i,))
            if s is None:
                return ()
            if len(s) > MAX_CATEGORY:
                c.add(path + (i,), f"a value of at most {MAX_CATEGORY} characters, got {len(s)}")
                return ()
            out.append(s)
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            c.add(path + (i,), f"expected a number, got {show_value(v)}")
            return ()
        else:
            out.append(v)
    if len(set(out)) != len(out):
        c.add(path, "a value is listed twice")
        return ()
    if t is ParamType.DISCRETE and sorted(out) != out:
        c.add(path, "discrete values go in increasing order")
        return ()
    return tuple(out)


def _when(c: Checker, value: Any, path: KeyPath) -> tuple[str | None, tuple[Value, ...]]:
    if value is None:
        return None, ()
    m = c.mapping(value, path)
    if not m or len(m) != 1:
        c.add(path, "expected one parent parameter and its values, such as {optimizer: [sgd]}")
        return None, ()
    ((parent, values),) = m.items()
    if not isinstance(values, list) or not values or any(isinstance(v, (dict, list)) for v in values):
        c.add(path + (parent,), f"expected a list of the parent's values, got {show_value(values)}")
        return None, ()
    return str(parent), tuple(values)
