"""A first apply in one round trip per host (run/firstapply.py, host/fresh.py), on sandbox
hosts: planned as a probing apply would plan it; a host changed since (a file put where the
job writes, a port taken, another job's ledger entry) refuses, is planned again from its
answer and is never overwritten; SIGKILLed at any point, the next apply converges. A GPU
job with outputs: and files: too (sandbox4's GPUs): a GPU taken by another job or
quarantined since is refused and that host alone planned again."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from clirun import cli, sh

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]
POOLS = {"chief": {"replicas": 1, "command": LONG}, "worker": {"replicas": 2, "command": LONG}}
PROBING = {"PROVISION_FIRST_APPLY": "probe"}
# Set, NCCL's and Gloo's interface is not looked up on each host: nothing a first apply
# writes depends on what a host would answer.
IFNAMES = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"}


def _commands(stderr: str) -> dict[str, int]:
    """host -> commands run on it (`-v` prints each as `[host] $ command`)."""
    out: dict[str, int] = {}
    for line in stderr.splitlines():
        if line.startswith("[") and "] $ " in line:
            host = line[1 : line.index("]")]
            out[host] = out.get(host, 0) + 1
    return out


def _actions(plan: dict) -> dict:
    """What a plan does per host: each file's and task's action (nothing that is a time;
    the GPUs' UUIDs of a plan made without asking are the host's to fill in)."""
    return {
        name: (
            sorted((f["path"], f["action"], f["drift"]) for f in h["files"]),
            sorted((t["task"], t["action"], t["reason"]) for t in h["tasks"]),
            h["error"],
            h["problems"],
            h["warnings"],
            {k: v for k, v in (h["reserve"] or {}).items() if k != "gpu_uuids"},
        )
        for name, h in plan["hosts"].items()
    }


def test_first_apply_is_one_round_trip_per_host_and_plans_as_a_probe_would(
    sandbox3, sandbox_inventory, job_name, tmp_path
):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(sandbox3, job=job_name, pools=POOLS, path=inv, env=IFNAMES)
    probed = json.loads(cli("plan", "--json", inv, cwd=tmp_path).stdout)
    r = cli("apply", "-y", "-v", "--json", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _commands(r.stderr) == {h.name: 1 for h in sandbox3.hosts}, r.stderr
    assert _actions(json.loads(r.stdout)["plan"]) == _actions(probed)
    for h in sandbox3.hosts:
        assert "active" in sh(sandbox3, h.name, f"systemctl is-active 'provision-{job_name}-*'").split()
    r = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("apply", "-y", "-v", inv, cwd=tmp_path)  # a no-op apply: one probe per host
    assert r.returncode == 0 and "No changes" in r.stdout, r.stdout + r.stderr
    assert _commands(r.stderr) == {h.name: 1 for h in sandbox3.hosts}, r.stderr
    cli("destroy", "-y", inv, cwd=tmp_path)
    # Asked (no -y), or turned off: the hosts are probed first, as before.
    r = cli("apply", "-y", "-v", inv, cwd=tmp_path, env=PROBING)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _commands(r.stderr) == {h.name: 2 for h in sandbox3.hosts}, r.stderr
    cli("destroy", "-y", inv, cwd=tmp_path)
    # A job whose env takes each host's interface asks the hosts first.
    sandbox_inventory(sandbox3, job=job_name, pools=POOLS, path=inv)
    r = cli("apply", "-y", "-v", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _commands(r.stderr) == {h.name: 2 for h in sandbox3.hosts}, r.stderr
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_a_file_put_where_the_job_writes_is_refused_and_planned_again(sandbox3, sandbox_inventory, job_name, tmp_path):
    """The host refuses, writing nothing, and is planned again from its answer (the file
    there is drift the new plan replaces, as a probing apply's would), alone: the other
    hosts keep what the one round trip wrote."""
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(sandbox3, job=job_name, pools=POOLS, path=inv, env=IFNAMES)
    target = f"/etc/systemd/system/provision-{job_name}.target"
    sh(sandbox3, "host-2", f"printf '# hand-made\\n' > {target}")
    r = cli("apply", "-y", "-v", inv, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "host-2: not as the plan presumed" in out and f"{target} is here" in out, out
    assert "cleared the job" not in out, out
    assert _commands(r.stderr) == {"host-1": 1, "host-3": 1, "host-2": 3}, r.stderr  # guard, probe, write
    assert "# hand-made" not in sh(sandbox3, "host-2", f"cat {target}")
    assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
    cli("destroy", "-y", inv, cwd=tmp_path)


def test_another_jobs_ledger_entry_refuses_and_the_apply_plans_every_host_again(
    sandbox3, sandbox_inventory, job_name, tmp_path
):
    """host-3 runs another job on the same port: the presumed placement does not hold; the
    hosts this apply wrote are cleared and every host is planned (probed) again."""
    other, inv = tmp_path / "other.yaml", tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox3,
        job="o" + job_name[1:],
        pools={"chief": {"replicas": 1, "command": LONG}},
        path=other,
        hosts=["host-3"],
        env=IFNAMES,
    )
    assert cli("apply", "-y", other, cwd=tmp_path).returncode == 0
    sandbox_inventory(sandbox3, job=job_name, pools=POOLS, path=inv, env=IFNAMES)
    r = cli("apply", "-y", inv, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "host-3: not as the plan presumed" in out and "the ledger holds" in out, out
    assert "cleared the job from" in out or "planning again" in out, out
    assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
    assert cli("plan", "--detailed-exitcode", other, cwd=tmp_path).returncode == 0  # untouched
    cli("destroy", "-y", inv, cwd=tmp_path)
    cli("destroy", "-y", other, cwd=tmp_path)


def test_sigkill_of_one_round_trip_applies_then_converges(sandbox3, sandbox_inventory, job_name, tmp_path):
    """First applies SIGKILLed at random points (each from fresh hosts and an empty state):
    the state stays readable, the next apply converges and plan shows no changes."""
    inv = tmp_path / "inv.yaml"
    state = tmp_path / ".provision" / f"{job_name}.state.json"
    sandbox_inventory(sandbox3, job=job_name, pools=POOLS, path=inv, env=IFNAMES)
    rnd = random.Random(int(os.environ.get("PROVISION_KILL_SEED", "58")))
    kills = 0
    for _ in range(6):
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rnd.uniform(0.2, 1.5))
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
        if state.exists():
            json.loads(state.read_text())  # readable, whole
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        r = cli("plan", "--detailed-exitcode", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        for h in sandbox3.hosts:
            assert "active" in sh(sandbox3, h.name, f"systemctl is-active 'provision-{job_name}-*'").split()
        assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0
        assert not state.exists() or not json.loads(state.read_text())["hosts"]
    assert kills >= 2, f"only {kills} applies were still running when killed"


def _gpu_job(sb, sandbox_inventory, job: str, tmp_path, path, **pools_extra) -> None:
    data = tmp_path / "data.txt"
    data.write_text("input\n")
    pools = {r: {"replicas": 1, "accelerators": 1, "command": LONG, **pools_extra} for r in ("chief", "worker")}
    extra = {"outputs": f"/var/tmp/{job}/out", "files": [{"src": str(data), "dest": f"/opt/{job}/"}]}
    sandbox_inventory(sb, job=job, pools=pools, path=path, env=IFNAMES, hosts=["host-1", "host-2"], **extra)


def _gpus_held(sb, host: str, job: str) -> tuple[list[int], list[str]]:
    from provision.host import layout

    e = json.loads(sh(sb, host, f"cat {layout.ledger_path(job)}"))
    return e["gpus"], e["gpu_uuids"]


def test_a_gpu_job_is_one_round_trip_and_a_gpu_taken_or_quarantined_since_is_planned_again(
    sandbox4, sandbox_inventory, job_name, tmp_path
):
    """One agent call per host for a GPU job with outputs: and files:, planned as a probe
    would plan it, the ledger holding the GPUs' UUIDs; then host-2's GPU 0 taken by another
    job, and quarantined: host-2 refuses, is planned again alone (its task on GPU 1), host-1
    keeps what its one call wrote; SIGKILLed, the next apply converges."""
    from provision.host import layout

    inv, other = tmp_path / "inv.yaml", tmp_path / "other.yaml"
    _gpu_job(sandbox4, sandbox_inventory, job_name, tmp_path, inv)
    probed = json.loads(cli("plan", "--json", inv, cwd=tmp_path).stdout)
    r = cli("apply", "-y", "-v", "--json", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _commands(r.stderr) == {"host-1": 1, "host-2": 1}, r.stderr
    assert _actions(json.loads(r.stdout)["plan"]) == _actions(probed)
    for host in ("host-1", "host-2"):
        gpus, uuids = _gpus_held(sandbox4, host, job_name)
        assert gpus and len(uuids) == len(gpus) and all(u.startswith("GPU-") for u in uuids), (gpus, uuids)
        assert sh(sandbox4, host, f"cat /opt/{job_name}/data.txt").strip() == "input"
    assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
    assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0
    # Another job takes host-2's GPU 0 (on a port of its own: only the GPU differs).
    o = "o" + job_name[1:]
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": LONG, "port": 2400}}
    sandbox_inventory(sandbox4, job=o, pools=pools, path=other, hosts=["host-2"], env=IFNAMES)
    assert cli("apply", "-y", other, cwd=tmp_path).returncode == 0
    assert _gpus_held(sandbox4, "host-2", o)[0] == [0]
    try:
        r = cli("apply", "-y", "-v", inv, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert "host-2: not as the plan presumed" in out and f"the ledger holds {o}" in out, out
        assert "cleared the job" not in out and _commands(r.stderr)["host-1"] == 1, out
        assert 0 not in _gpus_held(sandbox4, "host-2", job_name)[0]
        assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
        assert cli("plan", "--detailed-exitcode", other, cwd=tmp_path).returncode == 0  # untouched
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        cli("destroy", "-y", other, cwd=tmp_path)
    # host-2's GPU 0 quarantined: host-2 refuses, is planned again around it.
    r = cli("health", "quarantine", inv, "host-2:0", "--reason", "test", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        r = cli("apply", "-y", "-v", inv, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert "host-2: not as the plan presumed" in out and "health record" in out, out
        assert "cleared the job" not in out and _commands(r.stderr)["host-1"] == 1, out
        assert 0 not in _gpus_held(sandbox4, "host-2", job_name)[0]
        assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)
        sh(sandbox4, "host-2", f"rm -f {layout.HEALTH_PATH}")
    # SIGKILLed one-call applies: the next apply converges from what they left.
    rnd = random.Random(int(os.environ.get("PROVISION_KILL_SEED", "58")))
    for _ in range(2):
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rnd.uniform(0.3, 1.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert cli("plan", "--detailed-exitcode", inv, cwd=tmp_path).returncode == 0
        assert cli("destroy", "-y", inv, cwd=tmp_path).returncode == 0
    for host in ("host-1", "host-2"):  # outputs: are the user's: destroy keeps them
        sh(sandbox4, host, f"rm -rf /var/tmp/{job_name}")
