"""The service's database (io/servicestore.py) on the embedded SQLite file and on a real
PostgreSQL, the snapshot's content addressing (serve/snapshot.py), who leads
(io/servicelead.py), GPU-hours from history (rules/usage.py, a table), and `--detach`
refusing what it cannot run (cli/servecmd.py)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clirun import run, wait_until
from provision.core.submission import Kind, Options, Status
from provision.inventory.inventory import load
from provision.io.servicehistory import HistoryRow
from provision.io.servicelead import Leadership
from provision.io.servicestore import ServiceRow, ServiceStore, Submission
from provision.rules.tenancy import identity
from provision.rules.usage import Use, gpu_hours, since_seconds
from provision.serve.snapshot import materialise, snapshot_of, store_files

INVENTORY = """
job: {job}
hosts:
  - {{name: h1, address: 10.0.0.1, accelerators: {{type: nvidia-tesla-t4, count: 2}}}}
files:
  - {{src: train.py, dest: /opt/{job}/train.py}}
  - {{src: ../shared/lib, dest: /opt/{job}/lib}}
pools:
  chief: {{replicas: 1, accelerators: 2, command: [python3, /opt/{job}/train.py]}}
"""


@pytest.fixture(autouse=True)
def _fresh_identity():
    yield
    identity.cache_clear()  # the tests below change PROVISION_OWNER


@pytest.fixture
def local_store(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "svc" / "service.sqlite"))
    s = ServiceStore.open_local()
    yield s
    s.close()


@pytest.fixture
def pg_store(postgres, monkeypatch):
    pytest.importorskip("psycopg")
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    postgres.sql("DROP TABLE IF EXISTS provision_service_blobs, provision_service_submissions, "
                 "provision_service_services, provision_service_history, provision_service_tokens")  # fmt: skip
    s = ServiceStore.open_pg(postgres.url(), "pg")
    yield s
    s.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request):
    return request.getfixturevalue("local_store" if request.param == "sqlite" else "pg_store")


def _sub(sid: str, job: str = "j", **kw) -> Submission:
    return Submission(
        sid,
        Kind.TUNE,
        job,
        "ann@example.com",
        "local",
        "/s/j.state.json",
        "inv.yaml",
        {"inv.yaml": ("ab", 0o644)},
        **kw,
    )


def test_embedded_file_is_private(local_store):
    assert local_store.path is not None
    assert stat.S_IMODE(local_store.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(local_store.path.parent.stat().st_mode) == 0o700


def test_submission_lifecycle(store):
    s = store.submit(_sub("s1", options=Options(seed=3)))
    assert s.status is Status.WAITING and s.created > 0 and s.options == Options(seed=3)
    assert s.manifest == {"inv.yaml": ("ab", 0o644)}
    assert [x.id for x in store.submissions(unfinished=True, job="j")] == ["s1"]
    assert store.claim("s1", "svc-a")
    got = store.get("s1")
    assert got is not None and got.status is Status.RUNNING and got.claimed_by == "svc-a" and got.started
    # A new leader takes over a dead one's claim; the start time stays the first.
    assert store.claim("s1", "svc-b")
    again = store.get("s1")
    assert again is not None and again.claimed_by == "svc-b" and again.started == got.started
    # Running: cancel asks the service (the row keeps who asked); it finishes once.
    assert store.cancel("s1", "bob") is Status.RUNNING
    assert store.get("s1").cancel == "bob"  # type: ignore[union-attr]
    store.finish("s1", Status.CANCELLED, "cancelled by bob")
    store.finish("s1", Status.DONE, "late")  # a finished submission is not changed
    assert store.get("s1").status is Status.CANCELLED  # type: ignore[union-attr]
    assert store.cancel("s1", "bob") is None
    assert not store.claim("s1", "svc-c")
    # Waiting: taken back at once, nothing of it ran.
    store.submit(_sub("s2"))
    assert store.cancel("s2", "ann") is Status.CANCELLED
    assert not store.claim("s2", "svc-a")
    assert store.submissions(unfinished=True) == []


def test_queued_submissions_in_the_queues_order(local_store):
    """the higher priority first, then the earlier submission (older ones: normal)."""
    for sid, prio in (("a", 100), ("b", None), ("c", 1000), ("d", 500)):
        local_store.submit(_sub(sid, job=sid, options=Options() if prio is None else Options(priority=prio)))
    assert [x.id for x in local_store.submissions(unfinished=True)] == ["c", "b", "d", "a"]
    assert [x.id for x in local_store.submissions()] == ["a", "b", "c", "d"]  # history: by time


def test_an_applied_job_is_watched_until_a_worker_ends_it(store):
    store.submit(_sub("w1"))
    store.watching("w1", "too early")  # only a running submission turns to watching
    assert store.get("w1").status is Status.WAITING  # type: ignore[union-attr]
    assert store.claim("w1", "svc-a")
    store.watching("w1", "applied; the service watches it")
    got = store.get("w1")
    assert got is not None and got.status is Status.WATCHING and not got.status.finished
    assert [x.id for x in store.submissions(unfinished=True)] == ["w1"]
    # A cancel of a watched job asks the service (a worker stops it); a worker looks again.
    assert store.cancel("w1", "bob") is Status.RUNNING and store.get("w1").cancel == "bob"  # type: ignore[union-attr]
    assert store.claim("w1", "svc-a") and store.get("w1").status is Status.RUNNING  # type: ignore[union-attr]
    store.watching("w1", "still running")
    store.finish("w1", Status.CANCELLED, "stopped by bob")
    assert store.get("w1").status is Status.CANCELLED  # type: ignore[union-attr]


def test_services_heartbeat_on_the_databases_clock(store):
    row = ServiceRow("h:1:x", "h", 1, store.place, ("HOME", "WANDB_API_KEY"), True, 0.0)
    store.beat(row)
    [got] = store.services()
    assert got.env_names == ("HOME", "WANDB_API_KEY") and got.leader
    assert abs(got.heartbeat - store.now()) < 5
    # Another database's service (a team's, said in the embedded file) is not this one's.
    store.beat(ServiceRow("h:2:y", "h", 2, "postgresql://db:5432/team", (), True, 0.0))
    assert [s.id for s in store.services()] == ["h:1:x"]
    assert len(store.services(everywhere=True)) == 2
    store.leave("h:1:x")
    assert store.services() == []


def test_history_is_kept_and_filtered(store):
    now = store.now()
    a = store.record(HistoryRow("trial", "j-t1", "ann", now - 7200, None, "", ("h1",), 2, "s1"))
    store.record(HistoryRow("wait", "q", "bob", now - 100, now - 50, "fitted", ("h1",), 1, "s2"))
    store.record(HistoryRow("trial", "old", "ann", now - 30 * 86400, now - 29 * 86400, "succeeded", (), 1, "s0"))
    assert store.open_event("s1", "trial") == a and store.open_event("s1", "run") is None
    store.closed(a, now - 3600, "succeeded, 0.5")
    assert store.open_event("s1", "trial") is None
    assert [e.job for e in store.history()] == ["old", "j-t1", "q"]
    assert [e.job for e in store.history(owner="ann", since=now - 7 * 86400)] == ["j-t1"]
    [t] = store.history(owner="ann", since=now - 86400)
    assert t.ended == pytest.approx(now - 3600) and t.how == "succeeded, 0.5" and t.hosts == ("h1",) and t.gpus == 2


def test_snapshot_stores_each_content_once(tmp_path, local_store):
    job = "snap"
    (tmp_path / "proj").mkdir()
    (tmp_path / "shared" / "lib" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "train.py").write_text("print('train')\n")
    (tmp_path / "shared" / "lib" / "a.py").write_text("A = 1\n")
    (tmp_path / "shared" / "lib" / "sub" / "b.sh").write_text("echo b\n")
    os.chmod(tmp_path / "shared" / "lib" / "sub" / "b.sh", 0o755)
    inv_path = tmp_path / "proj" / "inv.yaml"
    inv_path.write_text(INVENTORY.format(job=job))
    snap = snapshot_of(load(inv_path))
    assert snap.root == tmp_path
    assert snap.inventory == "proj/inv.yaml"
    assert set(snap.files) == {"proj/inv.yaml", "proj/train.py", "shared/lib/a.py", "shared/lib/sub/b.sh"}
    first = store_files(local_store, snap)
    assert local_store.blob_count() == 4
    # The same files handed over again (a second submission): no new blob; a changed file: one.
    assert store_files(local_store, snapshot_of(load(inv_path))) == first
    assert local_store.blob_count() == 4
    (tmp_path / "proj" / "train.py").write_text("print('train v2')\n")
    second = store_files(local_store, snapshot_of(load(inv_path)))
    assert local_store.blob_count() == 5
    assert second["shared/lib/a.py"] == first["shared/lib/a.py"]
    assert second["proj/train.py"] != first["proj/train.py"]
    # Materialised: the submission's content, modes kept, after the submitter deleted theirs.
    (tmp_path / "proj" / "train.py").unlink()
    out = tmp_path / "work" / "s1"
    materialise(local_store, first, out)
    assert (out / "proj" / "train.py").read_text() == "print('train')\n"
    assert stat.S_IMODE((out / "shared" / "lib" / "sub" / "b.sh").stat().st_mode) == 0o755
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert load(out / "proj" / "inv.yaml").job == job  # its relative src: paths read the snapshot


HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from provision.io.servicelead import Leadership
    lead = Leadership(lock_file=Path(sys.argv[1]))
    assert lead.try_take()
    print("leading", flush=True)
    time.sleep(120)
    """
)


def test_the_lead_is_one_process_and_freed_when_it_dies(tmp_path):
    lock = tmp_path / "service.sqlite.leader"
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "leading"
        me = Leadership(lock_file=lock)
        assert not me.try_take()
        p.kill()  # kill -9: the kernel frees the lock
        wait_until(me.try_take, timeout=10, what="the lead taken over")
        assert me.still_held()
        me.release()
    finally:
        p.kill()
        p.wait()


def test_pg_lead_is_an_advisory_lock(postgres, monkeypatch):
    pytest.importorskip("psycopg")
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    a, b = Leadership(pg_url=postgres.url()), Leadership(pg_url=postgres.url())
    try:
        assert a.try_take()
        assert not b.try_take()
        a.release()
        assert b.try_take() and b.still_held()
    finally:
        a.release()
        b.release()


H = 3600.0


@pytest.mark.parametrize(
    ("uses", "since", "want"),
    [
        ([], None, {}),
        ([Use("ann", "trial", 2, 0, H)], None, {"ann": 2.0}),  # 2 GPUs for an hour
        ([Use("ann", "trial", 1, 0, H), Use("ann", "run", 4, H, 1.5 * H)], None, {"ann": 3.0}),
        ([Use("bob", "wait", 8, 0, H)], None, {}),  # a queue wait holds nothing
        ([Use("bob", "trial", 0, 0, H)], None, {}),  # no GPU
        ([Use("ann", "trial", 2, 0, None)], None, {"ann": 20.0}),  # still running: until now
        ([Use("ann", "trial", 2, 0, 4 * H)], 2 * H, {"ann": 4.0}),  # clipped to the window
        ([Use("ann", "trial", 2, 0, H)], 2 * H, {}),  # ended before it
        ([Use("zed", "trial", 1, 0, H), Use("amy", "trial", 1, 0, H)], None, {"amy": 1.0, "zed": 1.0}),
    ],
)
def test_gpu_hours(uses, since, want):
    got = gpu_hours(uses, now=10 * H, since=since)
    assert got == pytest.approx(want) and list(got) == list(want)


@pytest.mark.parametrize(("text", "want"), [("7d", 7 * 86400), ("12h", 12 * H), ("30m", 1800), ("90", 90)])
def test_since(text, want):
    assert since_seconds(text) == want


@pytest.mark.parametrize("text", ["", "x", "-1d", "7y"])
def test_since_refused(text):
    with pytest.raises(ValueError):
        since_seconds(text)


def _project(tmp_path: Path, job: str, extra: str = "") -> Path:
    d = tmp_path / "proj"
    d.mkdir(exist_ok=True)
    (d / "train.py").write_text("print(1)\n")
    inv = d / "inv.yaml"
    inv.write_text(
        f"job: {job}\nhosts:\n  - {{name: h1, address: 10.0.0.1}}\n"
        f"files:\n  - {{src: train.py, dest: /opt/{job}/train.py}}\n"
        f"pools:\n  chief: {{replicas: 1, command: [python3, /opt/{job}/train.py]}}\n{extra}"
    )
    return inv


def test_detach_hands_over_and_cancel_takes_back(tmp_path, local_store, monkeypatch):
    monkeypatch.setenv("PROVISION_OWNER", "ann@example.com")
    identity.cache_clear()
    monkeypatch.delenv("PROVISION_STATE", raising=False)
    inv = _project(tmp_path, "dq")
    code, out, err = run("apply", "--queue", "--detach", str(inv), cwd=tmp_path)
    assert code == 0, out + err
    assert "Handed over queued apply of job dq" in out and "No service runs" in out
    assert "provision cancel" in out
    [sub] = local_store.submissions(unfinished=True)
    assert sub.owner == "ann@example.com" and sub.kind is Kind.APPLY
    assert sub.state_path == str(tmp_path / "proj" / ".provision" / "dq.state.json")
    # Handed over once: a second detach of the same job is refused.
    code, out, err = run("apply", "--queue", "--detach", str(inv), cwd=tmp_path)
    assert code == 1 and "already handed over" in err
    # Only its owner cancels it.
    monkeypatch.setenv("PROVISION_OWNER", "bob@example.com")
    identity.cache_clear()  # cached per process: the service runs each owner's work in a process of its own
    code, out, err = run("cancel", str(inv), cwd=tmp_path)
    assert code == 1 and "ann@example.com" in err
    code, out, err = run("cancel", "--take-over", str(inv), cwd=tmp_path)
    assert code == 0 and "Took back" in out, out + err
    assert local_store.get(sub.id).status is Status.CANCELLED  # type: ignore[union-attr]


def test_detach_refuses_bad_input_and_missing_secrets(tmp_path, local_store, monkeypatch):
    monkeypatch.delenv("PROVISION_STATE", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: x\nhosts: []\n")
    code, _, err = run("apply", "--queue", "--detach", str(bad), cwd=tmp_path)
    assert code == 1 and len(err.strip().splitlines()) >= 1
    code, _, err = run("apply", "--detach", str(bad), cwd=tmp_path)
    assert code == 1 and "--detach goes with --queue" in err
    assert local_store.submissions() == []
    # A running service without the secret's variable: refused in one line naming it.
    local_store.beat(ServiceRow("srv:42:n", "srv", 42, "local", ("HOME",), True, 0.0))
    inv = _project(tmp_path, "ds", extra="secret_env: [WANDB_API_KEY]\n")
    monkeypatch.setenv("WANDB_API_KEY", "x")
    code, _, err = run("apply", "--queue", "--detach", str(inv), cwd=tmp_path)
    assert code == 1
    assert err.strip() == (
        "Error: secret_env WANDB_API_KEY: the service on srv (pid 42) has no such variable; start it with the variable set"
    )
    assert local_store.submissions() == []
    local_store.beat(ServiceRow("srv:42:n", "srv", 42, "local", ("HOME", "WANDB_API_KEY"), True, 0.0))
    code, out, err = run("apply", "--queue", "--detach", str(inv), cwd=tmp_path)
    assert code == 0 and "The service on srv (pid 42) runs it." in out, out + err


def test_detach_refuses_what_apply_and_tune_would_refuse(tmp_path, local_store, monkeypatch):
    """An identity file that is not there fails every connection: `apply` refuses to start,
    and so does handing the work over (every trial of a study failed)."""
    monkeypatch.delenv("PROVISION_STATE", raising=False)
    inv = _project(tmp_path, "dk", extra="ssh: {identity_file: ~/nope/id_x}\n")
    code, _, err = run("apply", "--queue", "--detach", str(inv), cwd=tmp_path)
    assert code == 1 and "ssh.identity_file: identity file not found: ~/nope/id_x" in err, err
    study = _project(tmp_path, "dks", extra="ssh: {identity_file: ~/nope/id_x}\n" + TUNE)
    code, _, err = run("tune", "--detach", str(study), cwd=tmp_path)
    assert code == 1 and "identity file not found" in err, err
    assert local_store.submissions() == []


TUNE = (
    "tune:\n  metric: {name: loss, goal: minimize}\n  parameters:\n    lr: {type: double, min: 0.1, max: 1.0}\n"
    "  max_trials: 2\n"
)


def test_a_second_connection_in_the_process_loses_no_write(tmp_path):
    # The service, its pages and its rounds each open the embedded file; opening it again
    # must not drop the first connection's locks (a service's claim was lost that way).
    db = tmp_path / "svc.sqlite"
    first = ServiceStore.open_local(db)
    first.beat(ServiceRow("svc-a", "h", 1, "local", (), True, 0.0))
    second = ServiceStore.open_local(db)

    def other_process(code: str) -> str:
        head = f"from pathlib import Path\nfrom provision.io.servicestore import *\ns = ServiceStore.open_local(Path({str(db)!r}))\n"
        return subprocess.run([sys.executable, "-c", head + code], capture_output=True, text=True, check=True).stdout

    other_process("s.submit(Submission('c1', Kind.APPLY, 'j', 'o', 'local', '', 'i', {}))")
    assert first.claim("c1", "svc-a")
    assert other_process("print(s.get('c1').status.value)").strip() == "running"
    second.close()
    first.close()


# --------------------------------------------------------------------------- the event stream


def test_events_are_kept_once_by_key_with_what_the_rounds_saw(store):
    from provision.core.events import Event, How
    from provision.core.events import Kind as EventKind

    ended = Event(EventKind.JOB_ENDED, "end:bert:1", "bert", "ana", "gpu-1", "job bert succeeded", How.SUCCEEDED, 1)
    started = Event(
        EventKind.JOB_STARTED, "start:bert:1", "bert", "ana", "gpu-1", "job bert started", None, 1, ("gpu-1",), 2
    )
    ids = store.emit([started, ended], ("rounds", {"jobs": {}}))
    assert len(ids) == 2 and ids[0] < ids[1]
    assert store.emit([ended]) == []  # the same happening told again (a run's own end): kept once
    got = store.events()
    assert [s.event for s in got] == [started, ended] and got[0].time > 0
    assert store.events(after=ids[0]) == got[1:] and store.events(job="x") == []
    assert [s.id for s in store.events(kinds=(EventKind.JOB_ENDED,))] == [ids[1]]
    assert store.seen("rounds") == {"jobs": {}} and store.seen("other") is None
    # A subscriber's cursor never moves back.
    assert store.cursor("history") is None
    store.advance("history", ids[1])
    store.advance("history", ids[0])
    assert store.cursor("history") == ids[1]
    assert got[1].to_json()["how"] == "succeeded" and got[0].to_json()["hosts"] == ["gpu-1"]


def test_a_row_this_version_cannot_read_is_set_aside_and_the_others_go_on(local_store):
    local_store.submit(_sub("good"))
    bad = [
        ("k1", "kind", "bogus"),  # a kind no version knows
        ("../../../escape", "id", None),  # an id that would walk out of the work directory
        ("o1", "options", '{"take_over": "yes"}'),
        ("i1", "inventory", "../../etc/passwd"),
        ("s1", "status", "bogus"),
    ]
    for sid, column, value in bad:
        local_store.submit(_sub("tmp"))
        if column == "id":
            local_store._do("UPDATE provision_service_submissions SET id = ? WHERE id = 'tmp'", (sid,))
        else:
            local_store._do(
                f"UPDATE provision_service_submissions SET {column} = ?, id = ? WHERE id = 'tmp'", (value, sid)
            )
    assert [s.id for s in local_store.submissions(unfinished=True)] == ["good"]
    why = dict(local_store.bad_rows())
    assert sorted(why) == sorted(sid for sid, _, _ in bad)
    assert "'bogus' is not a valid Kind" in why["k1"] and "not a submission id" in why["../../../escape"]
    assert (
        "options.take_over" in why["o1"]
        and "inside its snapshot" in why["i1"]
        and "'bogus' is not a valid Status" in why["s1"]
    )
    for sid in why:
        assert local_store.set_aside(sid, why[sid])
    assert local_store.bad_rows() == []  # failed: never run, not said again
    assert local_store.get("k1") is None  # unreadable: not given to anyone


def test_each_move_of_a_submission_says_whether_it_took(local_store):
    local_store.submit(_sub("s"))
    assert not local_store.watching("s", "x")  # waiting: not applied yet
    assert local_store.claim("s", "svc") and local_store.queued("s", "queued: room")
    assert local_store.get("s").status is Status.QUEUED  # type: ignore[union-attr]
    assert not local_store.finish("s", Status.DONE, "x")  # a queued apply is not done
    assert local_store.claim("s", "svc") and local_store.finish("s", Status.DONE, "applied")
    assert not local_store.finish("s", Status.FAILED, "late")  # once
    local_store.submit(_sub("q"))
    assert local_store.claim("q", "svc") and local_store.queued("q", "queued")
    assert local_store.cancel("q", "ann") is Status.CANCELLED  # a row, no worker: taken back at once


def test_a_large_pushed_file_is_stored_and_written_a_piece_at_a_time(store, tmp_path):
    """A 700 MiB pushed file peaked `--detach` at 2.2 GiB (read whole, then copied) and the
    worker read the blob back whole: both now hold a piece (8 MiB) at a time."""
    import tracemalloc

    from provision.serve.snapshot import Snapshot

    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for k in range(12):  # 96 MiB, not all alike
            f.write(bytes([k]) * (8 << 20))
    snap = Snapshot(tmp_path, "big.bin", {"big.bin": (big, 0o644)})
    tracemalloc.start()
    try:
        manifest = store_files(store, snap)
        _, stored = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        materialise(store, manifest, tmp_path / "out")
        _, written = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stored < 40 << 20 and written < 40 << 20, (stored >> 20, written >> 20)
    out = tmp_path / "out" / "big.bin"
    assert out.stat().st_size == 96 << 20 and manifest["big.bin"][0] == store_files(store, snap)["big.bin"][0]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == manifest["big.bin"][0]
    assert next(store.blob_parts(manifest["big.bin"][0]))[:1] == b"\x00"
