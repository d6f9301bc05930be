"""Which parameters mattered: Optuna's own importance evaluator
(optuna.importance.get_param_importances, PED-ANOVA by default in Optuna 5) over a study's
finished trials, as Optuna Dashboard shows it. Read from the rows the dashboard holds (no
second read of the storage): the succeeded trials with a value, each a FrozenTrial in a
study of Optuna's in-memory storage, asked once per set of trials (the reader keeps it)."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence

import optuna

from provision.core.tuning import Goal, TrialRow, TrialState, Tune
from provision.io.studyspace import distribution

MIN_TRIALS = 4  # fewer succeeded trials than this: no importance (nothing to compare)
MAX_TRIALS = 20_000  # the last this many succeeded trials are weighed (10,000 took ~0.8 s)


def importances(tune: Tune, rows: Sequence[TrialRow]) -> dict[str, float]:
    """Each parameter's share of the value's variation (they add up to 1), most important
    first; {} when there are too few trials to say, or Optuna cannot (a parameter that never
    varied, a space it does not weigh)."""
    dists = {p.name: distribution(p) for p in tune.params}
    trials = []
    for r in rows:
        params = dict(r.params)
        if r.state is not TrialState.SUCCEEDED or r.value is None or not math.isfinite(r.value):
            continue
        if set(params) != set(dists):
            continue  # a conditional parameter it was not asked: weighed only among trials with all
        try:
            trials.append(
                optuna.trial.create_trial(
                    params=params, distributions={k: dists[k] for k in params}, value=float(r.value)
                )
            )
        except ValueError:
            continue  # a value outside the space now declared
    trials = trials[-MAX_TRIALS:]
    if len(trials) < MIN_TRIALS:
        return {}
    direction = optuna.study.StudyDirection.MAXIMIZE if tune.metric.goal is Goal.MAXIMIZE else None
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), direction=direction)
    study.add_trials(trials)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its experimental-feature warnings: not the user's business
            optuna.logging.set_verbosity(logging.WARNING)
            got = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
    return {str(k): float(v) for k, v in got.items() if math.isfinite(float(v))}
