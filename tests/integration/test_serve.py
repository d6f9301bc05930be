"""`provision serve` on sandbox hosts: a study handed over with `tune --detach`
survives two kill -9 of the service (every trial ran once, checked on the hosts, and the
study ended with its best trial); an `apply --queue --detach` runs what was submitted after
the submitter deleted their files; a queued one is taken back by `cancel`; `history`
shows them all.

Each test runs its own service (a real `provision serve` process) on its own embedded
database (PROVISION_SERVICE_DB under tmp_path).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from clirun import cli, ok, sh, wait_until

from .servehelp import APPLY_HOSTS, STUDY_HOSTS, TRAINER, Service, service_env, show_logs

pytestmark = pytest.mark.integration


@pytest.fixture
def env(tmp_path):
    return service_env(tmp_path)


@pytest.fixture
def service(tmp_path, env):
    s = Service(tmp_path, env)
    yield s
    s.stop()
    show_logs(tmp_path)


def _trials(inv: Path, cwd: Path, env: dict) -> list[dict]:
    r = cli("tune", "--status", "--json", inv, cwd=cwd, env=env)
    return json.loads(r.stdout)["trials"] if r.returncode == 0 else []


def _ended(inv: Path, cwd: Path, env: dict) -> tuple[int, int]:
    t = _trials(inv, cwd, env)
    return sum(x["state"] != "running" for x in t), sum(x["state"] == "running" for x in t)


def test_a_handed_over_study_survives_two_kill_9(sandbox4, sandbox_inventory, tmp_path, env, service):
    job = "srvstudy"
    ran = f"/var/tmp/{job}.ran"
    for h in STUDY_HOSTS:
        sh(sandbox4, h, f"rm -f {ran}")
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    inv = tmp_path / "study.yaml"
    # Each trial's task appends its number to a file on its host before it trains: a trial
    # run twice would be there twice.
    script = f'echo "$CLOUD_ML_TRIAL_ID" >> {ran}; exec python3 /opt/{job}/trainer.py --steps=30 --step_seconds=0.5 "$0" "$@"'
    sandbox_inventory(
        sandbox4,
        job=job,
        path=inv,
        hosts=STUDY_HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", script]}},
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": 8,
            "parallel_trials": 3,
        },
    )
    r = ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=env))
    assert "Handed over study of job srvstudy" in r.stdout and "No service runs" in r.stdout, r.stdout
    assert f"provision tune {inv}" in r.stdout
    # The service runs what was submitted: a trainer changed since would fail every trial.
    # (Changed, not deleted: `tune --status` of the submitter's checkout reads its files.)
    (tmp_path / "trainer.py").write_text("raise SystemExit(3)\n")
    service.start()
    # Killed while trials run, twice: once some ended, then once more of them did.
    for ended_at_least in (2, 5):
        wait_until(
            lambda n=ended_at_least: (lambda e: e[0] >= n and e[1] >= 1)(_ended(inv, tmp_path, env)),
            timeout=480,  # the machine is shared: a trial's apply may take a while
            what=f"{ended_at_least} trials ended and one running",
        )
        service.kill9()
        service.start()
    # `provision tune INV` follows it (no second runner) to its end.
    follow = cli("tune", inv, cwd=tmp_path, env=env, timeout=600)
    assert follow.returncode == 0, follow.stdout + follow.stderr
    assert "handed over" in follow.stdout and "done" in follow.stdout, follow.stdout
    trials = _trials(inv, tmp_path, env)
    assert [t["number"] for t in trials] == list(range(1, 9)), trials
    assert all(t["state"] == "succeeded" for t in trials), trials
    # On the hosts: every trial ran once.
    numbers = [int(x) for h in STUDY_HOSTS for x in sh(sandbox4, h, f"cat {ran} 2>/dev/null").split()]
    assert sorted(numbers) == list(range(1, 9)), numbers
    doc = json.loads(ok(cli("tune", "--status", "--json", inv, cwd=tmp_path, env=env)).stdout)
    assert doc["best"]["value"] == min(t["value"] for t in trials)
    # The restarts adopted what the killed workers left.
    logs = "".join(p.read_text() for p in (tmp_path / "svc" / "work").glob("*.log"))
    assert "adopted" in logs, logs
    # History: every trial, who and on what.
    h = json.loads(ok(cli("history", "--json", cwd=tmp_path, env=env)).stdout)
    assert h["format_version"] == 1
    trial_rows = [e for e in h["events"] if e["kind"] == "trial"]
    assert sorted(e["job"] for e in trial_rows) == sorted(f"{job}-t{n}" for n in range(1, 9)), trial_rows
    assert all(e["owner"] == "ann@example.com" and e["gpus"] == 1 for e in trial_rows)
    assert [e["how"].split(":")[0] for e in h["events"] if e["kind"] == "study"] == ["done"]
    assert h["gpu_hours"]["ann@example.com"] > 0


def _small_study(make, sb, tmp: Path, job: str) -> Path:
    """A study of 3 trials, one at a time, whose trainer (pushed with files:) prints a line
    every 0.25 s for 100 s."""
    shutil.copy(TRAINER, tmp / "trainer.py")
    inv = tmp / "study.yaml"
    trainer = ["python3", f"/opt/{job}/trainer.py", "--steps=400", "--step_seconds=0.25"]
    make(
        sb,
        job=job,
        path=inv,
        hosts=STUDY_HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={"chief": {"replicas": 1, "accelerators": 1, "command": trainer}},
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": 3,
            "parallel_trials": 1,
        },
    )
    return inv


def _trainer_runs(sb, job: str) -> bool:
    return any(sh(sb, h, f"pgrep -f '[/]opt/{job}/trainer.py'").code == 0 for h in STUDY_HOSTS)


def test_handed_over_work_is_read_and_cancelled_without_its_files(sandbox4, sandbox_inventory, tmp_path, env, service):
    """Handed over, then the files deleted (the service keeps a snapshot): `tune --status`,
    `status` and `cancel` need only the job's name and state; what pushes (plan, apply,
    tune --detach) still refuses with the files' message."""
    job = "srvgone"
    inv = _small_study(sandbox_inventory, sandbox4, tmp_path, job)
    ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=env))
    (tmp_path / "trainer.py").unlink()
    service.start()
    wait_until(lambda: _trainer_runs(sandbox4, job), timeout=300, what="trial 1's trainer to run")
    doc = json.loads(ok(cli("tune", "--status", "--json", inv, cwd=tmp_path, env=env)).stdout)
    assert [t["state"] for t in doc["trials"]] == ["running"], doc
    assert "1 running" in ok(cli("tune", "--status", inv, cwd=tmp_path, env=env)).stdout
    ok(cli("status", inv, cwd=tmp_path, env=env))
    for args in (("plan", inv), ("apply", "-y", inv), ("tune", "--detach", inv)):
        r = cli(*args, cwd=tmp_path, env=env)
        assert r.returncode == 1 and "files[0].src: no such file or directory" in r.stderr, (args, r.stderr)
    r = ok(cli("cancel", inv, cwd=tmp_path, env=env))
    assert "Asked the service to stop" in r.stdout, r.stdout
    wait_until(lambda: not _trainer_runs(sandbox4, job), timeout=120, what="the cancelled trial to stop")
    wait_until(
        lambda: all(t["state"] != "running" for t in _trials(inv, tmp_path, env)), timeout=120, what="the study to end"
    )


def test_logs_of_a_handed_over_study_are_its_trials(sandbox4, sandbox_inventory, tmp_path, env, service):
    """`logs STUDY` prints its trials' output, each line as trial-N/TASK@HOST (one line saying
    why when there is none yet, never silence); `logs -f` follows it until the study ended;
    an ended trial's lines come from where the service kept them."""
    job = "srvlogs"
    inv = _small_study(sandbox_inventory, sandbox4, tmp_path, job)
    r = ok(cli("logs", inv, cwd=tmp_path, env=env))
    assert r.stdout == "" and r.stderr.startswith(f"study {job}: no trial has run yet, so no logs: "), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=env))
    service.start()
    wait_until(
        lambda: "step=" in cli("logs", inv, cwd=tmp_path, env=env).stdout,
        timeout=300,
        what="trial 1's output in `provision logs`",
    )
    line = next(x for x in ok(cli("logs", inv, cwd=tmp_path, env=env)).stdout.splitlines() if "step=" in x)
    assert re.fullmatch(r"trial-1/chief-0@host-[12] \| step=\d+ loss=[0-9.]+", line), line
    ok(cli("cancel", inv, cwd=tmp_path, env=env))
    # Cancelled: the running trial is stopped and the study ends; -f printed its lines to the end.
    r = cli("logs", "-f", inv, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "trial-1/chief-0@host-" in r.stdout and "step=1 " in r.stdout, r.stdout
    # Its lines, kept by the service beside the submitter's state once the trial left its hosts.
    kept = tmp_path / ".provision" / f"{job}.tune" / "trial-1" / "chief-0.log"
    wait_until(kept.exists, 60, what="trial 1's kept logs")
    r = ok(cli("logs", "--tail", "2", inv, cwd=tmp_path, env=env))
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(x.startswith("trial-1/chief-0@host-") for x in lines), r.stdout


def _apply_job(make, sb, tmp: Path, job: str, gpus: int, payload: str | None = None) -> Path:
    d = tmp / job
    d.mkdir()
    files = []
    if payload is not None:
        (d / "payload.txt").write_text(payload)
        files = [{"src": "payload.txt", "dest": f"/opt/{job}/payload.txt"}]
    inv = d / "inv.yaml"
    make(
        sb,
        job=job,
        path=inv,
        hosts=APPLY_HOSTS,
        files=files,
        pools={"chief": {"replicas": 1, "accelerators": gpus, "command": ["sleep", "600"]}},
    )
    return inv


def test_queued_applies_handed_over_run_as_submitted_or_are_taken_back(
    sandbox4, sandbox_inventory, tmp_path, env, service
):
    # Handed over while no service runs; the submitter's files are gone when it starts.
    a = _apply_job(sandbox_inventory, sandbox4, tmp_path, "srvapply", 2, payload="as submitted\n")
    ok(cli("apply", "--queue", "--detach", a, cwd=tmp_path, env=env))
    (a.parent / "payload.txt").unlink()
    service.start()
    try:
        host = wait_until(
            lambda: next(
                (h for h in APPLY_HOSTS if sh(sandbox4, h, "test -f /opt/srvapply/payload.txt").code == 0), None
            ),
            timeout=120,
            what="the handed-over apply to write its file",
        )
        assert sh(sandbox4, host, "cat /opt/srvapply/payload.txt") == "as submitted\n"
        wait_until(  # status reads the job without the files it pushed
            lambda: (
                json.loads(cli("status", "--json", a, cwd=a.parent, env=env).stdout or "{}").get("phase") == "Running"
            ),
            timeout=120,
            what="the handed-over apply's job to run",
        )
        # Every GPU of both hosts held: the next job waits in the queue, `jobs` shows it,
        # and `cancel` takes it back.
        blocker = _apply_job(sandbox_inventory, sandbox4, tmp_path, "srvblock", 2)
        ok(cli("apply", "-y", blocker, cwd=blocker.parent, env=env))
        b = _apply_job(sandbox_inventory, sandbox4, tmp_path, "srvqueued", 2)
        ok(cli("apply", "--queue", "--detach", b, cwd=tmp_path, env=env))

        def queued() -> dict | None:
            view = json.loads(ok(cli("jobs", "--json", b, cwd=tmp_path, env=env)).stdout)
            return next((j for j in view["jobs"] if j["job"] == "srvqueued" and j["state"] == "queued"), None)

        seen = wait_until(queued, timeout=120, what="srvqueued queued in provision jobs")
        assert seen["owner"], seen
        r = ok(cli("cancel", b, cwd=tmp_path, env=env))
        assert "Asked the service to stop" in r.stdout, r.stdout
        wait_until(lambda: queued() is None, timeout=60, what="the queued apply to be gone")
        wait_until(lambda: "cancelled" in service.output(), timeout=60, what="the service to say it is cancelled")
        h = json.loads(ok(cli("history", "--json", "--owner", "ann@example.com", cwd=tmp_path, env=env)).stdout)
        kinds = {(e["kind"], e["job"]): e["how"] for e in h["events"]}
        assert kinds[("run", "srvapply")] == "", kinds  # its job runs: the row is open
        assert kinds[("wait", "srvqueued")] == "cancelled", kinds
        text = ok(cli("history", cwd=tmp_path, env=env)).stdout
        assert "srvapply" in text and "GPU-hours: ann@example.com" in text, text
        # The applied job runs on under the service: cancel stops it as `provision stop` does.
        r = ok(cli("cancel", a, cwd=tmp_path, env=env))
        assert "Asked the service to stop" in r.stdout, r.stdout
        wait_until(
            lambda: (
                json.loads(cli("status", "--json", a, cwd=a.parent, env=env).stdout or "{}").get("phase") == "Stopped"
            ),
            timeout=120,
            what="the applied job stopped",
        )
        h = json.loads(ok(cli("history", "--json", cwd=tmp_path, env=env)).stdout)
        run = next(e for e in h["events"] if e["kind"] == "run" and e["job"] == "srvapply")
        assert run["how"] == "stopped by ann@example.com" and run["ended"], run
    finally:
        (a.parent / "payload.txt").write_text("as submitted\n")  # destroy renders the job: it reads them
        for inv in (a, tmp_path / "srvblock" / "inv.yaml", tmp_path / "srvqueued" / "inv.yaml"):
            if inv.exists():
                cli("destroy", "-y", inv, cwd=inv.parent, env=env)


def test_two_services_on_postgresql_the_follower_takes_over(sandbox4, sandbox_inventory, tmp_path, env, postgres):
    pytest.importorskip("psycopg")
    team = {**env, **postgres.env(), "PROVISION_STATE": postgres.url()}
    job = "srvha"
    ran = f"/var/tmp/{job}.ran"
    for h in STUDY_HOSTS:
        sh(sandbox4, h, f"rm -f {ran}")
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    inv = tmp_path / "ha.yaml"
    script = f'echo "$CLOUD_ML_TRIAL_ID" >> {ran}; exec python3 /opt/{job}/trainer.py --steps=20 --step_seconds=0.5 "$0" "$@"'
    sandbox_inventory(
        sandbox4,
        job=job,
        path=inv,
        hosts=STUDY_HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{job}/trainer.py"}],
        pools={"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", script]}},
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": 4,
            "parallel_trials": 2,
        },
    )
    ok(cli("tune", "--detach", "--poll", "0.3", inv, cwd=tmp_path, env=team))
    a, b = Service(tmp_path / "a", team), Service(tmp_path / "b", team)
    try:
        a.start()  # leads
        b.start(until="following")
        wait_until(lambda: _ended(inv, tmp_path, team)[1] >= 1, timeout=300, what="a trial running")
        assert "leading" not in b.output()
        a.kill9()
        killed = time.monotonic()
        wait_until(lambda: "leading" in b.output(), timeout=15, every=0.2, what="the follower to lead within 15 s")
        assert time.monotonic() - killed <= 15
        follow = cli("tune", inv, cwd=tmp_path, env=team, timeout=600)
        assert follow.returncode == 0, follow.stdout + follow.stderr
    finally:
        a.stop()
        b.stop()
        show_logs(tmp_path)
    trials = _trials(inv, tmp_path, team)
    assert [t["state"] for t in trials] == ["succeeded"] * 4, trials
    numbers = [int(x) for h in STUDY_HOSTS for x in sh(sandbox4, h, f"cat {ran} 2>/dev/null").split()]
    assert sorted(numbers) == [1, 2, 3, 4], numbers
    h = json.loads(ok(cli("history", "--json", cwd=tmp_path, env=team)).stdout)
    assert len([e for e in h["events"] if e["kind"] == "trial" and e["job"].startswith(job)]) == 4


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_service_serves_the_dashboard(tmp_path, env, service):
    """A real `provision serve` answers the JSON API and the Cluster page on loopback; on
    another address it needs a token (401 without, 200 with)."""
    service.args = ("--listen", "127.0.0.1:0")
    service.start()
    base = re.search(r"Dashboard on (http://\S+/) \(loopback\)", service.output())
    assert base, service.output()
    code, body = _get(base.group(1) + "api/v1/jobs")
    assert code == 200 and json.loads(body)["jobs"] == []
    code, body = _get(base.group(1))
    assert code == 200 and b"<html" in body.lower()
    service.stop()

    made = ok(cli("serve", "token", "create", "--owner", "ann@example.com", cwd=tmp_path, env=env))
    token = made.stdout.strip()
    service.args = ("--listen", "0.0.0.0:0")
    service.start()
    port = re.search(r"Dashboard on http://0\.0\.0\.0:(\d+)/ \(token\)", service.output())
    assert port, service.output()
    url = f"http://127.0.0.1:{port.group(1)}/api/v1/jobs"
    assert _get(url)[0] == 401
    assert _get(url, "wrong")[0] == 401
    code, body = _get(url, token)
    assert code == 200 and json.loads(body)["jobs"] == []


def test_what_the_service_would_refuse_is_refused_at_submission(sandbox4, sandbox_inventory, tmp_path, env, job_name):
    """`--detach --rerun` of a job that never ran, and `tune --detach` of a study that has
    ended, are refused at once with the words the service's worker would have said later
    (it failed 3-40 s later, or said "done" without saying why)."""
    job, study = f"{job_name[:30]}-rr", f"{job_name[:30]}-end"
    inv = tmp_path / "rr.yaml"
    sandbox_inventory(
        sandbox4, job=job, path=inv, hosts=APPLY_HOSTS[:1],
        pools={"chief": {"replicas": 1, "command": ["/bin/sh", "-c", "sleep 1"]}},
    )  # fmt: skip
    r = cli("apply", "--queue", "--detach", "--rerun", inv, cwd=tmp_path, env=env)
    assert r.returncode == 1 and f"--rerun: job {job} has not finished" in r.stderr, r.stdout + r.stderr
    assert "Handed over" not in r.stdout
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    sinv = tmp_path / "end.yaml"
    sandbox_inventory(
        sandbox4, job=study, path=sinv, hosts=APPLY_HOSTS[:1],
        files=[{"src": "trainer.py", "dest": f"/opt/{study}/trainer.py"}],
        pools={"chief": {"replicas": 1, "command": ["python3", f"/opt/{study}/trainer.py", "--steps=2", "--step_seconds=0.1"]}},
        tune={"metric": {"name": "loss", "goal": "minimize"}, "algorithm": "random", "max_trials": 1,
              "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}}},
    )  # fmt: skip
    ok(cli("tune", sinv, cwd=tmp_path, env=env))  # run here, to its end
    r = cli("tune", "--detach", sinv, cwd=tmp_path, env=env)
    assert r.returncode == 1 and f"the study of job {study} has ended" in r.stderr, r.stdout + r.stderr
    db = Path(env["PROVISION_SERVICE_DB"])
    assert not db.exists() or "Handed over" not in r.stdout
