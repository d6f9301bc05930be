"""The event stream on sandbox hosts with a real `provision serve`: every way a job ends
(run from a terminal and succeeding, failing or destroyed; handed over; a trial; its
study) yields exactly one ended event with how it ended, read through /api/v1/events and
`provision events`; a kill -9 of the service between a job's end and the round that sees it
loses none and doubles none; the history writer (the stream's first subscriber) records the
terminal jobs' runs once each.

Preemption's events (job.preempted, job.ended preempted, job.resumed) are checked where a
preempted job is resumed by the service (test_preempt.py)."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from clirun import cli, ok, wait_until

from .servehelp import APPLY_HOSTS, STUDY_HOSTS, TRAINER, Service, service_env, show_logs

pytestmark = pytest.mark.integration


def _url(service: Service) -> str:
    m = re.search(r"Dashboard on (http://[^ ]+/)", service.output())
    assert m, service.output()
    return m.group(1)


def _events(service: Service) -> list[dict[str, Any]]:
    """Every event so far, through the API (reading them keeps the rounds at 10 s)."""
    out: list[dict[str, Any]] = []
    after = 0
    while True:
        with urllib.request.urlopen(f"{_url(service)}api/v1/events?after={after}", timeout=30) as r:
            doc = json.loads(r.read())
        out += doc["events"]
        if not doc["events"]:
            return out
        after = doc["after"]


def _ended(service: Service, job: str) -> list[dict[str, Any]]:
    return [e for e in _events(service) if e["job"] == job and e["kind"] in ("job.ended", "trial.ended")]


def _watching(env: dict[str, str], hosts: list[str]) -> None:
    """Until the service's rounds watch `hosts` (what a host runs when its watch begins is
    where the watch begins: no event)."""
    import sqlite3

    def seen() -> bool:
        with sqlite3.connect(env["PROVISION_SERVICE_DB"]) as db:
            row = db.execute("SELECT doc FROM provision_service_seen WHERE name = 'rounds'").fetchone()
        return row is not None and set(hosts) <= set(json.loads(row[0])["hosts"])

    wait_until(seen, 60, 0.5, what=f"the rounds to watch {hosts}")


def _job(sb, sandbox_inventory, tmp_path: Path, name: str, command: str, hosts: list[str]) -> Path:
    inv = tmp_path / f"{name}.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", command]}}
    sandbox_inventory(sb, job=name, path=inv, hosts=hosts, pools=pools)
    return inv


def test_every_way_a_job_ends_is_one_ended_event(sandbox4, sandbox_inventory, tmp_path, job_name):
    env = service_env(tmp_path)
    ok_, bad, gone, k9 = (f"{job_name[:30]}-{x}" for x in ("ok", "bad", "gone", "k9"))
    invs = {
        ok_: _job(sandbox4, sandbox_inventory, tmp_path, ok_, "sleep 4", APPLY_HOSTS[:1]),
        bad: _job(sandbox4, sandbox_inventory, tmp_path, bad, "sleep 4; exit 3", APPLY_HOSTS[1:]),
        gone: _job(sandbox4, sandbox_inventory, tmp_path, gone, "sleep 600", APPLY_HOSTS[:1]),
        k9: _job(sandbox4, sandbox_inventory, tmp_path, k9, "sleep 12", APPLY_HOSTS[1:]),
    }
    args = ("--listen", "127.0.0.1:0", *(a for p in invs.values() for a in ("--inventory", str(p))))
    service = Service(tmp_path / "svc", env, args)
    service.start()
    try:
        _watching(env, APPLY_HOSTS)
        for name in (ok_, bad, gone):
            ok(cli("apply", "-y", invs[name], cwd=tmp_path, env=env))
        wait_until(
            lambda: len(_ended(service, ok_)) == 1 and len(_ended(service, bad)) == 1, 120, 1, what="the two ends"
        )
        started = [e for e in _events(service) if e["kind"] == "job.started" and e["job"] in (ok_, bad, gone)]
        wait_until(
            lambda: any(e["kind"] == "job.started" and e["job"] == gone for e in _events(service)),
            60,
            1,
            what="the long job's start",
        )
        ok(cli("destroy", "-y", invs[gone], cwd=tmp_path, env=env))
        wait_until(lambda: len(_ended(service, gone)) == 1, 60, 1, what="the destroyed job's end")

        # kill -9 of the service while the job ends: the next service's first round sees it.
        ok(cli("apply", "-y", invs[k9], cwd=tmp_path, env=env))
        wait_until(
            lambda: any(e["kind"] == "job.started" and e["job"] == k9 for e in _events(service)),
            60,
            1,
            what="k9's start",
        )
        service.kill9()
        wait_until(
            lambda: json.loads(cli("status", "--json", invs[k9], cwd=tmp_path, env=env).stdout)["phase"] == "Succeeded",
            60,
            1,
            what="k9 to end while no service runs",
        )
        service.start()
        wait_until(lambda: len(_ended(service, k9)) == 1, 90, 1, what="k9's end after the restart")
        service.kill9()  # ... and again right after: nothing is made twice
        service.start()
        wait_until(lambda: len(_events(service)) > 0, 30, 1, what="the events")

        events = _events(service)
        how = {e["job"]: e["how"] for e in events if e["kind"] == "job.ended"}
        assert how == {ok_: "succeeded", bad: "failed", gone: "destroyed", k9: "succeeded"}, events
        for name in invs:
            ends = [e for e in events if e["job"] == name and e["kind"] == "job.ended"]
            assert len(ends) == 1, (name, ends)
        assert len(started) >= 2 and {e["job"] for e in events if e["kind"] == "job.started"} == set(invs)
        failed = [e for e in events if e["kind"] == "task.failed" and e["job"] == bad]
        assert len(failed) == 1 and "exit code 3" in failed[0]["words"] and failed[0]["host"] == APPLY_HOSTS[1], failed
        assert len({e["id"] for e in events}) == len(events)
        bad_end = next(e for e in events if e["job"] == bad and e["kind"] == "job.ended")
        assert (
            bad_end["owner"] == env["PROVISION_OWNER"] and bad_end["hosts"] == [APPLY_HOSTS[1]] and bad_end["gpus"] == 1
        )

        # The CLI reads the same stream; the history writer recorded each terminal run once.
        text = ok(cli("events", "--job", bad, cwd=tmp_path, env=env)).stdout
        assert "job.ended" in text and "failed" in text and "task.failed" in text, text
        doc = json.loads(ok(cli("events", "--json", "--kind", "job.ended", cwd=tmp_path, env=env)).stdout)
        assert sorted(e["job"] for e in doc["events"]) == sorted(invs)

        def runs() -> list[dict[str, Any]]:
            h = json.loads(ok(cli("history", "--json", cwd=tmp_path, env=env)).stdout)
            return [e for e in h["events"] if e["kind"] == "run" and e["job"] in invs]

        wait_until(lambda: len(runs()) == 4 and all(r["ended"] for r in runs()), 30, 1, what="the runs in the history")
        assert sorted(r["job"] for r in runs()) == sorted(invs)
    finally:
        service.stop()
        for p in invs.values():
            cli("destroy", "-y", p, cwd=tmp_path, env=env)
        show_logs(tmp_path)


def test_a_handed_over_apply_and_a_study_end_once_each(sandbox4, sandbox_inventory, tmp_path, job_name):
    env = service_env(tmp_path)
    apply_job, study = f"{job_name[:28]}-ap", f"{job_name[:28]}-st"
    inv = _job(sandbox4, sandbox_inventory, tmp_path, apply_job, "sleep 3", APPLY_HOSTS)  # runs on one of the two
    shutil.copy(TRAINER, tmp_path / "trainer.py")
    sinv = tmp_path / "study.yaml"
    sandbox_inventory(
        sandbox4,
        job=study,
        path=sinv,
        hosts=STUDY_HOSTS,
        files=[{"src": "trainer.py", "dest": f"/opt/{study}/trainer.py"}],
        pools={
            "chief": {
                "replicas": 1,
                "accelerators": 1,
                "command": ["python3", f"/opt/{study}/trainer.py", "--steps=4", "--step_seconds=0.3"],
            }
        },
        tune={
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"quality": {"type": "double", "min": 0.1, "max": 2.0}},
            "algorithm": "random",
            "max_trials": 3,
            "parallel_trials": 2,
        },
    )
    service = Service(tmp_path / "svc", env, ("--listen", "127.0.0.1:0"))
    service.start()
    try:
        ok(cli("apply", "--queue", "--detach", inv, cwd=tmp_path, env=env))
        ok(cli("tune", "--detach", "--poll", "0.3", sinv, cwd=tmp_path, env=env))

        def kinds() -> list[str]:
            return [e["kind"] for e in _events(service)]

        wait_until(lambda: kinds().count("submission.ended") == 2, 240, 1, what="both submissions' ends")
        wait_until(
            lambda: any(e["kind"] == "job.ended" and e["job"] == apply_job for e in _events(service)),
            90,
            1,
            what="the applied job's end",
        )
        events = _events(service)
        trials = [e for e in events if e["kind"] == "trial.ended"]
        assert sorted(e["job"] for e in trials) == [f"{study}-t{n}" for n in (1, 2, 3)], events
        assert all(e["how"] == "succeeded" and e["host"] in STUDY_HOSTS for e in trials), trials
        assert [e["how"] for e in events if e["kind"] == "study.ended"] == ["succeeded"]
        assert [e["how"] for e in events if e["job"] == apply_job and e["kind"] == "job.ended"] == ["succeeded"]
        assert not [
            e for e in events if e["kind"] == "job.ended" and e["job"].startswith(f"{study}-t")
        ]  # trials: trial.ended only
        # The history names the hosts each run used, not every host its inventory lists.
        h = json.loads(ok(cli("history", "--json", cwd=tmp_path, env=env)).stdout)["events"]
        run = next(e for e in h if e["kind"] == "run" and e["job"] == apply_job)
        assert len(run["hosts"]) == 1 and run["hosts"][0] in APPLY_HOSTS, run
        trial_rows = [e for e in h if e["kind"] == "trial"]
        assert len(trial_rows) == 3 and all(len(e["hosts"]) == 1 for e in trial_rows), trial_rows
    finally:
        service.stop()
        cli("destroy", "-y", inv, cwd=tmp_path, env=env)
        show_logs(tmp_path)
