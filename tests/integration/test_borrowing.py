"""GPUs borrowed beyond an owner's guarantee go back, on 3 sandbox hosts of 4
(stand-in) GPUs and a team state in PostgreSQL whose policy guarantees ana 8 GPUs and bob
4. Bob's preemptible jobs hold all 12 (4 on host-1; 8 on host-2 and host-3); ana's 8-GPU
job, within her guarantee, preempts the borrower whose leaving empties two hosts, and bob
keeps his guaranteed 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clirun import cli, ok

pytestmark = pytest.mark.integration

ANA, BOB = "ana@lab.example", "bob@lab.example"
SLEEP = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def cluster(sandbox_factory):
    sb = sandbox_factory(hosts=3, gpus_per_host=4)
    yield sb
    sandbox_factory.down(sb)


@pytest.fixture
def team(postgres) -> dict[str, str]:
    """The environment of a team state of its own (its policy is this test's alone)."""
    postgres.sql("CREATE DATABASE borrowing")
    return {**postgres.env(), "PROVISION_STATE": postgres.url(database="borrowing"), "PROVISION_QUEUE_POLL": "1"}


def job(sb, make, d: Path, name: str, replicas: int, **extra) -> Path:
    inv = d / f"{name}.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 4, "command": SLEEP}}
    if replicas > 1:
        pools["worker"] = {"replicas": replicas - 1, "accelerators": 4, "command": SLEEP}
    make(sb, job=name, pools=pools, path=inv, **extra)
    return inv


def phase(inv: Path, env: dict[str, str]) -> str:
    return str(json.loads(ok(cli("status", "--json", inv, cwd=inv.parent, env=env)).stdout)["phase"])


def hosts_of(inv: Path, env: dict[str, str], name: str) -> dict[str, list[int]]:
    view = json.loads(ok(cli("jobs", "--json", inv, cwd=inv.parent, env=env)).stdout)
    return {h: v["gpus"] for h, v in {j["job"]: j for j in view["jobs"]}[name]["hosts"].items() if v["gpus"]}


def test_a_guaranteed_job_takes_back_what_borrowers_hold(cluster, sandbox_inventory, team, tmp_path):
    bob, ana = {**team, "PROVISION_OWNER": BOB}, {**team, "PROVISION_OWNER": ANA}
    borrower = {"preemptible": True, "preemption": {"grace": "5s"}}
    a = job(cluster, sandbox_inventory, tmp_path, "walk-bob-a", 1, **borrower)
    b = job(cluster, sandbox_inventory, tmp_path, "walk-bob-b", 2, **borrower)
    mine = job(cluster, sandbox_inventory, tmp_path, "walk-ana", 2)
    try:
        ok(cli("apply", "-y", a, cwd=tmp_path, env=bob))
        ok(cli("apply", "-y", b, cwd=tmp_path, env=bob))
        assert hosts_of(a, bob, "walk-bob-a") == {"host-1": [0, 1, 2, 3]}
        assert hosts_of(b, bob, "walk-bob-b") == {"host-2": [0, 1, 2, 3], "host-3": [0, 1, 2, 3]}
        pol = tmp_path / "policy.yaml"
        pol.write_text(f"guarantees: {{{ANA}: 8, {BOB}: 4}}\n")
        ok(cli("policy", "set", pol, cwd=tmp_path, env=ana))

        r = cli("apply", "-y", "--queue", "--timeout", "90", mine, cwd=tmp_path, env=ana)
        assert r.returncode == 0, r.stdout + r.stderr
        for h in ("host-2", "host-3"):
            said = f"preempted job walk-bob-b ({BOB}, priority normal) on {h}: GPUs 0, 1, 2, 3"
            assert said in r.stderr and "(borrowing beyond its owner's guarantee)" in r.stderr, r.stderr
        assert "preempted job walk-bob-a" not in r.stderr, r.stderr  # bob keeps his guaranteed 4
        assert phase(mine, ana) == "Running"
        assert hosts_of(mine, ana, "walk-ana") == {"host-2": [0, 1, 2, 3], "host-3": [0, 1, 2, 3]}
        assert phase(a, bob) == "Running"
        assert phase(b, bob) == "Preempted"
    finally:
        for inv, env in ((mine, ana), (b, bob), (a, bob)):
            cli("destroy", "-y", inv, cwd=tmp_path, env=env)
