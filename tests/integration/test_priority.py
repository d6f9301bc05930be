"""part A: priority in the ledger, the queue's order, `provision policy`, on one
sandbox host with 2 (stand-in) GPUs shared by this module's tests. Each test destroys what
it applied."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import cli, first_output, ok, status, wait_until

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def gpu_host(sandbox_factory):
    sb = sandbox_factory(hosts=1, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def write(sb, make, d: Path, job: str, gpus: int, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    inv = d / f"{job}.yaml"
    make(sb, job=job, pools={"chief": {"replicas": 1, "accelerators": gpus, "command": LONG}}, path=inv, **extra)
    return inv


def jobs(inv: Path, env: dict[str, str] | None = None) -> dict[str, dict]:
    view = json.loads(ok(cli("jobs", "--json", inv, cwd=inv.parent, env=env)).stdout)
    return {j["job"]: j for j in view["jobs"]}


def queued(inv: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "provision", "apply", "-y", "--queue", "--timeout", "300", str(inv)],
        cwd=inv.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PROVISION_QUEUE_POLL": "1"},
    )


def test_high_goes_before_low_and_a_plain_apply_waits_its_turn(gpu_host, sandbox_inventory, tmp_path):
    filler = write(gpu_host, sandbox_inventory, tmp_path, "prio-filler", 1)
    low = write(gpu_host, sandbox_inventory, tmp_path, "prio-low", 2, priority="low")
    high = write(gpu_host, sandbox_inventory, tmp_path, "prio-high", 2, priority="high")
    small = write(gpu_host, sandbox_inventory, tmp_path, "prio-small", 1)
    procs: list[subprocess.Popen] = []
    try:
        ok(cli("apply", "-y", filler, cwd=tmp_path))  # one GPU of two held
        # low is submitted first, then high: both wait for the two GPUs.
        procs.append(queued(low))
        first_output(procs[0])
        wait_until(lambda: jobs(filler).get("prio-low", {}).get("state") == "queued", what="prio-low queued")
        procs.append(queued(high))
        first_output(procs[1])
        view = wait_until(
            lambda: (v := jobs(filler)).get("prio-high", {}).get("state") == "queued" and v, what="prio-high queued"
        )
        assert (view["prio-low"]["priority"], view["prio-low"]["priority_level"]) == ("low", 100)
        assert (view["prio-high"]["priority"], view["prio-high"]["priority_level"]) == ("high", 1000)
        assert (view["prio-filler"]["priority"], view["prio-filler"]["preemptible"]) == ("normal", False)
        text = ok(cli("jobs", filler, cwd=tmp_path)).stdout
        assert "PRIORITY" in text and "prio-high (" in text and "priority high) is queued since" in text, text
        assert text.index("prio-high (") < text.index("prio-low ("), text  # the queue's order

        # A plain apply that would fit on the free GPU does not slip past the queue: it fails
        # naming the work ahead (high: the head of the queue) and suggesting --queue.
        r = cli("apply", "-y", small, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "waiting behind prio-high (" in r.stderr and "priority high, queued" in r.stderr, r.stderr
        assert "apply --queue" in r.stderr and "Traceback" not in r.stderr

        # Room comes: high goes first though low was submitted first; low keeps waiting.
        ok(cli("destroy", "-y", filler, cwd=tmp_path))
        out, err = procs[1].communicate(timeout=120)
        assert procs[1].returncode == 0, out + err
        assert status(tmp_path, high)["phase"] == "Running"
        assert procs[0].poll() is None, "prio-low must still wait"
        assert jobs(high)["prio-low"]["state"] == "queued"
        # ... and goes once high leaves.
        ok(cli("destroy", "-y", high, cwd=tmp_path))
        out, err = procs[0].communicate(timeout=120)
        assert procs[0].returncode == 0, out + err
        assert status(tmp_path, low)["phase"] == "Running"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        for inv in (filler, low, high, small):
            cli("destroy", "-y", inv, cwd=tmp_path)


def test_policy_set_and_show_on_the_team_database(gpu_host, sandbox_inventory, postgres, tmp_path):
    env = {**postgres.env(), "PROVISION_STATE": postgres.url(), "PROVISION_OWNER": "ana@lab.example"}
    pol = tmp_path / "policy.yaml"
    # Bad input: one line each, naming the place; nothing stored.
    pol.write_text("classes: {low: 100, urgent: soon}\n")
    r = cli("policy", "set", pol, cwd=tmp_path, env=env)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"Error: {pol}:1: classes.urgent: expected an integer from -1000000 to 1000000, got 'soon'"
    ], r.stderr
    pol.write_text("guarantees: {nobody@lab.example: 2}\n")
    r = cli("policy", "set", pol, cwd=tmp_path, env=env)
    assert r.returncode == 1 and "'nobody@lab.example' is neither an owner the team knows" in r.stderr, r.stderr
    assert "ana@lab.example" in r.stderr  # the known owners, and where they come from
    shown = json.loads(ok(cli("policy", "show", "--json", cwd=tmp_path, env=env)).stdout)
    assert shown["set"] is False and shown["classes"] == {"low": 100, "normal": 500, "high": 1000}

    pol.write_text("classes: {low: 100, normal: 500, high: 1000, urgent: 2000}\nguarantees: {ana@lab.example: 2}\n")
    assert "Policy of" in ok(cli("policy", "set", pol, cwd=tmp_path, env=env)).stdout
    shown = json.loads(ok(cli("policy", "show", "--json", cwd=tmp_path, env=env)).stdout)
    assert shown["set"] is True and shown["updated_by"] == "ana@lab.example"
    assert shown["classes"]["urgent"] == 2000 and shown["guarantees"] == {"ana@lab.example": 2}
    text = ok(cli("policy", "show", cwd=tmp_path, env=env)).stdout
    assert "urgent 2000" in text and "ana@lab.example 2 GPUs" in text
    # The local state has none: show says so, set refuses in one line naming `state:`.
    local = {"PROVISION_STATE": "local"}
    assert "no team policy" in ok(cli("policy", "show", cwd=tmp_path, env=local)).stdout
    r = cli("policy", "set", pol, cwd=tmp_path, env=local)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "`state:`" in r.stderr

    # The policy's classes are what a job's `priority:` means with this state.
    inv = write(gpu_host, sandbox_inventory, tmp_path / "team", "prio-urgent", 1, priority="urgent")
    try:
        ok(cli("apply", "-y", inv, cwd=inv.parent, env=env))
        got = jobs(inv, env)["prio-urgent"]
        assert (got["priority"], got["priority_level"]) == ("urgent", 2000)
    finally:
        cli("destroy", "-y", inv, cwd=inv.parent, env=env)
