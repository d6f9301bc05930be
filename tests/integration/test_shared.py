"""a cluster shared by many jobs and many people, on real sandbox hosts.

Two hosts with 2 (stand-in) GPUs each. Each test destroys what it applied."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import cli, first_output, ok, sh, status, wait_until

pytestmark = pytest.mark.integration

LONG = ["/bin/sh", "-c", "exec sleep 600"]


@pytest.fixture(scope="module")
def shared(sandbox_factory):
    sb = sandbox_factory(hosts=2, gpus_per_host=2)
    yield sb
    sandbox_factory.down(sb)


def pair(gpus: int = 1) -> dict:
    """chief and worker, `gpus` each: one per host when both hosts are free."""
    return {
        "chief": {"replicas": 1, "accelerators": gpus, "command": LONG},
        "worker": {"replicas": 1, "accelerators": gpus, "command": LONG},
    }


def write(sb, make, d: Path, job: str, pools: dict, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    inv = d / f"{job}.yaml"
    make(sb, job=job, pools=pools, path=inv, **extra)
    return inv


def slots(inv: Path) -> dict[str, tuple[str, list[int], str]]:
    return {t["task"]: (t["host"], t["gpus"], t["address"]) for t in status(inv.parent, inv)["tasks"]}


def ledger(sb, host: str) -> dict[str, dict]:
    code, out = sb.docker_exec(
        host, ["/bin/sh", "-c", "for f in /var/lib/provision/.ledger/*.json; do [ -f $f ] && cat $f && echo; done"]
    )
    return {e["job"]: e for e in (json.loads(line) for line in out.splitlines() if line.strip())}


def age(inv: Path, job: str) -> int:
    """A job's age in seconds, as `provision jobs --json` shows it."""
    view = json.loads(ok(cli("jobs", "--json", inv, cwd=inv.parent)).stdout)
    return next(j["age_seconds"] for j in view["jobs"] if j["job"] == job)


def destroy(*invs: Path, take_over: bool = False) -> None:
    for inv in invs:
        if inv.exists():
            extra = ["--take-over"] if take_over else []
            cli("destroy", "-y", *extra, inv, cwd=inv.parent)


def test_jobs_side_by_side_then_full_then_queued(shared, sandbox_inventory, tmp_path):
    a = write(shared, sandbox_inventory, tmp_path, "exp-a", pair())
    b = write(shared, sandbox_inventory, tmp_path, "exp-b", pair())
    c = write(shared, sandbox_inventory, tmp_path, "exp-c", pair())
    d = write(shared, sandbox_inventory, tmp_path, "exp-d", {"chief": {"replicas": 1, "command": LONG}})
    try:
        ok(cli("apply", "-y", a, cwd=tmp_path))
        ok(cli("apply", "-y", b, cwd=tmp_path))
        sa, sb_ = slots(a), slots(b)
        # Disjoint GPUs and ports on every host, and both jobs run.
        for task in ("chief-0", "worker-0"):
            assert sa[task][0] == sb_[task][0]  # same host (one replica per host)...
            assert not set(sa[task][1]) & set(sb_[task][1])  # ...other GPUs
            assert sa[task][2] != sb_[task][2]  # ...and another port
        assert status(a.parent, a)["phase"] == "Running" and status(b.parent, b)["phase"] == "Running"
        # A job without GPUs (the third, on one host) still fits: ports only.
        ok(cli("apply", "-y", d, cwd=tmp_path))
        assert slots(d)["chief-0"][2].endswith(":2224")

        # The jobs view: three jobs, every GPU held, text and JSON.
        r = ok(cli("jobs", a, cwd=tmp_path))
        assert "exp-a" in r.stdout and "exp-b" in r.stdout and "exp-d" in r.stdout and "running" in r.stdout
        view = json.loads(ok(cli("jobs", "--json", a, cwd=tmp_path)).stdout)
        assert view["format_version"] == 1
        assert {j["job"]: j["state"] for j in view["jobs"]} == {
            "exp-a": "running",
            "exp-b": "running",
            "exp-d": "running",
        }
        assert view["hosts"] and all(h["free_gpus"] == [] for h in view["hosts"].values())
        assert all(isinstance(j["age_seconds"], int) and j["owner"] for j in view["jobs"])

        # A third GPU job does not fit: refused, naming the holders; nothing written.
        r = cli("apply", "-y", c, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "does not fit" in r.stderr and "held by job exp-a" in r.stderr and "held by job exp-b" in r.stderr
        assert "`provision apply --queue` waits until it fits" in r.stderr
        assert "Traceback" not in r.stderr
        assert "exp-c" not in ledger(shared, "host-1")

        # --queue waits, saying for what, and starts once a holder is destroyed.
        q = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", "--queue", "--timeout", "120", str(c)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PROVISION_QUEUE_POLL": "1"},
        )
        said = first_output(q)  # it says it waits (and what for) ...
        assert q.poll() is None, "the queued apply must wait"  # ... and waits
        # `provision jobs` shows the queued apply: who, since when, what it waits for.
        queued = wait_until(
            lambda: next(
                (
                    j
                    for j in json.loads(ok(cli("jobs", "--json", a, cwd=tmp_path)).stdout)["jobs"]
                    if j["job"] == "exp-c"
                ),
                None,
            ),
            what="exp-c in provision jobs",
        )
        assert queued["state"] == "queued" and queued["owner"], queued
        assert "does not fit" in queued["queued"]["waiting_for"] and queued["queued"]["since"], queued
        assert "exp-c (" in ok(cli("jobs", a, cwd=tmp_path)).stdout
        # Four more polls (one a second): the holders' ages change, what it waits for does not.
        then = age(a, "exp-a")
        wait_until(lambda: age(a, "exp-a") >= then + 4, 60, what="exp-a's age to move on by 4 s")
        ok(cli("destroy", "-y", a, cwd=tmp_path))
        out, err = q.communicate(timeout=120)
        err = said + err
        assert q.returncode == 0, out + err
        assert "queued" in err and "exp-a" in err
        # A line (and its holders) per change of what it waits for, never the same again per
        # poll: the holders' ages are not a change. (The destroy may change it once or twice.)
        blocks, cur = [], None
        for line in err.splitlines():
            if "queued (" in line:
                cur = [line.split("so far): ", 1)[1]]
                blocks.append(cur)
            elif cur is not None and "waiting for " in line:
                cur.append(re.sub(r"\d+[smhd]\b", "", line))
            else:
                cur = None
        assert blocks and all(a != b for a, b in zip(blocks, blocks[1:])), err
        assert status(c.parent, c)["phase"] == "Running"
        assert set(ledger(shared, "host-1")) == {"exp-b", "exp-c", "exp-d"}
    finally:
        destroy(a, b, c, d)
    # destroy leaves no ledger behind once the last job is gone
    code, out = shared.docker_exec("host-1", ["/bin/sh", "-c", "ls -A /var/lib/provision 2>&1 || true"])
    assert ".ledger" not in out


def test_a_foreign_listener_moves_the_port(shared, sandbox_inventory, tmp_path):
    code, out = shared.docker_exec("host-1", "systemd-run --unit squatter python3 -m http.server 2222 --bind 0.0.0.0")
    assert code == 0, out
    inv = write(
        shared, sandbox_inventory, tmp_path, "squat", {"chief": {"replicas": 1, "command": LONG}}, hosts=["host-1"]
    )
    try:
        wait_until(
            lambda: sh(shared, "host-1", "grep -q ' 0A ' /proc/net/tcp && grep -qi ':08AE ' /proc/net/tcp").code == 0,
            30,
            0.1,
            what="the squatter to listen on port 2222",
        )
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert slots(inv)["chief-0"][2].endswith(":2223")
        r = ok(cli("jobs", inv, cwd=tmp_path))
        assert "other processes: - / 2222" in r.stdout
    finally:
        destroy(inv)
        shared.docker_exec("host-1", "systemctl stop squatter")


def test_another_state_is_refused_until_take_over(shared, sandbox_inventory, tmp_path):
    alice, bob = tmp_path / "alice", tmp_path / "bob"
    a = write(shared, sandbox_inventory, alice, "owned", pair(), env={"V": "1"})
    b = write(shared, sandbox_inventory, bob, "owned", pair(), env={"V": "2"})
    try:
        ok(cli("apply", "-y", a, cwd=alice, env={"PROVISION_OWNER": "alice@example.com"}))
        # The owner as the team knows her: jobs, status, refusals.
        assert "alice@example.com" in ok(cli("jobs", a, cwd=alice)).stdout
        assert status(a.parent, a)["owner"] == "alice@example.com"
        before = {t["task"] for t in status(a.parent, a)["tasks"]}
        env_before = shared.docker_exec("host-1", "cat /etc/provision/owned/chief-0.env")[1]
        for verb in ("plan", "apply", "destroy"):
            r = cli(verb, *(["-y"] if verb != "plan" else []), b, cwd=bob)
            assert r.returncode == 1, f"{verb}: {r.stdout + r.stderr}"
            assert "belongs to alice@example.com" in r.stderr and "--take-over" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        # Nothing changed on the hosts: same env file, tasks never restarted.
        assert shared.docker_exec("host-1", "cat /etc/provision/owned/chief-0.env")[1] == env_before
        assert status(a.parent, a)["phase"] == "Running"
        assert {t["task"] for t in status(a.parent, a)["tasks"]} == before
        # Reading works from anyone's state.
        assert status(b.parent, b)["phase"] == "Running"

        ok(cli("apply", "-y", "--take-over", b, cwd=bob))
        assert 'V="2"' in shared.docker_exec("host-1", "cat /etc/provision/owned/chief-0.env")[1]
        r = cli("apply", "-y", a, cwd=alice)  # now alice is the other state
        assert r.returncode == 1 and "belongs to" in r.stderr
        ok(cli("plan", "--detailed-exitcode", b, cwd=bob))
    finally:
        destroy(b, take_over=True)
        destroy(a)


@pytest.mark.parametrize("round_", range(3))
def test_two_applies_racing_for_the_same_gpus(shared, sandbox_inventory, tmp_path, round_):
    """Both want every GPU of both hosts, at the same moment: no GPU is ever given twice;
    the loser fails cleanly (exit 1, saying it lost) and holds nothing."""
    x = write(shared, sandbox_inventory, tmp_path, "race-x", pair(2))
    y = write(shared, sandbox_inventory, tmp_path, "race-y", pair(2))
    try:
        procs = {
            inv: subprocess.Popen(
                [sys.executable, "-m", "provision", "apply", "-y", str(inv)],
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for inv in (x, y)
        }
        results = {inv: (p.wait(timeout=180), p.stderr.read()) for inv, p in procs.items()}
        winners = [inv for inv, (code, _) in results.items() if code == 0]
        assert len(winners) <= 1, results
        for code, err in results.values():
            assert "Traceback" not in err
            if code != 0:
                assert "taken by job" in err or "rolled back" in err or "does not fit" in err, err
        for host in ("host-1", "host-2"):
            entries = ledger(shared, host)
            given = [g for e in entries.values() for g in e["gpus"]]
            assert len(given) == len(set(given)), f"{host}: a GPU given twice: {entries}"
            for inv in results:
                if inv not in winners:
                    assert inv.stem not in entries, f"{host}: the loser {inv.stem} still holds {entries}"
        for inv in winners:
            assert status(inv.parent, inv)["phase"] == "Running"
    finally:
        destroy(x, y)


def test_a_killed_apply_leaves_a_stale_reservation_that_is_reclaimed(shared, sandbox_inventory, tmp_path):
    """SIGKILL between reserving (the write) and starting: `jobs` shows the reservation as
    stale, and another job's apply takes its GPUs."""
    k = write(
        shared,
        sandbox_inventory,
        tmp_path,
        "killed",
        {
            "ps": {"replicas": 1, "command": LONG, "hosts": ["host-2"]},
            "worker": {"replicas": 1, "command": LONG, "hosts": ["host-2"]},
            "chief": {"replicas": 1, "accelerators": 2, "command": LONG, "hosts": ["host-1"]},
        },
    )
    other = write(
        shared,
        sandbox_inventory,
        tmp_path,
        "claimer",
        {"chief": {"replicas": 1, "accelerators": 2, "command": LONG, "hosts": ["host-1"]}},
    )
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "provision", "apply", "-y", str(k)],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PROVISION_TEST_PAUSE": "START:60"},
        )
        # Reserved on both hosts: it is paused before starting (PROVISION_TEST_PAUSE).
        wait_until(
            lambda: all("killed" in ledger(shared, h) for h in ("host-1", "host-2")),
            30,
            0.1,
            what="the apply to reserve on both hosts",
        )
        p.send_signal(signal.SIGKILL)
        p.wait()
        held = ledger(shared, "host-1")
        assert "killed" in held, p.stderr.read() if p.stderr else ""
        entry = held["killed"]
        assert entry["started"] is False and entry["gpus"] == [0, 1]
        view = json.loads(ok(cli("jobs", "--json", k, cwd=tmp_path)).stdout)
        killed = next(j for j in view["jobs"] if j["job"] == "killed")
        assert killed["hosts"]["host-1"]["state"] == "stale"
        assert view["hosts"]["host-1"]["free_gpus"] == [0, 1]
        assert "stale" in ok(cli("jobs", k, cwd=tmp_path)).stdout

        ok(cli("apply", "-y", other, cwd=tmp_path))  # reclaims GPUs 0-1
        assert slots(other)["chief-0"][1] == [0, 1]
        # The killed job, applied again, now does not fit: its GPUs were reclaimed.
        r = cli("apply", "-y", k, cwd=tmp_path)
        assert r.returncode == 1 and "held by job claimer" in r.stderr, r.stderr
    finally:
        destroy(other, k)


def test_drain_moves_tasks_away_and_the_job_still_succeeds(shared, sandbox_inventory, tmp_path):
    """`drain: true` on a host moves its task to another host while it is up."""
    from provision.sandbox.inventory import dump

    pools = {
        "chief": {"replicas": 1, "command": ["/bin/sh", "-c", "sleep 12"]},
        "worker": {"replicas": 1, "command": LONG},
    }
    inv = tmp_path / "drain.yaml"
    data = sandbox_inventory(shared, job="drain", pools=pools, path=inv)
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        before = slots(inv)
        assert {before["chief-0"][0], before["worker-0"][0]} == {"host-1", "host-2"}
        drained = before["worker-0"][0]
        for h in data["hosts"]:
            h["drain"] = h["name"] == drained
        inv.write_text(dump(data, shared))
        r = ok(cli("apply", "-y", inv, cwd=tmp_path))
        after = slots(inv)
        assert {host for host, _, _ in after.values()} == {before["chief-0"][0]}, r.stdout
        code, out = shared.docker_exec(
            drained,
            ["/bin/sh", "-c", "ls /etc/provision/drain 2>&1; systemctl list-units 'provision-drain-*' --no-legend"],
        )
        assert "No such file" in out and "provision-drain" not in out.replace("/etc/provision/drain", "")
        ok(cli("wait", "--timeout", "60", inv, cwd=tmp_path))
        assert status(inv.parent, inv)["phase"] == "Succeeded"
    finally:
        destroy(inv)


def plan_json(inv: Path) -> dict:
    r = cli("plan", "--json", inv, cwd=inv.parent)
    assert r.returncode in (0, 2), r.stdout + r.stderr
    return json.loads(r.stdout)


def task_actions(p: dict) -> dict[str, tuple[str, str]]:
    return {t["task"]: (t["action"], t["why"]) for h in p["hosts"].values() for t in h["tasks"]}


def test_a_synchronous_job_restarts_as_a_unit(shared, sandbox_inventory, tmp_path):
    """a DDP-style job (no ps) whose worker's env changes restarts chief and
    worker together; with a host of it paused the apply refuses (exit 3) and nothing
    restarts; --rerun starts a finished job again."""
    pools = {
        "chief": {"replicas": 1, "command": LONG},
        "worker": {"replicas": 1, "command": LONG, "env": {"V": "1"}},
    }
    inv = tmp_path / "unit.yaml"
    sandbox_inventory(shared, job="unit", pools=pools, path=inv, ssh={"connect_timeout": 5})
    try:
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        chief_host = slots(inv)["chief-0"][0]
        worker_host = slots(inv)["worker-0"][0]
        pools["worker"]["env"] = {"V": "2"}
        sandbox_inventory(shared, job="unit", pools=pools, path=inv, ssh={"connect_timeout": 5})
        acts = task_actions(plan_json(inv))
        assert acts["worker-0"][0] == "restart" and "changed" in acts["worker-0"][1]
        assert acts["chief-0"] == ("restart", "restarts with the job (worker-0 restarts: its tasks run together)")
        pid = lambda h: shared.docker_exec(h, "systemctl show -p MainPID --value provision-unit-chief-0")[1].strip()  # noqa: E731
        chief_pid = pid(chief_host)
        ok(cli("apply", "-y", inv, cwd=tmp_path))
        assert pid(chief_host) != chief_pid, "the chief restarted with the worker"

        # A change for every task while the worker's host is down: refused, nothing restarts.
        sandbox_inventory(shared, job="unit", pools=pools, path=inv, ssh={"connect_timeout": 5}, env={"ALL": "1"})
        chief_pid = pid(chief_host)
        shared.container(worker_host).pause()
        try:
            r = cli("apply", "-y", inv, cwd=tmp_path, timeout=60)
        finally:
            shared.container(worker_host).unpause()
        assert r.returncode == 3, r.stdout + r.stderr
        assert "runs its tasks together" in r.stderr and "--partial" in r.stderr and "Traceback" not in r.stderr
        assert pid(chief_host) == chief_pid, "nothing restarted"
        ok(cli("apply", "-y", inv, cwd=tmp_path))  # host back: converges
    finally:
        destroy(inv)


def test_rerun_starts_a_finished_job_again(shared, sandbox_inventory, tmp_path):
    quick = ["/bin/sh", "-c", "echo run; sleep 1"]
    pools = {"chief": {"replicas": 1, "command": quick}, "worker": {"replicas": 1, "command": quick}}
    inv = tmp_path / "again.yaml"
    sandbox_inventory(shared, job="again", pools=pools, path=inv)
    try:
        r = cli("apply", "-y", "--rerun", inv, cwd=tmp_path)  # nothing to rerun yet: not finished
        assert r.returncode == 1 and "has not finished" in r.stderr, r.stderr
        ok(cli("apply", "-y", "--wait", "--timeout", "60", inv, cwd=tmp_path))
        assert "No changes" in ok(cli("apply", "-y", inv, cwd=tmp_path)).stdout  # a finished job stays finished
        acts = task_actions(json.loads(ok(cli("apply", "-y", "--rerun", "--json", inv, cwd=tmp_path)).stdout)["plan"])
        assert acts == {"chief-0": ("restart", "rerun requested"), "worker-0": ("restart", "rerun requested")}
        st = status(inv.parent, inv)
        assert st["phase"] in ("Running", "Succeeded") and st["tasks"] and all(t["restarts"] == 0 for t in st["tasks"])
        ok(cli("wait", "--timeout", "60", inv, cwd=tmp_path))
    finally:
        destroy(inv)


@pytest.mark.parametrize("bad", ["garbage\n", '{"job": "steal", "gpus": [0, 1'])
def test_an_unreadable_ledger_entry_holds_the_host(shared, sandbox_inventory, tmp_path, bad):
    """item 9: a ledger entry that is not JSON (or cut short) made its job's GPUs
    look free; now it holds the host until fixed, and every message names the file."""
    path = "/var/lib/provision/.ledger/steal.json"
    code, out = shared.docker_exec(
        "host-1", ["/bin/sh", "-c", f"mkdir -p /var/lib/provision/.ledger && printf %s '{bad}' > {path}"]
    )
    assert code == 0, out
    inv = write(shared, sandbox_inventory, tmp_path, "victim", pair(), hosts=["host-1"])
    try:
        r = cli("apply", "-y", inv, cwd=tmp_path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"ledger entry {path} (" in r.stderr and "cannot be read" in r.stderr and "Traceback" not in r.stderr
        assert (
            shared.docker_exec("host-1", "test -e /var/lib/provision/.ledger/victim.json")[0] != 0
        )  # nothing reserved
        j = ok(cli("jobs", inv, cwd=tmp_path)).stdout
        assert f"unreadable ledger entry {path}" in j, j
        # Removed: the host is usable again.
        shared.docker_exec("host-1", f"rm -f {path}")
        ok(cli("apply", "-y", inv, cwd=tmp_path))
    finally:
        shared.docker_exec("host-1", f"rm -f {path}")
        destroy(inv)


def test_two_jobs_share_a_pushed_file_with_the_same_bytes_only(shared, sandbox_inventory, tmp_path):
    """item 1: a variant of a job (the inventory copied, the job renamed) shares
    the pushed files it has in common; a file with other bytes is refused naming its job,
    and `replace: true` never takes it."""
    code = tmp_path / "train.py"
    code.write_text("print('v1')\n")
    dest = "/opt/shared-variant/train.py"
    files = [{"src": str(code), "dest": dest}]
    one = {"chief": {"replicas": 1, "hosts": ["host-1"], "command": LONG}}
    a = write(shared, sandbox_inventory, tmp_path / "a", "variant-a", one, files=files)
    b = write(shared, sandbox_inventory, tmp_path / "b", "variant-b", one, files=files)

    def on_host() -> str:
        return shared.docker_exec("host-1", ["/bin/sh", "-c", f"cat {dest} || echo gone"])[1]

    try:
        ok(cli("apply", "-y", a, cwd=a.parent, env={"PROVISION_OWNER": "ana@lab"}))
        p = ok(cli("plan", b, cwd=b.parent))
        assert f"= file {dest} (the same file as job variant-a's: shared, not written)" in p.stdout, p.stdout
        assert json.loads(ok(cli("plan", "--json", b, cwd=b.parent)).stdout)["hosts"]["host-1"]["shared_files"] == [
            {"path": dest, "job": "variant-a"}
        ]
        ok(cli("apply", "-y", b, cwd=b.parent))
        assert status(a.parent, a)["phase"] == status(b.parent, b)["phase"] == "Running"

        # b's own edit would change what a runs: refused, and so is replace: true.
        code.write_text("print('v2')\n")
        for entry in (files, [{**files[0], "replace": True}]):
            write(shared, sandbox_inventory, tmp_path / "b", "variant-b", one, files=entry)
            r = cli("apply", "-y", b, cwd=b.parent)
            assert r.returncode == 1 and f"{dest} is shared with job variant-a (ana@lab)" in r.stderr, r.stderr
            assert "Traceback" not in r.stderr
        assert "v1" in on_host()

        # Destroying one keeps the file for the other; the last one removes it.
        code.write_text("print('v1')\n")
        destroy(a)
        assert "v1" in on_host() and status(b.parent, b)["phase"] == "Running"
        # A third job with other bytes is refused, naming the job that has the path.
        code.write_text("print('v3')\n")
        c = write(shared, sandbox_inventory, tmp_path / "c", "variant-c", one, files=[{**files[0], "replace": True}])
        r = cli("apply", "-y", c, cwd=c.parent)
        assert r.returncode == 1 and f"{dest} belongs to job variant-b" in r.stderr, r.stderr
        assert "set `replace: true`" not in r.stderr and "v1" in on_host()
        destroy(b)
        assert "gone" in on_host()
    finally:
        destroy(b, a)


def test_a_finished_variant_does_not_hold_the_originals_files(shared, sandbox_inventory, tmp_path):
    """item 14: a variant job kept the original's pushed files locked after it had
    finished (plan of the original refused until the variant was destroyed). A finished
    job's claim does not block a change it will never read again; plan says what its rerun
    then meets (its own bytes written back, refused while a running job uses the new ones)."""
    code = tmp_path / "train.py"
    code.write_text("print('v1')\n")
    dest = "/opt/shared-finished/train.py"
    files = [{"src": str(code), "dest": dest}]
    one = {"chief": {"replicas": 1, "hosts": ["host-1"], "command": LONG}}
    quick = {"chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "echo ran"]}}
    a = write(shared, sandbox_inventory, tmp_path / "a", "orig-a", one, files=files)
    b = write(shared, sandbox_inventory, tmp_path / "b", "variant-done", quick, files=files)

    def on_host() -> str:
        return shared.docker_exec("host-1", ["/bin/sh", "-c", f"cat {dest} || echo gone"])[1]

    try:
        ok(cli("apply", "-y", a, cwd=a.parent))
        ok(cli("apply", "-y", "--wait", "--timeout", "60", b, cwd=b.parent))
        assert status(b.parent, b)["phase"] == "Succeeded"

        code.write_text("print('v2')\n")
        write(shared, sandbox_inventory, tmp_path / "a", "orig-a", one, files=files)
        p = cli("plan", a, cwd=a.parent)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"{dest} is shared with job variant-done, which has finished: this apply changes it" in p.stderr
        assert "a rerun of variant-done writes its own bytes back" in p.stderr, p.stderr
        ok(cli("apply", "-y", a, cwd=a.parent))
        assert "v2" in on_host() and status(a.parent, a)["phase"] == "Running"

        # The variant's own plan: nothing to write, nothing refused (it reads nothing now).
        code.write_text("print('v1')\n")
        p = cli("plan", "--detailed-exitcode", b, cwd=b.parent)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"{dest} was changed by job orig-a" in p.stderr and "cannot start again while orig-a runs" in p.stderr
        # Its rerun would start it with v2 (or write v1 under the running original): refused.
        r = cli("apply", "-y", "--rerun", b, cwd=b.parent)
        assert r.returncode == 1 and f"{dest} is shared with job orig-a" in r.stderr, r.stdout + r.stderr
        assert "Traceback" not in r.stderr and "v2" in on_host()
        # The original finished too (stopped): the variant's rerun writes its bytes back.
        ok(cli("stop", "-y", a, cwd=a.parent))
        ok(cli("apply", "-y", "--rerun", "--wait", "--timeout", "60", b, cwd=b.parent))
        assert "v1" in on_host()
    finally:
        destroy(b, a)
