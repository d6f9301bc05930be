"""A finite search space sampled without repeats while unseen points remain.

TPE and random search draw each parameter on its own: over a few discrete values, trials
asked while others run get points already taken (4 values, 4 parallel trials ran 1, 1, 4, 4).
Vertex's service does not repeat a point; `Unseen` wraps the search's sampler so that a point
taken by any trial of the study (running, ended, or queued as a retry) is drawn again, up to
`TRIES` times, and then one of the points nobody took is picked at random. Once every point
is taken, the search's own choice stands (a point runs again).

It samples the whole point when a trial's first parameter is suggested (Optuna's "relative"
sampling); a conditional parameter whose parent did not take its values is never suggested,
so its drawn value goes unused.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.study import Study
from optuna.trial import FrozenTrial
from optuna.trial import TrialState as OptunaState

from provision.core.tuning import Param, ParamType, Value
from provision.rules.space import Point, finite_points, point

TRIES = 20  # draws of the search's own before an unseen point is picked at random
MAX_POINTS = 20000  # a larger space is only redrawn (a repeat is unlikely there anyway)
SURPLUS = "surplus"  # io/study.py's mark of an ask past max_trials by a racing runner: not a trial


class Unseen(BaseSampler):
    def __init__(
        self,
        base: BaseSampler,
        params: Sequence[Param],
        space: dict[str, BaseDistribution],
        seed: int | None,
    ) -> None:
        self._base = base
        self._params = tuple(params)
        self._space = space
        self._points = finite_points(params, MAX_POINTS)
        self._rng = random.Random(seed)

    # -- the whole point at once

    def infer_relative_search_space(self, study: Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        if "fixed_params" in trial.system_attrs:
            return {}  # a retry: its parameters are the lost trial's
        return dict(self._space)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        if not search_space:
            return {}
        taken = _taken(study, trial)
        drawn: dict[str, Any] = {}
        for _ in range(TRIES):
            drawn = {name: self._base.sample_independent(study, trial, name, d) for name, d in search_space.items()}
            if point(self._active(drawn)) not in taken:
                return drawn
        unseen = [p for p in self._points or () if point(p) not in taken]
        if unseen:
            return dict(self._rng.choice(unseen))
        return drawn  # every point is taken: the search's choice runs again

    def _active(self, drawn: dict[str, Any]) -> dict[str, Value]:
        """The parameters a trial given `drawn` gets (a conditional one only when its parent
        took one of its values), as study.py's `_suggest` gives them."""
        out: dict[str, Value] = {}
        for p in self._params:
            if p.parent is not None and out.get(p.parent) not in p.parent_values:
                continue
            out[p.name] = drawn[p.name]
        return out

    # -- the rest is the search's own

    def sample_independent(
        self, study: Study, trial: FrozenTrial, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)

    def after_trial(self, study: Study, trial: FrozenTrial, state: OptunaState, values: Sequence[float] | None) -> None:
        self._base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()
        self._rng.seed()


def _taken(study: Study, asking: FrozenTrial) -> set[Point]:
    """The points of every trial but `asking`: running, ended (failed ones too: Vertex does not
    repeat them either) and queued retries; not the surplus asks of racing runners."""
    out: set[Point] = set()
    # The storage's own list: a pruner may hand the sampler a filtered study (hyperband).
    for t in study._storage.get_all_trials(study._study_id, deepcopy=False):
        if t._trial_id == asking._trial_id or t.user_attrs.get(SURPLUS):
            continue
        if t.state is OptunaState.WAITING:
            fixed = t.system_attrs.get("fixed_params")
            if isinstance(fixed, dict):
                out.add(point(fixed))
        elif t.params:
            out.add(point(t.params))
    return out


def unseen(
    base: BaseSampler, params: Sequence[Param], space: dict[str, BaseDistribution], seed: int | None
) -> BaseSampler:
    """`base` without repeats when the space is finite; `base` itself when it is not (a double)."""
    if any(p.type is ParamType.DOUBLE for p in params):
        return base
    return Unseen(base, params, space, seed)
