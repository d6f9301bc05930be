"""A hyperparameter study → the inventory's `tune:` section.

Vertex AI's HyperparameterTuningJob (`studySpec`, `maxTrialCount`, ...) and AI Platform's
`trainingInput.hyperparameters` describe the same search in two spellings. Both become a
`Tune` (core/tuning.py) here, and `as_mapping` writes it in the inventory's schema. As
everywhere in the importers, a field either maps or is named in the notes with the reason.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import TypeVar

from provision.core.tuning import (
    DEFAULT_MAX_FAILED,
    DEFAULT_METRIC_TAG,
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
)
from provision.inventory.yamldoc import show_value as show
from provision.inventory.yamldoc import show_values

from .common import JSON, Note, StudyPlan, Where, boolean, check_keys, integer, items, mapping, note, string

T = TypeVar("T")

GOALS = {"MAXIMIZE": Goal.MAXIMIZE, "MINIMIZE": Goal.MINIMIZE}
ALGORITHMS = {
    "ALGORITHM_UNSPECIFIED": Algorithm.BAYESIAN,  # both services' default search is Bayesian
    "GRID_SEARCH": Algorithm.GRID,
    "RANDOM_SEARCH": Algorithm.RANDOM,
}
MEASUREMENTS = {
    "MEASUREMENT_SELECTION_TYPE_UNSPECIFIED": Measurement.LAST,
    "LAST_MEASUREMENT": Measurement.LAST,
    "BEST_MEASUREMENT": Measurement.BEST,
}
REVERSE_LOG = "UNIT_REVERSE_LOG_SCALE"
SCALES = {
    "SCALE_TYPE_UNSPECIFIED": Scale.LINEAR,
    "NONE": Scale.LINEAR,  # AI Platform's "unspecified"
    "UNIT_LINEAR_SCALE": Scale.LINEAR,
    "UNIT_LOG_SCALE": Scale.LOG,
    # Dense near the maximum: the search library has no such scale. Linear, with a note: log
    # would be dense near the minimum, the opposite of what was asked.
    REVERSE_LOG: Scale.LINEAR,
}
BOUNDED = (ParamType.DOUBLE, ParamType.INTEGER)

# Vertex AI: the parameter's type is which value spec it has.
VALUE_SPECS = {
    "doubleValueSpec": ParamType.DOUBLE,
    "integerValueSpec": ParamType.INTEGER,
    "categoricalValueSpec": ParamType.CATEGORICAL,
    "discreteValueSpec": ParamType.DISCRETE,
}
PARENT_VALUES = {
    ParamType.DISCRETE: "parentDiscreteValues",
    ParamType.INTEGER: "parentIntValues",
    ParamType.CATEGORICAL: "parentCategoricalValues",
}
VERTEX_PARAM_KEYS = frozenset({"parameterId", "scaleType", "conditionalParameterSpecs", *VALUE_SPECS})
CONDITION_KEYS = frozenset({"parameterSpec", *PARENT_VALUES.values()})
STUDY_KEYS = frozenset(
    {
        "metrics",
        "parameters",
        "algorithm",
        "measurementSelectionType",
        "medianAutomatedStoppingSpec",
        "decayCurveStoppingSpec",
        "convexAutomatedStoppingSpec",
        "convexStopConfig",
        "observationNoise",
        "studyStoppingConfig",
    }
)
# Vertex AI's other stopping rules: the median rule is the closest provision has.
CLOSE_TO_MEDIAN = ("decayCurveStoppingSpec", "convexAutomatedStoppingSpec", "convexStopConfig")
STUDY_WHY = {
    "observationNoise": "provision's search has no noise setting",
    "studyStoppingConfig": "the study ends when max_trials trials have ended (or max_failed_trials have failed)",
    "defaultValue": "provision's search has no first value to try: it picks every trial's values",
    "safetyConfig": "Vertex AI's safe search has no equal in provision",
}

# AI Platform Training: the type is named.
TYPES = {
    "DOUBLE": ParamType.DOUBLE,
    "INTEGER": ParamType.INTEGER,
    "CATEGORICAL": ParamType.CATEGORICAL,
    "DISCRETE": ParamType.DISCRETE,
}
AIP_VALUES = {ParamType.CATEGORICAL: "categoricalValues", ParamType.DISCRETE: "discreteValues"}
AIP_PARAM_KEYS = frozenset({"parameterName", "type", "minValue", "maxValue", "scaleType", *AIP_VALUES.values()})
AIP_KEYS = frozenset(
    {
        "goal",
        "hyperparameterMetricTag",
        "maxTrials",
        "maxParallelTrials",
        "maxFailedTrials",
        "enableTrialEarlyStopping",
        "algorithm",
        "resumePreviousJobId",
        "params",
    }
)


@dataclass
class Notes:
    """What reading a study did not apply (`dropped`) or applied only in part (`changed`)."""

    dropped: list[Note] = field(default_factory=list)
    changed: list[Note] = field(default_factory=list)

    def unknown(self, m: dict[str, JSON], at: Where, known: frozenset[str]) -> None:
        for key in check_keys(m, at, known):
            self.dropped.append(note(at / key, m[key], "not known to provision import"))


# --------------------------------------------------------------------------- values


def choice(value: JSON, at: Where, table: dict[str, T]) -> T:
    s = string(value, at)
    if s not in table:
        at.fail(f"expected one of {', '.join(table)}, got {show(s)}")
    return table[s]


def number(value: JSON, at: Where) -> int | float:
    """A finite number; the APIs' JSON may write int64 and double fields as text ("1", "0.5")."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if re.fullmatch(r"-?\d{1,18}", text) else float(text)
        except ValueError:
            at.fail(f"expected a number, got {show(value)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        at.fail(f"expected a finite number, got {show(value)}")
    return value


def whole(value: JSON, at: Where) -> int:
    n = number(value, at)
    if n != int(n):
        at.fail(f"expected a whole number, got {n}")
    return int(n)


def _bounds(ptype: ParamType, holder: dict[str, JSON], at: Where, scale: Scale) -> tuple[int | float, int | float]:
    """minValue and maxValue (both services' names) of a double or integer parameter."""
    for key in ("minValue", "maxValue"):
        if key not in holder:
            (at / key).fail(f"missing: a {ptype.value} parameter needs minValue and maxValue")
    read = whole if ptype is ParamType.INTEGER else (lambda v, a: float(number(v, a)))
    lo, hi = read(holder["minValue"], at / "minValue"), read(holder["maxValue"], at / "maxValue")
    if lo > hi:
        (at / "minValue").fail(f"{lo} is above maxValue, {hi}")
    if scale is Scale.LOG and lo <= 0:
        (at / "minValue").fail(f"{lo}: a log scale needs minValue above 0")
    return lo, hi


def _values(ptype: ParamType, raw: JSON, at: Where) -> tuple[Value, ...]:
    """A categorical parameter's strings (each once), or a discrete one's numbers (increasing)."""
    listed = items(raw, at)
    if not listed:
        at.fail(f"missing: a {ptype.value} parameter needs a non-empty list of values")
    if ptype is ParamType.CATEGORICAL:
        words = tuple(string(v, at / i) for i, v in enumerate(listed))
        for i, w in enumerate(words):
            if w in words[:i]:
                (at / i).fail(f"{show(w)} is listed twice")
        return words
    numbers = tuple(number(v, at / i) for i, v in enumerate(listed))
    for i in range(1, len(numbers)):
        if numbers[i] <= numbers[i - 1]:
            (at / i).fail(f"{numbers[i]} after {numbers[i - 1]}: the values must be increasing")
    return numbers


def _scale(m: dict[str, JSON], at: Where, ptype: ParamType, notes: Notes) -> Scale:
    if m.get("scaleType") is None:
        return Scale.LINEAR
    raw = m["scaleType"]
    scale = choice(raw, at / "scaleType", SCALES)
    if ptype not in BOUNDED:
        if scale is Scale.LOG or raw == REVERSE_LOG:
            notes.dropped.append(note(at / "scaleType", raw, "a scale applies to double and integer parameters only"))
        return Scale.LINEAR
    if raw == REVERSE_LOG:
        notes.changed.append(
            note(
                at / "scaleType",
                raw,
                "scale: linear: provision's search has no reverse log scale (dense near the maximum); log would be dense near the minimum",
            )
        )
    return scale


def _param(name: str, ptype: ParamType, holder: dict[str, JSON], at: Where, values_key: str, scale: Scale) -> Param:
    """The parameter from its bounds or values in `holder` (at `at`)."""
    if ptype in BOUNDED:
        lo, hi = _bounds(ptype, holder, at, scale)
        return Param(name, ptype, lo, hi, scale)
    return Param(name, ptype, values=_values(ptype, holder.get(values_key), at / values_key))


def _name(value: JSON, at: Where) -> str:
    name = string(value, at)
    if not name.strip():
        at.fail("expected the parameter's name, got an empty string")
    return name


# --------------------------------------------------------------------------- Vertex AI


def from_vertex(job: dict[str, JSON], top: Where, notes: Notes) -> StudyPlan:
    """A HyperparameterTuningJob's study: studySpec and the trial counts."""
    at = top / "studySpec"
    spec = mapping(job.get("studySpec"), at)
    if not spec:
        at.fail("missing: a HyperparameterTuningJob has a studySpec (metrics and parameters)")
    notes.unknown(spec, at, STUDY_KEYS)
    for key in ("observationNoise", "studyStoppingConfig"):
        if spec.get(key):
            notes.dropped.append(note(at / key, spec[key], STUDY_WHY[key]))
    if "maxTrialCount" not in job:
        top.fail("missing 'maxTrialCount' (how many trials the study runs)")
    params: list[Param] = []
    _vertex_params(spec.get("parameters"), at / "parameters", notes, params, None)
    algorithm = choice(spec["algorithm"], at / "algorithm", ALGORITHMS) if "algorithm" in spec else Algorithm.BAYESIAN
    _grid_check(algorithm, params, at / "algorithm")
    measurement = (
        choice(spec["measurementSelectionType"], at / "measurementSelectionType", MEASUREMENTS)
        if "measurementSelectionType" in spec
        else Measurement.LAST
    )
    max_failed = _max_failed(job, "maxFailedTrialCount", top, notes)
    tune = Tune(
        metric=_vertex_metric(spec, at, notes),
        params=tuple(params),
        max_trials=integer(job["maxTrialCount"], top / "maxTrialCount", lo=1),
        parallel_trials=integer(job.get("parallelTrialCount", 1), top / "parallelTrialCount", lo=1),
        max_failed_trials=max_failed or DEFAULT_MAX_FAILED,
        algorithm=algorithm,
        early_stopping=_vertex_stopping(spec, at, notes),
        measurement=measurement,
    )
    return StudyPlan(tune, "studySpec", max_failed_given=max_failed is not None)


def _vertex_metric(spec: dict[str, JSON], at: Where, notes: Notes) -> Metric:
    """The first metric; provision's search has one objective, so the others are named as dropped."""
    listed = items(spec.get("metrics"), at / "metrics")
    if not listed:
        (at / "metrics").fail("missing: the metric the study optimizes ({metricId, goal})")
    m_at = at / "metrics" / 0
    m = mapping(listed[0], m_at)
    notes.unknown(m, m_at, frozenset({"metricId", "goal", "safetyConfig"}))
    if m.get("safetyConfig"):
        notes.dropped.append(note(m_at / "safetyConfig", m["safetyConfig"], STUDY_WHY["safetyConfig"]))
    for key in ("metricId", "goal"):
        if key not in m:
            m_at.fail(f"missing '{key}'")
    metric = Metric(_name(m["metricId"], m_at / "metricId"), choice(m["goal"], m_at / "goal", GOALS))
    for j in range(1, len(listed)):
        notes.dropped.append(
            note(
                at / "metrics" / j,
                listed[j],
                f"provision's search optimizes one metric, the first ({metric.name}); this one is not searched on",
            )
        )
    return metric


def _vertex_params(raw: JSON, at: Where, notes: Notes, out: list[Param], parent: Param | None) -> None:
    """Parameters in order, each conditional one right after its parent (depth first)."""
    listed = items(raw, at)
    if parent is None and not listed:
        at.fail("missing: the parameters the study searches")
    for i, item in enumerate(listed):
        spec_at = at / i
        when: tuple[Value, ...] = ()
        if parent is not None:
            spec_at, when = _condition(item, at / i, parent, notes)
        m = mapping(item if parent is None else mapping(item, at / i).get("parameterSpec"), spec_at)
        p = _vertex_param(m, spec_at, notes)
        if any(q.name == p.name for q in out):
            (spec_at / "parameterId").fail(f"{show(p.name)} is a parameter already")
        out.append(replace(p, parent=parent.name, parent_values=when) if parent is not None else p)
        children = m.get("conditionalParameterSpecs")
        if children:
            if p.type is ParamType.DOUBLE:
                (spec_at / "conditionalParameterSpecs").fail(
                    "a double parameter has no conditional parameters (discrete, integer and categorical ones may)"
                )
            _vertex_params(children, spec_at / "conditionalParameterSpecs", notes, out, p)


def _vertex_param(m: dict[str, JSON], at: Where, notes: Notes) -> Param:
    notes.unknown(m, at, VERTEX_PARAM_KEYS)
    if "parameterId" not in m:
        at.fail("missing 'parameterId'")
    name = _name(m["parameterId"], at / "parameterId")
    kinds = [k for k in VALUE_SPECS if k in m]
    if len(kinds) != 1:
        given = f", got {' and '.join(kinds)}" if kinds else ""
        at.fail(f"expected one of {', '.join(VALUE_SPECS)}: the parameter's type{given}")
    kind, ptype = kinds[0], VALUE_SPECS[kinds[0]]
    holder = mapping(m[kind], at / kind)
    known = {"minValue", "maxValue"} if ptype in BOUNDED else {"values"}
    notes.unknown(holder, at / kind, frozenset({*known, "defaultValue"}))
    if "defaultValue" in holder:
        notes.dropped.append(note(at / kind / "defaultValue", holder["defaultValue"], STUDY_WHY["defaultValue"]))
    return _param(name, ptype, holder, at / kind, "values", _scale(m, at, ptype, notes))


def _condition(raw: JSON, at: Where, parent: Param, notes: Notes) -> tuple[Where, tuple[Value, ...]]:
    """A conditionalParameterSpecs entry: where its parameterSpec is, and the parent's values it is for."""
    m = mapping(raw, at)
    notes.unknown(m, at, CONDITION_KEYS)
    want = PARENT_VALUES[parent.type]  # a double parent was refused before
    given = [k for k in PARENT_VALUES.values() if k in m]
    if given != [want]:
        got = f", got {' and '.join(given)}" if given else ""
        at.fail(f"expected {want}: the values of {parent.type.value} parameter {show(parent.name)} it is for{got}")
    if "parameterSpec" not in m:
        at.fail("missing 'parameterSpec'")
    v_at = at / want / "values"
    listed = items(mapping(m[want], at / want).get("values"), v_at)
    if not listed:
        v_at.fail(f"missing: the values of {show(parent.name)} this parameter is for")
    return at / "parameterSpec", tuple(_parent_value(parent, v, v_at / i) for i, v in enumerate(listed))


def _parent_value(parent: Param, raw: JSON, at: Where) -> Value:
    if parent.type is ParamType.INTEGER:
        n = whole(raw, at)
        assert parent.min is not None and parent.max is not None
        if not parent.min <= n <= parent.max:
            at.fail(f"{n} is outside {show(parent.name)}'s range, {int(parent.min)} to {int(parent.max)}")
        return n
    value: Value = string(raw, at) if parent.type is ParamType.CATEGORICAL else number(raw, at)
    for v in parent.values:
        if v == value:
            return v  # the parent's own spelling (32, not 32.0)
    at.fail(f"{show(value)} is not one of {show(parent.name)}'s values ({show_values(parent.values)})")


def _vertex_stopping(spec: dict[str, JSON], at: Where, notes: Notes) -> EarlyStopping:
    """A stopping spec turns the median rule on; present, even empty (`{}`), means on."""
    rule = EarlyStopping.NONE
    if "medianAutomatedStoppingSpec" in spec:
        rule = EarlyStopping.MEDIAN
        m_at = at / "medianAutomatedStoppingSpec"
        m = mapping(spec["medianAutomatedStoppingSpec"], m_at)
        if "useElapsedDuration" in m and boolean(m["useElapsedDuration"], m_at / "useElapsedDuration"):
            notes.changed.append(
                note(m_at / "useElapsedDuration", True, "the median rule compares trials at the same step, not time")
            )
    for key in CLOSE_TO_MEDIAN:
        if key in spec:
            rule = EarlyStopping.MEDIAN
            notes.changed.append(
                note(
                    at / key,
                    spec[key] if spec[key] is not None else {},
                    "early_stopping: median, the closest rule provision has: a trial stops when its best value so far is worse than the median of the completed trials' running averages up to its step",
                )
            )
    return rule


# --------------------------------------------------------------------------- AI Platform Training


def from_ai_platform(raw: JSON, at: Where, notes: Notes) -> StudyPlan:
    """trainingInput.hyperparameters (HyperparameterSpec)."""
    h = mapping(raw, at)
    notes.unknown(h, at, AIP_KEYS)
    goal = (
        choice(h["goal"], at / "goal", {"GOAL_TYPE_UNSPECIFIED": Goal.MAXIMIZE, **GOALS})
        if "goal" in h
        else Goal.MAXIMIZE
    )
    tag = (
        string(h["hyperparameterMetricTag"], at / "hyperparameterMetricTag") if h.get("hyperparameterMetricTag") else ""
    )
    params: list[Param] = []
    listed = items(h.get("params"), at / "params")
    if not listed:
        (at / "params").fail("missing: the parameters the study searches")
    for i, item in enumerate(listed):
        p = _aip_param(item, at / "params" / i, notes)
        if any(q.name == p.name for q in params):
            (at / "params" / i / "parameterName").fail(f"{show(p.name)} is a parameter already")
        params.append(p)
    algorithm = choice(h["algorithm"], at / "algorithm", ALGORITHMS) if "algorithm" in h else Algorithm.BAYESIAN
    _grid_check(algorithm, params, at / "algorithm")
    stop = "enableTrialEarlyStopping" in h and boolean(h["enableTrialEarlyStopping"], at / "enableTrialEarlyStopping")
    if h.get("resumePreviousJobId"):
        notes.dropped.append(
            note(
                at / "resumePreviousJobId",
                h["resumePreviousJobId"],
                "provision tune resumes its own study: run it again and it goes on from the trials it has",
            )
        )
    max_failed = _max_failed(h, "maxFailedTrials", at, notes)
    tune = Tune(
        metric=Metric(tag or DEFAULT_METRIC_TAG, goal),
        params=tuple(params),
        max_trials=integer(h.get("maxTrials", 1), at / "maxTrials", lo=1),
        parallel_trials=integer(h.get("maxParallelTrials", 1), at / "maxParallelTrials", lo=1),
        max_failed_trials=max_failed or DEFAULT_MAX_FAILED,
        algorithm=algorithm,
        early_stopping=EarlyStopping.MEDIAN if stop else EarlyStopping.NONE,
    )
    return StudyPlan(tune, at.path, max_failed_given=max_failed is not None)


def _aip_param(raw: JSON, at: Where, notes: Notes) -> Param:
    m = mapping(raw, at)
    notes.unknown(m, at, AIP_PARAM_KEYS)
    if "parameterName" not in m:
        at.fail("missing 'parameterName'")
    name = _name(m["parameterName"], at / "parameterName")
    if "type" not in m:
        (at / "type").fail(f"missing: the parameter's type ({', '.join(TYPES)})")
    ptype = choice(m["type"], at / "type", TYPES)
    used = ("minValue", "maxValue") if ptype in BOUNDED else (AIP_VALUES[ptype],)
    for key in ("minValue", "maxValue", *AIP_VALUES.values()):
        if key not in used and m.get(key) is not None:
            notes.dropped.append(note(at / key, m[key], f"a {m['type']} parameter does not use it"))
    return _param(name, ptype, m, at, used[0], _scale(m, at, ptype, notes))


# --------------------------------------------------------------------------- both


def _grid_check(algorithm: Algorithm, params: list[Param], at: Where) -> None:
    if algorithm is Algorithm.GRID:
        for p in params:
            if p.type is ParamType.DOUBLE:
                at.fail(f"GRID_SEARCH needs integer, categorical or discrete parameters; {show(p.name)} is a double")


def _max_failed(m: dict[str, JSON], key: str, at: Where, notes: Notes) -> int | None:
    """The failed trials that end the study; None when not given or 0 (the service decided)."""
    if key not in m:
        return None
    at = at / key
    n = integer(m[key], at)
    if n == 0:
        notes.changed.append(
            note(
                at,
                m[key],
                f"0: the service decided how many failed trials end the study; tune: leaves max_failed_trials out, so provision's default, {DEFAULT_MAX_FAILED}, applies",
            )
        )
        return None
    return n


def as_mapping(study: StudyPlan) -> dict[str, JSON]:
    """The `tune:` section in the inventory's schema, defaults written out (but for
    max_failed_trials when the service decided it)."""
    t = study.tune
    out: dict[str, JSON] = {
        "metric": {"name": t.metric.name, "goal": t.metric.goal.value},
        "parameters": {p.name: _param_mapping(p) for p in t.params},
        "algorithm": t.algorithm.value,
        "max_trials": t.max_trials,
        "parallel_trials": t.parallel_trials,
    }
    if study.max_failed_given:
        out["max_failed_trials"] = t.max_failed_trials
    out["early_stopping"] = t.early_stopping.value
    out["measurement"] = t.measurement.value
    return out


def _param_mapping(p: Param) -> dict[str, JSON]:
    out: dict[str, JSON] = {"type": p.type.value}
    if p.type in BOUNDED:
        out["min"], out["max"] = p.min, p.max
        if p.scale is not Scale.LINEAR:
            out["scale"] = p.scale.value
    else:
        out["values"] = list(p.values)
    if p.parent is not None:
        out["when"] = {p.parent: list(p.parent_values)}
    return out
