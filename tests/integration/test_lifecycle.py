"""The job's life on real systemd 252 hosts: restart policies as rendered, the end-of-job
stop and what status says about it, wait, no restart of a finished job, pushed files.

Each test drives the real `provision` command in a subprocess and checks the hosts
themselves through `docker exec` (the exit records, systemctl, the files).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clirun import cli, first_output, ok, rows, sh, status, wait_until

pytestmark = pytest.mark.integration

SERVE = ["/bin/sh", "-c", 'trap "echo bye; exit 0" TERM; echo up; while :; do sleep 1; done']


def exits(sb, host: str, job: str, task: str) -> list[list[str]]:
    out = sh(sb, host, f"cat /var/lib/provision/{job}/{task}.exits 2>/dev/null")
    return [line.split() for line in out.splitlines() if line.strip()]


# --------------------------------------------------------------------------- restarts


def test_worker_exit_3_on_failure_limit_2_restarts_twice_then_job_fails(sandbox3, sandbox_inventory, tmp_path):
    """OnFailure, limit 2: three tries, then the job is Failed; wait exits 1; status names
    the task and its code; the chief and the ps are stopped (ps first by rank: chief, then ps)."""
    inv = tmp_path / "inv.yaml"
    job = "lc-onfailure"
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        pools={
            "chief": {
                "replicas": 1,
                "command": ["/bin/sh", "-c", "echo chief up; exec sleep 120"],
                "hosts": ["host-1"],
            },
            "worker": {
                "replicas": 1,
                "hosts": ["host-2"],
                "restart": {"policy": "OnFailure", "limit": 2},
                "command": ["/bin/sh", "-c", "echo try; sleep 1; exit 3"],
            },
            "ps": {"replicas": 1, "command": SERVE, "hosts": ["host-3"]},
        },
    )
    t0 = time.monotonic()
    r = cli("apply", "-y", "--wait", "--timeout", "120", inv, cwd=tmp_path)
    took = time.monotonic() - t0
    assert r.returncode == 1, r.stdout + r.stderr
    assert "job Failed: worker-0 on host-2 failed: exit code 3, restart limit (2) reached" in r.stderr
    # systemd really ran it three times (1 + 2 restarts, RestartSec=2), not more.
    ex = exits(sandbox3, "host-2", job, "worker-0")
    assert [e[1:4] for e in ex] == [["exit-code", "exited", "3"]] * 3
    time.sleep(3)  # past RestartSec: systemd refuses a 4th start by itself
    assert len(exits(sandbox3, "host-2", job, "worker-0")) == 3
    props = sh(sandbox3, "host-2", f"systemctl show -p ActiveState,NRestarts provision-{job}-worker-0.service")
    assert "ActiveState=failed" in props
    assert took < 60

    w = cli("wait", inv, cwd=tmp_path)
    assert w.returncode == 1 and "worker-0 on host-2 failed: exit code 3" in w.stderr
    st = status(tmp_path, inv)
    assert st["phase"] == "Failed"
    assert st["reason"] == "worker-0 on host-2 failed: exit code 3, restart limit (2) reached"
    r_ = rows(st)
    assert (r_["worker-0"]["state"], r_["worker-0"]["exit_code"], r_["worker-0"]["restarts"]) == ("Failed", 3, 2)
    assert r_["chief-0"]["state"] == "Stopped"
    assert r_["chief-0"]["detail"] == "stopped by provision: job failed (killed by SIGTERM)"
    assert r_["ps-0"]["state"] == "Stopped"  # it caught SIGTERM and exited 0: still a stop
    assert r_["ps-0"]["detail"] == "stopped by provision: job failed (exited 0)"
    # Human output says the same.
    r = cli("status", inv, cwd=tmp_path)
    assert "Job lc-onfailure: Failed (worker-0 on host-2 failed: exit code 3, restart limit (2) reached)" in r.stdout
    # Stop order: chief (rank 1) before ps (rank 2).
    chief_end = float(exits(sandbox3, "host-1", job, "chief-0")[-1][0])
    ps_end = float(exits(sandbox3, "host-3", job, "ps-0")[-1][0])
    assert chief_end <= ps_end
    # A no-op apply does not restart the failed job; plan and apply say why, and how to
    # run it again, with the rule --rerun uses.
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    a = cli("apply", "-y", inv, cwd=tmp_path)
    assert a.returncode == 0 and "No changes: the job failed" in a.stdout and "apply --rerun" in a.stdout, a.stdout
    r = cli("apply", "-y", "--rerun", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0


def test_restart_policies_as_systemd_runs_them(sandbox3, sandbox_inventory, tmp_path):
    """ExitCode: 1-127 permanent, >=128 retried up to the limit; Always: even exit 0;
    Never: one try. Observed on the hosts before any provision command ends the job."""
    inv = tmp_path / "inv.yaml"
    job = "lc-policies"
    branch = (
        'case "$PROVISION_TASK" in worker-0) echo w0; exit 3;; worker-1) echo w1; exit 130;; '
        "evaluator-0) echo ev; exit 0;; ps-0) echo ps; exit 1;; esac"
    )
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        pools={
            "chief": {"replicas": 1, "command": ["/bin/sleep", "120"], "hosts": ["host-1"]},
            "worker": {
                "replicas": 2,
                "command": ["/bin/sh", "-c", branch],
                "hosts": ["host-2"],
                "restart": {"policy": "ExitCode", "limit": 2},
            },
            "ps": {
                "replicas": 1,
                "command": ["/bin/sh", "-c", branch],
                "hosts": ["host-3"],
                "restart": {"policy": "Never"},
            },
            # Not beside ps-0: apply starts no later phase on a host where a task did not start.
            "evaluator": {
                "replicas": 1,
                "command": ["/bin/sh", "-c", branch],
                "hosts": ["host-1"],
                "restart": {"policy": "Always", "limit": 1},
            },
        },
    )
    r = cli("apply", "-y", inv, cwd=tmp_path)
    # ps-0 exits at once: apply may report it did not start; that is not what is tested here.
    assert r.returncode in (0, 1), r.stdout + r.stderr

    def settled():
        got = {
            "worker-0": exits(sandbox3, "host-2", job, "worker-0"),
            "worker-1": exits(sandbox3, "host-2", job, "worker-1"),
            "ps-0": exits(sandbox3, "host-3", job, "ps-0"),
            "evaluator-0": exits(sandbox3, "host-1", job, "evaluator-0"),
        }
        return got if len(got["worker-1"]) >= 3 and len(got["evaluator-0"]) >= 2 else None

    got = wait_until(settled, 60, what="worker-1 and evaluator-0 to use their restarts")
    time.sleep(3)  # one RestartSec more: nothing else may start
    got = settled()
    assert [e[3] for e in got["worker-0"]] == ["3"]  # permanent: never retried
    assert [e[3] for e in got["worker-1"]] == ["130"] * 3  # retried twice
    assert [e[3] for e in got["ps-0"]] == ["1"]  # Never
    assert [e[3] for e in got["evaluator-0"]] == ["0", "0"]  # Always: restarted after exit 0, limit 1
    for task, host in (("worker-0", "host-2"), ("worker-1", "host-2"), ("ps-0", "host-3"), ("evaluator-0", "host-1")):
        props = sh(sandbox3, host, f"systemctl show -p ActiveState provision-{job}-{task}.service")
        assert "ActiveState=failed" in props or "ActiveState=inactive" in props, (task, props)

    st = status(tmp_path, inv)
    r_ = rows(st)
    assert st["phase"] == "Failed"
    assert (r_["worker-0"]["state"], r_["worker-0"]["exit_code"], r_["worker-0"]["restarts"]) == ("Failed", 3, 0)
    assert (r_["worker-1"]["state"], r_["worker-1"]["exit_code"], r_["worker-1"]["restarts"]) == ("Failed", 130, 2)
    assert "restart limit (2) reached" in r_["worker-1"]["detail"]
    assert (r_["ps-0"]["state"], r_["ps-0"]["exit_code"]) == ("Failed", 1)
    assert r_["chief-0"]["state"] == "Stopped"
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0


# --------------------------------------------------------------------------- success, wait


def test_success_stops_long_lived_tasks_and_no_op_apply_keeps_the_job_finished(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    job = "lc-success"
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        pools={
            "reduction_server": {"replicas": 1, "command": SERVE, "hosts": ["host-3"]},
            "chief": {
                "replicas": 1,
                "command": ["/bin/sh", "-c", "echo training; sleep 6; echo done"],
                "hosts": ["host-1"],
            },
            "worker": {"replicas": 1, "command": SERVE, "hosts": ["host-2"]},  # serves until stopped
            "evaluator": {"replicas": 1, "command": ["/bin/sleep", "600"], "hosts": ["host-3"]},
        },
    )
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    w = cli("wait", "--timeout", "1", inv, cwd=tmp_path)  # still running: a timeout's own exit code
    assert w.returncode == 124 and "timed out after 1s; the job is still Running" in w.stderr
    w = cli("wait", "--timeout", "60", inv, cwd=tmp_path)
    assert w.returncode == 0, w.stderr
    assert "job Succeeded: chief-0 exited 0" in w.stderr
    st = status(tmp_path, inv)
    r_ = rows(st)
    assert st["phase"] == "Succeeded"
    assert r_["chief-0"]["state"] == "Succeeded"
    for t in ("worker-0", "reduction_server-0", "evaluator-0"):
        assert r_[t]["state"] == "Stopped", r_[t]
        assert r_[t]["detail"].startswith("stopped by provision: job succeeded"), r_[t]
    # Stop order: evaluator, then workers, then reduction servers.
    ends = {
        t: float(exits(sandbox3, h, job, t)[-1][0])
        for t, h in (("evaluator-0", "host-3"), ("worker-0", "host-2"), ("reduction_server-0", "host-3"))
    }
    assert ends["evaluator-0"] <= ends["worker-0"] <= ends["reduction_server-0"]
    before = {h: sh(sandbox3, h, f"cat /var/lib/provision/{job}/*.exits") for h in ("host-1", "host-2", "host-3")}
    # A no-op apply does not start the finished job again.
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    a = cli("apply", "-y", inv, cwd=tmp_path)
    assert a.returncode == 0 and "No changes: the job succeeded" in a.stdout, a.stdout + a.stderr
    assert "provision apply --rerun" in a.stdout  # how to run it again
    time.sleep(1)  # the behaviour under test: nothing starts during it
    for h in before:
        assert sh(sandbox3, h, f"cat /var/lib/provision/{job}/*.exits") == before[h]
        assert "ActiveState=active" not in sh(sandbox3, h, f"systemctl show -p ActiveState 'provision-{job}-*'")
    assert status(tmp_path, inv)["phase"] == "Succeeded"
    # `apply --wait` on the finished job: nothing to do, and the outcome at once.
    a = cli("apply", "-y", "--wait", inv, cwd=tmp_path)
    assert a.returncode == 0 and "job Succeeded" in a.stderr
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0


def test_wait_on_a_job_never_applied_is_one_line(sandbox3, sandbox_inventory, tmp_path):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3, job="lc-never-applied", path=inv, pools={"chief": {"replicas": 1, "command": ["/bin/true"]}}
    )
    w = cli("wait", inv, cwd=tmp_path, timeout=60)
    assert w.returncode == 1
    assert w.stderr.strip().splitlines()[-1] == (
        f"Error: job lc-never-applied is not on its hosts: run `provision apply {inv}` first"
    )
    assert "Traceback" not in w.stderr


# --------------------------------------------------------------------------- files


def test_files_sent_once_by_hash_and_changed_code_restarts_tasks(sandbox3, sandbox_inventory, tmp_path):
    job = "lc-files"
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "train.py").write_text("print('v1')\n")
    (code / "pkg" / "data.txt").write_text("data\n")
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        pools={
            "chief": {
                "replicas": 1,
                "hosts": ["host-1"],
                "command": ["/bin/sh", "-c", "python3 /opt/lc-files/train.py; exec sleep 600"],
            },
            "worker": {
                "replicas": 1,
                "hosts": ["host-2"],
                "command": ["/bin/sh", "-c", "python3 /opt/lc-files/train.py; exec sleep 600"],
            },
        },
        files=[{"src": str(code) + "/", "dest": "/opt/lc-files/"}],
    )
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for h in ("host-1", "host-2"):
        assert sh(sandbox3, h, "cat /opt/lc-files/train.py /opt/lc-files/pkg/data.txt") == "print('v1')\ndata\n"
    assert sh(sandbox3, "host-3", "ls /opt/lc-files 2>&1").startswith("ls: cannot access")  # no task there
    stamp = lambda h: sh(sandbox3, h, "stat -c '%i %Y %y' /opt/lc-files/train.py /opt/lc-files/pkg/data.txt")
    inv_id = lambda h, t: sh(sandbox3, h, f"systemctl show -p InvocationID --value provision-{job}-{t}.service").strip()
    for h in ("host-1", "host-2"):  # an mtime of 2001: a rewrite would show in it
        sh(sandbox3, h, "touch -m -d @1000000000 /opt/lc-files/train.py /opt/lc-files/pkg/data.txt", check=True)
    before = {h: stamp(h) for h in ("host-1", "host-2")}
    assert [before[h].count(" 1000000000 ") for h in before] == [2, 2], before  # both files, both hosts
    ids = {"chief-0": inv_id("host-1", "chief-0"), "worker-0": inv_id("host-2", "worker-0")}
    # Unchanged: plan compares sha256, nothing is sent, nothing restarts.
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    a = cli("apply", "-y", inv, cwd=tmp_path)
    assert a.returncode == 0 and "No changes." in a.stdout
    assert {h: stamp(h) for h in before} == before
    assert ids == {"chief-0": inv_id("host-1", "chief-0"), "worker-0": inv_id("host-2", "worker-0")}
    # Touching the file without changing it sends nothing either (content hash, not mtime).
    os.utime(code / "train.py", None)
    assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
    # Changed code: that file is updated, the tasks using it restart, the other file stays.
    (code / "train.py").write_text("print('v2')\n")
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "~ file /opt/lc-files/train.py (content changed)" in p.stdout
    assert "/opt/lc-files/pkg/data.txt" not in p.stdout
    assert "task chief-0: restart" in p.stdout and "task worker-0: restart" in p.stdout
    a = cli("apply", "-y", inv, cwd=tmp_path)
    assert a.returncode == 0, a.stdout + a.stderr
    for h, t in (("host-1", "chief-0"), ("host-2", "worker-0")):
        assert sh(sandbox3, h, "cat /opt/lc-files/train.py") == "print('v2')\n"
        assert inv_id(h, t) != ids[t]
        after = stamp(h).splitlines()
        assert after[1] == before[h].splitlines()[1]  # data.txt untouched
    lines = wait_until(
        lambda: [l for l in cli("logs", inv, "chief-0", cwd=tmp_path).stdout.splitlines() if "| v" in l],
        30,
        what="the chief's output",
    )
    assert lines[-1].endswith("| v2")
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0
    for h in ("host-1", "host-2"):
        assert sh(sandbox3, h, "ls -d /opt/lc-files 2>&1").startswith("ls: cannot access")


def test_apply_after_ctrl_c_during_setup_waits_for_it_and_succeeds(sandbox3, sandbox_inventory, tmp_path):
    """item 12: Ctrl-C while the setup ran; the next apply waited for the setup,
    then failed with `/var/lib/provision/JOB/setup.key: No such file or directory` (the
    interrupted apply's agent, still waiting on the host, wrote the key through the same
    temp file at the same moment); only the apply after it succeeded."""
    inv = tmp_path / "inv.yaml"
    job = "lc-setupint"
    sandbox_inventory(
        sandbox3,
        job=job,
        path=inv,
        pools={"chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "exec sleep 600"]}},
        setup={"commands": ["sleep 15"]},
    )
    try:
        for _ in range(2):  # the race is on one moment: twice makes a pass mean something
            cli("destroy", "-y", inv, cwd=tmp_path)
            p = subprocess.Popen(
                [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "PROVISION_SETUP_TICK": "1"},
            )
            seen = first_output(p)
            deadline = time.monotonic() + 120
            while "setup running" not in seen and time.monotonic() < deadline:
                seen += first_output(p)
            assert "setup running" in seen, seen
            p.send_signal(signal.SIGINT)
            out, err = p.communicate(timeout=30)
            assert p.returncode == 130, (p.returncode, seen, out, err)
            r = cli("apply", "-y", inv, cwd=tmp_path)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "No such file or directory" not in r.stderr
            assert sh(sandbox3, "host-1", f"cat /var/lib/provision/{job}/setup.key").strip()
            assert status(tmp_path, inv)["phase"] == "Running"
            assert "No changes" in ok(cli("apply", "-y", inv, cwd=tmp_path)).stdout  # the setup does not run again
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
