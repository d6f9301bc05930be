"""The lead and the state lock when a machine dies rather than a process: their
sessions are bounded on the server (io/pgstate.py's LOCK_BOUND), the leader's connection on
the client (io/servicelead.py's CUT_OFF), both read back from the real sockets of a real
server; a leader frozen past a take-over takes nothing when it wakes (serve/service.py).
The take-over itself, with the leader's packets dropped: bench/serve_takeover.py --dead-machine."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from provision.core.errors import ProvisionError
from provision.core.submission import Kind, Status
from provision.inventory.statebackend import Backend
from provision.io.pgstate import LOCK_BOUND, lock_session_settings
from provision.io.servicelead import CUT_OFF, POLL, Leadership
from provision.io.servicestore import ServiceStore, Submission
from provision.io.state import open_store
from provision.serve.service import Mode, Service

TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)  # Linux's number (Python < 3.12 lacks the name)


@pytest.mark.parametrize("bound", [7, 10, 15, 60])
def test_a_silent_clients_session_ends_within_the_bound(bound: int) -> None:
    s = lock_session_settings(bound)
    # Without TCP_USER_TIMEOUT's say (another kernel): idle, then every probe unanswered.
    assert s["tcp_keepalives_idle"] + s["tcp_keepalives_interval"] * s["tcp_keepalives_count"] == bound
    assert s["tcp_user_timeout"] == bound * 1000  # ms: data sent, never acknowledged
    assert s["tcp_keepalives_idle"] >= 1


def test_the_server_default_is_below_the_take_over_bound() -> None:
    assert LOCK_BOUND + 1 <= 15 - 2  # + a follower's poll (1 s) and its connect: <= 15 s
    assert 2 * CUT_OFF + POLL < LOCK_BOUND - 1  # a cut-off leader stops before a follower can lead


def _server_side(conn: Any) -> dict[str, int]:
    """This session's settings, in their base units (s; ms for tcp_user_timeout), as the
    server reads them back from its socket."""
    rows = conn.execute("SELECT name, setting FROM pg_settings WHERE name LIKE 'tcp_%'").fetchall()
    return {name: int(setting) for name, setting in rows}


def test_the_leads_session_is_bounded_on_both_sides(postgres, monkeypatch) -> None:
    pytest.importorskip("psycopg")
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    lead = Leadership(pg_url=postgres.url())
    try:
        assert lead.try_take()
        conn = lead._conn
        assert _server_side(conn) == lock_session_settings()
        with socket.socket(fileno=conn.fileno()) as sock:  # the client's socket, as libpq set it
            try:
                assert sock.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT) == CUT_OFF * 1000
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            finally:
                sock.detach()  # libpq's descriptor: not ours to close
        assert lead.still_held()
    finally:
        lead.release()


def test_the_state_locks_session_is_bounded_on_the_server(postgres, monkeypatch) -> None:
    pytest.importorskip("psycopg")
    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    store = open_store(Backend(postgres.url(), "test"), Path("/nonexistent/x.state.json"), "pg-bounded-lock")
    try:
        lock = store.lock("apply").acquire()
        try:
            assert _server_side(lock._conn) == lock_session_settings()
        finally:
            lock.release()
    finally:
        store.close()


class _FrozenLead:
    """The loop's look said held; the leader froze; a follower took over meanwhile: every
    look from now on fails (the lock's session is gone)."""

    def __init__(self) -> None:
        self.looks = 0

    def try_take(self) -> bool:
        return True

    def still_held(self) -> bool:
        self.looks += 1
        return False

    def release(self) -> None:
        pass

    def backend(self) -> int | None:
        return None


def test_a_leader_frozen_past_a_take_over_takes_nothing_when_it_wakes(tmp_path: Path, monkeypatch) -> None:
    store = ServiceStore.open_local(tmp_path / "svc.sqlite")
    lead = _FrozenLead()
    lines: list[str] = []
    svc = Service(store, lead, tmp_path / "work", say=lines.append)  # type: ignore[arg-type]
    svc.mode, svc.holds = Mode.LEADING, True  # it led when it froze
    started: list[str] = []
    monkeypatch.setattr("subprocess.Popen", lambda *a, **kw: started.append("worker"))
    store.submit(Submission("a", Kind.APPLY, "j", "ann@lab", "local", "", "inv.yaml", {}))
    svc._drive()  # where it woke: after its loop's look, before it takes the submission
    assert lead.looks == 1 and started == []
    got = store.get("a")
    assert got is not None and got.status is Status.WAITING  # not claimed: the new leader's to take


class _LostLead(_FrozenLead):
    def try_take(self) -> bool:
        raise AssertionError("a lead lost is not taken again in the same look")


def test_a_leader_cut_off_from_the_database_stops_leading_while_it_is_away(tmp_path: Path, monkeypatch) -> None:
    """The lead is looked at first: while the database is away (every store call fails), a
    leader whose lock's session is gone stops its workers all the same."""
    store = ServiceStore.open_local(tmp_path / "svc.sqlite")
    svc = Service(store, _LostLead(), tmp_path / "work", say=lambda line: None)  # type: ignore[arg-type]
    svc.mode, svc.holds = Mode.CUT_OFF, True  # it led, and the database stopped answering a look ago
    stopped: list[bool] = []
    monkeypatch.setattr(svc, "_stop_workers", lambda: stopped.append(True))

    def away() -> float:
        raise ProvisionError("postgresql://db/ml: the service's database: timed out")

    monkeypatch.setattr(store, "now", away)
    monkeypatch.setattr(store, "beat", lambda row: away())
    with pytest.raises(ProvisionError):
        svc._tick()
    assert stopped == [True] and not svc.holds and svc.lost
