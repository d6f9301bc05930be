"""A study's search space as Optuna keeps it: each parameter's distribution, and the check
that a resumed study searches the space its trials were asked in."""

from __future__ import annotations

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from provision.core.errors import ProvisionError
from provision.core.tuning import Param, ParamType, Scale, Tune


def distribution(p: Param) -> BaseDistribution:
    log = p.scale is Scale.LOG
    if p.type is ParamType.DOUBLE:
        return FloatDistribution(float(p.min or 0), float(p.max or 0), log=log)
    if p.type is ParamType.INTEGER:
        return IntDistribution(int(p.min or 0), int(p.max or 0), log=log)
    return CategoricalDistribution(list(p.values))


def _words(d: BaseDistribution) -> str:
    if isinstance(d, FloatDistribution | IntDistribution):
        kind = "double" if isinstance(d, FloatDistribution) else "integer"
        return f"{kind} {d.low:g}..{d.high:g}{' (log)' if d.log else ''}"
    if isinstance(d, CategoricalDistribution):
        return f"values {list(d.choices)}"
    return type(d).__name__


def same_space(study: optuna.Study, job: str, tune: Tune) -> None:
    """A resumed study searches the space its trials were asked in: Optuna cannot mix two
    distributions of one parameter, and a best trial outside the declared space would be
    named without a word. A change is refused, saying what changed."""
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("surplus") and t.distributions]
    if not trials:
        return
    then: dict[str, BaseDistribution] = {}
    for t in trials:
        for name, d in t.distributions.items():
            then.setdefault(name, d)
    now = {p.name: distribution(p) for p in tune.params}
    changes = [f"{n} was {_words(d)}, now {_words(now[n])}" for n, d in then.items() if n in now and now[n] != d]
    changes += [f"{n} was {_words(d)}, now gone" for n, d in then.items() if n not in now]
    if changes:
        raise ProvisionError(
            f"tune.parameters changed since study {job} began ({'; '.join(changes)}): its {len(trials)} trials were "
            "asked in the old space. Put the old parameters back to resume it, or start a new study "
            "(another `job:` name)"
        )
