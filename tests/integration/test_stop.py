"""`provision stop` on sandbox hosts: the job's tasks end in reverse start order (SIGTERM,
then SIGKILL after the pool's grace_period), files, logs and state stay, the GPUs and
ports are freed or (--hold) kept, no apply or boot starts it again, and `apply --rerun`
does. Also: a wait that gives up (--timeout, Ctrl-C) says the job still runs and what to
do about it, with its own exit code."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from clirun import cli, first_output, ok, rows, sh, status, wait_until
from provision.core.errors import EXIT_TIMEOUT

pytestmark = pytest.mark.integration

# Each task notes when SIGTERM reached it (the hosts share this machine's clock), then exits.
TERM_NOTE = "trap 'echo \"$PROVISION_TASK got TERM at $(date +%s.%N)\"; exit 0' TERM; "
SERVE = TERM_NOTE + 'echo "$PROVISION_TASK started"; while :; do sleep 0.2; done'


def _inventory(sandbox_inventory, sb, inv, job):
    sandbox_inventory(
        sb,
        job=job,
        path=inv,
        files=[{"src": "note.txt", "dest": f"/opt/{job}/note.txt"}],
        pools={
            "ps": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", SERVE]},
            # Ignores SIGTERM: ended by SIGKILL once its 2 s grace period is over.
            "chief": {
                "replicas": 1,
                "hosts": ["host-2"],
                "grace_period": 2,
                "command": ["/bin/sh", "-c", "trap '' TERM; echo \"$PROVISION_TASK started\"; exec sleep 600"],
            },
            "worker": {"replicas": 1, "hosts": ["host-3"], "command": ["/bin/sh", "-c", SERVE]},
        },
    )


def _running(tmp, inv):
    def running() -> bool:
        st = status(tmp, inv)  # one `status` a look (a CLI process and SSH: about a second)
        return st["phase"] == "Running" and all(t["state"] == "Running" for t in st["tasks"])

    return wait_until(running, timeout=60, what="every task running")


def _held_ports(tmp, inv, job) -> dict[str, list[int]]:
    j = json.loads(ok(cli("jobs", "--json", inv, cwd=tmp)).stdout)
    return {h: v["held"][job]["ports"] for h, v in j["hosts"].items() if job in v["held"]}


def test_stop_keeps_files_and_logs_and_rerun_starts_again(sandbox3, sandbox_inventory, tmp_path):
    job, inv = "stop-rerun", tmp_path / "inv.yaml"
    (tmp_path / "note.txt").write_text("kept\n")
    _inventory(sandbox_inventory, sandbox3, inv, job)
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        _running(tmp_path, inv)
        assert set(_held_ports(tmp_path, inv, job)) == {"host-1", "host-2", "host-3"}

        began = time.monotonic()
        r = ok(cli("stop", "-y", "--json", inv, cwd=tmp_path))
        took = time.monotonic() - began
        out = json.loads(r.stdout)
        # Chief and workers first (the chief after its grace period), ps last.
        assert out["stopped"][-1] == "ps-0" and sorted(out["stopped"]) == ["chief-0", "ps-0", "worker-0"], out
        assert out["status"]["phase"] == "Stopped" and out["held"] is False, out
        assert 2 <= took < 60, took

        st = status(tmp_path, inv)
        assert st["phase"] == "Stopped" and "(provision stop)" in st["reason"], st
        tasks = rows(st)
        assert {t["state"] for t in tasks.values()} == {"Stopped"}, tasks
        assert "killed by SIGKILL" in tasks["chief-0"]["detail"], tasks["chief-0"]
        assert "exited 0" in tasks["ps-0"]["detail"], tasks["ps-0"]

        # The order, as the tasks saw it: ps got SIGTERM after the worker had.
        logs = ok(cli("logs", inv, cwd=tmp_path)).stdout
        term = {
            l.split(" got TERM at ")[0].split()[-1]: float(l.split(" got TERM at ")[1])
            for l in logs.splitlines()
            if " got TERM at " in l
        }
        assert set(term) == {"ps-0", "worker-0"} and term["worker-0"] < term["ps-0"], logs
        assert "chief-0 started" in logs  # logs stay

        # Files and state stay; the ports are free for other jobs.
        sh(sandbox3, "host-1", f"grep -q kept /opt/{job}/note.txt", check=True)
        assert _held_ports(tmp_path, inv, job) == {}

        # Plan and apply say the job was stopped and start nothing; a second stop has nothing to do.
        p = ok(cli("plan", inv, cwd=tmp_path))
        assert "No changes: the job was stopped (provision stop)" in p.stdout and "--rerun" in p.stdout, p.stdout
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert status(tmp_path, inv)["phase"] == "Stopped"
        again = ok(cli("stop", "-y", inv, cwd=tmp_path))
        assert "Nothing to stop: job Stopped" in again.stdout, again.stdout
        w = cli("wait", inv, cwd=tmp_path)
        assert w.returncode == 1 and "job Stopped" in w.stderr, w.stderr

        # Another operator's state may not stop it.
        ok(cli("apply", "-y", "--rerun", inv, cwd=tmp_path))
        _running(tmp_path, inv)

        # Runs: the rerun is run 2; logs mark where each run begins and
        # show one run on request.
        assert status(tmp_path, inv)["run"]["number"] == 2
        assert "Run 2, started " in ok(cli("status", inv, cwd=tmp_path)).stdout
        wait_until(lambda: ok(cli("logs", inv, cwd=tmp_path)).stdout.count("ps-0 started") == 2, what="run 2's lines")
        logs = ok(cli("logs", inv, cwd=tmp_path)).stdout.splitlines()
        marks = [l for l in logs if l.startswith("── run ")]
        assert [m.split(",")[0] for m in marks] == ["── run 1", "── run 2"], logs
        assert logs.index(marks[1]) > max(i for i, l in enumerate(logs) if "got TERM" in l), logs
        one = ok(cli("logs", "--run", "1", inv, cwd=tmp_path)).stdout
        assert "── run 1" in one and "got TERM" in one and "── run 2" not in one, one
        assert ok(cli("logs", "--previous", inv, cwd=tmp_path)).stdout == one
        two = ok(cli("logs", "--run", "2", inv, cwd=tmp_path)).stdout
        assert "── run 2" in two and "got TERM" not in two and two.count("ps-0 started") == 1, two
        bad = cli("logs", "--run", "7", inv, cwd=tmp_path)
        assert bad.returncode == 1 and "no such run; the job's runs are 1, 2" in bad.stderr, bad.stderr
        other = cli("stop", "-y", "--state", tmp_path / "other.state.json", inv, cwd=tmp_path)
        assert other.returncode == 1 and "--take-over" in other.stderr, other.stderr
        assert status(tmp_path, inv)["phase"] == "Running"

        # --hold: the ports stay held by the stopped job, until its rerun runs it again.
        before = _held_ports(tmp_path, inv, job)
        h = ok(cli("stop", "-y", "--hold", inv, cwd=tmp_path))
        assert "Stopped 3 tasks." in h.stdout and "its GPUs and ports stay held" in h.stdout, h.stdout
        assert _held_ports(tmp_path, inv, job) == before
        jobs = json.loads(ok(cli("jobs", "--json", inv, cwd=tmp_path)).stdout)
        assert next(j for j in jobs["jobs"] if j["job"] == job)["state"] == "held", jobs
        ok(cli("apply", "-y", "--rerun", inv, cwd=tmp_path))
        _running(tmp_path, inv)
        ok(cli("stop", "-y", inv, cwd=tmp_path))
        assert _held_ports(tmp_path, inv, job) == {}  # the rerun's stop frees them: the hold is gone
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_wait_that_gives_up_says_the_job_still_runs(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="stop-wait",
        path=inv,
        pools={"chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "echo up; exec sleep 600"]}},
    )
    hint = [f"`provision {c} {inv}`" for c in ("wait", "logs -f", "stop", "destroy")]
    try:
        r = cli("apply", "-y", "--wait", "--timeout", "3", inv, cwd=tmp_path)
        assert r.returncode == EXIT_TIMEOUT == 124, r.stderr
        assert "timed out after 3s" in r.stderr and all(h in r.stderr for h in hint), r.stderr
        r = cli("wait", "--timeout", "1", "--logs", inv, cwd=tmp_path)
        assert r.returncode == EXIT_TIMEOUT and all(h in r.stderr for h in hint), r.stderr

        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "wait", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        first_output(p)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130 and all(h in err for h in hint), err
        assert status(tmp_path, inv)["phase"] == "Running"
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_stopped_job_whose_inputs_changed_stays_stopped_and_rerun_starts_it(sandbox3, sandbox_inventory, tmp_path):
    """item 13: a stopped job whose inputs changed: `apply --rerun` refused ("has
    not finished") while `status` said Stopped, and a plain `apply` restarted it. One rule
    now: a finished job stays finished; apply writes the change and starts nothing; --rerun
    starts it again, with the change."""
    job, inv = "stop-changed", tmp_path / "inv.yaml"
    (tmp_path / "note.txt").write_text("kept\n")
    _inventory(sandbox_inventory, sandbox3, inv, job)
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        _running(tmp_path, inv)
        ok(cli("stop", "-y", inv, cwd=tmp_path))
        assert status(tmp_path, inv)["phase"] == "Stopped"
        (tmp_path / "note.txt").write_text("changed\n")  # every task's inputs change
        p = json.loads(ok(cli("plan", "--json", inv, cwd=tmp_path)).stdout)
        acts = {t["task"]: t["action"] for h in p["hosts"].values() for t in h["tasks"]}
        assert set(acts.values()) == {"none"}, acts
        assert p["finished"] == "the job was stopped (provision stop)" and p["changes"], p
        r = ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert "these changes are written and nothing starts" in r.stdout and "--rerun" in r.stdout, r.stdout
        st = status(tmp_path, inv)
        assert st["phase"] == "Stopped" and {t["state"] for t in st["tasks"]} == {"Stopped"}, st
        sh(sandbox3, "host-1", f"grep -q changed /opt/{job}/note.txt", check=True)
        # Changed again, then --rerun: accepted (the job has finished), and it runs with it.
        (tmp_path / "note.txt").write_text("changed again\n")
        ok(cli("apply", "-y", "--rerun", inv, cwd=tmp_path))
        _running(tmp_path, inv)
        sh(sandbox3, "host-1", f"grep -q 'changed again' /opt/{job}/note.txt", check=True)
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
