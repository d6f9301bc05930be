"""The fabric between sandbox hosts, for real: `provision check --bandwidth` measures every
pair and the job-wide ring with provision's stream test, keeps the first healthy figures as
the baseline of the hosts' class (beside the local state, and in the team's PostgreSQL) and
compares the next run with it; a baseline of another host class is never compared with; a
host that does not answer is named; torch.distributed (gloo) measures it where torch is
installed, nccl-tests' all_reduce_perf under mpirun where those are (the image's stand-ins,
which move the data over real TCP); the bisection names the one host of eight throttled
with tc; the topology the hardware tells (the image's `nvidia-smi topo -m` and `-q`, and
its /sys/class/infiniband) are host facts and the labels `init --facts` writes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from clirun import cli, sh

pytestmark = pytest.mark.integration

TRUE = ["/bin/true"]
FAULTS = "/etc/provision-sandbox"


def inventory(sb, sandbox_inventory, path: Path, **extra) -> Path:
    sandbox_inventory(
        sb, job=extra.pop("job", "fab"), pools={"worker": {"replicas": 1, "command": TRUE}}, path=path, **extra
    )
    return path


def bandwidth(inv: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    r = cli("check", "--bandwidth", "--json", *args, inv, cwd=inv.parent, env=env, timeout=900)
    assert r.returncode in (0, 1, 3), r.stdout + r.stderr
    return r.returncode, json.loads(r.stdout)


def healthy(inv: Path, *args: str, env: dict | None = None) -> dict:
    """A healthy measurement (a pair slower than the other by half on this loaded machine is
    not: up to three tries)."""
    for _ in range(3):
        code, data = bandwidth(inv, *args, env=env)
        if code == 0:
            return data
    raise AssertionError(json.dumps(data, indent=1))


def test_pairs_job_wide_and_the_baseline_kept_then_compared(sandbox3, sandbox_inventory, tmp_path):
    inv = inventory(sandbox3, sandbox_inventory, tmp_path / "inv.yaml")
    first = healthy(inv)
    assert first["tool"] == "tcp" and first["host_class"] == "cpu" and first["baseline"] is None
    jw = first["job_wide"]
    assert jw["hosts"] == ["host-1", "host-2", "host-3"] and jw["gbps"] > 0 and jw["error"] is None
    pairs = {tuple(p["hosts"]) for p in first["pairs"]}
    assert {h for p in pairs for h in p} == {"host-1", "host-2", "host-3"}  # every host in a pair
    assert all(p["gbps"] > 0 for p in first["pairs"])
    assert [r["round"] for r in first["rounds"]] == [1, 2, 3] and all(r["seconds"] > 0 for r in first["rounds"])
    assert "no baseline for host class cpu yet" in first["notes"][0]
    kept = first["kept_baseline"]
    assert kept["class"] == "cpu" and kept["tool"] == "tcp" and kept["ring_hosts"] == 3
    stored = json.loads((tmp_path / ".provision" / "fabric-baselines.json").read_text())
    assert stored["baselines"]["cpu|tcp"]["ring_gbps"] == pytest.approx(jw["gbps"], rel=1e-3)

    code, second = bandwidth(inv)
    assert second["baseline"]["ring_gbps"] == pytest.approx(jw["gbps"], rel=1e-3)
    assert second["kept_baseline"] is None  # the first one stays
    assert second["job_wide"]["baseline_gbps"] == pytest.approx(jw["gbps"], rel=1e-3)
    assert second["job_wide"]["of_baseline"] > 0
    assert all(p["baseline_gbps"] == pytest.approx(kept["pair_gbps"], rel=1e-3) for p in second["pairs"])
    r = cli("check", "--bandwidth", inv, cwd=tmp_path, timeout=900)
    assert "of the baseline (" in r.stdout and "Job-wide: " in r.stdout and "Pairs: " in r.stdout, r.stdout

    # The same hosts as another class (a label): the baseline of class cpu is not compared.
    other = inventory(sandbox3, sandbox_inventory, tmp_path / "other.yaml")
    doc = yaml.safe_load(other.read_text())
    for h in doc["hosts"]:
        h["labels"] = {"rack": "r7"}
    other.write_text(yaml.safe_dump(doc))
    r = cli("check", "--bandwidth", other, cwd=tmp_path, timeout=900)
    notes = [line for line in r.stdout.splitlines() if line.startswith("Note: ")]
    assert notes == [
        "Note: no baseline for host class cpu,rack=r7 (the stored ones are of other host classes: cpu; not "
        "compared); a healthy measurement now becomes its baseline"
    ], r.stdout
    assert "of the baseline" not in r.stdout


def test_the_baseline_in_the_teams_postgresql(sandbox3, sandbox_inventory, tmp_path, postgres):
    postgres.sql("CREATE DATABASE fabric")
    env = {**postgres.env(), "PROVISION_STATE": postgres.url(database="fabric")}
    inv = inventory(sandbox3, sandbox_inventory, tmp_path / "inv.yaml", job="fabpg")
    healthy(inv, env=env)
    row = postgres._psql("fabric", "SELECT class, tool, doc FROM provision_fabric_baselines").strip().split("|")
    assert row[:2] == ["cpu", "tcp"] and json.loads(row[2])["ring_hosts"] == 3
    assert not (tmp_path / ".provision" / "fabric-baselines.json").exists()
    _, second = bandwidth(inv, env=env)
    assert second["baseline"] == json.loads(row[2]) and second["kept_baseline"] is None


def test_a_host_that_does_not_answer_is_named(sandbox3, sandbox_inventory, tmp_path):
    inv = inventory(sandbox3, sandbox_inventory, tmp_path / "inv.yaml", ssh={"connect_timeout": 3})
    container = sandbox3.host("host-3").container
    subprocess.run(["docker", "pause", container], check=True)
    try:
        t0 = time.monotonic()
        r = cli("check", "--bandwidth", inv, cwd=tmp_path, timeout=900)
        took = time.monotonic() - t0
    finally:
        subprocess.run(["docker", "unpause", container], check=True)
    assert r.returncode == 3, r.stdout + r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("Did not answer")]
    assert len(said) == 1 and said[0].startswith("Did not answer: host-3: the look: "), r.stderr
    assert "host-1 host-2" in r.stdout  # the others were measured
    assert took < 120  # bounded: not waited on for ever


def test_torch_distributed_measures_it_where_torch_is(sandbox_frameworks, sandbox_inventory, tmp_path):
    inv = inventory(sandbox_frameworks, sandbox_inventory, tmp_path / "inv.yaml", job="fabtorch")
    _, data = bandwidth(inv)
    assert data["tool"] == "torch", data  # chosen: every host has torch, none nccl-tests
    assert data["job_wide"]["gbps"] > 0 and data["job_wide"]["error"] is None, data
    assert data["pairs"] and all(p["gbps"] > 0 for p in data["pairs"])


@pytest.fixture
def nccl_tests(sandbox4):
    """The image's all_reduce_perf and mpirun stand-ins on PATH, and keys between the hosts
    (mpirun reaches the other hosts over ssh, as Open MPI's launcher does); put back after."""
    names = [h.name for h in sandbox4.hosts[:2]]
    for n in names:
        sh(sandbox4, n, "ssh-keygen -q -t ed25519 -N '' -f /root/.ssh/fabric_test && cp /root/.ssh/authorized_keys "
           "/root/.ssh/authorized_keys.fabric-test && ln -sf /usr/lib/provision-sandbox/nccl-tests/all_reduce_perf "
           "/usr/lib/provision-sandbox/nccl-tests/mpirun /usr/local/bin/ && printf 'IdentityFile /root/.ssh/fabric_test\\n' "
           "> /root/.ssh/config", check=True)  # fmt: skip
    for n in names:
        key = sh(sandbox4, n, "cat /root/.ssh/fabric_test.pub", check=True).strip()
        for m in names:
            sh(sandbox4, m, f"echo '{key}' >> /root/.ssh/authorized_keys", check=True)
    yield names
    for n in names:
        sh(sandbox4, n, "rm -f /usr/local/bin/all_reduce_perf /usr/local/bin/mpirun /root/.ssh/fabric_test* "
           "/root/.ssh/config /root/.ssh/known_hosts && mv /root/.ssh/authorized_keys.fabric-test "
           "/root/.ssh/authorized_keys", check=True)  # fmt: skip


def test_nccl_tests_under_mpirun_where_they_are(sandbox4, sandbox_inventory, tmp_path, nccl_tests):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(
        sandbox4, job="fabnccl", pools={"worker": {"replicas": 1, "command": TRUE}}, path=inv, hosts=nccl_tests
    )
    _, data = bandwidth(inv)
    assert data["tool"] == "nccl-tests", data
    assert data["host_class"] == "nvidia-h100x2"
    assert data["job_wide"]["gbps"] > 0 and data["job_wide"]["error"] is None, data


@pytest.fixture
def fabric_hardware(sandbox4):
    """host-1 with two InfiniBand ports up and an NVLink fabric; host-2 with the defaults."""
    sh(sandbox4, "host-1", f"printf 'mlx5_0 1 ACTIVE 400 fe80:0000:0000:00aa\\nmlx5_1 1 ACTIVE 400 "
       f"fe80:0000:0000:00aa\\n' > {FAULTS}/infiniband && printf 'fabric 6f5a4c2e-0000-4000-8000-000000000001 7\\n' "
       f"> {FAULTS}/topology && /usr/lib/provision-sandbox/infiniband", check=True)  # fmt: skip
    yield
    sh(sandbox4, "host-1", f"/usr/lib/provision-sandbox/infiniband --remove && rm -f {FAULTS}/infiniband "
       f"{FAULTS}/topology", check=True)  # fmt: skip
    assert not sh(sandbox4, "host-1", "ls /sys/class/infiniband 2>/dev/null").strip()


def test_the_topology_the_hardware_tells_is_facts_and_labels(sandbox4, sandbox_inventory, tmp_path, fabric_hardware):
    inv = tmp_path / "inv.yaml"
    sandbox_inventory(sandbox4, job="fabfacts", pools={"worker": {"replicas": 1, "command": TRUE}}, path=inv,
                      hosts=["host-1", "host-2"])  # fmt: skip
    r = cli("facts", "--json", inv, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    one, two = (json.loads(r.stdout)["hosts"][h] for h in ("host-1", "host-2"))
    assert one["fabric"]["nvlink"] == "NV18" and one["fabric"]["near_nic"] == {"GPU0": "NIC0", "GPU1": "NIC1"}
    assert one["fabric"]["nics"] == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert [(p["device"], p["state"], p["rate_gbps"]) for p in one["fabric"]["infiniband"]] == [
        ("mlx5_0", "ACTIVE", 400.0),
        ("mlx5_1", "ACTIVE", 400.0),
    ]
    assert one["labels"] == {
        "nvlink_domain": "6f5a4c2e-0000-4000-8000-000000000001.7",
        "ib_subnet": "fe80-0000-0000-00aa",
    }
    assert two["fabric"]["nvlink"] == "NV18" and two["fabric"]["infiniband"] == [] and two["labels"] == {}
    table = cli("facts", inv, cwd=tmp_path).stdout
    assert "NV18 between GPUs; 2 InfiniBand ports up (400 Gb/s); NVLink domain 6f5a4c2e" in table, table
    # `init --facts` writes the labels the hardware suggests.
    h1 = sandbox4.host("host-1")
    out = tmp_path / "init.yaml"
    r = cli(
        "init", "--facts", "-o", out, f"gpu-1={h1.address}", "-i", sandbox4.key_path, "--user", "root", cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    host = yaml.safe_load(out.read_text())["hosts"][0]
    assert host["labels"] == {
        "ib_subnet": "fe80-0000-0000-00aa",
        "nvlink_domain": "6f5a4c2e-0000-4000-8000-000000000001.7",
    }


def test_bisection_names_the_throttled_host_of_eight(sandbox_factory, sandbox_inventory, tmp_path):
    sb = sandbox_factory(hosts=8)
    try:
        inv = inventory(sb, sandbox_inventory, tmp_path / "inv.yaml")
        sh(sb, "host-5", "tc qdisc add dev eth0 root tbf rate 50mbit burst 32kbit latency 400ms", check=True)
        code, data = bandwidth(inv)
        assert code == 1 and "host-5" in data["slow_hosts"], json.dumps(data, indent=1)
        assert len(data["rounds"]) <= 4 == data["max_rounds"]
        assert all(r["seconds"] > 0 for r in data["rounds"])
        r = cli("check", "--bandwidth", inv, cwd=tmp_path, timeout=900)
        assert "Slow: host-5 with known-good " in r.stdout, r.stdout
        print(r.stdout, file=sys.stderr)
    finally:
        sandbox_factory.down(sb)
