"""What the dashboard reads of the service's database, on SQLite and PostgreSQL: a page of
the history (open rows first, then the ended newest first; filters; how many in all), a
job's rows, its GPU-hours, its events, the latest finished submission of each job, and the
kept logs."""

from __future__ import annotations

import pytest

from provision.core.events import Event, How, Kind
from provision.core.submission import Kind as SubKind
from provision.core.submission import Status
from provision.io.servicehistory import HistoryRow
from provision.io.servicestore import ServiceStore, Submission
from provision.rules.historyview import HistoryQuery

NOW = 2_000_000_000.0


@pytest.fixture
def local_store(tmp_path):
    s = ServiceStore.open_local(tmp_path / "service.sqlite")
    yield s
    s.close()


@pytest.fixture
def pg_store(postgres, monkeypatch):
    pytest.importorskip("psycopg")
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    postgres.sql(
        "DROP TABLE IF EXISTS provision_service_blobs, provision_service_submissions, provision_service_services, "
        "provision_service_history, provision_service_tokens, provision_service_events, provision_service_logs"
    )
    s = ServiceStore.open_pg(postgres.url(), "pg")
    yield s
    s.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request):
    return request.getfixturevalue("local_store" if request.param == "sqlite" else "pg_store")


def _rows(store: ServiceStore) -> None:
    for i in range(30):  # finished runs, an hour apart, the newest last
        how = ["Succeeded", "Failed: chief-0 exited 1", "Preempted by big"][i % 3]
        owner = "ana" if i % 2 else "bob"
        store.record(
            HistoryRow("run", f"job-{i}", owner, NOW - 3600 * (40 - i), NOW - 3600 * (39 - i), how, ("h",), 2, f"s{i}")
        )
    store.record(HistoryRow("run", "live", "ana", NOW - 60, None, "", ("h",), 8, "s-live"))
    store.record(HistoryRow("wait", "queued", "bob", NOW - 30, None, "", ("h",), 4, "s-q"))
    # A terminal job's row: its end is the event's sentence.
    store.record(
        HistoryRow("run", "term", "cy", NOW - 7200, NOW - 3600, "job term was destroyed while it ran", (), 1, "event:9")
    )


def test_a_page_of_the_history_is_newest_first_with_the_open_rows_before(store):
    _rows(store)
    rows, total = store.history_page(HistoryQuery(limit=5), NOW)
    assert total == 33
    assert [r.job for r in rows] == ["queued", "live", "term", "job-29", "job-28"]
    rows, _ = store.history_page(HistoryQuery(limit=5, offset=2), NOW)  # past the open ones
    assert [r.job for r in rows] == ["term", "job-29", "job-28", "job-27", "job-26"]
    rows, total = store.history_page(HistoryQuery(limit=3, offset=30), NOW)
    assert [r.job for r in rows] == ["job-2", "job-1", "job-0"] and total == 33


def test_the_history_filters(store):
    _rows(store)
    rows, total = store.history_page(HistoryQuery(owner="ana", kinds=("run",), finished=True, limit=100), NOW)
    assert total == 15 and all(r.owner == "ana" and r.ended is not None for r in rows)
    rows, total = store.history_page(HistoryQuery(state="failed", limit=100), NOW)
    assert total == 10 and all(r.how.startswith("Failed") for r in rows)
    rows, _ = store.history_page(HistoryQuery(state="destroyed", limit=100), NOW)
    assert [r.job for r in rows] == ["term"]
    rows, total = store.history_page(HistoryQuery(since=NOW - 3600 * 10.5, limit=100), NOW)
    assert {r.job for r in rows} == {"live", "queued", "term", "job-29"}
    rows, total = store.history_page(HistoryQuery(job="ob-2", finished=True, limit=100), NOW)
    assert total == 11  # job-2, job-20..job-29
    rows, _ = store.history_page(HistoryQuery(job="%", limit=100), NOW)
    assert rows == []  # a text, not a pattern


def test_a_jobs_rows_hours_and_events(store):
    store.record(HistoryRow("run", "bert", "ana", NOW - 7200, NOW - 3600, "Preempted", ("h",), 12, "s"))
    store.record(HistoryRow("wait", "bert", "ana", NOW - 3600, NOW - 1800, "fitted", ("h",), 12, "s"))
    store.record(HistoryRow("run", "bert", "ana", NOW - 1800, None, "", ("h",), 12, "s"))
    assert [(r.kind, r.ended) for r in store.job_history("bert")] == [
        ("run", NOW - 3600), ("wait", NOW - 1800), ("run", None)
    ]  # fmt: skip
    hours = store.jobs_hours(["bert", "nobody"], NOW, ["run", "trial"])
    assert hours == {"bert": (18.0, None, 2, 12)}  # 12 GPUs x (1 h + 0.5 h); a run open: no end yet
    store.emit([Event(Kind.JOB_STARTED, f"start:bert:{n}", "bert", run=n) for n in range(1, 6)])
    store.emit([Event(Kind.JOB_ENDED, "end:other:1", "other", how=How.FAILED)])
    assert [s.event.run for s in store.job_events("bert", 3)] == [3, 4, 5]


def test_the_latest_finished_submission_of_each_job(store):
    for i, job in enumerate(["a", "b", "a", "c"]):
        sid = f"sub-{i}"
        store.submit(Submission(sid, SubKind.APPLY, job, "ana", "local", "", "inv.yaml", {}))
        store.claim(sid, "svc")
        store.finish(sid, Status.DONE, "done")
    store.submit(Submission("sub-live", SubKind.APPLY, "d", "ana", "local", "", "inv.yaml", {}))
    got = store.finished_submissions(2)
    assert [s.job for s in got] == ["c", "a"] and got[1].id == "sub-2"


def test_kept_logs(store):
    lines = [{"time": f"t{i}", "task": "chief-0", "host": "h", "text": f"line {i}"} for i in range(1000)]
    store.keep_logs("bert", 3, lines)
    got, newest = store.kept_logs("bert", 10)
    assert [ln.text for ln in got] == [f"line {i}" for i in range(990, 1000)] and newest > 0
    assert store.kept_runs("bert") == {3} and store.has_kept_logs("bert") and not store.has_kept_logs("gpt")


def test_the_history_writer_leaves_handed_over_work_to_its_worker_even_once_finished(local_store):
    """A handed-over job that ended in seconds: its submission finished before the stream's
    job.started reached the writer, which wrote a second run row of it (the Jobs page listed
    it twice, `history` counted its GPU-hours twice)."""
    from provision.core.events import Stored
    from provision.serve.stream import HistoryWriter

    store = local_store
    store.submit(Submission("sub-fast", SubKind.APPLY, "fast", "ana", "local", "", "inv.yaml", {}))
    store.claim("sub-fast", "svc")
    t = store.now()
    store.finish("sub-fast", Status.DONE, "applied; the job Succeeded")
    writer = HistoryWriter(store)
    started = Stored(1, t + 0.5, Event(Kind.JOB_STARTED, "start:fast:1", "fast", "ana", run=1, gpus=2))
    terminal = Stored(2, t + 1, Event(Kind.JOB_STARTED, "start:term:1", "term", "cy", run=1, gpus=1))
    writer.handle([started, terminal])
    assert [r.job for r in store.history()] == ["term"]
