"""Early stopping, as numbers: Vertex AI's median rule and the sentences that say why a
trial stopped. Pure (io/pruners.py applies them to Optuna's trials).

Vertex's `medianAutomatedStoppingSpec`: "stops a pending Trial if the Trial's best
objective_value is strictly below the median 'performance' of all completed Trials reported
up to the Trial's last measurement", where a completed trial's performance is "the running
average of the objective values reported by the Trial in each measurement". So, for a trial
whose latest report is at step S: each completed trial's average of its values at steps <= S
(a completed trial with no report by S has none and is not counted), the median of those
averages, and the trial's best value so far against it. Vertex documents no minimum number of
completed trials: one is enough; none, and nobody is stopped. Optuna's MedianPruner is another
rule (the others' values at the very step S, ended trials counted whether completed or not).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Curve = Mapping[int, float]  # a trial's reports: step -> value


@dataclass(frozen=True)
class MedianCall:
    """The median rule's look at one trial: the numbers that decided."""

    step: int  # the trial's latest step: completed trials are averaged up to it
    best: float | None  # the trial's best value so far (None: no finite value yet)
    median: float | None  # of the completed trials' running averages (None: no such trial)
    completed: int  # completed trials with a running average to `step`
    stop: bool


@dataclass(frozen=True)
class RungCall:
    """Successive halving's look (asha, or one of hyperband's brackets) at the rung a trial
    reached: it goes on only if its value there is among the best 1/`reduction` there."""

    rule: str  # "asha" or "hyperband"
    rung: int  # from 0, as Optuna's `completed_rung_N` trial attributes count
    step: int  # the trial's step when it was looked at (its value at this step is the rung's)
    value: float
    cut: float | None  # the worst value that goes on (None: the value is not a number)
    reached: int  # trials with a value at this rung, this one included
    reduction: int
    stop: bool
    bracket: int | None = None  # hyperband's


Call = MedianCall | RungCall


def running_average(curve: Curve, step: int) -> float | None:
    """The average of the values reported at steps <= `step` (None: none was)."""
    values = [v for s, v in curve.items() if s <= step and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def median_rule(trial: Curve, completed: Sequence[Curve], maximize: bool) -> MedianCall | None:
    """Vertex's median rule on a trial's reports so far; None: it reported nothing."""
    if not trial:
        return None
    step = max(trial)
    finite = [v for v in trial.values() if math.isfinite(v)]
    best = (max(finite) if maximize else min(finite)) if finite else None
    averages = [a for a in (running_average(c, step) for c in completed) if a is not None]
    median = statistics.median(averages) if averages else None
    stop = best is not None and median is not None and (best < median if maximize else best > median)
    return MedianCall(step, best, median, len(averages), stop)


def rung_cut(competing: Sequence[float], reduction: int, maximize: bool) -> float:
    """The worst value that goes on from a rung whose values (the trial's included) are
    `competing`: the best 1/`reduction` of them, at least the best one (Optuna's successive
    halving, which cannot pause a trial to wait for more)."""
    ranked = sorted(competing, reverse=maximize)
    return ranked[max(len(ranked) // reduction - 1, 0)]


def _both(a: float, b: float) -> tuple[str, str]:
    """Two numbers short (3 significant digits), with more digits when that would print two
    different numbers alike: the printed ones show which is worse."""
    for digits in range(3, 18):
        x, y = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if x != y:
            return x, y
    return f"{a!r}", f"{b!r}"


def words(call: Call, metric: str) -> str:
    """Why a trial stopped (or would go on), with the numbers that decided: a trial's `why`,
    shown after "trial N stopped early at step M: "."""
    if isinstance(call, MedianCall):
        if call.best is None or call.median is None:
            return f"no median rule yet at step {call.step}: {call.completed} completed trials"
        best, median = _both(call.best, call.median)
        trials = "trial's running average" if call.completed == 1 else "trials' running averages"
        return f"best {metric} {best}, median of {call.completed} completed {trials} to step {call.step}: {median}"
    where = f"rung {call.rung}" + (f" of bracket {call.bracket}" if call.bracket is not None else "")
    if call.cut is None:
        return f"{call.rule} at {where}, step {call.step}: {metric} is not a number"
    value, cut = _both(call.value, call.cut)
    return (
        f"{call.rule} at {where}, step {call.step}: {metric} {value}, not in the best 1/{call.reduction} "
        f"of the {call.reached} trials there (the cut: {cut})"
    )
