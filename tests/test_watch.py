"""The service watches applied jobs from its sampling rounds, not with a worker each
(rules/watch.py, a table; serve/service.py's loop with a stand-in round)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from clirun import wait_until
from provision.core.submission import Kind, Status
from provision.io.servicestore import ServiceStore, Submission
from provision.rules.rounds import Round
from provision.rules.watch import AGAIN_S, Watched, to_look_at
from provision.serve.service import Service, _die_with_parent

HOSTS = frozenset({"h1", "h2"})


def _doc(state: str | None, errors: tuple[str, ...] = ()) -> dict:
    jobs = [] if state is None else [{"job": "j", "state": state}]
    return {"jobs": jobs, "hosts": {h: {"error": "down" if h in errors else None} for h in sorted(HOSTS)}}


@pytest.mark.parametrize(
    ("state", "errors", "at", "looked", "want"),
    [
        ("running", (), 100.0, 0.0, (set(), set())),  # runs as applied: nothing to do
        ("queued", (), 100.0, 0.0, (set(), set())),
        ("ended", (), 100.0, 0.0, ({"s"}, set())),  # its units ended: a worker looks
        ("held", (), 100.0, 0.0, ({"s"}, set())),  # stopped with --hold
        ("stale", (), 100.0, 0.0, ({"s"}, set())),
        ("ended", (), 100.0, 100.0 - AGAIN_S / 2, (set(), set())),  # looked at a moment ago
        ("ended", (), 50.0, 0.0, (set(), set())),  # a round begun before the watch: may predate the apply
        (None, (), 100.0, 0.0, (set(), {"s"})),  # no host has it: destroyed
        (None, ("h2",), 100.0, 0.0, (set(), set())),  # a host did not answer: nothing known
    ],
)
def test_which_watched_jobs_a_round_sends_a_worker_to(state, errors, at, looked, want):
    w = Watched("s", "j", HOSTS, since=60.0, looked=looked)
    assert to_look_at(_doc(state, errors), at, [w]) == want


@pytest.mark.parametrize(
    ("hosts", "looked", "want"),
    [
        # Preempted on h1 (its entry marked), still running on h2: a worker preempts it whole, at once.
        ({"h1": ("ended", "hi"), "h2": ("running", None)}, 90.0, {"s"}),
        # ... once a round: a worker sent by this round is at it (a mark that stays would
        # otherwise send one at every poll).
        ({"h1": ("ended", "hi"), "h2": ("running", None)}, 100.0, set()),
        ({"h1": ("running", "hi"), "h2": ("running", None)}, 0.0, {"s"}),  # h1 still saving
        ({"h1": ("ended", "hi"), "h2": ("running", "hi")}, 0.0, set()),  # h2 marked too: stopping
        ({"h1": ("running", None), "h2": ("running", None)}, 0.0, set()),  # runs as applied
    ],
)
def test_a_job_preempted_on_some_hosts_is_looked_at_every_round(hosts, looked, want):
    job = {
        "job": "j",
        "state": "running",
        "hosts": {h: {"state": st, "preempted_by": by} for h, (st, by) in hosts.items()},
    }
    doc = {"jobs": [job], "hosts": {h: {"error": None} for h in sorted(HOSTS)}}
    assert to_look_at(doc, 100.0, [Watched("s", "j", HOSTS, since=60.0, looked=looked)]) == (want, set())


def _sub(sid: str) -> Submission:
    return Submission(sid, Kind.APPLY, "j", "ann@lab", "local", "", "inv.yaml", {})


class _NoLead:
    def try_take(self) -> bool:
        return True

    def still_held(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def backend(self) -> int | None:
        return None


def test_the_service_starts_no_worker_for_a_watched_job_until_a_round_says_so(tmp_path: Path, monkeypatch) -> None:
    store = ServiceStore.open_local(tmp_path / "svc.sqlite")
    started: list[str] = []
    svc = Service(store, _NoLead(), tmp_path / "work", say=lambda line: None)  # type: ignore[arg-type]
    monkeypatch.setattr(svc, "_start", lambda sub: started.append(sub.id))
    verdict: tuple[set[str], set[str]] = (set(), set())
    # A round (here a stand-in: its verdict is the table's above) says what to look at.
    svc.rounds = SimpleNamespace(latest=Round(1, time.time() + 60, {}, {}), soon=lambda: None)  # type: ignore[assignment]
    monkeypatch.setattr("provision.serve.service.to_look_at", lambda doc, at, watched: verdict)
    store.submit(_sub("a"))
    store.claim("a", svc.id)
    store.watching("a", "applied")
    svc._drive()
    assert started == []  # watched: no process of its own
    verdict = ({"a"}, set())
    svc._drive()
    assert started == ["a"]  # the round says it ended: a worker looks once
    store.submit(_sub("b"))
    store.claim("b", svc.id)
    store.watching("b", "applied")
    verdict = (set(), {"b"})
    svc._drive()
    got = store.get("b")
    assert got is not None and got.status is Status.DONE and "destroyed" in got.why
    store.close()


def test_a_cancel_signal_before_the_workers_handler_does_not_kill_it() -> None:
    proc = subprocess.Popen(  # noqa: S603 - our own interpreter
        [sys.executable, "-c", "import time; time.sleep(1); print('alive')"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - as the service starts its workers
    )
    proc.send_signal(signal.SIGUSR1)  # as the service's cancel would, during the worker's imports
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and out.strip() == "alive"


def test_a_submission_goes_to_the_spare_worker_started_ahead_with_its_owner_and_log(tmp_path: Path) -> None:
    """The leader keeps one worker started ahead (its imports done); a submission is handed
    to it on its stdin, and it runs as a worker started for it would: the submitter as owner,
    its own log. Its snapshot is empty here, so the work fails: said in its log and its row."""
    store = ServiceStore.open_local(tmp_path / "svc.sqlite")
    svc = Service(store, _NoLead(), tmp_path / "work", say=lambda line: None)  # type: ignore[arg-type]
    try:
        svc._tick()  # it takes the lead: a spare is started
        spare = svc.spare
        assert spare is not None and spare.poll() is None
        store.submit(_sub("a"))
        svc._drive()
        assert svc.workers["a"].proc is spare  # handed over, not started anew
        assert svc.spare is not None and svc.spare is not spare  # the next one, ahead
        wait_until(lambda: spare.poll() is not None, timeout=60, what="the handed worker's end")
        log = (tmp_path / "work" / "a.log").read_text()
        assert "submission a: apply of job j for ann@lab" in log, log
        got = store.get("a")
        assert got is not None and got.status is Status.FAILED, got
    finally:
        svc._stop_workers()
    assert spare.poll() is not None and svc.spare is None
