"""Local state and its lock (state.py): never absent, never older than what was read, one
holder at a time. Races are forced with a hook at the lock and state steps."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from provision.core.errors import ProvisionError
from provision.io import state as S
from provision.placement.tasks import Slot


def test_an_empty_lock_file_is_never_taken_over_as_stale(tmp_path):
    sp = tmp_path / "j.state.json"
    S.lock_path(sp).write_text("")  # a holder that created the file and has not written it yet
    holder = S.StateLock(sp, "apply").try_acquire()
    assert holder is not None, "an unreadable lock is someone's"
    with pytest.raises(ProvisionError, match="state is locked"):
        S.StateLock(sp, "apply").acquire()
    assert S.lock_path(sp).exists()


def test_the_lock_appears_with_its_content(tmp_path, monkeypatch):
    sp = tmp_path / "j.state.json"
    seen: list[str] = []
    real_link = os.link

    def link(src, dst):  # at the instant the lock's name appears, its content is complete
        real_link(src, dst)
        seen.append(Path(dst).read_text())

    monkeypatch.setattr(os, "link", link)
    lock = S.StateLock(sp, "apply").acquire()
    assert json.loads(seen[0])["id"] == lock.info.id
    lock.release()
    assert not S.lock_path(sp).exists()


def test_a_dead_holder_on_this_machine_is_stale(tmp_path):
    sp = tmp_path / "j.state.json"
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    dead = S.LockInfo("old", "me", child, __import__("socket").gethostname(), "apply", "then")
    S.lock_path(sp).write_text(json.dumps(dead.__dict__))
    lock = S.StateLock(sp, "apply").acquire()
    assert lock.notice and "stale" in lock.notice
    lock.release()


def test_two_takers_at_once_one_wins(tmp_path):
    sp = tmp_path / "j.state.json"
    for _ in range(20):
        barrier = threading.Barrier(8)
        won: list[S.StateLock] = []

        def take(barrier: threading.Barrier, won: list[S.StateLock]) -> None:
            lk = S.StateLock(sp, "apply")
            barrier.wait()
            if lk.try_acquire() is None:
                won.append(lk)

        threads = [threading.Thread(target=take, args=(barrier, won)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        won[0].release()


def test_the_lock_is_taken_before_the_state_is_read(tmp_path, monkeypatch):
    """An apply that waits for the lock must read the state its predecessor saved, never
    an older one: open_context locks, then loads."""
    from provision.run import context as engine

    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: j\nhosts: [{name: h1, address: 127.0.0.1}]\npools: {chief: {replicas: 1, command: [/bin/true]}}\n"
    )
    order: list[str] = []
    real_load, real_acquire = S.State.load, S.StateLock.acquire
    monkeypatch.setattr(S.State, "load", classmethod(lambda cls, *a: (order.append("load"), real_load(*a))[1]))
    monkeypatch.setattr(S.StateLock, "acquire", lambda self: (order.append("lock"), real_acquire(self))[1])
    ctx = engine.open_context(str(inv), operation="apply", render_secrets=False)
    ctx.close()
    assert order == ["lock", "load"]
    # Held by someone else: refused before the state is even read.
    other = S.StateLock(S.default_state_path(inv, "j"), "apply").acquire()
    order.clear()
    with pytest.raises(ProvisionError, match="state is locked"):
        engine.open_context(str(inv), operation="apply", render_secrets=False)
    assert order == ["lock"]
    other.release()


def test_a_save_never_leaves_no_state_and_the_backup_is_what_was_read(tmp_path, monkeypatch):
    sp = tmp_path / "j.state.json"
    st = S.State.load(sp, "j")
    st.set_placement({"chief-0": Slot("h1", 2222, ())})
    first = sp.read_bytes()
    st = S.State.load(sp, "j")
    # A kill between any two steps of a save: the state file exists with old or new content.
    real_replace = os.replace
    states: list[bytes | None] = []

    def replace(src, dst):
        states.append(sp.read_bytes() if sp.exists() else None)
        real_replace(src, dst)
        states.append(sp.read_bytes() if sp.exists() else None)

    monkeypatch.setattr(os, "replace", replace)
    st.record_host("h1", S.HostRecord("127.0.0.1"))
    st.record_host("h2", S.HostRecord("127.0.0.2"))
    assert None not in states
    assert (tmp_path / "j.state.json.backup").read_bytes() == first  # written once, from the read
    data = json.loads(sp.read_text())
    assert data["serial"] == 3 and set(data["hosts"]) == {"h1", "h2"}


def test_a_steps_changes_are_saved_once_when_it_ends(tmp_path, monkeypatch):
    """deferred(): an apply step's hosts are recorded in memory as they finish and saved
    once at the end (one fsync, not one per host); outside it every change saves at once."""
    sp = tmp_path / "j.state.json"
    st = S.State.load(sp, "j")
    st.record_host("h0", S.HostRecord("127.0.0.9", pending=True))  # saved before the step
    saves = []
    real = S._write_atomic
    monkeypatch.setattr(S, "_write_atomic", lambda path, data: (saves.append(path), real(path, data)))
    with st.deferred():
        with st.deferred():  # nested: still one save, at the outer end
            for i in range(5):
                st.record_host(f"h{i}", S.HostRecord(f"127.0.0.{i}"))
            st.forget_host("h4")
        assert saves == [] and json.loads(sp.read_text())["hosts"]["h0"]["pending"] is True
    assert saves == [sp]
    data = json.loads(sp.read_text())
    assert set(data["hosts"]) == {"h0", "h1", "h2", "h3"} and data["hosts"]["h0"]["pending"] is False
    with st.deferred():
        pass  # nothing changed: nothing saved
    assert saves == [sp]
    st.record_host("h5", S.HostRecord("127.0.0.5"))
    assert saves == [sp, sp]


@pytest.mark.parametrize(
    "text",
    [
        '{"format_version": 2, "job": "j", "lineage": "x", "hosts": []}',
        '{"format_version": 2, "job": "j", "hosts": {}}',
        '{"format_version": 2, "job": "j", "lineage": "x", "hosts": {"h": {"port": 1}}}',
    ],
)
def test_a_state_of_the_wrong_shape_is_one_line(tmp_path, text):
    sp = tmp_path / "j.state.json"
    sp.write_text(text)
    with pytest.raises(ProvisionError, match="wrong shape"):
        S.State.load(sp, "j")


def test_checksums_are_keyed(tmp_path):
    sp = tmp_path / "j.state.json"
    a, b = S.State.load(sp, "j"), S.State.load(tmp_path / "k.state.json", "k")
    digest = "0" * 64
    assert a.keyed(digest) == a.keyed(digest) != b.keyed(digest)
    assert digest not in a.keyed(digest)
    assert oct(a.key_path.stat().st_mode & 0o777) == "0o600"


def test_a_state_directory_that_takes_no_file_is_one_line(tmp_path, monkeypatch):
    """item 18: a read-only .provision was a traceback (apply) or every host
    "unreachable" (plan: the host keys could not be saved). Now one line naming the
    directory, exit 1, before any host is asked. (Root writes through file modes, so the
    read-only file system is stood in for by the error it gives.)"""
    import errno

    from click.testing import CliRunner

    from provision.cli.app import main

    inv = tmp_path / "inv.yaml"
    inv.write_text(
        "job: ro\nhosts:\n  - {name: h1, address: 192.0.2.1}\npools:\n  chief: {replicas: 1, command: [/bin/true]}\n"
    )
    real_open = os.open

    def read_only(path, flags, *a, **kw):
        if ".provision" in str(path) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", read_only)
    for command in (["plan"], ["apply", "-y"]):
        r = CliRunner().invoke(main, [*command, str(inv)])
        assert r.exit_code == 1, r.output
        assert r.output == (
            f"Error: {tmp_path / '.provision'}: cannot write there (Read-only file system): provision keeps the "
            "job's state and learnt host keys in it; make it writable, or give --state a path elsewhere\n"
        )


def test_two_force_unlocks_at_once_one_removes_the_lock(tmp_path, monkeypatch):
    """item 16: two teammates' `force-unlock ID` at once both said "Removed the
    lock" (or one ended in a traceback): now one removes it, the other says nothing was."""
    sp = tmp_path / "j.state.json"
    lock = S.StateLock(sp, "apply").acquire()
    assert lock.info is not None
    both_read = threading.Barrier(2)
    real_read = S.read_lock

    def read_lock(path: Path):  # both read the holder before either removes it
        got = real_read(path)
        if path == S.lock_path(sp):
            both_read.wait(timeout=10)
        return got

    monkeypatch.setattr(S, "read_lock", read_lock)
    results: list[object] = []

    def unlock() -> None:
        try:
            results.append(S.force_unlock(sp, lock.info.id))
        except ProvisionError as e:
            results.append(str(e))

    threads = [threading.Thread(target=unlock) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    removed = [r for r in results if isinstance(r, S.LockInfo)]
    said = [r for r in results if isinstance(r, str)]
    assert len(removed) == 1 and removed[0].id == lock.info.id, results
    assert said == [f"{S.lock_path(sp)}: no lock is held (someone removed it just now)"], results
    assert not S.lock_path(sp).exists() and list(tmp_path.iterdir()) == []


def test_force_unlock_never_removes_a_lock_taken_meanwhile(tmp_path, monkeypatch):
    """Between reading the named lock and removing it, its holder ended and another took the
    lock: that one stays."""
    sp = tmp_path / "j.state.json"
    old = S.StateLock(sp, "apply").acquire()
    assert old.info is not None
    real_read = S.read_lock
    newer: list[S.StateLock] = []

    def read_lock(path: Path):
        got = real_read(path)
        if path == S.lock_path(sp) and not newer:
            newer.append(S.StateLock(sp, "apply"))
            old.release()
            newer[0].acquire()
        return got

    monkeypatch.setattr(S, "read_lock", read_lock)
    with pytest.raises(ProvisionError, match="someone removed it just now"):
        S.force_unlock(sp, old.info.id)
    assert real_read(S.lock_path(sp)) == newer[0].info
