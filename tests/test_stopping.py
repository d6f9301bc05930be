"""Vertex AI's median rule (rules/stopping.py) against hand-computed cases: the decision and
the numbers a stopped trial's `why` prints. Its definition (medianAutomatedStoppingSpec): a
trial is stopped when its best value so far is strictly worse than the median, over completed
trials, of each one's running average of the values it reported up to the trial's latest step."""

from __future__ import annotations

import math

import pytest

from provision.cli.tunecmd import space_line
from provision.core.tuning import Algorithm, Goal, Metric, Param, ParamType, Tune
from provision.rules.space import finite_points, space_size
from provision.rules.stopping import MedianCall, RungCall, median_rule, rung_cut, words

# (what it shows, the trial's reports, the completed trials' reports, maximize,
#  expected (step, best, median, completed, stop), expected words or None)
CASES = [
    (
        "no completed trial yet: never stops",
        {0: 9.0, 1: 8.0},
        [],
        False,
        (1, 8.0, None, 0, False),
        "no median rule yet at step 1: 0 completed trials",
    ),
    (
        # running averages to step 8: (0.5+0.3+0.1)/3=0.3, 0.4, (0.5+0.375)/2=0.4375, 0.5 (its
        # step 16 is past 8), (3+1)/2=2 -> median 0.4375; best 0.974 > 0.4375. Optuna's
        # MedianPruner would have looked at the values at step 8: 0.1, 0.4, 0.375, 1.0.
        "the issue's sentence: five completed trials, averages to the trial's step only",
        {0: 1.2, 4: 0.974, 8: 1.1},
        [
            {0: 0.5, 4: 0.3, 8: 0.1, 12: 100.0},
            {0: 0.4, 8: 0.4},
            {0: 0.5, 8: 0.375},
            {0: 0.5, 16: 0.0},
            {0: 3.0, 8: 1.0},
        ],
        False,
        (8, 0.974, 0.4375, 5, True),
        "best val_loss 0.974, median of 5 completed trials' running averages to step 8: 0.438",
    ),
    (
        "one completed trial is enough (Vertex documents no minimum)",
        {0: 2.0, 1: 1.5},
        [{0: 1.0, 1: 1.0, 2: 1.0}],
        False,
        (1, 1.5, 1.0, 1, True),
        "best val_loss 1.5, median of 1 completed trial's running average to step 1: 1",
    ),
    (
        "a completed trial with no report by the step is not counted",
        {0: 1.0, 2: 0.9},
        [{0: 0.5}, {5: 0.1}],
        False,
        (2, 0.9, 0.5, 1, True),
        "best val_loss 0.9, median of 1 completed trial's running average to step 2: 0.5",
    ),
    (
        "equal to the median is not strictly worse: goes on",
        {3: 0.5},
        [{0: 1.0, 3: 0.0}],
        False,
        (3, 0.5, 0.5, 1, False),
        None,
    ),
    (
        "its best counts, not its latest: 3.0 then 0.2 goes on against a median of 1.5",
        {0: 3.0, 1: 0.2, 2: 2.9},
        [{0: 1.0, 1: 1.0}, {0: 2.0, 1: 2.0}],
        False,
        (2, 0.2, 1.5, 2, False),
        None,
    ),
    (
        "an even count: the mean of the middle two",
        {0: 2.5},
        [{0: 1.0}, {0: 3.0}],
        False,
        (0, 2.5, 2.0, 2, True),
        "best val_loss 2.5, median of 2 completed trials' running averages to step 0: 2",
    ),
    (
        "maximize: strictly below the median stops",
        {0: 0.6, 1: 0.7},
        [{0: 0.8, 1: 0.9}, {0: 0.7, 1: 0.9}, {0: 0.1, 1: 0.2}],
        True,
        (1, 0.7, 0.8, 3, True),
        "best val_loss 0.7, median of 3 completed trials' running averages to step 1: 0.8",
    ),
    (
        "numbers alike in 3 digits are printed with as many as tell them apart",
        {0: 0.43751},
        [{0: 0.4375}],
        False,
        (0, 0.43751, 0.4375, 1, True),
        "best val_loss 0.43751, median of 1 completed trial's running average to step 0: 0.4375",
    ),
    (
        "a value that is not a number is no best: goes on",
        {0: math.nan},
        [{0: 1.0}],
        False,
        (0, None, 1.0, 1, False),
        None,
    ),
]


@pytest.mark.parametrize(
    ("shows", "trial", "completed", "maximize", "expected", "said"), CASES, ids=[c[0] for c in CASES]
)
def test_the_median_rule_by_hand(
    shows: str,
    trial: dict[int, float],
    completed: list[dict[int, float]],
    maximize: bool,
    expected: tuple[int, float | None, float | None, int, bool],
    said: str | None,
) -> None:
    call = median_rule(trial, completed, maximize)
    assert call is not None
    step, best, median, count, stop = expected
    assert (call.step, call.completed, call.stop) == (step, count, stop)
    assert call.best == pytest.approx(best) if best is not None else call.best is None
    assert call.median == pytest.approx(median) if median is not None else call.median is None
    if said is not None:
        assert words(call, "val_loss") == said


def test_a_trial_that_reported_nothing_has_no_decision() -> None:
    assert median_rule({}, [{0: 1.0}], False) is None


def test_the_rung_cut_is_the_worst_value_that_goes_on() -> None:
    # Optuna's successive halving: the best len // reduction (at least 1) go on.
    assert rung_cut([5.0, 10.0], 4, maximize=False) == 5.0
    assert rung_cut([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], 4, maximize=False) == 2.0
    assert rung_cut([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3, maximize=True) == 5.0


def test_a_rung_stop_names_the_rung_and_the_cut() -> None:
    call = RungCall("asha", 0, 1, 10.0, 5.0, 2, 4, True)
    assert (
        words(call, "loss") == "asha at rung 0, step 1: loss 10, not in the best 1/4 of the 2 trials there (the cut: 5)"
    )
    hb = RungCall("hyperband", 2, 9, 0.5, 0.25, 7, 3, True, bracket=1)
    assert words(hb, "loss").startswith(
        "hyperband at rung 2 of bracket 1, step 9: loss 0.5, not in the best 1/3 of the 7"
    )
    assert "not a number" in words(RungCall("asha", 0, 3, math.nan, None, 0, 4, True), "loss")
    assert isinstance(median_rule({0: 1.0}, [], False), MedianCall)


def test_a_finite_space_counts_its_points_conditionals_included() -> None:
    opt = Param("opt", ParamType.CATEGORICAL, values=("adam", "sgd"))
    momentum = Param("momentum", ParamType.DISCRETE, values=(0.0, 0.9), parent="opt", parent_values=("sgd",))
    layers = Param("layers", ParamType.INTEGER, 1, 3)
    points = finite_points((opt, momentum, layers), 100)
    assert points is not None and len(points) == (1 + 2) * 3
    assert {"opt": "adam", "layers": 2} in points and {"opt": "sgd", "momentum": 0.9, "layers": 1} in points
    assert space_size((opt, momentum, layers), 8) is None  # more than the limit
    assert space_size((opt, Param("lr", ParamType.DOUBLE, 0.0, 1.0)), 100) is None  # no end of points


def test_the_study_says_when_max_trials_exceeds_the_space() -> None:
    quality = (Param("quality", ParamType.DISCRETE, values=(1.0, 2.0, 3.0, 4.0)),)
    tune = Tune(Metric("loss", Goal.MINIMIZE), quality, max_trials=12)
    assert space_line(tune) == (
        "The search space has 4 points, fewer than max_trials (12): each point runs once before any runs again."
    )
    assert space_line(Tune(Metric("loss", Goal.MINIMIZE), quality, max_trials=4)) is None
    grid = Tune(Metric("loss", Goal.MINIMIZE), quality, max_trials=12, algorithm=Algorithm.GRID)
    assert space_line(grid) == "The grid has 4 points: the study runs 4 trials, not max_trials (12)."
    lr = (Param("lr", ParamType.DOUBLE, 0.0, 1.0),)
    assert space_line(Tune(Metric("loss", Goal.MINIMIZE), lr, max_trials=12)) is None
