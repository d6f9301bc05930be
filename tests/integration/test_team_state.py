"""a job's state in PostgreSQL, shared by a team, on real sandbox hosts and a real
PostgreSQL server (tests/pgserver.py, the `postgres` fixture).

Two checkouts are two directories with their own HOME and owner name (PROVISION_OWNER),
the same inventory in each, both pointing at one database through PROVISION_STATE. Each
test uses its own job and destroys what it applied."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import cli, ok, wait_until

pytestmark = pytest.mark.integration

SAY = ["/bin/sh", "-c", "echo hello-$MODE; exec sleep 600"]
POOLS = {"chief": {"replicas": 1, "command": SAY}, "worker": {"replicas": 1, "command": SAY}}


@pytest.fixture(scope="module")
def hosts(sandbox3):
    """host-1 and host-2 of the session's sandbox3: inventories list these two only."""
    return dataclasses.replace(sandbox3, hosts=sandbox3.hosts[:2])


class Checkout:
    """One teammate's checkout: a directory with the inventory, a HOME, a name."""

    def __init__(self, root: Path, who: str, env: dict[str, str]):
        self.dir = root / who.split("@")[0]
        (self.dir / "home").mkdir(parents=True, exist_ok=True)
        self.env = {"HOME": str(self.dir / "home"), "PROVISION_OWNER": who, **env}
        self.inv = self.dir / "inv.yaml"

    def run(self, *args: str, **env: str):
        return cli(*args, cwd=self.dir, env={**self.env, **env})

    def ok(self, *args: str, **env: str):
        return ok(self.run(*args, **env))

    def json(self, *args: str, **env: str) -> dict:
        return json.loads(self.ok(*args, "--json", self.inv, **env).stdout)

    def popen(self, *args: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "provision", *args],
            cwd=self.dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.env, **env},
        )


def team(tmp_path, postgres, hosts, make, job: str, **extra) -> tuple[Checkout, Checkout]:
    env = {**postgres.env(), "PROVISION_STATE": postgres.url()}
    a, b = Checkout(tmp_path, "ana@lab.example", env), Checkout(tmp_path, "bo@lab.example", env)
    make(hosts, job=job, pools=POOLS, path=a.inv, env={"MODE": "a"}, **extra)
    shutil.copy(a.inv, b.inv)  # B's clone of the same repository
    return a, b


def set_mode(c: Checkout, mode: str) -> None:
    c.inv.write_text(c.inv.read_text().replace("MODE: a", f"MODE: {mode}"))


def row(postgres, job: str) -> tuple[int, str] | None:
    out = postgres.sql(f"SELECT serial, lineage FROM provision_state WHERE job = '{job}'").strip()
    if not out:
        return None
    serial, lineage = out.split("|")
    return int(serial), lineage


def one_error_line(r) -> str:
    """The command failed with exactly one Error: line, no traceback, no password."""
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert r.returncode == 1 and len(errors) == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "provision-test-password" not in r.stdout + r.stderr
    return errors[0]


def test_two_checkouts_one_backend(postgres, hosts, sandbox_inventory, tmp_path):
    a, b = team(tmp_path, postgres, hosts, sandbox_inventory, "team-ab")
    try:
        a.ok("apply", "-y", a.inv)
        # B, from its own checkout and HOME, sees A's job: status, owner, logs.
        st = b.json("status")
        assert st["phase"] == "Running" and st["owner"] == "ana@lab.example", st
        wait_until(lambda: "hello-a" in b.ok("logs", b.inv).stdout, what="B reads the tasks' output")
        # B changes an env value: no --take-over, the same owner (one lineage, from the database).
        set_mode(b, "b")
        # A's content is A's: -y alone does not replace it; B says so.
        refused = b.run("apply", "-y", b.inv)
        assert refused.returncode != 0 and "--force-conflicts" in one_error_line(refused), refused.stderr
        r = b.ok("apply", "-y", "--force-conflicts", b.inv)
        assert "Apply complete!" in r.stdout
        wait_until(lambda: "hello-b" in b.ok("logs", b.inv).stdout, what="the tasks restarted with B's value")
        assert a.json("status")["phase"] == "Running"
        # Who did what, seen from either checkout.
        hist = a.json("state", "history")["changes"]
        assert [(c["who"], c["operation"]) for c in hist] == [("bo@lab.example", "apply"), ("ana@lab.example", "apply")]
        assert hist[0]["summary"].startswith("Apply complete! Resources: ")
        shown = b.json("state", "show")
        assert shown["backend"]["type"] == "postgresql" and shown["serial"] == row(postgres, "team-ab")[0]
        assert set(shown["hosts"]) == {"host-1", "host-2"} and shown["lock"] is None
        # B destroys it; A's next plan shows nothing of it left on the hosts.
        assert "Destroy complete!" in b.ok("destroy", "-y", b.inv).stdout
        plan = a.json("plan")
        assert plan["summary"]["change"] == 0 and plan["summary"]["destroy"] == 0, plan["summary"]
        assert all(t["new"] for h in plan["hosts"].values() for t in h["tasks"])
        assert a.json("state", "show")["hosts"] == {}
        last = b.ok("state", "history", "-n", "1", b.inv).stdout.splitlines()
        assert len(last) == 1 and "  bo@lab.example  destroy (serial " in last[0], last
    finally:
        b.run("destroy", "-y", b.inv)


def test_racing_applies_and_a_killed_holder(postgres, hosts, sandbox_inventory, tmp_path):
    a, b = team(tmp_path, postgres, hosts, sandbox_inventory, "team-race")
    try:
        a.ok("apply", "-y", a.inv)
        before = row(postgres, "team-race")
        set_mode(a, "c")
        set_mode(b, "d")
        # A's apply holds the lock (paused before it asks the hosts); B's is refused, naming A.
        slow = a.popen("apply", "-y", str(a.inv), PROVISION_TEST_PAUSE="PROBE:120")
        try:
            wait_until(lambda: b.json("state", "show")["lock"], timeout=60, every=0.3, what="A holds the lock")
            line = one_error_line(b.run("apply", "-y", b.inv))
            assert "state is locked: apply by ana@lab.example" in line and postgres.url() in line, line
            assert row(postgres, "team-race") == before  # B wrote nothing
            # SIGKILL A: its session ends, the server frees the lock.
            slow.send_signal(signal.SIGKILL)
            slow.wait(30)
        finally:
            if slow.poll() is None:
                slow.kill()
            slow.communicate()
        wait_until(lambda: b.json("state", "show")["lock"] is None, timeout=30, every=0.3, what="the lock freed")
        assert row(postgres, "team-race") == before  # A wrote nothing either
        r = b.ok("apply", "-y", "--force-conflicts", b.inv)  # A's content is replaced on purpose
        assert "ended without releasing it" in r.stderr  # the note about the dead holder
        assert row(postgres, "team-race")[1] == before[1]
        assert b.run("plan", "--detailed-exitcode", b.inv).returncode == 0
        wait_until(lambda: "hello-d" in b.ok("logs", b.inv).stdout, what="B's apply converged")
    finally:
        b.run("destroy", "-y", b.inv)


def test_the_database_stopped_in_the_middle_of_an_apply(postgres, hosts, sandbox_inventory, tmp_path):
    a, _ = team(tmp_path, postgres, hosts, sandbox_inventory, "team-down")
    try:
        a.ok("apply", "-y", a.inv)
        serial, _ = row(postgres, "team-down")
        set_mode(a, "e")
        # Paused before it writes the hosts (the pending records saved): the database goes.
        p = a.popen("apply", "-y", str(a.inv), PROVISION_TEST_PAUSE="WRITE:8")
        try:
            wait_until(lambda: row(postgres, "team-down")[0] > serial, timeout=60, every=0.2, what="pending saved")
            postgres.stop()
            out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
            postgres.start()
        r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        line = one_error_line(r)
        assert line.startswith(f"Error: {postgres.url()}: cannot save job team-down's state"), line
        assert "the next apply (with the database back) finds it and converges" in line
        # The database is back: the next apply converges, and then there is nothing to do.
        a.ok("apply", "-y", a.inv)
        assert a.run("plan", "--detailed-exitcode", a.inv).returncode == 0
        wait_until(lambda: "hello-e" in a.ok("logs", a.inv).stdout, what="the tasks run with the new value")
    finally:
        a.run("destroy", "-y", a.inv)


def test_migrate_local_to_postgresql_and_back(postgres, hosts, sandbox_inventory, tmp_path):
    solo = Checkout(tmp_path, "ana@lab.example", postgres.env())
    sandbox_inventory(hosts, job="team-move", pools=POOLS, path=solo.inv, env={"MODE": "a"})
    pg = {"PROVISION_STATE": postgres.url()}
    try:
        solo.ok("apply", "-y", solo.inv)
        local = solo.json("state", "show")
        assert local["backend"]["type"] == "local" and local["exists"]
        key = (local["lineage"], local["serial"])

        r = solo.ok("state", "migrate", solo.inv, "--to", postgres.url())
        assert f"export PROVISION_STATE={postgres.url()}" in r.stdout
        there = solo.json("state", "show", **pg)
        assert (there["lineage"], there["serial"]) == key and there["backend"]["type"] == "postgresql"
        assert solo.run("plan", "--detailed-exitcode", solo.inv, **pg).returncode == 0
        # The old local state is retired: used by mistake, it says where the state went.
        assert f"was moved to {postgres.url()} by `provision state migrate`" in one_error_line(
            solo.run("plan", solo.inv)
        )

        r = solo.ok("state", "migrate", solo.inv, "--to", "local", **pg)
        assert "unset PROVISION_STATE" in r.stdout
        back = solo.json("state", "show")
        assert (back["lineage"], back["serial"]) == key
        assert solo.run("plan", "--detailed-exitcode", solo.inv).returncode == 0
        assert "was moved to local" in one_error_line(solo.run("plan", solo.inv, **pg))
        changes = solo.json("state", "history")["changes"]
        assert changes[0]["summary"] == f"Migrated from {postgres.url()}." and changes[-1]["operation"] == "apply"
    finally:
        solo.run("destroy", "-y", solo.inv)


def test_bad_input_is_one_line_and_changes_nothing(postgres, hosts, sandbox_inventory, tmp_path):
    a, _ = team(tmp_path, postgres, hosts, sandbox_inventory, "team-bad")
    url = postgres.url()
    # Unreachable, wrong password, no password, no such database: one line naming the URL.
    closed = url.replace(f":{postgres.port}/", ":1/")
    assert "Connection refused" in one_error_line(a.run("plan", a.inv, PROVISION_STATE=closed))
    line = one_error_line(a.run("apply", "-y", a.inv, PGPASSWORD="wrong"))
    assert line.startswith(f"Error: {url}: cannot connect:") and "password authentication failed" in line, line
    assert "no password supplied" in one_error_line(a.run("plan", a.inv, PGPASSWORD="", PGPASSFILE="/dev/null"))
    nodb = postgres.url(database="nosuch")
    assert 'database "nosuch" does not exist' in one_error_line(a.run("plan", a.inv, PROVISION_STATE=nodb))
    # A password in the URL: refused from the variable and from the inventory (naming the key).
    line = one_error_line(a.run("plan", a.inv, PROVISION_STATE=postgres.url(password=True)))
    assert line.startswith("Error: PROVISION_STATE: a password in the URL is not accepted"), line
    a.inv.write_text(a.inv.read_text() + f"state: {postgres.url(password=True)}\n")
    line = one_error_line(a.run("validate", a.inv, PROVISION_STATE=""))
    assert ": state: a password in the URL is not accepted" in line, line
    # A database without provision's tables: created on first use, with a schema version.
    if not postgres.sql("SELECT 1 FROM pg_database WHERE datname = 'fresh'").strip():
        postgres.sql("CREATE DATABASE fresh")
    fresh = postgres.url(database="fresh")
    a.inv.write_text(a.inv.read_text().replace(f"state: {postgres.url(password=True)}\n", ""))
    assert "No state yet" in a.ok("state", "show", a.inv, PROVISION_STATE=fresh).stdout
    assert postgres._psql("fresh", "SELECT value FROM provision_meta WHERE name = 'schema_version'").strip() == "1"
    # ... and one a newer provision set up: refused.
    postgres._psql("fresh", "UPDATE provision_meta SET value = '99' WHERE name = 'schema_version'")
    line = one_error_line(a.run("apply", "-y", a.inv, PROVISION_STATE=fresh))
    assert "schema version 99, newer than this provision knows (1)" in line, line
    # A state row from a newer provision: refused, the row untouched.
    doc = json.dumps({"format_version": 3, "job": "team-bad", "lineage": "x", "serial": 5, "hosts": {}})
    postgres.sql(
        "INSERT INTO provision_state (job, lineage, serial, format_version, doc) "
        f"VALUES ('team-bad', 'x', 5, 3, '{doc}')"
    )
    line = one_error_line(a.run("apply", "-y", a.inv))
    assert line == f"Error: {url}: state format 3 is not 2; this provision cannot read it", line
    assert row(postgres, "team-bad") == (5, "x")
    assert "Traceback" not in a.run("state", "show", a.inv).stderr
    postgres.sql("DELETE FROM provision_state WHERE job = 'team-bad'")


def test_pending_after_the_database_stopped_is_cleared_by_the_next_apply(postgres, hosts, sandbox_inventory, tmp_path):
    """item 16: after the database stopped mid-apply (the hosts written, the last
    save refused) and came back, `state show` kept saying `pending` through every later
    no-op apply."""
    a, _ = team(tmp_path, postgres, hosts, sandbox_inventory, "team-pending")
    try:
        a.ok("apply", "-y", a.inv)
        serial, _ = row(postgres, "team-pending")
        set_mode(a, "f")
        p = a.popen("apply", "-y", str(a.inv), PROVISION_TEST_PAUSE="WRITE:8")
        try:
            wait_until(lambda: row(postgres, "team-pending")[0] > serial, timeout=60, every=0.2, what="pending saved")
            postgres.stop()
            out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
            postgres.start()
        assert p.returncode == 1 and "cannot save job team-pending's state" in err, out + err
        assert any(h["pending"] for h in a.json("state", "show")["hosts"].values())
        for _ in range(2):  # the next applies have nothing to change on the hosts
            a.ok("apply", "-y", a.inv)
            hosts_ = a.json("state", "show")["hosts"]
            assert hosts_ and not any(h["pending"] for h in hosts_.values()), hosts_
            rows_ = [l for l in a.ok("state", "show", a.inv).stdout.splitlines() if l.startswith("  host-")]
            assert len(rows_) == 2 and not any(l.endswith("pending") for l in rows_), rows_
        assert a.run("plan", "--detailed-exitcode", a.inv).returncode == 0
    finally:
        a.run("destroy", "-y", a.inv)
