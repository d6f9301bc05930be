"""Hosts that reboot, for real: `docker restart` of a sandbox host is a systemd shutdown and
boot (sandbox.reboot). The job's tasks come back by themselves under their pool's restart
policy, status names the reboot, a finished job stays finished; the sandbox host keeps its
SSH port and host key.

Each test drives the real `provision` command in a subprocess and checks the hosts
themselves through `docker exec`.
"""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from clirun import cli, rows, sh, status, unit_props, wait_until
from provision import sandbox
from provision.host import layout

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


def exits(sb, host: str, job: str, task: str) -> list[list[str]]:
    return layout.parse_exits(sh(sb, host, f"cat {layout.exits_path(job, task)} 2>/dev/null"))


def boot_of(sb, host: str) -> str:
    """The host's boot as the unit's gate names it (sh); the agent's (layout.boot_id) agrees."""
    got = sh(sb, host, f'{layout.BOOT_ID_SH}; echo "$b"').strip()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(layout.__file__, arcname="provision-test-layout/layout.py")
    sb.container(host).put_archive("/var/tmp", buf.getvalue())  # /tmp is a tmpfs
    agent = sh(sb, host, "cd /var/tmp/provision-test-layout && python3 -S -c 'import layout; print(layout.boot_id())'")
    assert agent.strip() == got and got.count(".") == 1, (agent, got)
    return got


def apply(tmp: Path, inv: Path, *extra: str) -> subprocess.CompletedProcess:
    r = cli("apply", "-y", *extra, inv, cwd=tmp)
    return r


@pytest.fixture
def job(sandbox3, sandbox_inventory, job_name, tmp_path):
    """Writes the test's inventory on sandbox3; the job is destroyed afterwards, so the next
    test's reboots start nothing of it."""
    inv = tmp_path / "inv.yaml"

    def make(pools: dict) -> Path:
        sandbox_inventory(sandbox3, job=job_name, pools=pools, path=inv)
        return inv

    yield make
    if inv.exists():
        cli("destroy", "-y", inv, cwd=tmp_path)


# --------------------------------------------------------------------------- the sandbox


def test_sandbox_reboot_keeps_the_ssh_port_and_the_host_key(sandbox3, tmp_path):
    """`provision sandbox reboot NAME HOST`: a new boot of the host (PID 1 started again),
    at the same published port, with the same host key (the sandbox's known_hosts still
    matches: the connection below refuses any other key), systemd running."""
    h = sandbox3.host("host-3")
    port, boot = h.ssh_port, boot_of(sandbox3, "host-3")
    known = sandbox3.known_hosts_path.read_text()
    binding = sandbox3.container("host-3").attrs["HostConfig"]["PortBindings"]["22/tcp"][0]
    assert binding == {"HostIp": "127.0.0.1", "HostPort": str(port)}, "a fixed port, not one Docker picks"

    r = cli("sandbox", "reboot", sandbox3.name, "host-3", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"host-3 rebooted, back at 127.0.0.1:{port}" in r.stdout

    assert boot_of(sandbox3, "host-3") != boot
    c = sandbox3.container("host-3")
    assert c.ports["22/tcp"][0]["HostPort"] == str(port)
    assert sandbox.load(sandbox3.name).host("host-3").ssh_port == port
    assert sandbox3.known_hosts_path.read_text() == known
    with sandbox3.connection("host-3") as conn:
        assert conn.run("systemctl is-system-running", hide=True, warn=True).stdout.strip() == "running"

    # The Python function, by number; a host that is not there is one clear line.
    assert sandbox.reboot(sandbox3.name, 3).ssh_port == port
    r = cli("sandbox", "reboot", sandbox3.name, "host-9", cwd=tmp_path)
    assert r.returncode != 0 and "has no host 'host-9'" in r.stderr


# --------------------------------------------------------------------------- the job


def test_on_failure_worker_comes_back_after_its_host_reboots(sandbox3, job, tmp_path):
    """The issue's first case: chief on host-1, worker (OnFailure, limit 3) on host-2; host-2
    restarts. The worker is back within 30 s of the host answering, by itself; status says
    the host rebooted and counts one restart; the job is Running, not Pending; a plan then
    has nothing to do."""
    inv = job(
        {
            "chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]},
            "worker": {
                "replicas": 1,
                "command": LONG,
                "hosts": ["host-2"],
                "restart": {"policy": "OnFailure", "limit": 3},
            },
        }
    )
    r = apply(tmp_path, inv)
    assert r.returncode == 0, r.stdout + r.stderr
    name = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)["job"]
    assert sh(sandbox3, "host-2", f"readlink {layout.wants_link(name)}").strip() == layout.target_path(name)

    sandbox.reboot(sandbox3.name, "host-2")
    answered = time.monotonic()

    def back():
        w = rows(status(tmp_path, inv))["worker-0"]
        return w if w["state"] == "Running" and w["restarts"] == 1 else None

    w = wait_until(back, timeout=30, what="the worker back after the reboot")
    assert time.monotonic() - answered < 30
    assert w["detail"].startswith("running; host rebooted at ")
    st = status(tmp_path, inv)
    assert st["phase"] == "Running"
    assert rows(st)["chief-0"]["state"] == "Running" and rows(st)["chief-0"]["restarts"] == 0
    # On the host: the shutdown's record, and a process that runs again.
    assert [e[1:] for e in exits(sandbox3, "host-2", name, "worker-0")] == [["success", "killed", "TERM", "reboot"]]
    assert unit_props(sandbox3, "host-2", name, "worker-0")["ActiveState"] == "active"
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr

    # A second reboot is a second restart (the count survives the boots).
    sandbox.reboot(sandbox3.name, "host-2")
    w = wait_until(
        lambda: (x := rows(status(tmp_path, inv))["worker-0"])["restarts"] == 2 and x["state"] == "Running" and x,
        timeout=30,
        what="the second restart",
    )
    assert "host rebooted at" in w["detail"]


def test_never_chief_is_failed_host_rebooted(sandbox3, job, tmp_path):
    """The issue's second case: the chief's host restarts and its policy is Never. The chief
    is Failed, "host rebooted at T" (neither Pending nor stopped by hand), nothing started it
    again; the job is Failed for that reason and the worker is stopped by provision."""
    inv = job(
        {
            "chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]},
            "worker": {
                "replicas": 1,
                "command": LONG,
                "hosts": ["host-2"],
                "restart": {"policy": "OnFailure", "limit": 3},
            },
        }
    )
    r = apply(tmp_path, inv)
    assert r.returncode == 0, r.stdout + r.stderr
    name = status(tmp_path, inv)["job"]

    sandbox.reboot(sandbox3.name, "host-1")
    st = status(tmp_path, inv)
    chief = rows(st)["chief-0"]
    assert chief["state"] == "Failed", chief
    assert chief["detail"].startswith("host rebooted at "), chief
    assert st["phase"] == "Failed"
    assert st["reason"].startswith("chief-0 on host-1 failed: host rebooted at ")
    # Nothing ran it again: the one record is the shutdown's, the unit is not active.
    assert [e[1:] for e in exits(sandbox3, "host-1", name, "chief-0")] == [["success", "killed", "TERM", "reboot"]]
    assert unit_props(sandbox3, "host-1", name, "chief-0")["ActiveState"] != "active"
    worker = rows(st)["worker-0"]
    assert worker["state"] == "Stopped" and worker["detail"].startswith("stopped by provision: job failed")
    w = cli("wait", inv, cwd=tmp_path)
    assert w.returncode == 1 and "host rebooted at" in w.stderr
    # The job ended: its target is no longer started at boot, on either host.
    for host in ("host-1", "host-2"):
        assert sh(sandbox3, host, f"test -e {layout.wants_link(name)} && echo linked").strip() == ""
    # Failed for status is finished for --rerun too (one rule).
    r = cli("apply", "-y", "--rerun", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rows(status(tmp_path, inv))["chief-0"]["state"] == "Running"


def test_succeeded_job_stays_succeeded_after_a_reboot(sandbox3, job, tmp_path):
    """A job that Succeeded (the chief exited 0; the worker, policy Always, stopped by
    provision) is still Succeeded after both its hosts reboot, and nothing of it started:
    the same exit records, no run of either unit in the new boot."""
    inv = job(
        {
            "chief": {"replicas": 1, "command": ["/bin/sh", "-c", "sleep 2; exit 0"], "hosts": ["host-1"]},
            "worker": {
                "replicas": 1,
                "command": LONG,
                "hosts": ["host-2"],
                "restart": {"policy": "Always", "limit": 3},
            },
        }
    )
    r = apply(tmp_path, inv, "--wait", "--timeout", "120")
    assert r.returncode == 0, r.stdout + r.stderr
    st = status(tmp_path, inv)
    assert st["phase"] == "Succeeded"
    name = st["job"]
    # Its exit record is ExecStopPost's, which may come after systemd says it exited (what
    # status read): a loaded host writes it a moment later.
    wait_until(lambda: exits(sandbox3, "host-1", name, "chief-0"), 30, what="the chief's exit record")
    before = {h: exits(sandbox3, h, name, t) for h, t in (("host-1", "chief-0"), ("host-2", "worker-0"))}

    for host in ("host-1", "host-2"):
        sandbox.reboot(sandbox3.name, host)
    time.sleep(3)  # past the worker's RestartSec, were anything to restart it

    for host, task in (("host-1", "chief-0"), ("host-2", "worker-0")):
        assert exits(sandbox3, host, name, task) == before[host], f"{task} ran again"
        props = unit_props(sandbox3, host, name, task)
        assert props["ActiveState"] == "inactive" and props.get("InvocationID", "") == "", f"{task}: {props}"
    st = status(tmp_path, inv)
    assert st["phase"] == "Succeeded", st
    assert rows(st)["chief-0"]["state"] == "Succeeded"
    assert rows(st)["worker-0"]["state"] == "Stopped"
    p = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
