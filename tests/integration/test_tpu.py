"""TPU slices on sandbox hosts: JAX's own cluster detection, reading the env
provision wrote, finds the coordinator, process count and process id provision meant for
every process, in a job of two slices of two hosts; and `check` fails a host where a
process that provision did not start holds a TPU chip open.

The hosts have no TPU: each gets four stand-in /dev/accelN files (what provision counts as
chips), and JAX (CPU) from the sandbox's jax layer. The detection runs as
`jax.distributed.initialize()` runs it (ClusterEnv.auto_detect_unset_distributed_params),
told that it runs on a TPU VM, which is what the hosts' libtpu would say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from clirun import cli, ok, sh, wait_until
from provision.inventory.inventory import load
from provision.render.files import render
from provision.sandbox.inventory import dump

pytestmark = pytest.mark.integration

DETECT = """
import json, os
import jax._src.clusters.cloud_tpu_cluster as tpu
import jax._src.clusters.cluster as cluster
tpu.running_in_cloud_tpu_vm = True  # what a TPU VM's libtpu says; this host has none
addr, n, pid, _ = cluster.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 60)
print("DETECTED " + json.dumps({"task": os.environ["PROVISION_TASK"], "coordinator": addr, "processes": n, "id": pid}))
"""


@pytest.fixture(scope="module")
def slices(sandbox_factory):
    sb = sandbox_factory(hosts=4, with_=("jax",))
    for h in ("host-1", "host-2", "host-3", "host-4"):
        sh(sb, h, "for i in 0 1 2 3; do touch /dev/accel$i; done", check=True)
    yield sb
    sandbox_factory.down(sb)


def _tpu_inventory(sb, make, path: Path, job: str, pools: dict) -> Path:
    inv = make(sb, job=job, pools=pools)
    for i, h in enumerate(inv["hosts"]):
        h["accelerators"] = {"type": "tpu-v5e", "count": 4}
        h["labels"] = {"tpu_slice": "a" if i < 2 else "b"}
    path.write_text(dump(inv, sb))
    return path


def test_jax_reads_the_slices_provision_meant(slices, sandbox_inventory, tmp_path):
    pools = {
        "chief": {"replicas": 1, "accelerators": 4, "command": ["/usr/bin/python3", "-c", DETECT]},
        "worker": {"replicas": 3, "accelerators": 4, "command": ["/usr/bin/python3", "-c", DETECT]},
    }
    inv = _tpu_inventory(slices, sandbox_inventory, tmp_path / "inv.yaml", "tpu-slices", pools)
    meant = {}
    r = render(load(inv))
    for t in r.placement.tasks:
        env_file = next(f for f in r.hosts[t.host.name].files if f.path.endswith(f"/{t.name}.env"))
        env = dict(x.split("=", 1) for x in env_file.data().decode().splitlines() if "=" in x and x[0] != "#")
        env = {k: v.strip('"') for k, v in env.items()}
        meant[t.name] = {
            "coordinator": env["JAX_COORDINATOR_ADDRESS"],
            "processes": int(env["JAX_NUM_PROCESSES"]),
            "id": int(env["JAX_PROCESS_ID"]),
        }
        assert env["MEGASCALE_NUM_SLICES"] == "2" and env["TPU_SKIP_MDS_QUERY"] == "true"
    assert sorted(m["id"] for m in meant.values()) == [0, 1, 2, 3]
    try:
        ok(cli("apply", "-y", "--wait", "--timeout", "240", inv, cwd=tmp_path, timeout=300))
        logs = wait_until(
            lambda: [x for x in ok(cli("logs", inv, cwd=tmp_path)).stdout.splitlines() if "DETECTED " in x],
            what="every process's detection",
        )
        got = {d["task"]: d for d in (json.loads(x.split("DETECTED ", 1)[1]) for x in logs)}
        assert set(got) == set(meant), logs
        for task, m in meant.items():
            assert {k: got[task][k] for k in m} == m, (task, got[task], m)
    finally:
        cli("destroy", "-y", inv, cwd=tmp_path)


def test_check_names_a_process_holding_a_chip(slices, sandbox_inventory, tmp_path):
    pools = {"worker": {"replicas": 4, "accelerators": 4, "command": ["/bin/sh", "-c", "exec sleep 600"]}}
    inv = _tpu_inventory(slices, sandbox_inventory, tmp_path / "inv.yaml", "tpu-busy", pools)
    # A leftover Python holding chip 2 of host-3 open, outside provision.
    sh(slices, "host-3", "systemd-run --unit leftover-tpu sh -c 'exec 3</dev/accel2; exec sleep 600'", check=True)
    try:
        r = cli("check", "--json", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        hosts = json.loads(r.stdout)["hosts"]
        found = [dict(f, host=h) for h, v in hosts.items() for f in v["checks"] if f["check"] == "tpu processes"]
        bad = [f for f in found if f["status"] == "fail"]
        assert [f["host"] for f in bad] == ["host-3"], found
        assert "TPU chip /dev/accel2 is busy: sleep (pid" in bad[0]["detail"], bad
        assert "leftover-tpu.service" in bad[0]["detail"] and "not started by provision" in bad[0]["detail"]
        assert {f["host"] for f in found if f["status"] == "pass"} == {"host-1", "host-2", "host-4"}
    finally:
        sh(slices, "host-3", "systemctl stop leftover-tpu")
    assert yaml.safe_load(inv.read_text())["job"] == "tpu-busy"
