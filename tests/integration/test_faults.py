"""Faults injected for real on sandbox hosts: SIGKILLed applies, a shrink after kills, a
host file provision must not lose, a paused host, --target on status."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from clirun import cli, sh
from provision import sandbox

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


def test_sigkill_at_random_points_never_loses_the_state(sandbox4, sandbox_inventory, job_name, tmp_path):
    """16 applies SIGKILLed at random points, alternating between two versions
    of the job (so each kill lands in writes, restarts or records): after every kill the state
    file is readable JSON; the next apply converges and a plan then shows no changes; a shrink
    afterwards leaves nothing of the job on the host it left."""
    inv = tmp_path / "inv.yaml"
    state = tmp_path / ".provision" / f"{job_name}.state.json"
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 3, "command": LONG}}
    rnd = random.Random(int(os.environ.get("PROVISION_KILL_SEED", "7")))
    seen_state = False
    kills = tries = 0
    while kills < 16 and tries < 48:  # a kill that comes after the apply ended is no kill
        i, tries = tries, tries + 1
        sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, env={"VERSION": str(i % 2)})
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rnd.uniform(0.1, 1.3))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        if state.exists():
            seen_state = True
            data = json.loads(state.read_text())  # readable, whole
            assert data["job"] == job_name and isinstance(data["hosts"], dict)
        else:
            assert not seen_state, f"the state file vanished after kill {i}"
    assert kills >= 16, f"only {kills} of {tries} applies were still running when killed"

    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(state.read_text())
    on_hosts = {h for h in data["placement"].values() for h in [h["host"]]}
    assert on_hosts <= set(data["hosts"]), "every host that runs a task is in the state"

    # Shrink: host-4 leaves the inventory; its tasks move and nothing of the job stays there.
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, hosts=["host-1", "host-2", "host-3"])
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = sh(
        sandbox4,
        "host-4",
        f"ls /etc/provision/{job_name} /etc/systemd/system/provision-{job_name}-* 2>&1; "
        f"systemctl list-units --all --no-legend 'provision-{job_name}-*'",
    )
    assert f"provision-{job_name}-" not in out.replace(f"/etc/systemd/system/provision-{job_name}-*", ""), out
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0


def test_status_target_reports_only_that_host(sandbox4, sandbox_inventory, job_name, tmp_path):
    inv = tmp_path / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]},
        "worker": {"replicas": 2, "command": LONG, "hosts": ["host-2", "host-3"]},
    }
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv)
    assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
    try:
        r = cli("status", "--json", "--target", "host-2", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        st = json.loads(r.stdout)
        assert {t["host"] for t in st["tasks"]} == {"host-2"}
        assert st["unreachable"] == [] and st["phase"] == "Running"
        assert "unreachable" not in r.stderr.lower()
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_host_file_provision_does_not_manage_is_refused_or_kept_and_put_back(
    sandbox4, sandbox_inventory, job_name, tmp_path
):
    """a files: dest over an existing host file is refused by plan; with
    replace: true it is replaced, and destroy puts the original back."""
    dest = f"/opt/{job_name}-motd"
    sh(sandbox4, "host-1", f"printf 'the host own motd\\n' > {dest} && chmod 0640 {dest}")
    (tmp_path / "motd").write_text("provision's motd\n")
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]}}
    sandbox_inventory(sandbox4, job=job_name, pools=pools, path=inv, files=[{"src": "motd", "dest": dest}])
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 1
    assert f"{dest} exists and is not managed by provision" in r.stderr and "replace: true" in r.stderr
    assert sh(sandbox4, "host-1", f"cat {dest}") == "the host own motd\n"
    assert sh(sandbox4, "host-1", f"test -e /etc/provision/{job_name}").code != 0, "nothing written anywhere"

    sandbox_inventory(
        sandbox4, job=job_name, pools=pools, path=inv, files=[{"src": "motd", "dest": dest, "replace": True}]
    )
    r = cli("apply", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sh(sandbox4, "host-1", f"cat {dest}") == "provision's motd\n"
    assert "No changes" in cli("plan", inv, cwd=tmp_path).stdout
    r = cli("destroy", "-y", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sh(sandbox4, "host-1", f"cat {dest}; stat -c %a {dest}") == "the host own motd\n640\n"
    sh(sandbox4, "host-1", f"rm -f {dest}")


def test_a_paused_host_costs_connect_timeout_and_one_line(sandbox4, sandbox_inventory, tmp_path):
    """A hung host is unreachable within about connect_timeout, with the
    stage it hung in, exit 3, no traceback; the other host is still planned."""
    sb = dataclasses.replace(sandbox4, hosts=sandbox4.hosts[:2])  # the inventory lists two hosts
    inv = tmp_path / "inv.yaml"
    pools = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 1, "command": LONG}}
    data = sandbox_inventory(sb, job="paused", pools=pools)
    data["ssh"]["connect_timeout"] = 5
    import yaml

    inv.write_text(yaml.safe_dump(data))
    assert cli("plan", inv, cwd=tmp_path).returncode == 0  # keys learnt, both answer
    sb.container("host-2").pause()
    try:
        t0 = time.monotonic()
        r = cli("plan", inv, cwd=tmp_path)
        took = time.monotonic() - t0
    finally:
        sb.container("host-2").unpause()
    assert r.returncode == 3, r.stdout + r.stderr
    assert took < 8, f"plan took {took:.1f}s with connect_timeout 5"
    assert "Traceback" not in r.stderr and "No existing session" not in r.stderr
    line = [ln for ln in r.stderr.splitlines() if "host-2" in ln]
    assert line and "timed out during" in line[0], r.stderr
    assert "host-1" not in r.stderr


def test_a_host_removed_while_unreachable_is_shown_until_cleaned(sandbox3, sandbox_inventory, tmp_path):
    """item 12: stop a host, apply the inventory without it (exit 3), start the
    host: its old worker runs beside the new one and `status` said nothing. Now status
    names the host; once it reaches it, it stops the old task and marks the job left there
    (no boot starts it again); the next apply removes the rest."""
    import yaml

    sb = sandbox3
    inv = tmp_path / "inv.yaml"
    try:
        pools = {
            "chief": {"replicas": 1, "command": LONG, "hosts": ["host-1"]},
            "worker": {"replicas": 2, "command": LONG, "hosts": ["host-2", "host-3"]},
        }
        data = sandbox_inventory(sb, job="moved", pools=pools)
        data["ssh"]["connect_timeout"] = 3
        inv.write_text(yaml.safe_dump(data))
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        sb.container("host-3").pause()
        try:
            data["hosts"] = [h for h in data["hosts"] if h["name"] != "host-3"]
            data["pools"]["worker"] = {"replicas": 1, "command": LONG, "hosts": ["host-2"]}
            inv.write_text(yaml.safe_dump(data))
            r = cli("apply", "-y", inv, cwd=tmp_path)
            assert r.returncode == 3, r.stdout + r.stderr
            assert "Warning: host-3 leaves the job but cannot be reached" in r.stderr, r.stderr
            st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
            assert st["left_behind"] and st["left_behind"][0].startswith("host-3 left the job while it could not"), st
        finally:
            sb.container("host-3").unpause()
        # Reached again: status stops what the job left running there and marks the job
        # left, so that no boot starts it (the old worker ran beside its replacement).
        text = cli("status", inv, cwd=tmp_path).stdout
        assert "Warning: host-3 left the job; its files are still there: the next apply removes them" in text, text
        assert sh(sb, "host-3", "systemctl is-active provision-moved-worker-1").strip() != "active"
        sandbox.reboot(sb.name, "host-3")
        assert sh(sb, "host-3", "systemctl is-active provision-moved-worker-1").strip() != "active"
        assert cli("apply", "-y", inv, cwd=tmp_path).returncode == 0
        st = json.loads(cli("status", "--json", inv, cwd=tmp_path).stdout)
        assert st["left_behind"] == [], st
        assert sh(sb, "host-3", "systemctl list-units --all 'provision-moved-*' --no-legend | wc -l").strip() == "0"
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)  # the session's hosts: the job goes, not them
