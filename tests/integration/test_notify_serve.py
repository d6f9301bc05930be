"""Notifications from a real `provision serve` on sandbox hosts, to an HTTP receiver on
loopback in the test (tests/notifyhelp.py): a job run from a terminal ends and its
job.ended reaches a signed webhook, with its words and its page's link (--public-url);
the service killed (kill -9) while a post is in flight loses nothing: the next service
sends what its rule's cursor had not passed, and a repeat carries the same event id."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest

from clirun import cli, ok, wait_until
from notifyhelp import Receiver

from .servehelp import APPLY_HOSTS, Service, service_env, show_logs

pytestmark = pytest.mark.integration

PUBLIC = "https://ml.example.org/provision"


def _watching(env: dict[str, str], hosts: list[str]) -> None:
    """Until the service's rounds watch `hosts` (a job that runs when the watch begins makes no event)."""

    def seen() -> bool:
        with sqlite3.connect(env["PROVISION_SERVICE_DB"]) as db:
            row = db.execute("SELECT doc FROM provision_service_seen WHERE name = 'rounds'").fetchone()
        return row is not None and set(hosts) <= set(json.loads(row[0])["hosts"])

    wait_until(seen, 60, 0.5, what=f"the rounds to watch {hosts}")


def _stream(env: dict[str, str]) -> list[tuple[int, str, str]]:
    """(id, kind, job) of every event the service stored."""
    with sqlite3.connect(env["PROVISION_SERVICE_DB"]) as db:
        return [
            (int(r[0]), str(r[1]), str(r[2])) for r in db.execute("SELECT id, kind, job FROM provision_service_events")
        ]


def _job(sb, sandbox_inventory, tmp_path: Path, name: str, command: str) -> Path:
    inv = tmp_path / f"{name}.yaml"
    pools = {"chief": {"replicas": 1, "accelerators": 1, "command": ["/bin/sh", "-c", command]}}
    sandbox_inventory(sb, job=name, path=inv, hosts=APPLY_HOSTS[:1], pools=pools)
    return inv


def _rule(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    r = cli("notify", "add", *args, cwd=tmp_path, env=env)
    ok(r)
    assert "SECRET-PATH-TOKEN" not in r.stdout + r.stderr
    return r.stdout.split()[2].rstrip(":")


def test_a_terminal_jobs_end_reaches_a_webhook_and_a_kill_9_loses_nothing(
    sandbox4, sandbox_inventory, tmp_path, job_name
) -> None:
    env = {**service_env(tmp_path), "HOOK_KEY": "k3y-of-the-team"}
    done, k9 = f"{job_name[:30]}-end", f"{job_name[:30]}-k9"
    invs = {n: _job(sandbox4, sandbox_inventory, tmp_path, n, "sleep 3") for n in (done, k9)}
    hook = Receiver()
    hang = threading.Event()
    stuck = Receiver(hang=hang)
    args = ("--listen", "none", "--public-url", PUBLIC, *(a for p in invs.values() for a in ("--inventory", str(p))))
    service = Service(tmp_path / "svc", env, args)
    try:
        rid = _rule(env, tmp_path, "--events", "job.ended", "--webhook", hook.url(), "--secret-env", "HOOK_KEY")
        service.start()
        _watching(env, APPLY_HOSTS[:1])

        # A terminal job's end: one signed post with its words and link.
        ok(cli("apply", "-y", invs[done], cwd=tmp_path, env=env))
        wait_until(lambda: any(g.doc["event"]["job"] == done for g in hook.taken()), 120, 0.5, what="its job.ended")
        got = [g for g in hook.taken() if g.doc["event"]["job"] == done]
        assert len(got) == 1 and got[0].signed_by(b"k3y-of-the-team"), got
        doc = got[0].doc
        assert doc["rule"] == rid and doc["event"]["kind"] == "job.ended" and doc["event"]["how"] == "succeeded"
        assert doc["title"].startswith(f"job {done} succeeded") and doc["link"] == f"{PUBLIC}/jobs/{done}"
        assert got[0].headers["x-provision-event"] == str(doc["event"]["id"])

        # kill -9 while a post is in flight: a second rule's receiver holds it.
        _rule(env, tmp_path, "--job", f"{job_name[:30]}-k9", "--webhook", stuck.url())
        ok(cli("apply", "-y", invs[k9], cwd=tmp_path, env=env))
        wait_until(lambda: stuck.arrived > 0, 120, 0.5, what="a post of k9's to be in flight")
        service.kill9()
        hang.set()  # the receiver takes what it held (its sender is gone: the answer is lost)
        wait_until(
            lambda: json.loads(cli("status", "--json", invs[k9], cwd=tmp_path, env=env).stdout)["phase"] == "Succeeded",
            60,
            1,
            what="k9 to end",
        )
        service.start()
        wait_until(
            lambda: {(i, kind) for i, kind, job in _stream(env) if job == k9 and kind == "job.ended"},
            120,
            1,
            what="k9's end",
        )
        want = {(i, kind) for i, kind, job in _stream(env) if job == k9}
        wait_until(
            lambda: {(g.doc["event"]["id"], g.doc["event"]["kind"]) for g in stuck.taken()} >= want,
            60,
            0.5,
            what=f"every event of k9 at the receiver: {sorted(want)}",
        )
        held = stuck.got[0].doc["event"]["id"]  # in flight at the kill: sent again by the next service
        assert [g.doc["event"]["id"] for g in stuck.taken()].count(held) >= 2
        by_id: dict[int, set[bytes]] = {}
        for g in stuck.taken():
            by_id.setdefault(g.doc["event"]["id"], set()).add(g.body)
        assert all(len(bodies) == 1 for bodies in by_id.values()), by_id  # a repeat is the same event, same id
        assert [g.doc["event"]["job"] for g in hook.taken()].count(done) == 1
        log = "".join(p.read_text() for p in (tmp_path / "svc").glob("serve-*.log"))
        assert "SECRET-PATH-TOKEN" not in log and "k3y-of-the-team" not in log
    except BaseException:
        show_logs(tmp_path)
        raise
    finally:
        hang.set()
        service.stop()
        for inv in invs.values():
            cli("destroy", "-y", inv, cwd=tmp_path, env=env)
        hook.close()
        stuck.close()
