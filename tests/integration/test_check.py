"""`provision check` on sandbox hosts with GPUs, each fault injected for real (the image's
nvidia-smi stand-in reads them from /etc/provision-sandbox/; the hosts run with NET_ADMIN, so
iptables drops traffic): a healthy cluster passes, and each fault fails with one line naming
the host and what is wrong. Plan and apply refuse on the same failures where they would
start a task (--skip-checks lets them through), and every task's env names the interface of
its host's cluster address."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from clirun import cli, sh

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]
FAULTS = "/etc/provision-sandbox"


@pytest.fixture(scope="module")
def sb(sandbox_factory):
    sb = sandbox_factory(hosts=3, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture(scope="module")
def job(sb, sandbox_inventory, tmp_path_factory):
    """chief-0 on host-1 (GPU 0, port 2222), worker-0 on host-2 and worker-1 on host-3, applied."""
    d = tmp_path_factory.mktemp("check")
    (d / "data").mkdir()
    (d / "data" / "a.txt").write_text("pushed\n")
    inv = d / "inv.yaml"
    pools = {
        "chief": {"replicas": 1, "accelerators": 1, "command": LONG, "hosts": ["host-1"]},
        "worker": {"replicas": 2, "accelerators": 1, "command": LONG, "hosts": ["host-2", "host-3"]},
    }
    sandbox_inventory(sb, job="chk", pools=pools, path=inv, files=[{"src": "data/", "dest": "/opt/chk/"}])
    r = cli("apply", "-y", inv, cwd=d)
    assert r.returncode == 0, r.stdout + r.stderr
    yield inv
    cli("destroy", "-y", inv, cwd=d)


def check(inv: Path, *args, env: dict | None = None) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    r = cli("check", "--json", *args, inv, cwd=inv.parent, env=env)
    took = time.monotonic() - t0
    assert r.returncode in (0, 1, 3), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout), took


def statuses(data: dict, host: str, check_: str) -> list[tuple[str, str]]:
    return [(c["status"], c["detail"]) for c in data["hosts"][host]["checks"] if c["check"] == check_]


def test_a_healthy_cluster_passes(job):
    code, data, _ = check(job)
    assert code == 0, data["failures"]
    assert data["ok"] and data["format_version"] == 1 and data["failures"] == []
    assert data["network"]["checked"] and data["network"]["failures"] == []
    for host in ("host-1", "host-2", "host-3"):
        seen = {c["check"]: c["status"] for c in data["hosts"][host]["checks"]}
        for name in ("systemd", "gpus", "gpu health", "gpu processes", "driver", "ports", "clock", "disk", "network"):
            assert seen.get(name) == "pass", (host, name, data["hosts"][host]["checks"])
    # The human form: a table per host and check, and exit 0.
    r = cli("check", job, cwd=job.parent)
    assert r.returncode == 0 and "HOST" in r.stdout and "check: all passed" in r.stdout, r.stdout + r.stderr
    # plan runs the per-host checks too, and finds nothing to change.
    r = cli("plan", "--detailed-exitcode", job, cwd=job.parent)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_foreign_listener_on_a_tasks_port(sb, job):
    sh(sb, "host-1", "systemd-run --unit chk-foreign python3 -m http.server 2222", check=True)
    try:
        sh(
            sb,
            "host-1",
            "for i in $(seq 50); do grep -qi ':08AE 00000000:0000 0A' /proc/net/tcp* && exit 0; sleep 0.1; done; exit 1",
            check=True,
        )
        code, data, _ = check(job)
        assert code == 1
        assert any(
            line.startswith("host-1: port 2222 (chief-0) is taken by python3 (pid ") and "chk-foreign.service" in line
            for line in data["failures"]
        ), data["failures"]
        # The port is not tested from the workers (it would reach the foreign listener).
        assert ("skip", "not tested: 2222 (chief-0), taken by another process") in statuses(data, "host-1", "network")
        # An apply that would start chief-0 refuses; nothing else failed.
        r = cli("apply", "-y", "--replace", "chief-0", job, cwd=job.parent)
        assert r.returncode == 1 and "port 2222 (chief-0) is taken by python3" in r.stderr, r.stdout + r.stderr
        # One that starts nothing has nothing to check before (engine.settled): the running
        # job is left as it is, and `check` is what reports the listener.
        r = cli("apply", "-y", job, cwd=job.parent)
        assert r.returncode == 0 and "No changes" in r.stdout, r.stdout + r.stderr
        assert len(data["failures"]) == 1, data["failures"]
    finally:
        sh(sb, "host-1", "systemctl stop chk-foreign", check=True)


def test_a_firewalled_chief_port_seen_from_one_worker(sb, job):
    peer = sh(sb, "host-1", f"getent hosts {sb.host('host-3').container}", check=True).split()[0]
    rule = f"INPUT -p tcp -s {peer} --dport 2222 -j DROP"
    sh(sb, "host-1", f"iptables -I {rule}", check=True)
    try:
        code, data, took = check(job)
    finally:
        sh(sb, "host-1", f"iptables -D {rule}", check=True)
    assert code == 1
    chief = f"{sb.host('host-1').container}:2222"
    assert data["failures"] == [f"worker-1 on host-3 cannot reach chief-0 at {chief} (timed out: a firewall?)"]
    assert data["network"]["failures"][0]["from_host"] == "host-3"
    assert statuses(data, "host-2", "network")[0][0] == "pass"  # worker-0 reached it
    assert took < 30, took  # bounded by the window, not by TCP's own minutes


def test_ecc_errors_fail_and_apply_refuses(sb, job):
    sh(sb, "host-2", f"echo '0 3' > {FAULTS}/ecc-errors; echo 1 > {FAULTS}/remap-pending", check=True)
    try:
        code, data, _ = check(job, "--skip-network")
        # Checks guard what an apply starts: restarting worker-0 (and with it the job).
        r = cli("apply", "-y", "--replace", "worker-0", job, cwd=job.parent)
        skipped = cli("apply", "-y", "--skip-checks", "--replace", "worker-0", job, cwd=job.parent)
        plan = cli("plan", "--replace", "worker-0", job, cwd=job.parent)
        quiet = cli("plan", "--detailed-exitcode", job, cwd=job.parent)
    finally:
        sh(sb, "host-2", f"rm -f {FAULTS}/ecc-errors {FAULTS}/remap-pending", check=True)
    assert code == 1 and not data["network"]["checked"]
    assert data["failures"] == ["host-2: GPU 0: 3 uncorrectable ECC errors (reset the GPU or drain the host)"]
    # GPU 1 is not the job's on host-2: a warning.
    assert any(w.startswith("host-2: GPU 1: page retirement pending, row remapping pending") for w in data["warnings"])
    assert r.returncode == 1 and "GPU 0: 3 uncorrectable ECC errors" in r.stderr, r.stdout + r.stderr
    assert "nothing was changed" in r.stderr
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    assert plan.returncode == 1 and "Warning: host-2: GPU 1: page retirement pending" in plan.stderr
    # A plan that starts nothing does not look (engine.settled): `check` is the health report.
    assert quiet.returncode == 0, quiet.stdout + quiet.stderr


def test_a_missing_gpu(sb, job):
    sh(sb, "host-3", f"echo 1 > {FAULTS}/missing-gpus", check=True)
    try:
        code, data, _ = check(job, "--skip-network")
    finally:
        sh(sb, "host-3", f"rm -f {FAULTS}/missing-gpus", check=True)
    assert code == 1
    assert data["failures"] == ["host-3: inventory declares 2 nvidia-h100, but nvidia-smi reports 1"]


def test_a_busy_gpu(sb, job):
    sh(
        sb,
        "host-2",
        f"echo '0 4242 trainer 500' > {FAULTS}/busy-gpus; echo '1 4343 notebook' >> {FAULTS}/busy-gpus",
        check=True,
    )
    try:
        code, data, _ = check(job, "--skip-network")
    finally:
        sh(sb, "host-2", f"rm -f {FAULTS}/busy-gpus", check=True)
    assert code == 1
    assert len(data["failures"]) == 1 and data["failures"][0].startswith(
        "host-2: GPU 0 is busy: trainer (pid 4242, not among this host's processes"
    ), data["failures"]
    assert "500 MiB, not started by provision" in data["failures"][0]
    assert any("GPU 1 is busy: notebook" in w and "not one the job uses" in w for w in data["warnings"])


def test_a_hanging_nvidia_smi_is_bounded_by_its_timeout(sb, job):
    sh(sb, "host-1", f"touch {FAULTS}/nvidia-smi-hang", check=True)
    try:
        code, data, took = check(job, "--skip-network", env={"PROVISION_CHECK_GPU_TIMEOUT": "3"})
        left = sh(sb, "host-1", "pgrep -c -x nvidia-smi || true", check=True).strip()
    finally:
        sh(sb, "host-1", f"rm -f {FAULTS}/nvidia-smi-hang", check=True)
    assert code == 1
    assert data["failures"] == [
        "host-1: inventory declares 2 nvidia-h100, but nvidia-smi failed: nvidia-smi: timed out after 3s"
    ]
    assert 3 <= took < 20, took
    assert left == "0", "the hung nvidia-smi was killed"


def test_drivers_that_differ_are_a_warning(sb, job):
    sh(sb, "host-3", f"echo '535.104.05 12.2' > {FAULTS}/driver", check=True)
    try:
        code, data, _ = check(job, "--skip-network")
    finally:
        sh(sb, "host-3", f"rm -f {FAULTS}/driver", check=True)
    assert code == 0, data["failures"]
    assert data["warnings"] == [
        "host-3: driver 535.104.05 here, 550.54.15 on host-1, host-2: NCCL and CUDA may not agree across hosts"
    ]


def test_nccl_and_gloo_use_the_interface_of_the_cluster_address(sb, job):
    for h in sb.hosts:
        ip = sh(sb, h.name, f"getent hosts {h.cluster_address}", check=True).split()[0]
        want = next(
            line.split()[1]
            for line in sh(sb, h.name, "ip -o addr show", check=True).splitlines()
            if line.split()[3].split("/")[0] == ip
        )
        assert want != "lo"
        env = sh(sb, h.name, "cat /etc/provision/chk/*.env", check=True)
        assert f'NCCL_SOCKET_IFNAME="{want}"' in env and f'GLOO_SOCKET_IFNAME="{want}"' in env, env
