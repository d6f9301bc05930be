"""The service's worker (serve/worker.py) without hosts: a cancelled study asks no more
trials and stops the running ones (the study loop on Optuna's in-memory storage with a fake
trial worker, as tests/test_study_loop.py), a submission's snapshot is materialised
with the submitter's `.provision` beside it, and a study whose storage stops answering is
waited for with backoff and left to a fresh worker, never failed; and the service says an
outage of its database in one line and its end in another."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from clirun import run, wait_until
from provision.cli import servecmd, tunecmd
from provision.core.errors import ProvisionError
from provision.core.events import Kind as EventKind
from provision.core.submission import Kind, Status
from provision.core.trialend import Ended, Ending
from provision.core.tuning import Goal, Metric, Param, ParamType, TrialState, Tune
from provision.inventory.inventory import parse
from provision.io.servicestore import ServiceStore, Submission
from provision.io.study import Runner, Study, StudyUnavailable, memory_study
from provision.run import tune as tune_mod
from provision.run.trialposts import JobEnded, Removed, Started
from provision.run.trialrun import Handle, TrialWork
from provision.serve import snapshot, worker
from provision.serve.service import Service
from test_study_loop import INV  # the study loop's one-host sweep

TUNE = """\
tune:
  metric: {name: loss, goal: minimize}
  parameters:
    lr: {type: double, min: 0.0, max: 1.0}
  max_trials: 4
  parallel_trials: 2
"""


@pytest.fixture(autouse=True)
def _no_cancel():
    worker.CANCEL.clear()
    yield
    worker.CANCEL.clear()


def test_a_cancelled_study_asks_no_more_and_stops_its_trials(tmp_path: Path) -> None:
    tune = Tune(
        Metric("loss", Goal.MINIMIZE), (Param("lr", ParamType.DOUBLE, 0.0, 1.0),), max_trials=8, parallel_trials=2
    )
    inv = parse(INV, tmp_path / "study.yaml", "study.yaml")
    study = memory_study(tune, inv.job, seed=1)
    work = TrialWork(str(tmp_path / "study.yaml"), inv, tune, tmp_path, threading.Event(), lambda line: None, poll=0.05)
    started: list[int] = []

    def run(w: TrialWork, h: Handle) -> None:  # runs until the loop stops it early
        w.post(Started(h.number, {"chief-0": "a"}))
        started.append(h.number)
        while h.stop_early is None:
            time.sleep(0.02)
        ended = Ended(Ending.STOPPED_EARLY, h.stop_early)
        w.post(JobEnded(h.number, ended))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, ended))

    loop = worker._Cancellable(work, study, Runner.here(), on_row=lambda r: None, run=run)
    threading.Timer(0.5, worker.CANCEL.set).start()
    end = loop.run()
    assert loop.cancelled == "cancelled by its owner", end
    rows = study.rows()
    assert sorted(started) == [1, 2] and len(rows) == 2, rows
    assert all(r.state is TrialState.STOPPED_EARLY and r.why == "cancelled by its owner" for r in rows), rows


def test_prepare_materialises_beside_the_submitters_state(tmp_path: Path) -> None:
    store = ServiceStore.open_local(tmp_path / "svc" / "service.sqlite")
    try:
        store.put_blob("a" * 64, b"job: x\n")
        state = tmp_path / "me" / ".provision" / "x.state.json"
        sub = Submission(
            "s1", Kind.APPLY, "x", "ann", "local", str(state), "proj/inv.yaml", {"proj/inv.yaml": ("a" * 64, 0o644)}
        )
        where = snapshot.prepare(store, sub, tmp_path / "work" / "s1")
        again = snapshot.prepare(store, sub, tmp_path / "work" / "s1")  # a restart: the same
    finally:
        store.close()
    assert where == again == tmp_path / "work" / "s1" / "proj" / "inv.yaml"
    assert where.read_text() == "job: x\n"
    link = where.parent / ".provision"
    assert link.is_symlink() and link.resolve() == state.parent.resolve()


# --------------------------------------------------------------------------- the study's storage away


def test_a_storage_that_does_not_answer_is_looked_at_again_with_growing_pauses() -> None:
    waits: list[float] = []
    answers = iter([False, False, False, True])

    def probe() -> None:
        if not next(answers):
            raise StudyUnavailable("the study's storage stopped answering: connection refused")

    waited = worker.await_storage(probe, "gone", wait=lambda s: waits.append(s) or False)
    assert waits == [1.0, 2.0, 4.0, 8.0] and waited == 15.0
    # Past the last pause, the last one again (it never gives up: the owner's cancel ends it).
    waits.clear()
    answers = iter([False] * 9 + [True])
    worker.await_storage(probe, "gone", wait=lambda s: waits.append(s) or False)
    assert waits[-4:] == [worker.BACKOFF[-1]] * 4
    # A cancel ends the wait at once.
    waits.clear()
    worker.await_storage(probe, "gone", wait=lambda s: waits.append(s) or True)
    assert waits == [1.0]


class _Away(Study):
    """A study whose storage stops answering at the loop's first look (its database restarting)."""

    def rows(self):
        raise StudyUnavailable("the study's storage stopped answering: connection refused")


def test_a_study_whose_storage_stops_answering_is_left_to_a_fresh_worker_not_failed(tmp_path, monkeypatch) -> None:
    """StudyUnavailable mid-study: the worker waits until the storage answers (with backoff),
    then leaves (exit 130): the service starts a fresh worker, which adopts the trials. The
    submission stays unfinished; it is never marked failed."""
    inv_path = tmp_path / "study.yaml"
    inv_path.write_text(INV + TUNE)
    inv = parse(inv_path.read_text(), inv_path, "study.yaml")
    assert inv.tune is not None
    base = memory_study(inv.tune, inv.job, seed=1)
    away = _Away(base.tune, base.job, base.study)
    work = TrialWork(str(inv_path), inv, inv.tune, tmp_path, threading.Event(), lambda line: None, poll=0.05)
    monkeypatch.setattr(worker, "open_work", lambda *a, **k: (work, away))
    monkeypatch.setattr(worker, "prepare", lambda store, sub, workdir: inv_path)
    probes: list[int] = []

    def probe(where, inv) -> None:  # answers at the third look
        probes.append(1)
        if len(probes) < 3:
            raise StudyUnavailable("the study's storage stopped answering: connection refused")

    monkeypatch.setattr(worker, "_probe", probe)
    monkeypatch.setattr(worker, "BACKOFF", (0.01, 0.02))
    monkeypatch.setattr(worker.signal, "signal", lambda *a: None)  # pytest's own handlers stay
    db = tmp_path / "svc" / "service.sqlite"
    store = ServiceStore.open_local(db)
    try:
        store.submit(Submission("s1", Kind.TUNE, inv.job, "ann", "local", "", "study.yaml", {}))
        code = worker.main(["--place", "local", "--db", str(db), "--id", "s1", "--workdir", str(tmp_path / "w")])
        got = store.get("s1")
    finally:
        store.close()
    assert code == 130 and len(probes) == 3
    assert got is not None and got.status is Status.WAITING and not got.why, got

    # Unreachable when the worker opens it: the same (nothing asked yet, nothing failed).
    def gone(*a, **k):
        raise StudyUnavailable("tune.storage: cannot open the study's database at db:5432/x: connection refused")

    monkeypatch.setattr(worker, "open_work", gone)
    probes.clear()
    store = ServiceStore.open_local(db)
    try:
        code = worker.main(["--place", "local", "--db", str(db), "--id", "s1", "--workdir", str(tmp_path / "w")])
        got = store.get("s1")
    finally:
        store.close()
    assert code == 130 and len(probes) == 3
    assert got is not None and not got.status.finished, got


# --------------------------------------------------------------------------- following it


def test_following_a_handed_over_study_ends_as_the_terminal_does(tmp_path, monkeypatch) -> None:
    """`provision tune INV` of a study the service ran: after its trial lines, the same
    table and closing line (how it ended, the picture) as a terminal that runs one prints."""
    (tmp_path / "study.yaml").write_text(INV + TUNE)
    inv = parse(INV + TUNE, tmp_path / "study.yaml", "study.yaml")
    assert inv.tune is not None
    study = memory_study(inv.tune, inv.job, seed=1)
    me = Runner.here()
    for value in (0.5, 0.25):
        asked = study.ask(4)
        assert asked is not None
        study.claim(asked.number, me, f"sweep-t{asked.number}")
        study.tell(asked.number, Ended(Ending.SUCCEEDED, "", value=value, steps=3))
    study.mark_ended("the study ended: 2 trials")
    (tmp_path / "service.sqlite").touch()  # a service's database here: tune looks for its submission
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "service.sqlite"))
    monkeypatch.setattr(servecmd, "follow_handed_over", lambda *a: 0)
    monkeypatch.setattr(tune_mod, "existing_study", lambda where, inv: study)
    monkeypatch.setattr(tunecmd, "_draw", lambda *a: None)
    code, out, err = run("tune", "study.yaml", cwd=tmp_path)
    assert code == 0, out + err
    assert "TRIAL" in out and "0.25" in out, out
    assert "\nThe study ended: 2 trials. Picture: " in out, out


# --------------------------------------------------------------------------- the service's database away


class _Place:
    """The service's database and its lock, which a test takes away and gives back."""

    place, path = "postgresql://db:5432/ml", None

    def __init__(self) -> None:
        self.down = False
        self.looks = 0

    def _answer(self) -> None:
        self.looks += 1
        if self.down:
            raise ProvisionError(f"{self.place}: the service's database: terminating connection")

    def beat(self, row) -> None:
        self._answer()

    def now(self) -> float:
        self._answer()
        return time.time()

    def services(self, **kw):
        self._answer()
        return []

    def submissions(self, **kw):
        self._answer()
        return []

    def leave(self, sid) -> None:
        pass

    def lead_is(self, sid, backend) -> None:
        pass

    def unfinished(self):
        self._answer()
        return [], []

    def frozen_leader(self, me):
        return None

    # the lead
    def try_take(self) -> bool:
        self._answer()
        return True

    def still_held(self) -> bool:
        return not self.down

    def release(self) -> None:
        pass

    def backend(self) -> int | None:
        return None


def test_the_service_says_a_database_outage_in_one_line_and_its_end_in_another(tmp_path) -> None:
    place = _Place()
    lines: list[str] = []
    svc = Service(place, place, tmp_path / "work", say=lines.append, poll=0.01)  # type: ignore[arg-type]
    t = threading.Thread(target=svc.run)
    t.start()
    try:
        wait_until(lambda: any("leading" in x for x in lines), timeout=10, every=0.01, what="leading")
        place.down = True
        wait_until(lambda: any("does not answer" in x for x in lines), timeout=10, every=0.01, what="the outage")
        seen = place.looks
        wait_until(lambda: place.looks > seen + 20, timeout=10, every=0.01, what="looks during the outage")
        place.down = False
        wait_until(lambda: sum("leading" in x for x in lines) == 2, timeout=10, every=0.01, what="leading again")
    finally:
        svc.stopping.set()
        t.join(10)
    said = lines[1:]  # after "service ID on PLACE: following until it can lead"
    assert len(said) == 4, lines
    assert said[0] == "leading: driving every unfinished submission"
    assert said[1].startswith("the database does not answer (postgresql://db:5432/ml: the service's database:")
    assert "the lead was lost" in said[1] and said[1].endswith("looking again every 0.01 s"), said
    assert said[2].startswith("the database answers again after "), said
    assert said[3] == "leading: driving every unfinished submission"


def test_a_database_on_a_full_disk_is_said_once_until_it_takes_writes_again(tmp_path) -> None:
    """SQLite on a full file system answers reads and refuses writes ("database or disk is
    full"): one line when it goes, one when writes work again (it flapped twice a second)."""
    from provision.io.servicestore import ServiceStore
    from test_watch import _NoLead  # the stand-in lead those tests use

    class Full(ServiceStore):
        full = False

        def _do(self, sql, args=()):
            if self.full:
                raise ProvisionError(f"{self.path}: the service's database: database or disk is full")
            return super()._do(sql, args)

        def beat(self, s):
            if self.full:
                raise ProvisionError(f"{self.path}: the service's database: database or disk is full")
            return super().beat(s)

    store = ServiceStore.open_local(tmp_path / "svc.sqlite")
    store.__class__ = Full
    lines: list[str] = []
    svc = Service(store, _NoLead(), tmp_path / "work", say=lines.append, poll=0.01)  # type: ignore[arg-type]
    t = threading.Thread(target=svc.run)
    t.start()
    try:
        wait_until(lambda: any("leading" in x for x in lines), timeout=10, every=0.01, what="leading")
        store.full = True  # type: ignore[attr-defined]
        wait_until(lambda: any("does not answer" in x for x in lines), timeout=10, every=0.01, what="the full disk")
        time.sleep(0.5)  # 50 polls
        assert sum("does not answer" in x for x in lines) == 1 and not any("answers again" in x for x in lines), lines
        store.full = False  # type: ignore[attr-defined]
        wait_until(lambda: any("answers again" in x for x in lines), timeout=10, every=0.01, what="writes again")
    finally:
        svc.stopping.set()
        t.join(10)
    assert sum("does not answer" in x for x in lines) == 1 and sum("answers again" in x for x in lines) == 1, lines


def test_a_studys_new_best_is_one_event_per_trial_that_beat_those_before(tmp_path, monkeypatch) -> None:
    """The study's runner tells `study.best` for each trial that beat every one before it
    (a tie is not a new best), keyed by the trial's number."""
    inv_path = tmp_path / "study.yaml"
    inv_path.write_text(
        INV + TUNE.replace("parallel_trials: 2", "parallel_trials: 1").replace("max_trials: 4", "max_trials: 5")
    )
    inv = parse(inv_path.read_text(), inv_path, "study.yaml")
    assert inv.tune is not None
    study = memory_study(inv.tune, inv.job, seed=1)
    work = TrialWork(str(inv_path), inv, inv.tune, tmp_path, threading.Event(), lambda line: None, poll=0.05)
    monkeypatch.setattr(worker, "open_work", lambda *a, **k: (work, study))
    values = {1: 0.5, 2: 0.7, 3: 0.3, 4: 0.3, 5: 0.1}

    def run(w: TrialWork, h: Handle) -> None:
        w.post(Started(h.number, {"chief-0": "a"}))
        w.post(JobEnded(h.number, Ended(Ending.SUCCEEDED, "", values[h.number], 1)))
        assert h.told_event.wait(5)
        w.post(Removed(h.number, Ended(Ending.SUCCEEDED, "", values[h.number], 1)))

    class Loop(worker._Cancellable):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k, run=run)

    monkeypatch.setattr(worker, "_Cancellable", Loop)
    store = ServiceStore.open_local(tmp_path / "svc" / "service.sqlite")
    try:
        sub = Submission("s1", Kind.TUNE, inv.job, "ann@example.com", "local", "", "study.yaml", {})
        status, why = worker.run_tune(store, sub, inv_path)
        best = store.events(kinds=[EventKind.STUDY_BEST])
    finally:
        store.close()
    assert status is Status.DONE, why
    assert [s.event.key for s in best] == ["best:sweep:1", "best:sweep:3", "best:sweep:5"]
    assert best[-1].event.words == "study sweep: trial 5 is the best so far (loss 0.1)"
    assert {s.event.owner for s in best} == {"ann@example.com"} and {s.event.job for s in best} == {"sweep"}
