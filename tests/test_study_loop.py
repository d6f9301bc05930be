"""The study loop (run/tune.py) on Optuna's in-memory storage with a fake trial worker: who
asks, tells and decides, without hosts (the study on hosts: integration/test_tune.py)."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import pytest
import sqlalchemy

from provision.core.errors import EXIT_INTERRUPTED, ProvisionError
from provision.core.trialend import Ended, Ending
from provision.core.tuning import (
    Algorithm,
    EarlyStopping,
    Goal,
    Metric,
    Param,
    ParamType,
    Report,
    Scale,
    TrialRow,
    TrialState,
    Tune,
)
from provision.inventory.inventory import parse
from provision.io.study import Runner, Study, load_study, memory_study, open_study
from provision.placement.tasks import Slot
from provision.rules.plan import Plan
from provision.rules.trialwait import end_wait_command, settled_free
from provision.run import trialrun
from provision.run.apply import HostOutcome
from provision.run.context import Context, open_context
from provision.run.queue import Queue
from provision.run.trialplaces import HostLocks, Places
from provision.run.trialposts import (
    Freed,
    JobEnded,
    Paused,
    Removed,
    Reported,
    SettingUp,
    Started,
    Waiting,
)
from provision.run.trialrun import (
    Handle,
    TrialWork,
)
from provision.run.tune import StudyLoop

INV = """\
job: sweep
hosts:
  - {name: a, address: 192.0.2.1, accelerators: {type: nvidia-tesla-t4, count: 4}}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, /opt/t.py]}
"""

LR = Param("lr", ParamType.DOUBLE, 0.0, 1.0)


def _tune(**kw: object) -> Tune:
    base: dict[str, object] = {
        "metric": Metric("loss", Goal.MINIMIZE),
        "params": (LR,),
        "max_trials": 6,
        "parallel_trials": 2,
    }
    return Tune(**{**base, **kw})  # type: ignore[arg-type]


Worker = Callable[[TrialWork, Handle], None]


def _loop(
    tmp_path: Path, tune: Tune, worker: Worker, study: Study | None = None, poll: float = 0.05
) -> tuple[StudyLoop, Study, list[TrialRow]]:
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    study = study or memory_study(tune, inv.job, seed=1)
    work = TrialWork(
        where=str(tmp_path / "study.yaml"),
        inv=inv,
        tune=tune,
        logs_dir=tmp_path,
        stop=threading.Event(),
        say=lambda line: None,
        poll=poll,
    )
    rows: list[TrialRow] = []
    return StudyLoop(work, study, Runner.here(), on_row=rows.append, run=worker), study, rows


def _succeeds(value: Callable[[Handle], float] = lambda h: float(h.params["lr"])) -> Worker:
    """A worker whose trial reports two steps and succeeds, posting its end twice (as a
    worker that saw its job end and then failed in its wind-up would)."""

    def work(w: TrialWork, h: Handle) -> None:
        w.post(Started(h.number, {"chief-0": "a"}))
        v = value(h)
        w.post(Reported(h.number, (Report(0, v), Report(1, v))))
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "", v, 1)))
        w.post(JobEnded(h.number, Ended(Ending.FAILED, "told again from another thread")))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", v, 1)))

    return work


def test_each_trial_is_told_once_whatever_posts_its_end(tmp_path: Path) -> None:
    loop, study, rows = _loop(tmp_path, _tune(), _succeeds())
    tells: list[int] = []
    tell = study.tell
    study.tell = lambda n, e: tells.append(n) or tell(n, e)  # type: ignore[method-assign]
    end = loop.run()
    assert end.code == 0, end.why
    assert sorted(tells) == [1, 2, 3, 4, 5, 6]
    final = study.rows()
    assert len(final) == 6 and all(r.state is TrialState.SUCCEEDED for r in final)
    assert all(study.study.user_attrs.get(f"removed-{n}") for n in range(1, 7))
    assert [r.number for r in rows if r.state is TrialState.RUNNING] == [1, 2, 3, 4, 5, 6]


def test_at_most_parallel_trials_hold_gpus_and_the_next_starts_before_the_last_is_removed(tmp_path: Path) -> None:
    holding: set[int] = set()
    most = 0
    gates: dict[int, threading.Event] = {}
    started: list[int] = []
    lock = threading.Lock()

    def work(w: TrialWork, h: Handle) -> None:
        nonlocal most
        with lock:
            holding.add(h.number)
            most = max(most, len(holding))
            started.append(h.number)
            gates[h.number] = threading.Event()
        time.sleep(0.05)
        with lock:
            holding.discard(h.number)
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0)))
        assert h.told_event.wait(5)
        if h.number == 1:
            # The early hand-off: trial 1's GPU went to the next trial while 1 is still
            # being removed (its logs kept, its files taken away).
            assert _until(lambda: len(started) >= 3), "no trial started on trial 1's GPU before its removal"
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0)))

    loop, study, _ = _loop(tmp_path, _tune(max_trials=8, parallel_trials=2), work)
    assert loop.run().code == 0
    assert most <= 2
    assert len(study.rows()) == 8


def test_ctrl_c_during_a_wait_returns_within_a_second(tmp_path: Path) -> None:
    def forever(w: TrialWork, h: Handle) -> None:
        w.stop.wait(30)
        w.post(Removed(h.number, Ended(Ending.LEFT_RUNNING, "tune was interrupted"), left=True))

    loop, study, _ = _loop(tmp_path, _tune(), forever, poll=10.0)  # a poll far longer than the bound
    main = threading.get_ident()
    sent: list[float] = []

    def ctrl_c() -> None:
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    timer = threading.Timer(0.5, ctrl_c)
    timer.start()
    end = loop.run()
    took = time.monotonic() - sent[0]
    assert end.code == EXIT_INTERRUPTED and "2 trials still run" in end.why
    assert took < 1.0, f"Ctrl-C took {took:.2f} s"
    assert loop.w.stop.is_set()
    assert [r.state for r in study.rows()] == [TrialState.RUNNING, TrialState.RUNNING]  # left running


def _dead_runner() -> Runner:
    p = subprocess.Popen(["true"])
    p.wait()
    return Runner(socket.gethostname(), p.pid, "dead")


def test_a_dead_runners_trials_are_adopted_where_it_left_them(tmp_path: Path) -> None:
    tune = _tune(max_trials=3, parallel_trials=3)
    study = memory_study(tune, "sweep", seed=1)
    dead = _dead_runner()
    # Trial 1: running on the hosts; trial 2: its job ended and was recorded, not told;
    # trial 3: told, but not yet removed from the hosts.
    for n in (1, 2, 3):
        asked = study.ask(3)
        assert asked is not None and asked.number == n
        study.claim(n, dead, f"sweep-t{n}")
    study.beat(1, phase="running")
    study.beat(2, phase="ended", ending="succeeded", why="", value=0.5, steps=3)
    assert study.tell(3, Ended(Ending.SUCCEEDED, "", 0.25, 3))
    seen: dict[int, Handle] = {}

    def work(w: TrialWork, h: Handle) -> None:
        seen[h.number] = h
        ended = h.recorded or Ended(Ending.SUCCEEDED, "", 0.75, 4)
        if not h.told:
            w.post(JobEnded(h.number, ended))
            assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    loop, study, _ = _loop(tmp_path, tune, work, study=study)
    end = loop.run()
    assert end.code == 0, end.why
    assert sorted(seen) == [1, 2, 3] and all(h.adopt for h in seen.values())
    assert (seen[1].phase, seen[2].phase, seen[3].told) == ("running", "ended", True)
    assert [(r.number, r.state, r.value) for r in study.rows()] == [
        (1, TrialState.SUCCEEDED, 0.75),
        (2, TrialState.SUCCEEDED, 0.5),
        (3, TrialState.SUCCEEDED, 0.25),
    ]
    assert all(study.study.user_attrs.get(f"removed-{n}") for n in (1, 2, 3))


def test_a_live_runners_trials_are_not_adopted(tmp_path: Path) -> None:
    tune = _tune(max_trials=1)
    study = memory_study(tune, "sweep", seed=1)
    other = Runner("another-machine", 4242, "x")
    assert study.ask(1) is not None
    study.claim(1, other, "sweep-t1")  # its heartbeat is now, on the storage's clock
    assert study.abandoned(Runner.here()) == []
    study.beat(1)
    study.offset = 61.0  # the storage's clock a minute on: no heartbeat since
    assert [t.number for t in study.abandoned(Runner.here())] == [1]


def test_a_grid_ends_when_the_sampler_has_no_point_left(tmp_path: Path) -> None:
    grid = (
        Param("depth", ParamType.INTEGER, 1, 2),
        Param("act", ParamType.CATEGORICAL, values=("relu", "tanh")),
    )
    tune = _tune(params=grid, algorithm=Algorithm.GRID, max_trials=50, parallel_trials=3)
    loop, study, _ = _loop(tmp_path, tune, _succeeds(lambda h: float(h.params["depth"])))
    end = loop.run()
    assert end.code == 0, end.why
    points = sorted((r.params[0][1], r.params[1][1]) for r in study.rows())
    assert points == [(1, "relu"), (1, "tanh"), (2, "relu"), (2, "tanh")]


def test_the_median_rule_decides_in_the_loop_and_the_worker_stops_the_trial(tmp_path: Path) -> None:
    tune = _tune(max_trials=6, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)

    def work(w: TrialWork, h: Handle) -> None:
        behind = h.number == 6  # the last trial is far behind: it waits for the loop's word
        value = 10.0 if behind else 1.0
        for step in range(5):
            w.post(Reported(h.number, tuple(Report(s, value) for s in range(step + 1))))
            if behind and _until(lambda: h.stop_early is not None, 2.0):
                ended = Ended(Ending.STOPPED_EARLY, h.stop_early or "", value, step)
                break
        else:
            ended = Ended(Ending.SUCCEEDED, "", value, 4)
        w.post(JobEnded(h.number, ended))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    loop, study, _ = _loop(tmp_path, tune, work)
    assert loop.run().code == 0
    rows = study.rows()
    assert [r.state for r in rows[:5]] == [TrialState.SUCCEEDED] * 5
    assert rows[5].state is TrialState.STOPPED_EARLY
    assert rows[5].why == "best loss 10, median of 5 completed trials' running averages to step 0: 1"


def _stepwise(value: Callable[[Handle], float], steps: int = 10) -> tuple[Worker, Callable[[StudyLoop], None]]:
    """A worker whose trial reports `steps` steps one at a time, each after the loop has
    looked at the one before (so an early stop lands at the step that decided), and a hook
    that makes the loop say when it has."""
    looked: dict[int, int] = {}

    def hook(loop: StudyLoop) -> None:
        reported = loop._reported

        def and_say(h: Handle, reports: tuple[Report, ...], *, final: bool = False) -> None:
            reported(h, reports, final=final)
            looked[h.number] = reports[-1].step

        loop._reported = and_say  # type: ignore[method-assign]

    def work(w: TrialWork, h: Handle) -> None:
        v = value(h)
        ended = Ended(Ending.SUCCEEDED, "", v, steps - 1)
        for step in range(steps):
            w.post(Reported(h.number, tuple(Report(s, v) for s in range(step + 1))))
            assert _until(partial(_is, looked, h.number, step))
            if h.stop_early is not None:
                ended = Ended(Ending.STOPPED_EARLY, h.stop_early, v, step)
                break
        w.post(JobEnded(h.number, ended))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    return work, hook


def _is(looked: dict[int, int], number: int, step: int) -> bool:
    return looked.get(number) == step


def _rungs(study: Study, number: int) -> list[int]:
    t = study.study.get_trials(deepcopy=False)[number - 1]
    return sorted(int(k.rsplit("_", 1)[1]) for k in t.system_attrs if k.startswith("completed_rung_"))


def test_the_median_rule_counts_completed_trials_only(tmp_path: Path) -> None:
    # Trial 2 is stopped at step 0 (3.0 against trial 1's 1.0); trial 3 (2.0) then meets the
    # median of trial 1 alone, not of 1 and the stopped 2: stopped at step 0 too, by 1.0.
    values = {1: 1.0, 2: 3.0, 3: 2.0}
    work, hook = _stepwise(lambda h: values[h.number], steps=3)
    tune = _tune(max_trials=3, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    rows = study.rows()
    assert [r.state for r in rows] == [TrialState.SUCCEEDED, TrialState.STOPPED_EARLY, TrialState.STOPPED_EARLY]
    assert rows[2].why == "best loss 2, median of 1 completed trial's running average to step 0: 1"
    assert rows[2].steps == 0


def test_asha_stops_a_trial_at_a_rung_and_says_which(tmp_path: Path) -> None:
    # Trial 1 completes (asha's rungs start from its length); trial 2 (5.0) is alone at rung
    # 0 and goes on; trial 3 (10.0) is not in the best quarter of {5, 10} at rung 0.
    values = {1: 1.0, 2: 5.0, 3: 10.0, 4: 0.5}
    work, hook = _stepwise(lambda h: values[h.number])
    tune = _tune(max_trials=4, parallel_trials=1, early_stopping=EarlyStopping.ASHA)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    rows = study.rows()
    assert [r.state for r in rows] == [
        TrialState.SUCCEEDED,
        TrialState.SUCCEEDED,
        TrialState.STOPPED_EARLY,
        TrialState.SUCCEEDED,
    ]
    assert rows[2].why == "asha at rung 0, step 1: loss 10, not in the best 1/4 of the 2 trials there (the cut: 5)"
    assert _rungs(study, 3) == [0]  # the rung Optuna recorded is the one said
    assert _rungs(study, 2) == [0, 1] and _rungs(study, 4) == [0, 1]  # promoted at steps 1 and 4
    # The rung each reached is its status (tune --status: the RUNG column and "rung").
    assert [r.rung for r in rows] == [None, 1, 0, 1]
    assert [r.to_json()["rung"] for r in rows] == [None, 1, 0, 1]


def test_hyperband_stops_trials_at_the_rungs_optuna_recorded(tmp_path: Path) -> None:
    # Each trial worse than the one before: in each bracket, a trial after the first is
    # not among the best third at its first rung.
    work, hook = _stepwise(lambda h: float(h.number))
    tune = _tune(max_trials=9, parallel_trials=1, early_stopping=EarlyStopping.HYPERBAND)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    stopped = [r for r in study.rows() if r.state is TrialState.STOPPED_EARLY]
    assert stopped, [(r.number, r.state, r.why) for r in study.rows()]
    for r in stopped:
        rung = _rungs(study, r.number)[-1]
        assert r.why.startswith(f"hyperband at rung {rung} of bracket "), r.why
        assert f"loss {r.number}, not in the best 1/3 of the " in r.why
    # Brackets start stopping at different rungs: bracket 1's first rung is at step 3.
    assert any("of bracket 1, step 3:" in r.why for r in stopped), [r.why for r in stopped]


def _curve(study: Study, number: int) -> dict[int, float]:
    return dict(study.study.get_trials(deepcopy=False)[number - 1].intermediate_values)


def _at_once(
    curves: dict[int, dict[int, float]], seen: int | None = None
) -> tuple[Worker, Callable[[StudyLoop], None]]:
    """A worker whose trial's reports come in one look (a trial of short steps, or a slow
    poll): all of them; or (`seen`) the first `seen` before its end and all of them with its
    end's look (final); and the hook that makes the loop say when it has judged them."""
    judged: set[int] = set()

    def hook(loop: StudyLoop) -> None:
        reported = loop._reported

        def and_say(h: Handle, reports: tuple[Report, ...], *, final: bool = False) -> None:
            reported(h, reports, final=final)
            if final or seen is None:
                judged.add(h.number)

        loop._reported = and_say  # type: ignore[method-assign]

    def work(w: TrialWork, h: Handle) -> None:
        reports = tuple(Report(s, v) for s, v in sorted(curves[h.number].items()))
        if seen is None:
            w.post(Reported(h.number, reports))
        else:
            if reports[:seen]:
                w.post(Reported(h.number, reports[:seen]))
            w.post(Reported(h.number, reports, final=True))
        # As the worker does, once the loop judged them: stopped where the rule decided,
        # else it ran to its end.
        assert _until(lambda: h.number in judged)
        last = h.stop_at or reports[-1]
        ending = Ending.STOPPED_EARLY if h.stop_early is not None else Ending.SUCCEEDED
        ended = Ended(ending, h.stop_early or "", last.value, last.step)
        w.post(JobEnded(h.number, ended))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    return work, hook


def _by_step(*values: float) -> dict[int, float]:
    return dict(enumerate(values))


def test_a_look_that_brings_several_steps_is_judged_at_each_and_stops_at_the_first_behind(tmp_path: Path) -> None:
    # Trial 1 completes: 3, 3, then 0.3: its running averages 3, 3, 2.1, 1.65, 1.38, 1.16.
    # Trial 2 (2.0 at every step) comes in one look: not behind until step 3 (2 > 1.65),
    # so it stopped at step 3 (not 5, the look's last), said with step 3's numbers, and
    # the study keeps its curve to step 3 only.
    curves = {1: _by_step(3, 3, 0.3, 0.3, 0.3, 0.3), 2: _by_step(2, 2, 2, 2, 2, 2)}
    tune = _tune(max_trials=2, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    work, hook = _at_once(curves)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    rows = study.rows()
    assert rows[1].state is TrialState.STOPPED_EARLY
    assert rows[1].steps == 3 and rows[1].value == 2.0
    assert rows[1].why == "best loss 2, median of 1 completed trial's running average to step 3: 1.65"
    assert sorted(_curve(study, 2)) == [0, 1, 2, 3]


def test_a_completed_trials_reports_after_the_last_look_count_in_the_median(tmp_path: Path) -> None:
    # Trial 1's last two steps (3.0) come only with its end's look: its running average to
    # step 3 is (1 + 1 + 3 + 3) / 4 = 2, and trial 2 (1.5 at step 3) is not behind it.
    # Counted without them (an average of 1.0), trial 2 would have been stopped.
    curves = {1: _by_step(1, 1, 3, 3), 2: {3: 1.5}}
    tune = _tune(max_trials=2, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    work, hook = _at_once(curves, seen=2)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    assert _curve(study, 1) == {0: 1.0, 1: 1.0, 2: 3.0, 3: 3.0}
    assert [r.state for r in study.rows()] == [TrialState.SUCCEEDED, TrialState.SUCCEEDED]


def _told(study: Study, number: int, curve: Mapping[int, float]) -> None:
    """Trial `number`, asked, reported `curve` and succeeded, as a runner before did it."""
    assert study.ask(10) is not None
    for step, v in curve.items():
        study.report(number, v, step)
    study.tell(number, Ended(Ending.SUCCEEDED, "", curve[max(curve)], max(curve)))


def test_an_adopted_trial_is_judged_only_past_the_steps_its_dead_runner_reported(tmp_path: Path) -> None:
    # Trial 1 completed at 1.0. Trial 2's dead runner reported steps 0-5 (2.0, behind from
    # the start: its runner died before it stopped it). The adopter's first look brings
    # steps 0-5 again (the host's file has them all): kept, not judged again at step 0 (its
    # words would be about step 5, the study's last); step 6, new, decides.
    tune = _tune(max_trials=3, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    loop, study, _ = _loop(tmp_path, tune, _succeeds())
    _told(study, 1, _by_step(*[1.0] * 8))
    assert study.ask(10) is not None
    for step in range(6):
        study.report(2, 2.0, step)
    h = Handle(2, {"lr": 0.5}, phase="running", adopt=True)
    loop._reported(h, tuple(Report(s, 2.0) for s in range(6)))
    assert h.stop_early is None and h.stop_at is None
    loop._reported(h, tuple(Report(s, 2.0) for s in range(7)))
    assert h.stop_at == Report(6, 2.0)
    assert h.stop_early == "best loss 2, median of 1 completed trial's running average to step 6: 1"


def test_reports_and_beats_for_a_trial_another_runner_told_are_no_crash(tmp_path: Path) -> None:
    # Two runners adopted one trial: the other told it first. This one's last reports and
    # heartbeat come after: Optuna refuses them (a finished trial); the runner goes on.
    study = memory_study(_tune(), "sweep", seed=1)
    _told(study, 1, {0: 1.0})
    study.report(1, 0.5, 1)
    study.beat(1, steps=1)
    assert study.steps(1) == {0}
    assert study.tell(1, Ended(Ending.SUCCEEDED, "", 0.5, 1)) is False  # theirs stands


def test_a_completed_trials_last_reports_record_the_rungs_it_passed(tmp_path: Path) -> None:
    # asha's rungs (after trial 1's 10 steps) are at steps 1 and 4. Trial 2's steps past 2
    # come only with its end's look (final): not judged, but rung 1 is recorded, and is its
    # status: later trials compete with its value there.
    curves = {1: _by_step(*[1.0] * 10), 2: _by_step(*[0.5] * 10)}
    tune = _tune(max_trials=2, parallel_trials=1, early_stopping=EarlyStopping.ASHA)
    work, hook = _at_once(curves, seen=3)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    assert _rungs(study, 2) == [0, 1]
    assert [r.rung for r in study.rows()] == [None, 1]


def test_rungs_take_the_value_at_their_own_step_when_a_look_brings_several(tmp_path: Path) -> None:
    # asha's rungs (after trial 1's 10 steps) are at steps 1 and 4: trial 2's values there,
    # not the value at the look's last step, though all ten came in one look.
    curves = {1: _by_step(*[1.0] * 10), 2: _by_step(*[5.0 + s / 100 for s in range(10)])}
    tune = _tune(max_trials=2, parallel_trials=1, early_stopping=EarlyStopping.ASHA)
    work, hook = _at_once(curves)
    loop, study, _ = _loop(tmp_path, tune, work)
    hook(loop)
    assert loop.run().code == 0
    attrs = study.study.get_trials(deepcopy=False)[1].system_attrs
    assert attrs["completed_rung_0"] == curves[2][1] and attrs["completed_rung_1"] == curves[2][4], attrs


@pytest.mark.parametrize("algorithm", [Algorithm.BAYESIAN, Algorithm.RANDOM])
def test_a_finite_space_runs_no_point_twice_while_unseen_ones_remain(tmp_path: Path, algorithm: Algorithm) -> None:
    values = (1.0, 2.0, 3.0, 4.0)
    tune = _tune(
        params=(Param("quality", ParamType.DISCRETE, values=values),),
        algorithm=algorithm,
        max_trials=4,
        parallel_trials=4,
    )
    started: list[float] = []
    lock = threading.Lock()

    def work(w: TrialWork, h: Handle) -> None:
        with lock:
            started.append(float(h.params["quality"]))
        assert _until(lambda: len(started) == 4)  # all four in flight at once
        ended = Ended(Ending.SUCCEEDED, "", float(h.params["quality"]), 0)
        w.post(JobEnded(h.number, ended))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    for seed in range(5):
        loop, study, _ = _loop(tmp_path, tune, work, study=memory_study(tune, "sweep", seed=seed))
        started.clear()
        assert loop.run().code == 0
        assert sorted(started) == list(values), f"seed {seed}"


def test_a_finite_space_past_its_size_runs_every_point_before_any_again(tmp_path: Path) -> None:
    opt = Param("opt", ParamType.CATEGORICAL, values=("adam", "sgd"))
    momentum = Param("momentum", ParamType.DISCRETE, values=(0.0, 0.9), parent="opt", parent_values=("sgd",))
    tune = _tune(params=(opt, momentum), max_trials=5, parallel_trials=2)
    loop, study, _ = _loop(tmp_path, tune, _succeeds(lambda h: 1.0))
    assert loop.run().code == 0
    points = [r.params for r in study.rows()]
    assert sorted(points[:3]) == [
        (("opt", "adam"),),
        (("opt", "sgd"), ("momentum", 0.0)),
        (("opt", "sgd"), ("momentum", 0.9)),
    ]
    assert len(points) == 5


def test_past_max_failed_trials_the_study_stops_with_why(tmp_path: Path) -> None:
    def fails(w: TrialWork, h: Handle) -> None:
        w.post(JobEnded(h.number, Ended(Ending.FAILED, "exit 1")))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, Ended(Ending.FAILED, "exit 1")))

    loop, study, _ = _loop(tmp_path, _tune(max_trials=10, parallel_trials=1, max_failed_trials=2), fails)
    end = loop.run()
    assert end.code == 1 and "3 trials failed, more than max_failed_trials (2)" in end.why
    assert len(study.rows()) == 3


def _until(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _journal_study(tmp_path: Path, tune: Tune) -> Study:
    return open_study(tune, "sweep", None, tmp_path / "sweep.tune" / "study.journal", seed=1)


def test_a_resumed_study_refuses_a_changed_search_space_in_one_line(tmp_path: Path) -> None:
    tune = _tune(params=(Param("lr", ParamType.DOUBLE, 0.0001, 1.0, scale=Scale.LOG),))
    study = _journal_study(tmp_path, tune)
    asked = study.ask(6)
    assert asked is not None
    study.tell(asked.number, Ended(Ending.SUCCEEDED, "", 0.5, 1))
    assert _journal_study(tmp_path, tune).rows()  # the same space: resumed
    narrowed = _tune(params=(Param("lr", ParamType.DOUBLE, 0.001, 1.0, scale=Scale.LOG),))
    with pytest.raises(ProvisionError) as e:
        _journal_study(tmp_path, narrowed)
    assert "lr was double 0.0001..1 (log), now double 0.001..1 (log)" in e.value.message
    assert "its 1 trials were asked in the old space" in e.value.message
    retyped = _tune(params=(Param("lr", ParamType.CATEGORICAL, values=("a", "b")),))
    with pytest.raises(ProvisionError) as e:
        _journal_study(tmp_path, retyped)
    assert "now values ['a', 'b']" in e.value.message and "\n" not in e.value.message


def test_read_only_commands_create_nothing(tmp_path: Path) -> None:
    journal = tmp_path / "sweep.tune" / "study.journal"
    assert load_study(_tune(), "sweep", None, journal) is None
    assert not (tmp_path / "sweep.tune").exists()


def test_an_unknown_journal_record_is_one_line(tmp_path: Path) -> None:
    study = _journal_study(tmp_path, _tune())
    assert study.ask(6) is not None
    journal = tmp_path / "sweep.tune" / "study.journal"
    with journal.open("a") as f:
        f.write('{"op_code": 99, "worker_id": "from-the-future"}\n')
    with pytest.raises(ProvisionError) as e:
        _journal_study(tmp_path, _tune())
    assert "the study's journal cannot be read (a record this Optuna does not know)" in e.value.message


def test_a_storage_that_stops_answering_ends_the_runner_in_one_line(tmp_path: Path) -> None:
    def work(w: TrialWork, h: Handle) -> None:
        w.stop.wait(30)
        w.post(Removed(h.number, Ended(Ending.LEFT_RUNNING, ""), left=True))

    loop, study, _ = _loop(tmp_path, _tune(), work)
    calls = 0
    get_trials = study.study.get_trials

    def flaky(*a: object, **kw: object) -> object:
        nonlocal calls
        calls += 1
        if calls > 6:
            raise sqlalchemy.exc.OperationalError("SELECT", {}, Exception("server closed the connection"))
        return get_trials(*a, **kw)  # type: ignore[arg-type]

    study.study.get_trials = flaky  # type: ignore[method-assign]
    end = loop.run()
    assert end.code == 1
    assert end.why.startswith("the study's storage stopped answering: ")
    assert "the trials run on" in end.why and "again once it answers adopts them" in end.why
    assert loop.w.stop.is_set()


def test_the_study_says_it_ended_and_a_succeeded_trial_why(tmp_path: Path) -> None:
    """`tune --status --json` has `ended` once the loop ended the study
    (null before, and again while a resumed study with max_trials raised runs on)."""
    import json

    from click.testing import CliRunner

    from provision.cli.app import main
    from provision.io.state import default_state_path
    from provision.io.study import journal_path

    text = INV + (
        "tune:\n  metric: {name: loss, goal: minimize}\n  parameters: {lr: {type: double, min: 0.0, max: 1.0}}\n"
        "  max_trials: 3\n"
    )
    where = tmp_path / "study.yaml"
    where.write_text(text)
    tune = _tune(max_trials=3, parallel_trials=1)
    study = open_study(tune, "sweep", None, journal_path(default_state_path(where, "sweep"), "sweep"), seed=1)

    def status() -> dict[str, object]:
        r = CliRunner().invoke(main, ["tune", "--status", "--json", str(where)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        return dict(json.loads(r.stdout))

    def work(w: TrialWork, h: Handle) -> None:
        w.post(Started(h.number, {"chief-0": "a"}))
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "chief-0 exited 0", 0.5, 1)))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "chief-0 exited 0", 0.5, 1)))

    assert study.ended(0) is None
    loop, study, _ = _loop(tmp_path, tune, work, study=study)
    end = loop.run()
    assert end.code == 0 and end.why == "the study ended: 3 trials"
    doc = status()
    assert doc["ended"] == "the study ended: 3 trials"
    assert [t["why"] for t in doc["trials"]] == ["chief-0 exited 0"] * 3  # type: ignore[union-attr]
    assert study.ended(3) == end.why and study.ended(4) is None  # a resumed study with a 4th trial goes on
    table = CliRunner().invoke(main, ["tune", "--status", str(where)], catch_exceptions=False).stdout
    assert table.rstrip().endswith("The study ended: 3 trials.")


def test_a_succeeded_trials_why_is_how_its_job_succeeded(tmp_path: Path) -> None:
    from provision.core.lifecycle import JobPhase
    from provision.rules.status import JobStatus
    from provision.run.trialrun import _ending

    loop, _, _ = _loop(tmp_path, _tune(), _succeeds())
    st = JobStatus("sweep-t1", JobPhase.SUCCEEDED, "chief-0 exited 0", ())
    assert _ending(loop.w, st, (Report(1, 0.5),)) == Ended(Ending.SUCCEEDED, "chief-0 exited 0", 0.5, 1)


# --------------------------------------------------------------------------- the hand-off


def test_the_next_trial_is_given_the_place_the_ended_one_left_and_that_one_waits_for_its_start(
    tmp_path: Path,
) -> None:
    """A trial's end carries where it ran: the next trial asked is placed there (no lock, no
    second probe), and the ended trial's wind-up (logs, removal) waits until it started."""
    where = {1: Slot("a", 2222, (0,)), 2: Slot("a", 2223, (1,))}
    got: dict[int, tuple[Mapping[str, Slot] | None, int | None]] = {}
    order: list[str] = []
    lock = threading.Lock()

    def work(w: TrialWork, h: Handle) -> None:
        got[h.number] = (h.hint, h.after.number if h.after else None)
        slot = where.get(h.number) or (h.hint or {})["chief-0"]
        w.post(Started(h.number, {"chief-0": "a"}))
        with lock:
            order.append(f"started {h.number}")
        if h.after is not None:
            h.after.handed_off.set()  # as run_trial does once the start returned
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0), {"chief-0": slot}))
        assert h.told_event.wait(5)
        assert h.handed_off.wait(5), f"trial {h.number}: no word of its successor"
        with lock:
            order.append(f"wound up {h.number}")
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0)))

    loop, study, _ = _loop(tmp_path, _tune(max_trials=5, parallel_trials=2), work)
    assert loop.run().code == 0
    assert got[1] == (None, None) and got[2] == (None, None)  # the first ones find their place
    handed = {n: (dict(h or {}), after) for n, (h, after) in got.items() if n > 2}
    assert all(after is not None and hint["chief-0"] in where.values() for hint, after in handed.values()), handed
    for n, (_, after) in handed.items():
        assert order.index(f"started {n}") < order.index(f"wound up {after}"), order
    assert "wound up 5" in order  # the last: no successor, its wind-up goes on at once


def test_a_freed_place_goes_to_the_next_trial_before_the_ended_one_is_told(tmp_path: Path) -> None:
    """Freed (the host's wait saw the trial's only task end and its unit settle): the next
    trial is asked and given that place while the ended one is still being looked at, at
    most parallel_trials hold places, and the place is handed on once, not again when the
    end is told."""
    slots = {1: Slot("a", 2222, (0,)), 2: Slot("a", 2223, (1,))}
    got: dict[int, tuple[Mapping[str, Slot] | None, int | None]] = {}
    told_before_next: dict[int, bool] = {}
    lock = threading.Lock()
    holding: set[int] = set()
    most = 0

    def work(w: TrialWork, h: Handle) -> None:
        nonlocal most
        got[h.number] = (h.hint, h.after.number if h.after else None)
        slot = slots.get(h.number) or (h.hint or {})["chief-0"]
        with lock:
            holding.add(h.number)
            most = max(most, len(holding))
        w.post(Started(h.number, {"chief-0": "a"}))
        if h.after is not None:
            with lock:
                told_before_next[h.after.number] = h.after.told_event.is_set()
            h.after.handed_off.set()
        with lock:
            holding.discard(h.number)
        w.post(Freed(h.number, {"chief-0": slot}))
        # Its look, slow: the next trial starts meanwhile on its place (5 trials: one waits).
        _until(lambda: any(a == h.number for _, a in got.values()) or len(got) >= 5)
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0), {"chief-0": slot}))
        assert h.told_event.wait(5)
        h.handed_off.wait(5)
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0)))

    loop, study, _ = _loop(tmp_path, _tune(max_trials=5, parallel_trials=2), work)
    assert loop.run().code == 0
    assert len(study.rows()) == 5 and all(r.state is TrialState.SUCCEEDED for r in study.rows())
    assert most <= 2
    later = {n: (dict(hint or {}), after) for n, (hint, after) in got.items() if n > 2}
    assert all(after is not None and hint["chief-0"] in slots.values() for hint, after in later.values()), later
    assert len({after for _, after in later.values()}) == len(later)  # each place handed on once
    assert any(not told for told in told_before_next.values()), told_before_next  # before the tell


def test_a_running_trial_says_where_it_is(tmp_path: Path) -> None:
    seen: dict[str, str] = {}

    def work(w: TrialWork, h: Handle) -> None:
        if h.number == 1:
            w.post(Waiting(1, "pools.chief: GPUs held by job other"))
            assert _until(lambda: "waiting for GPUs: pools.chief" in _why(study, 1))
            seen["waiting"] = _why(study, 1)
            w.post(Waiting(1, None))
            w.post(SettingUp(1, ("a",)))
            assert _until(lambda: _why(study, 1).startswith("setting up on a"))
            w.post(Started(1, {"chief-0": "a"}))
            assert _until(lambda: _why(study, 1) == "running on a")
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "chief-0 exited 0", 1.0, 0)))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", 1.0, 0)))

    loop, study, _ = _loop(tmp_path, _tune(max_trials=1, parallel_trials=1), work)
    assert loop.run().code == 0
    assert seen["waiting"] == "waiting for GPUs: pools.chief: GPUs held by job other"
    assert _why(study, 1) == "chief-0 exited 0"  # once told: how it ended


def _why(study: Study, number: int) -> str:
    return next((r.why for r in study.rows() if r.number == number), "")


def test_the_host_side_wait_returns_when_a_process_ends_or_its_time_is_up(tmp_path: Path) -> None:
    """end_wait_command with a stand-in systemctl: one command in flight that answers as
    soon as the unit's main process is gone."""
    proc = subprocess.Popen(["sleep", "30"])
    state = tmp_path / "active"

    def set_state(value: str) -> None:  # whole, as systemd answers: the fake never reads half a write
        (tmp_path / "active.new").write_text(value)
        (tmp_path / "active.new").replace(state)

    set_state("active")
    fake = tmp_path / "systemctl"
    # `is-active`: the state; `show -p ActiveState -p MainPID --value`: the two values, one per line
    fake.write_text(
        f'#!/bin/sh\nif [ "$1" = is-active ]; then cat {state}; echo; exit 0; fi\n'
        f'printf \'%s\\n\' "$(cat {state})" "$(cat {tmp_path}/pid)"\n'
    )
    fake.chmod(0o755)
    (tmp_path / "pid").write_text(str(proc.pid))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}

    def run(seconds: float, units: int = 1) -> tuple[str, float]:
        t0 = time.monotonic()
        names = [f"provision-x-chief-{i}.service" for i in range(units)]
        cmd = end_wait_command(names, seconds, str(tmp_path / "preempt-at"))
        out = subprocess.run(cmd, shell=True, env=env, capture_output=True)
        return out.stdout.decode().strip(), time.monotonic() - t0

    try:
        assert run(0.3)[0] == "timeout"  # one process: `tail --pid` watches it
        assert run(0.3, units=2)[0] == "timeout"  # several: the loop of sleeps
        # Reaped, as systemd does, then its unit settles (its ExecStopPost) a moment later.
        threading.Timer(0.3, lambda: (proc.kill(), proc.wait())).start()
        threading.Timer(0.4, lambda: set_state("inactive")).start()
        said, took = run(10)
        # Well before its 10 s: at once, with room for a loaded machine (2.6 s seen under load 40).
        assert said == "ended inactive" and took < 6, (said, took)  # settled: its place is free
        assert settled_free(said)
    finally:
        proc.kill()
        proc.wait()
    set_state("active")
    proc = subprocess.Popen(["sleep", "0.2"])
    (tmp_path / "pid").write_text(str(proc.pid))
    threading.Timer(0.1, proc.wait).start()
    said, took = run(10)  # gone, its unit never settles (a restart pending): not a free place
    assert said == "ended active" and not settled_free(said) and took < 6, (said, took)
    # Stopped by a preemption (its mark written before the stop): its GPUs are not free.
    (tmp_path / "preempt-at").write_text("1700000000.000\n")
    set_state("inactive")
    proc = subprocess.Popen(["sleep", "0.2"])
    (tmp_path / "pid").write_text(str(proc.pid))
    set_state("active")
    threading.Timer(0.1, proc.wait).start()
    threading.Timer(0.25, lambda: set_state("inactive")).start()
    said, _ = run(10)
    assert said == "ended inactive preempted" and not settled_free(said), said
    (tmp_path / "preempt-at").unlink()
    set_state("active")
    (tmp_path / "pid").write_text("0")
    assert run(10)[0] == "none"  # no main process to watch (a unit between its start and its process)
    set_state("failed")
    assert run(10)[0] == "ended failed"
    assert settled_free("ended failed") and not settled_free("ended") and not settled_free("timeout")


def test_trials_starting_at_once_are_placed_apart_by_their_runner(tmp_path: Path) -> None:
    """Places: each trial about to start is placed beside this runner's others (no turn
    under the start lock, no lost race between them), an ended one's place goes first to
    the trial given it, and a place left is free again."""
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    places = Places()
    got = [places.take(n, inv, None) for n in (1, 2, 3, 4)]
    gpus = [s["chief-0"].accelerators for s in got if s is not None]
    assert sorted(gpus) == [(0,), (1,), (2,), (3,)], got
    assert places.take(5, inv, None) is None  # no room beside the others: it waits its turn
    second = got[1]
    assert second is not None
    places.leave(2)
    assert places.take(5, inv, second) == second  # the ended trial's place, as it was (its port too)
    places.leave(3)
    places.hold(6, {"chief-0": Slot("a", 2222, (2,))})  # adopted: where it runs
    assert places.take(7, inv, None) is None


def test_trials_on_other_hosts_plan_at_once_and_on_one_host_in_turn() -> None:
    locks = HostLocks()
    a = locks.acquire({"a"})
    b = locks.acquire({"b"})  # another host: no wait
    got: list[str] = []

    def both() -> None:
        held = locks.acquire({"b", "a"})  # every host (no room found): in the hosts' order
        got.append("both")
        locks.release(held)

    t = threading.Thread(target=both)
    t.start()
    time.sleep(0.1)
    assert got == []  # waits for a and b
    locks.release(a)
    locks.release(b)
    t.join(5)
    assert got == ["both"]


def test_an_adopted_trial_not_yet_running_is_planned_where_its_state_placed_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner killed between its trial's apply and the word that the trial runs: its state
    places the trial (on GPU 2 here), and its tasks may run there. The adopter plans it
    there, not anew (on GPU 0, the first free: its first start would run on beside it)."""
    (tmp_path / "study.yaml").write_text(INV)
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    state = tmp_path / "sweep-t1.state.json"
    ctx = open_context(str(tmp_path / "study.yaml"), state_path=str(state), loaded=inv, operation="apply")
    ctx.state.set_placement({"chief-0": Slot("a", 2300, (2,))})
    ctx.close()
    planned: list[Mapping[str, Slot]] = []

    def plan_and_apply(w: TrialWork, ctx: Context, *args: object, **kw: object) -> Ended:
        planned.append(ctx.rendered.placement.slots())
        return Ended(Ending.LEFT_RUNNING, "no hosts in this test")

    monkeypatch.setattr(trialrun, "_placed_and_applied", plan_and_apply)
    work = TrialWork(
        where=str(tmp_path / "study.yaml"), inv=inv, tune=_tune(), logs_dir=tmp_path, stop=threading.Event(), say=print
    )
    ctx = open_context(str(tmp_path / "study.yaml"), state_path=str(state), loaded=inv, operation="apply")
    try:
        trialrun._start(work, ctx, Handle(1, {"lr": 0.5}, phase="starting", adopt=True))
    finally:
        ctx.close()
    assert [s["chief-0"].accelerators for s in planned] == [(2,)], planned


def test_a_hosts_checks_are_made_once_by_the_first_trials_planned_there_in_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first wave: two trials placed on one host at once plan in turn; the second,
    planned once the first one's apply is done, finds the host checked just now (looked at
    under the turn, not before waiting for it) and is planned without the checks."""
    (tmp_path / "study.yaml").write_text(INV)
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    checked: list[bool] = []  # each plan: made with the checks

    def build_plan(ctx: Context, *, checks: bool, facts: bool, **more: object) -> Plan:  # whole=, ...: not its concern
        checked.append(checks)
        return Plan(ctx.inventory.job, ())

    monkeypatch.setattr(trialrun, "build_plan", build_plan)
    monkeypatch.setattr(trialrun, "apply_plan", lambda ctx, plan, say: {"a": HostOutcome("a")})
    work = TrialWork(
        where=str(tmp_path / "study.yaml"), inv=inv, tune=_tune(), logs_dir=tmp_path, stop=threading.Event(), say=print
    )
    turn = work.starting.acquire({"a"})  # both wait for the host's turn, as behind a first apply
    done: list[object] = []

    def start(n: int) -> None:
        ctx = open_context(
            str(tmp_path / "study.yaml"), state_path=str(tmp_path / f"t{n}.json"), loaded=inv, operation="apply"
        )
        try:
            queue = Queue(None, lambda line: None, poll=0.05, stop=work.stop)
            done.append(trialrun._placed_and_applied(work, ctx, n, queue, {"a"}, may_skip_checks=True))
        finally:
            ctx.close()

    threads = [threading.Thread(target=start, args=(n,)) for n in (1, 2)]
    for t in threads:
        t.start()
    work.starting.release(turn)
    for t in threads:
        t.join(10)
    assert len(done) == 2
    assert checked == [True, False]
    work.checked["a"] -= trialrun.CHECKED_FOR  # a minute later: checked again
    start(3)
    assert checked == [True, False, True]


# --------------------------------------------------------------------------- paused trials

PAUSED_WHY = "preempted by deadline-run (ana, priority high); resumes when 1 GPU is free"
STUDY = INV + (
    "tune:\n  metric: {name: loss, goal: minimize}\n  parameters: {lr: {type: double, min: 0.0, max: 1.0}}\n"
    "  max_trials: 3\n"
)


def _steps(study: Study, number: int) -> dict[int, float]:
    return dict(study.study.get_trials(deepcopy=False)[number - 1].intermediate_values)


def test_a_preempted_trial_pauses_untold_and_resumes_as_the_same_trial(tmp_path: Path) -> None:
    """Trial 1's job is preempted after two reports: it is not told (Optuna's trial stays
    running, its reports kept), its place goes to trial 2, the study does not end while it
    is paused, and it resumes as trial 1, its reports going on from step 2."""
    seen: dict[str, object] = {}
    lines: list[str] = []

    def work(w: TrialWork, h: Handle) -> None:
        w.post(Started(h.number, {"chief-0": "a"}))
        if h.number == 2:
            w.post(JobEnded(2, Ended(Ending.SUCCEEDED, "", 0.8, 0)))
            assert h.told_event.wait(5)
            w.post(Removed(2, Ended(Ending.SUCCEEDED, "", 0.8, 0)))
            return
        w.post(Reported(1, (Report(0, 1.0), Report(1, 0.9))))
        assert _until(lambda: _steps(study, 1) == {0: 1.0, 1: 0.9})
        w.post(Paused(1, PAUSED_WHY))
        # Trial 2 took its place, ran and was removed; the study goes on for trial 1.
        seen["second"] = _until(lambda: bool(study.study.user_attrs.get("removed-2")))
        seen["untold"] = study.is_running(1)
        seen["why"] = _why(study, 1)
        seen["counted"] = study.running_anywhere(loop.me)
        time.sleep(0.3)  # a few of the loop's polls: it must not end the study meanwhile
        seen["ended"] = study.ended(2)
        w.post(Started(1, {"chief-0": "a"}))  # resumed (PROVISION_RESUME=1 on the hosts)
        w.post(Reported(1, tuple(Report(s, 1.0 - s / 10) for s in range(4))))
        ended = Ended(Ending.SUCCEEDED, "chief-0 exited 0", 0.7, 3)
        w.post(JobEnded(1, ended))
        assert h.told_event.wait(5)
        w.post(Removed(1, ended))

    tune = _tune(max_trials=2, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    loop, study, _ = _loop(tmp_path, tune, work)
    loop.w.say = lines.append
    tells: list[int] = []
    tell = study.tell
    study.tell = lambda n, e: tells.append(n) or tell(n, e)  # type: ignore[method-assign]
    end = loop.run()
    assert end.code == 0 and end.why == "the study ended: 2 trials", end.why
    assert seen == {
        "second": True,
        "untold": True,
        "why": f"paused: {PAUSED_WHY}",
        "counted": 0,
        "ended": None,
    }, seen
    assert tells == [2, 1]  # trial 1 told once, after its resume
    assert [(r.number, r.state, r.value) for r in study.rows()] == [
        (1, TrialState.SUCCEEDED, 0.7),
        (2, TrialState.SUCCEEDED, 0.8),
    ]
    assert _steps(study, 1) == {0: 1.0, 1: 0.9, 2: 0.8, 3: 0.7}  # its reports before and after, one trial
    assert f"trial 1 paused: {PAUSED_WHY}" in lines and "trial 1 resumed on a (from its checkpoint)" in lines


def test_a_paused_trial_whose_runner_died_is_adopted_paused(tmp_path: Path) -> None:
    tune = _tune(max_trials=1, parallel_trials=1, early_stopping=EarlyStopping.MEDIAN)
    study = memory_study(tune, "sweep", seed=1)
    dead = _dead_runner()
    assert study.ask(1) is not None
    study.claim(1, dead, "sweep-t1")
    study.report(1, 1.0, 0)
    study.beat(1, phase="paused", doing=f"paused: {PAUSED_WHY}")
    assert study.running_anywhere(Runner.here()) == 0  # it holds no GPU
    seen: dict[str, object] = {}
    lines: list[str] = []

    def work(w: TrialWork, h: Handle) -> None:
        seen.update(phase=h.phase, adopt=h.adopt, holding=loop.mine.holding())
        w.post(Started(1, {"chief-0": "a"}))
        w.post(Reported(1, (Report(0, 1.0), Report(1, 0.5))))
        ended = Ended(Ending.SUCCEEDED, "", 0.5, 1)
        w.post(JobEnded(1, ended))
        assert h.told_event.wait(5)
        w.post(Removed(1, ended))

    loop, study, _ = _loop(tmp_path, tune, work, study=study)
    loop.w.say = lines.append
    assert loop.run().code == 0
    assert seen == {"phase": "paused", "adopt": True, "holding": 0}, seen
    assert f"trial 1: its runner ({dead.id}) is gone: adopted (paused: {PAUSED_WHY})" in lines, lines
    assert "trial 1 resumed on a (from its checkpoint)" in lines
    assert [(r.number, r.state, r.value) for r in study.rows()] == [(1, TrialState.SUCCEEDED, 0.5)]
    assert _steps(study, 1) == {0: 1.0, 1: 0.5}


def test_the_worker_pauses_a_preempted_trial_and_queues_its_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_trial: a follow that ends Preempted posts Paused (not its end), takes the state's
    lock again and starts the same trial as a queued apply; the metric reader goes on."""
    (tmp_path / "study.yaml").write_text(STUDY)
    inv = parse(STUDY, tmp_path / "study.yaml", "study.yaml")
    starts: list[tuple[str, bool]] = []
    readers: list[object] = []
    follows = iter([Ended(Ending.PAUSED, PAUSED_WHY), Ended(Ending.SUCCEEDED, "chief-0 exited 0", 0.5, 3)])

    def start(w: TrialWork, ctx: Context, h: Handle) -> None:
        starts.append((h.phase, ctx.lock is not None))

    def follow(w: TrialWork, ctx: Context, h: Handle, reader: object, *, started: bool = False) -> Ended:
        readers.append(reader)
        return next(follows)

    def wind_up(w: TrialWork, ctx: Context, h: Handle, ended: Ended, posted: bool) -> tuple[Ended, bool]:
        w.post(JobEnded(h.number, ended))
        return ended, True

    monkeypatch.setattr(trialrun, "_start", start)
    monkeypatch.setattr(trialrun, "_follow", follow)
    monkeypatch.setattr(trialrun, "_wind_up", wind_up)
    posts: list[object] = []
    work = TrialWork(
        where=str(tmp_path / "study.yaml"),
        inv=inv,
        tune=_tune(),
        logs_dir=tmp_path,
        stop=threading.Event(),
        say=print,
        post=posts.append,
    )
    trialrun.run_trial(work, Handle(1, {"lr": 0.5}))
    assert starts == [("", True), ("paused", True)], posts
    assert len(readers) == 2 and readers[0] is readers[1]
    assert [type(p).__name__ for p in posts] == ["Started", "Paused", "Started", "JobEnded", "Removed"]
    assert posts[1] == Paused(1, PAUSED_WHY)


def test_a_follow_that_sees_its_job_preempted_and_stopped_pauses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from provision.core.lifecycle import JobPhase, TaskState
    from provision.rules.status import JobStatus, TaskStatus

    (tmp_path / "study.yaml").write_text(INV)
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    mark = {"phase": "Preempted", "preempted": {"by": "deadline-run", "who": "ana", "priority_name": "high"}}

    def status(state: TaskState) -> JobStatus:
        task = TaskStatus("chief-0", "chief", "a", "192.0.2.1", [0], state, None, 0, None, "")
        return JobStatus("sweep-t1", JobPhase.PREEMPTED, "at 14:02 by deadline-run", (task,), stopped=mark)

    looks = iter([status(TaskState.RUNNING), status(TaskState.STOPPED)])  # saving its checkpoint, then stopped
    monkeypatch.setattr(trialrun, "look", lambda ctx, util=True: (next(looks), None))
    monkeypatch.setattr(trialrun, "_host_wait", lambda w, ctx, running: "timeout")

    class Reader:
        def read(self, ctx: Context) -> tuple[Report, ...]:
            return (Report(0, 1.0),)

    work = TrialWork(
        where=str(tmp_path / "study.yaml"), inv=inv, tune=_tune(), logs_dir=tmp_path, stop=threading.Event(), say=print
    )
    ctx = open_context(
        str(tmp_path / "study.yaml"), state_path=str(tmp_path / "t1.json"), loaded=inv, operation="apply"
    )
    try:
        got = trialrun._follow(work, ctx, Handle(1, {"lr": 0.5}), Reader())  # type: ignore[arg-type]
    finally:
        ctx.close()
    assert got == Ended(Ending.PAUSED, PAUSED_WHY)


@pytest.mark.parametrize("live", [True, False])
def test_an_adopted_trial_holds_its_place_only_while_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    """A dead runner may have freed a trial's place (Freed) and started the next trial
    there before it died: the adopting runner holds an adopted trial's place only when its
    first look finds it running."""
    from provision.core.lifecycle import JobPhase, TaskState
    from provision.rules.status import JobStatus, TaskStatus

    (tmp_path / "study.yaml").write_text(INV)
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    state, phase = (TaskState.RUNNING, JobPhase.RUNNING) if live else (TaskState.SUCCEEDED, JobPhase.SUCCEEDED)
    task = TaskStatus("chief-0", "chief", "a", "192.0.2.1", [0], state, None, 0, None, "")
    held: list[int] = []
    work = TrialWork(
        where=str(tmp_path / "study.yaml"), inv=inv, tune=_tune(), logs_dir=tmp_path, stop=threading.Event(), say=print
    )

    def look(ctx: Context, util: bool = True) -> tuple[JobStatus, None]:
        held.append(1 in work.places._taken)
        work.stop.set()  # one look is enough: then Ctrl-C
        return JobStatus("sweep-t1", phase, "", (task,)), None

    monkeypatch.setattr(trialrun, "look", look)
    monkeypatch.setattr(trialrun, "_host_wait", lambda w, ctx, running: "timeout")

    class Reader:
        def read(self, ctx: Context) -> tuple[Report, ...]:
            return (Report(0, 1.0),)

    ctx = open_context(
        str(tmp_path / "study.yaml"), state_path=str(tmp_path / "t1.json"), loaded=inv, operation="apply"
    )
    try:
        trialrun._follow(work, ctx, Handle(1, {"lr": 0.5}, phase="running", adopt=True), Reader())  # type: ignore[arg-type]
    finally:
        ctx.close()
    assert held == [False]  # nothing held before its first look
    assert (1 in work.places._taken) is live


def test_a_resumed_runs_metric_file_goes_after_the_reports_before_its_pause() -> None:
    from provision.run.trialmetric import after

    before = (Report(1, 0.9), Report(2, 0.8), Report(3, 0.7))
    assert after(before, (Report(3, 0.65), Report(4, 0.6))) == (
        Report(1, 0.9),
        Report(2, 0.8),
        *(Report(3, 0.65), Report(4, 0.6)),
    )
    assert after(before, ()) == before  # resumed, nothing reported yet
    assert after(before, (Report(1, 0.9), Report(2, 0.8), Report(3, 0.7), Report(4, 0.6))) == (
        *before,
        Report(4, 0.6),
    )  # a file kept whole
    assert after((), before) == before
