"""The service's worker (serve/worker.py) without hosts: a cancelled study asks no more
trials and stops the running ones (the study loop on Optuna's in-memory storage with a fake
trial worker, as tests/test_study_loop.py), and a submission's snapshot is materialised
with the submitter's `.provision` beside it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from provision.core.trialend import Ended, Ending
from provision.core.tuning import Goal, Metric, Param, ParamType, TrialState, Tune
from provision.io.servicestore import Kind, ServiceStore, Submission
from provision.io.study import Runner, memory_study
from provision.run.trialrun import Handle, JobEnded, Removed, Started, TrialWork
from provision.serve import worker
from provision.spec.inventory import parse

INV = """\
job: sweep
hosts:
  - {name: a, address: 192.0.2.1, accelerators: {type: nvidia-tesla-t4, count: 4}}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, /opt/t.py]}
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
        where = worker.prepare(store, sub, tmp_path / "work" / "s1")
        again = worker.prepare(store, sub, tmp_path / "work" / "s1")  # a restart: the same
    finally:
        store.close()
    assert where == again == tmp_path / "work" / "s1" / "proj" / "inv.yaml"
    assert where.read_text() == "job: x\n"
    link = where.parent / ".provision"
    assert link.is_symlink() and link.resolve() == state.parent.resolve()
