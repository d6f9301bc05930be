"""The early-stopping rules as Optuna pruners, each keeping the numbers of its last decision
(a pruner answers yes or no: the loop asks it why right after, on the same thread).

- `median`: Vertex AI's median rule (rules/stopping.py), a pruner of provision's own.
- `asha`: Optuna's SuccessiveHalvingPruner (asynchronous successive halving).
- `hyperband`: Optuna's HyperbandPruner (successive halving in brackets that start stopping
  at different rungs).

Successive halving records, in each trial's system attributes, its value at every rung it
reached (`completed_rung_N`); the rung a stopped trial is named by is the last of these, and
so is the rung a trial reached (its status).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optuna
from optuna.pruners import BasePruner, HyperbandPruner, SuccessiveHalvingPruner
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from provision.core.tuning import EarlyStopping
from provision.rules.stopping import Call, RungCall, median_rule, rung_cut

ASHA_REDUCTION = 4  # Optuna's defaults: a quarter of a rung goes on (asha), a third (hyperband)
HYPERBAND_REDUCTION = 3
RUNG = "completed_rung_"


def _maximize(study: optuna.Study) -> bool:
    return study.direction is StudyDirection.MAXIMIZE


class VertexMedian(BasePruner):
    """Vertex's `medianAutomatedStoppingSpec`: the trial's best value so far against the median
    of the completed trials' running averages up to its latest step."""

    def __init__(self) -> None:
        self.last: Call | None = None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        completed = [t.intermediate_values for t in study.get_trials(deepcopy=False, states=(OptunaState.COMPLETE,))]
        call = median_rule(trial.intermediate_values, completed, _maximize(study))
        self.last = call
        return call is not None and call.stop


def _rung_call(
    rule: str, study: optuna.Study, trial: FrozenTrial, reduction: int, peers: list[FrozenTrial], bracket: int | None
) -> RungCall:
    """The rung a trial was just stopped at, read back from what the pruner recorded."""
    attrs = study._storage.get_trial(trial._trial_id).system_attrs
    rung = reached_rung(attrs)
    step = trial.last_step if trial.last_step is not None else -1
    value = trial.intermediate_values.get(step, math.nan)
    if math.isnan(value) or rung is None:  # stopped for a value that is not a number, before any rung
        return RungCall(rule, 0 if rung is None else rung + 1, step, value, None, 0, reduction, True, bracket)
    key = f"{RUNG}{rung}"
    competing = [float(t.system_attrs[key]) for t in peers if key in t.system_attrs and t._trial_id != trial._trial_id]
    competing.append(float(attrs[key]))
    cut = rung_cut(competing, reduction, _maximize(study))
    return RungCall(rule, rung, step, float(attrs[key]), cut, len(competing), reduction, True, bracket)


class Asha(SuccessiveHalvingPruner):
    def __init__(self) -> None:
        super().__init__(reduction_factor=ASHA_REDUCTION)
        self.last: Call | None = None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        self.last = None
        stop = super().prune(study, trial)
        if stop:
            peers = study._storage.get_all_trials(study._study_id, deepcopy=False)
            self.last = _rung_call("asha", study, trial, ASHA_REDUCTION, peers, None)
        return stop


class Hyperband(HyperbandPruner):
    def __init__(self) -> None:
        super().__init__(reduction_factor=HYPERBAND_REDUCTION)
        self.last: Call | None = None

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        self.last = None
        stop = super().prune(study, trial)
        if stop:
            # Its bracket's trials are the ones it competed with (Optuna's own bracket rule).
            bracket = self._get_bracket_id(study, trial)
            peers = [
                t
                for t in study._storage.get_all_trials(study._study_id, deepcopy=False)
                if self._get_bracket_id(study, t) == bracket
            ]
            self.last = _rung_call("hyperband", study, trial, HYPERBAND_REDUCTION, peers, bracket)
        return stop


def pruner(rule: EarlyStopping) -> BasePruner:
    if rule is EarlyStopping.MEDIAN:
        return VertexMedian()
    if rule is EarlyStopping.ASHA:
        return Asha()
    if rule is EarlyStopping.HYPERBAND:
        return Hyperband()
    return optuna.pruners.NopPruner()


def last_call(p: BasePruner) -> Call | None:
    """The numbers of the pruner's last decision (None: a pruner that keeps none)."""
    return p.last if isinstance(p, VertexMedian | Asha | Hyperband) else None


def reached_rung(system_attrs: Mapping[str, Any]) -> int | None:
    """The highest rung a trial reached, as successive halving recorded it (None: none yet)."""
    rungs = [int(k[len(RUNG) :]) for k in system_attrs if k.startswith(RUNG) and k[len(RUNG) :].isdigit()]
    return max(rungs, default=None)
