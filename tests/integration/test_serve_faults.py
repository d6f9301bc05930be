"""`provision serve`'s faults on sandbox hosts and a real PostgreSQL: kill -9 of
the service during a queued apply's write step and between a trial's end and its tell; the
PostgreSQL stopped for 30 s; a second service started by mistake on the same database; a
`--detach` to the local state while a team's service runs; the dashboard's tokens in
PostgreSQL.

The module shares the session's sandbox (sandbox4) and PostgreSQL server; each test runs
its own `provision serve` processes with their own embedded file (PROVISION_SERVICE_DB under
tmp_path). What ran is counted on the hosts: each task appends to a file there when it
starts, so a trial or task run twice is there twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from clirun import cli, ok, sh, wait_until

from .servehelp import APPLY_HOSTS, STUDY_HOSTS, TRAINER, Service, service_env, show_logs

pytestmark = pytest.mark.integration

TMP_SUFFIX = ".provision-tmp"  # host/layout.py: an atomic write's temp file


@pytest.fixture
def env(tmp_path):
    return service_env(tmp_path)


def _team(env: dict[str, str], postgres) -> dict[str, str]:
    return {**env, **postgres.env(), "PROVISION_STATE": postgres.url()}


def _counted(sb, hosts: list[str], path: str) -> list[int]:
    """The numbers the tasks appended to `path` on the hosts (one per start)."""
    return sorted(int(x) for h in hosts for x in sh(sb, h, f"cat {path} 2>/dev/null").split())


def _study(make, sb, tmp: Path, job: str, trials: int, steps: int) -> Path:
    """A study of `trials` trials, 2 at once, each `steps` half-seconds long; each trial
    appends its number to /var/tmp/JOB.ran on its host when it starts and to JOB.ended
    when its trainer ended."""
    for h in STUDY_HOSTS:
        sh(sb, h, f"rm -f /var/tmp/{job}.ran /var/tmp/{job}.ended")
    shutil.copy(TRAINER, tmp / "trainer.py")
    inv = tmp / f"{job}.yaml"
    script = (
        f'echo "$CLOUD_ML_TRIAL_ID" >> /var/tmp/{job}.ran; '
        f'python3 /opt/{job}/trainer.py --steps={steps} --step_seconds=0.5 "$@"; rc=$?; '
        f'echo "$CLOUD_ML_TRIAL_ID" >> /var/tmp/{job}.ended; exit $rc'
    )
    make(
        sb,
        job=job,
        path=inv,
        hosts=STUDY_HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", script, "sh"]}},
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": trials,
            "parallel_trials": 2,
        },
    )
    return inv


def _trials(inv: Path, env: dict) -> list[dict]:
    r = cli("tune", "--status", "--json", inv, cwd=inv.parent, env=env)
    return json.loads(r.stdout)["trials"] if r.returncode == 0 else []


def _followed_to_its_end(inv: Path, env: dict, trials: int) -> str:
    """`provision tune INV` follows the handed-over study to its end and closes as a
    terminal that runs one does (the table, how it ended); its output."""
    r = cli("tune", inv, cwd=inv.parent, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "handed over" in r.stdout and "TRIAL" in r.stdout, r.stdout
    assert f"The study ended: {trials} trials. Picture: " in r.stdout, r.stdout
    return r.stdout


def _ran_once(sb, inv: Path, env: dict, job: str, trials: int) -> None:
    """Every trial asked once, run once (counted on the hosts), and succeeded."""
    rows = _trials(inv, env)
    assert [t["number"] for t in rows] == list(range(1, trials + 1)), rows
    assert all(t["state"] == "succeeded" for t in rows), rows
    assert _counted(sb, STUDY_HOSTS, f"/var/tmp/{job}.ran") == list(range(1, trials + 1))


# --------------------------------------------------------------------------- kill -9


def _pending(state: Path) -> list[str]:
    """Hosts the state records as being written (apply's write step began on them)."""
    try:
        doc = json.loads(state.read_text())
    except (OSError, ValueError):
        return []
    return [name for name, rec in (doc.get("hosts") or {}).items() if rec.get("pending")]


def test_kill_9_during_a_queued_applys_write_step(sandbox4, sandbox_inventory, tmp_path, env):
    """Held at the write step by PROVISION_TEST_PAUSE (io/steps.py; the worker inherits the
    service's environment): the state names the hosts pending, nothing is on them yet. kill -9
    there, a restart: the apply converges, nothing half-written is left, the task ran once."""
    job = "sfwrite"
    for h in APPLY_HOSTS:
        sh(sandbox4, h, f"rm -f /var/tmp/{job}.starts")
    d = tmp_path / job
    d.mkdir()
    payload = os.urandom(1 << 20)  # 1 MiB: a write of some size
    (d / "payload.bin").write_bytes(payload)
    inv = d / "inv.yaml"
    start = f"echo 1 >> /var/tmp/{job}.starts; exec sleep 600"
    sandbox_inventory(
        sandbox4,
        job=job,
        path=inv,
        hosts=APPLY_HOSTS,
        files=[{"src": "payload.bin", "dest": f"/opt/{job}/payload.bin"}],
        pools={
            "chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", start]},
            "worker": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", start]},
        },
    )
    ok(cli("apply", "--queue", "--detach", inv, cwd=d, env=env))
    svc = Service(tmp_path / "svc-a", env)
    try:
        svc.start(PROVISION_TEST_PAUSE="WRITE:600")
        state = d / ".provision" / f"{job}.state.json"
        held = wait_until(lambda: _pending(state), timeout=180, what="the apply held at its write step")
        assert held, held
        svc.kill9()
        # Killed at the write step: the state says pending, no file of the job is on a host yet.
        assert _pending(state)
        for h in APPLY_HOSTS:
            assert sh(sandbox4, h, f"test -e /opt/{job}/payload.bin").code != 0, h
        svc.start()  # no pause now
        wait_until(
            lambda: json.loads(cli("status", "--json", inv, cwd=d, env=env).stdout or "{}").get("phase") == "Running",
            timeout=240,
            what="the handed-over apply's job to run after the restart",
        )
        assert not _pending(state), _pending(state)
        placed = [h for h in APPLY_HOSTS if sh(sandbox4, h, f"test -f /opt/{job}/payload.bin").code == 0]
        assert placed, "the payload is on no host"
        for h in placed:
            digest = sh(sandbox4, h, f"sha256sum /opt/{job}/payload.bin").split()[0]
            assert digest == hashlib.sha256(payload).hexdigest(), h
        for h in APPLY_HOSTS:
            left = sh(sandbox4, h, f"find /opt/{job} /etc/provision/{job} -name '*{TMP_SUFFIX}' 2>/dev/null")
            assert left.strip() == "", (h, left)
        # Two tasks, each started once (a task started twice would have two lines).
        assert _counted(sandbox4, APPLY_HOSTS, f"/var/tmp/{job}.starts") == [1, 1]
    finally:
        svc.stop()
        cli("destroy", "-y", inv, cwd=d, env=env)
        show_logs(tmp_path)


def test_kill_9_between_a_trials_end_and_its_tell(sandbox4, sandbox_inventory, tmp_path, env):
    """No test hook: the service is killed while two trials run, and their trainers end on
    the hosts while no service runs (ended there, not told: `tune --status` still says
    running). The restarted service's worker adopts and tells them: no trial asked or run
    twice."""
    job = "sftell"
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, trials=4, steps=12)
    ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=env))
    svc = Service(tmp_path / "svc", env)
    try:
        svc.start()
        wait_until(
            lambda: len(_counted(sandbox4, STUDY_HOSTS, f"/var/tmp/{job}.ran")) >= 2,
            timeout=300,
            what="two trials running on the hosts",
        )
        svc.kill9()
        started = _counted(sandbox4, STUDY_HOSTS, f"/var/tmp/{job}.ran")
        wait_until(
            lambda: set(_counted(sandbox4, STUDY_HOSTS, f"/var/tmp/{job}.ended")) >= set(started),
            timeout=120,
            what="the running trials' trainers to end on the hosts",
        )
        # Ended on the hosts, not told: the study still has them running.
        rows = {t["number"]: t["state"] for t in _trials(inv, env)}
        assert all(rows.get(n) == "running" for n in started), (started, rows)
        svc.start()
        out = _followed_to_its_end(inv, env, 4)
        assert "succeeded" in out
    finally:
        svc.stop()
        show_logs(tmp_path)
    _ran_once(sandbox4, inv, env, job, 4)
    logs = "".join(p.read_text() for p in (tmp_path / "svc" / "work").glob("*.log"))
    assert "adopted" in logs, logs


# --------------------------------------------------------------------------- the database away


def test_postgresql_stopped_for_30_s(sandbox4, sandbox_inventory, tmp_path, env, postgres):
    """The service says the outage in one line and its end in another, does not die, and
    the study (its storage, the state and the service's tables all in that PostgreSQL) goes
    on to its end: every trial asked and run once."""
    pytest.importorskip("psycopg")
    team = _team(env, postgres)
    job = "sfpg"
    inv = _study(sandbox_inventory, sandbox4, tmp_path, job, trials=4, steps=24)
    ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=team))
    svc = Service(tmp_path / "svc", team)
    try:
        svc.start()
        wait_until(
            lambda: len(_counted(sandbox4, STUDY_HOSTS, f"/var/tmp/{job}.ran")) >= 1,
            timeout=300,
            what="a trial running on the hosts",
        )
        postgres.stop()
        away = time.monotonic()
        try:
            wait_until(lambda: svc.lines("does not answer"), timeout=30, what="the service to say the outage")
            time.sleep(max(0.0, 30 - (time.monotonic() - away)))  # the outage's length, not an ordering
            assert svc.p is not None and svc.p.poll() is None, "the service died of the outage"
        finally:
            postgres.start()
        wait_until(lambda: svc.lines("answers again"), timeout=60, what="the service to say the database is back")
        _followed_to_its_end(inv, team, 4)
        assert svc.p is not None and svc.p.poll() is None, "the service died"
        assert len(svc.lines("does not answer")) == 1, svc.output()
        assert len(svc.lines("answers again")) == 1, svc.output()
    finally:
        svc.stop()
        show_logs(tmp_path)
    _ran_once(sandbox4, inv, team, job, 4)


# --------------------------------------------------------------------------- two services


def test_a_second_service_by_mistake_follows_and_a_local_detach_says_where_it_goes(
    sandbox4, sandbox_inventory, tmp_path, env, postgres
):
    """A second `provision serve` on the same database follows, says whom, and does nothing
    twice; a `--detach` to the local state on this machine says in one line that the work
    goes to the local file, not to the team's service."""
    pytest.importorskip("psycopg")
    team = _team(env, postgres)
    job = "sfsecond"
    for h in APPLY_HOSTS:
        sh(sandbox4, h, f"rm -f /var/tmp/{job}.starts")
    d = tmp_path / job
    d.mkdir()
    inv = d / "inv.yaml"
    start = f"echo 1 >> /var/tmp/{job}.starts; exec sleep 600"
    sandbox_inventory(
        sandbox4,
        job=job,
        path=inv,
        hosts=APPLY_HOSTS,
        pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", start]}},
    )
    a, b = Service(tmp_path / "a", team), Service(tmp_path / "b", team)
    local = d / "local.yaml"
    try:
        a.start()
        assert a.p is not None
        b.start(until="following the service on")
        (line,) = b.lines("following the service on")
        assert f"(pid {a.p.pid}," in line and "doing nothing" in line, line
        ok(cli("apply", "--queue", "--detach", inv, cwd=d, env=team))
        wait_until(
            lambda: json.loads(cli("status", "--json", inv, cwd=d, env=team).stdout or "{}").get("phase") == "Running",
            timeout=240,
            what="the handed-over apply's job to run",
        )
        assert len(a.lines(f"apply of job {job}")) == 1, a.output()
        assert not b.lines(job) and not b.lines("leading"), b.output()
        assert _counted(sandbox4, APPLY_HOSTS, f"/var/tmp/{job}.starts") == [1]

        # The same machine, the local state: the work goes to the embedded file, said once.
        sandbox_inventory(
            sandbox4,
            job="sflocal",
            path=local,
            hosts=APPLY_HOSTS,
            pools={"chief": {"replicas": 1, "command": ["true"]}},
        )
        r = ok(cli("apply", "--queue", "--detach", local, cwd=d, env=env))
        notes = [x for x in r.stdout.splitlines() if x.startswith("Note:")]
        db = Path(env["PROVISION_SERVICE_DB"]).resolve()
        assert len(notes) == 1, r.stdout
        assert f"pid {a.p.pid}" in notes[0] and postgres.url().split("@")[-1] in notes[0], notes
        assert notes[0].endswith(f"the work goes to {db}."), notes
        took = ok(cli("cancel", local, cwd=d, env=env))
        assert "Took back" in took.stdout, took.stdout
    finally:
        b.stop()
        a.stop()
        cli("destroy", "-y", inv, cwd=d, env=team)
        show_logs(tmp_path)
    assert not b.lines("leading"), b.output()


def test_tokens_on_postgresql(tmp_path, env, postgres):
    """`serve token create|list|revoke` against the team's PostgreSQL: the token is printed
    once and only its sha256 is in the table."""
    pytest.importorskip("psycopg")
    team = _team(env, postgres)
    made = ok(cli("serve", "token", "create", "--owner", "bob@example.com", "--admin", cwd=tmp_path, env=team))
    token = made.stdout.strip()
    assert token and "shown this once" in made.stderr, made.stderr
    tid = made.stderr.split()[1]
    stored = postgres.sql(f"SELECT hash, owner, admin FROM provision_service_tokens WHERE id = '{tid}'").strip()
    assert stored.split("|") == [hashlib.sha256(token.encode()).hexdigest(), "bob@example.com", "1"], stored
    assert token not in postgres.sql("SELECT hash || owner FROM provision_service_tokens")
    listed = ok(cli("serve", "token", "list", cwd=tmp_path, env=team)).stdout
    assert tid in listed and "bob@example.com" in listed and token not in listed, listed
    ok(cli("serve", "token", "revoke", tid, cwd=tmp_path, env=team))
    assert tid not in ok(cli("serve", "token", "list", cwd=tmp_path, env=team)).stdout
    again = cli("serve", "token", "revoke", tid, cwd=tmp_path, env=team)
    assert again.returncode != 0 and f"no token {tid}" in again.stderr, again.stderr


# --------------------------------------------------------------------------- rows and waiting work


def _workers(svc: Service) -> list[int]:
    """The service's worker processes (the one started ahead, holding no work, included)."""
    assert svc.p is not None
    out = os.popen(f"pgrep -P {svc.p.pid} -f provision.serve.worker").read().split()
    return [int(x) for x in out]


def test_bad_rows_are_set_aside_and_waiting_work_costs_a_row(sandbox4, sandbox_inventory, tmp_path, env, job_name):
    """Rows no version can read (a kind, a status, options, an id that walks out of the work
    directory) are set aside with one line each while the service goes on; a dozen queued
    applies that do not fit cost rows, not a dozen processes."""
    import sqlite3

    blocker, d = f"{job_name[:28]}-blk", tmp_path / "proj"
    d.mkdir()
    binv = d / "blocker.yaml"
    sandbox_inventory(
        sandbox4, job=blocker, path=binv, hosts=APPLY_HOSTS,
        pools={"worker": {"replicas": 2, "accelerators": 2, "command": ["sleep", "600"]}},
    )  # fmt: skip
    ok(cli("apply", "-y", binv, cwd=d, env=env))  # every GPU of the two hosts
    queued = []
    for n in range(12):
        inv = d / f"q{n}.yaml"
        sandbox_inventory(
            sandbox4, job=f"{job_name[:28]}-q{n}", path=inv, hosts=APPLY_HOSTS,
            pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["true"]}},
        )  # fmt: skip
        ok(cli("apply", "--queue", "--detach", inv, cwd=d, env=env))
        queued.append(inv)
    db = Path(env["PROVISION_SERVICE_DB"])
    escape = db.parent.parent / "escape"  # where work/../../../escape would be (work/ is beside the database)
    with sqlite3.connect(db) as c:
        row = c.execute("SELECT * FROM provision_service_submissions LIMIT 1").fetchone()
        cols = [x[1] for x in c.execute("PRAGMA table_info(provision_service_submissions)")]
        for sid, column, value in (
            ("bogus-kind", "kind", "bogus"),
            ("bogus-status", "status", "bogus"),
            ("bogus-options", "options", '{"take_over": "yes"}'),
            ("../../../escape", None, None),
        ):
            bad = dict(zip(cols, row, strict=True), id=sid, job=f"bad-{abs(hash(sid)) % 1000}")
            if column is not None:
                bad[column] = value
            c.execute(
                f"INSERT INTO provision_service_submissions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                list(bad.values()),
            )
    svc = Service(tmp_path / "svc", env)
    try:
        svc.start()
        wait_until(lambda: len(svc.lines("set aside")) == 4, 30, what="the four bad rows set aside")
        seen: list[int] = []
        end = time.monotonic() + 45  # two of the queued applies' waits (20 s each)
        while time.monotonic() < end:
            seen.append(len(_workers(svc)))
            time.sleep(0.5)
        assert max(seen) <= 4 + 1, seen  # at most 4 admitted at a time, and the spare
        assert svc.p is not None and svc.p.poll() is None, svc.output()
        with sqlite3.connect(db) as c:
            states = dict(c.execute("SELECT id, status FROM provision_service_submissions").fetchall())
        assert all(states[s] == "failed" for s in ("bogus-kind", "bogus-status", "bogus-options", "../../../escape")), (
            states
        )
        assert sum(v == "queued" for v in states.values()) >= 4, states  # waited, found no room: rows
        assert not escape.exists() and not Path("/escape.log").exists()
        for inv in queued:  # a queued row is taken back at once
            r = ok(cli("cancel", inv, cwd=d, env=env))
            assert "Took back" in r.stdout or "Asked the service to stop" in r.stdout, r.stdout
        wait_until(lambda: len(_workers(svc)) <= 1, 60, what="the workers to end")
    finally:
        svc.stop()
        cli("destroy", "-y", binv, cwd=d, env=env)
        show_logs(tmp_path)


def test_a_frozen_leader_yields_on_postgresql(tmp_path, env, postgres):
    """SIGSTOP of the leader: its kernel still answers for its connections, so the lock would
    live on; the follower sees its heartbeat stop, ends its lock's session and leads within
    the documented take-over time. Woken, the old leader follows."""
    import signal

    pytest.importorskip("psycopg")
    team = _team(env, postgres)
    a, b = Service(tmp_path / "a", team), Service(tmp_path / "b", team)
    try:
        a.start()
        b.start(until="following the service on")
        assert a.p is not None
        a.p.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        try:
            wait_until(lambda: b.lines("leading: driving"), 30, 0.2, what="the follower to lead")
            took = time.monotonic() - frozen
        finally:
            a.p.send_signal(signal.SIGCONT)
        assert took <= 20, took  # ALIVE_AFTER (10 s) and a poll or two
        assert b.lines("has not beaten"), b.output()
        wait_until(lambda: a.lines("the lead was lost"), 30, what="the old leader to say it lost the lead")
        wait_until(lambda: a.lines("following the service on"), 30, what="the old leader to follow")
    finally:
        a.stop()
        b.stop()
        show_logs(tmp_path)
