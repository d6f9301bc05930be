"""The dashboard's study reader (io/studyread.py): the rows `tune --status` reads, read again
only where the study changed. A study in a SQLite database (Optuna's RDB schema, as in
PostgreSQL), in PostgreSQL itself, and in a journal file."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from provision.core.trialend import Ended, Ending
from provision.core.tuning import Algorithm, Goal, Metric, Param, ParamType, Scale, TrialState, Tune
from provision.io.study import Runner, Study, load_study, open_study
from provision.io.studyread import StudyReader

TUNE = Tune(
    metric=Metric("loss", Goal.MINIMIZE),
    params=(
        Param("lr", ParamType.DOUBLE, 1e-5, 1e-1, scale=Scale.LOG),
        Param("layers", ParamType.INTEGER, 1, 12),
        Param("opt", ParamType.CATEGORICAL, values=("adam", "sgd")),
    ),
    max_trials=100,
    algorithm=Algorithm.RANDOM,
)
JOB = "sweep"
ME = Runner("here", 1, "x")


def _finish(st: Study, ending: Ending = Ending.SUCCEEDED, value: float = 0.5) -> int:
    a = st.ask(TUNE.max_trials)
    assert a is not None
    st.claim(a.number, ME, f"{JOB}-t{a.number}", phase="running")
    st.tell(a.number, Ended(ending, "median rule" if ending is Ending.STOPPED_EARLY else "", value, 7))
    return a.number


def _start(st: Study, doing: str = "waiting for GPUs") -> int:
    a = st.ask(TUNE.max_trials)
    assert a is not None
    st.claim(a.number, ME, f"{JOB}-t{a.number}", doing=doing)
    return a.number


def _same(reader: StudyReader, st: Study) -> None:
    """What the reader has is what Study.rows reads (a running trial's seconds tick apart)."""
    snap = reader.read()
    assert snap is not None
    want = st.rows()
    assert [r for r in snap.rows if r.state is not TrialState.RUNNING] == [
        r for r in want if r.state is not TrialState.RUNNING
    ]
    strip = [(r.number, r.params, r.state, r.value, r.why, r.job) for r in snap.rows]
    assert strip == [(r.number, r.params, r.state, r.value, r.why, r.job) for r in want]
    running = any(r.state is TrialState.RUNNING for r in want)
    assert snap.ended == (st.ended(len(want)) if want and not running else None)


@pytest.fixture
def sqlite(tmp_path: Path) -> tuple[str, Path]:
    return f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "unused.journal"


def test_rows_are_the_studys_rows_and_an_unchanged_study_is_not_read_again(sqlite: tuple[str, Path]) -> None:
    url, journal = sqlite
    st = open_study(TUNE, JOB, url, journal, seed=1)
    for ending in (Ending.SUCCEEDED, Ending.STOPPED_EARLY, Ending.FAILED, Ending.SUCCEEDED):
        _finish(st, ending, value=0.25)
    reader = StudyReader(TUNE, JOB, url, journal, fresh=0.0)
    first = reader.read()
    assert first is not None and len(first.rows) == 4 and reader.reads == 4
    _same(reader, st)
    again = reader.read()
    assert again is first and reader.reads == 4  # nothing new, nothing running: no trial read


def test_a_changed_study_is_seen_and_only_what_changed_is_read(sqlite: tuple[str, Path]) -> None:
    url, journal = sqlite
    st = open_study(TUNE, JOB, url, journal, seed=1)
    for _ in range(5):
        _finish(st)
    running = _start(st)
    reader = StudyReader(TUNE, JOB, url, journal, fresh=0.0)
    before = reader.read()
    assert before is not None and reader.reads == 6
    row = next(r for r in before.rows if r.number == running)
    assert row.state is TrialState.RUNNING and row.why == "waiting for GPUs"

    st.beat(running, doing="running")  # a running trial's attribute: seen
    after = reader.read()
    assert after is not None and after.version > before.version and reader.reads == 7  # the running one alone
    assert next(r for r in after.rows if r.number == running).why == "running"

    new = _finish(st)  # a new trial, and the running one ends
    st.tell(running, Ended(Ending.SUCCEEDED, "", 0.125, 9))
    now = reader.read()
    assert now is not None and reader.reads == 9  # those two
    assert {r.number: r.state for r in now.rows}[running] is TrialState.SUCCEEDED
    assert new in {r.number for r in now.rows} and len(now.rows) == 7
    _same(reader, st)
    assert reader.read() is now and reader.reads == 9  # all finished: nothing read again


def test_the_study_ended_and_made_again(sqlite: tuple[str, Path]) -> None:
    url, journal = sqlite
    st = open_study(TUNE, JOB, url, journal, seed=1)
    _finish(st)
    _finish(st)
    st.mark_ended("max_trials reached")
    reader = StudyReader(TUNE, JOB, url, journal, fresh=0.0)
    snap = reader.read()
    assert snap is not None and snap.ended == "max_trials reached"
    _same(reader, st)
    _finish(st)  # resumed (max_trials raised): it goes on
    snap = reader.read()
    assert snap is not None and snap.ended is None
    optuna.delete_study(study_name=JOB, storage=url)
    assert reader.read() is None
    st = open_study(TUNE, JOB, url, journal, seed=2)
    _finish(st)
    snap = reader.read()
    assert snap is not None and [r.number for r in snap.rows] == [1]
    _same(reader, st)


def test_a_read_answers_for_fresh_seconds(sqlite: tuple[str, Path]) -> None:
    url, journal = sqlite
    st = open_study(TUNE, JOB, url, journal, seed=1)
    _finish(st)
    reader = StudyReader(TUNE, JOB, url, journal, fresh=3600.0)
    first = reader.read()
    _finish(st)
    assert reader.read() is first  # within a poll's time: the last look answers
    reader.fresh = 0.0
    snap = reader.read()
    assert snap is not None and len(snap.rows) == 2


def test_never_started(tmp_path: Path) -> None:
    # A database where no study was ever made (a team's fresh one: `tune --detach` read it first).
    assert load_study(TUNE, JOB, f"sqlite:///{tmp_path / 'fresh.db'}", tmp_path / "j") is None
    assert StudyReader(TUNE, JOB, f"sqlite:///{tmp_path / 'empty.db'}", tmp_path / "j").read() is None
    assert StudyReader(TUNE, JOB, None, tmp_path / "none.journal").read() is None
    url = f"sqlite:///{tmp_path / 'other.db'}"
    open_study(TUNE, "another", url, tmp_path / "j")
    assert StudyReader(TUNE, JOB, url, tmp_path / "j").read() is None


def test_a_journal_is_read_again_only_when_it_changed(tmp_path: Path) -> None:
    journal = tmp_path / "sweep.tune" / "study.journal"
    st = open_study(TUNE, JOB, None, journal, seed=1)
    _finish(st)
    _finish(st, Ending.STOPPED_EARLY)
    reader = StudyReader(TUNE, JOB, None, journal, fresh=0.0)
    first = reader.read()
    assert first is not None and reader.reads == 2
    assert reader.read() is first and reader.reads == 2
    _finish(st)
    snap = reader.read()
    assert snap is not None and len(snap.rows) == 3
    loaded = load_study(TUNE, JOB, None, journal)
    assert loaded is not None
    _same(reader, loaded)


def test_postgresql(postgres: object) -> None:
    url = "postgresql+psycopg://" + postgres.url(password=True).split("://", 1)[1]  # type: ignore[attr-defined]
    st = open_study(TUNE, JOB, url, Path("/nonexistent"), seed=1)
    for ending in (Ending.SUCCEEDED, Ending.STOPPED_EARLY, Ending.FAILED):
        _finish(st, ending)
    running = _start(st)
    reader = StudyReader(TUNE, JOB, url, Path("/nonexistent"), fresh=0.0)
    _same(reader, st)
    st.tell(running, Ended(Ending.SUCCEEDED, "", float("inf"), 3))
    _same(reader, st)
    assert reader.reads == 5
    reader.close()
    optuna.delete_study(study_name=JOB, storage=url)


@pytest.mark.parametrize("where", ["sql", "journal"])
def test_each_trials_reports_are_its_curve_and_the_importance_is_optunas(where: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}" if where == "sql" else None
    journal = tmp_path / "sweep.tune" / "study.journal"
    st = open_study(TUNE, JOB, url, journal, seed=1)
    for k in range(8):
        a = st.ask(TUNE.max_trials)
        assert a is not None
        st.claim(a.number, ME, f"{JOB}-t{a.number}", phase="running")
        for step in (1, 2, 3):
            st.report(a.number, 1.0 / step + k, step)
        if k < 7:
            st.tell(a.number, Ended(Ending.SUCCEEDED, "", 0.1 * k, 3))
    reader = StudyReader(TUNE, JOB, url, journal, fresh=0.0)
    snap = reader.read()
    assert snap is not None and len(snap.curves) == 8
    assert snap.curves[1] == ((1, 1.0), (2, 0.5), (3, 1.0 / 3))
    st.report(8, 0.25, 4)  # the running trial reports again: seen at the next look
    later = reader.read()
    assert later is not None and later.curves[8][-1] == (4, 0.25) and later.version > snap.version
    got = reader.importance(later)
    assert set(got) == {"lr", "layers", "opt"} and abs(sum(got.values()) - 1.0) < 1e-6
    assert reader.importance(later) is got  # weighed once for the same succeeded trials
