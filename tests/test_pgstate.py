"""Team state in PostgreSQL (io/pgstate.py) against a real server (the `postgres` fixture, no
hosts): two clients never both write a state, the lock is the database's and dies with its
holder, force-unlock ends a hung holder's session, the key is shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clirun import wait_until
from provision.core.errors import ProvisionError
from provision.core.records import HostRecord
from provision.inventory.statebackend import Backend
from provision.io.state import State, open_store

pytest.importorskip("psycopg")


@pytest.fixture
def stores(postgres, monkeypatch, request):
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    job = "pg-" + request.node.name.removeprefix("test_").replace("_", "-")[:30]
    opened = []

    def make():
        s = open_store(Backend(postgres.url(), "test"), Path("/nonexistent") / f"{job}.state.json", job)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


HOLD = """
import os, sys, time
from pathlib import Path
from provision.io.state import open_store
from provision.inventory.statebackend import Backend
lock = open_store(Backend(sys.argv[1]), Path("/nonexistent/x.json"), sys.argv[2]).lock("apply").acquire()
print(lock.info.id, flush=True)
time.sleep(120)
"""


def _holder(postgres, job: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, postgres.url(), job],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **postgres.env()},
    )
    return p, p.stdout.readline().strip()


def test_two_clients_never_both_write(stores):
    a, b = stores(), stores()
    sa = State.load(a, a.job)
    sa.record_host("h1", HostRecord("192.0.2.1"))
    sb = State.load(b, b.job)
    assert (sb.lineage, sb.serial) == (sa.lineage, 1)
    assert sb.keyed("0" * 64) == sa.keyed("0" * 64)  # one key for the team
    sa.record_host("h2", HostRecord("192.0.2.2"))
    with pytest.raises(
        ProvisionError, match=r"was changed by another run \(serial 2, saved by .*this run read serial 1"
    ):
        sb.record_host("h3", HostRecord("192.0.2.3"))
    assert set(State.load(stores(), a.job).hosts) == {"h1", "h2"}
    # Two first saves: one wins.
    c, d = stores(), stores()
    c.job = d.job = a.job + "-new"
    sc, sd = State.load(c, c.job), State.load(d, d.job)
    sc.record_host("h1", HostRecord("192.0.2.1"))
    with pytest.raises(ProvisionError, match="this run read none"):
        sd.record_host("h1", HostRecord("192.0.2.9"))


def test_the_lock_is_held_until_its_holder_dies(stores, postgres):
    s = stores()
    p, lock_id = _holder(postgres, s.job)
    try:
        held = s.held()
        assert held is not None and held.id == lock_id
        with pytest.raises(ProvisionError, match=f"state is locked: apply by .* lock id {lock_id}"):
            s.lock("apply").acquire()
        p.kill()  # SIGKILL: no release; the server sees the connection close
        p.wait(10)
        wait_until(lambda: s.held() is None, 10, 0.1, what="the server to drop the dead holder's lock")
        lock = s.lock("apply").acquire()
        assert lock.notice and "ended without releasing it" in lock.notice
        lock.release()
        assert s.held() is None
    finally:
        p.kill()
        p.wait()


def test_force_unlock_ends_the_holders_session(stores, postgres):
    s = stores()
    p, lock_id = _holder(postgres, s.job)
    try:
        with pytest.raises(ProvisionError, match="does not match the lock held"):
            s.force_unlock("not-" + lock_id)
        assert s.force_unlock(lock_id).id == lock_id
        assert s.held() is None
        with pytest.raises(ProvisionError, match=f"no lock is held on job {s.job}"):
            s.force_unlock(lock_id)
    finally:
        p.kill()
        p.wait()


def test_a_run_whose_lock_was_forced_away_cannot_save(stores):
    """Saves go through the lock's session: once force-unlock ended it, the hung run that
    held it writes nothing over what others do next."""
    mine, other = stores(), stores()
    lock = mine.lock("apply").acquire()
    st = State.load(mine, mine.job)
    st.record_host("h1", HostRecord("192.0.2.1"))
    other.force_unlock(lock.info.id)
    with pytest.raises(ProvisionError, match=rf"^{mine.where}: cannot save job {mine.job}'s state \(serial 2\): "):
        st.record_host("h2", HostRecord("192.0.2.2"))
    lock.release()  # its connection is gone: nothing to undo, no error
    assert set(State.load(other, mine.job).hosts) == {"h1"}


def test_two_force_unlocks_at_once_one_removes_the_lock(stores, postgres):
    """item 16: two teammates' simultaneous `force-unlock ID` both said "Removed the
    lock"; one of them removed nothing. Now the row's removal decides: one removes it, the
    other says nobody's lock was removed by it (exit 1 from the command)."""
    import threading

    s = stores()
    for _ in range(3):
        p, lock_id = _holder(postgres, s.job)
        try:
            start = threading.Barrier(2)
            results: list[object] = []

            def unlock(store, start: threading.Barrier, results: list[object], lock_id: str) -> None:
                start.wait(timeout=10)
                try:
                    results.append(store.force_unlock(lock_id))
                except ProvisionError as e:
                    results.append(str(e))

            threads = [threading.Thread(target=unlock, args=(stores(), start, results, lock_id)) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            removed = [r for r in results if not isinstance(r, str)]
            said = [r for r in results if isinstance(r, str)]
            assert len(removed) == 1 and removed[0].id == lock_id, results
            # The loser came after the winner, or between its removal and the session's end.
            assert len(said) == 1 and ("no lock" in said[0] and f"held on job {s.job}" in said[0]), results
            assert s.held() is None
        finally:
            p.kill()
            p.wait()
