"""Session keeps at most `parallelism` connections open: the least recently used idle one is
closed to make room (fake connections; no network)."""

from __future__ import annotations

import threading

from provision.core.target import Target
from provision.io.hostkeys import KnownHosts
from provision.io.ssh import Session


class FakeConn:
    def __init__(self, name: str):
        self.name = name
        self.user = "root"
        self.is_connected = True
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.is_connected = False


def session(tmp_path, parallelism: int) -> tuple[Session, list[FakeConn]]:
    s = Session(KnownHosts(tmp_path / "known_hosts"), parallelism=parallelism)
    dialled: list[FakeConn] = []

    def dial(target: Target) -> FakeConn:
        c = FakeConn(target.name)
        dialled.append(c)
        return c

    s._dial = dial  # type: ignore[method-assign]
    return s, dialled


def t(name: str) -> Target:
    return Target(name, "127.0.0.1")


def open_names(s: Session) -> list[str]:
    return list(s._conns)


def test_hosts_within_parallelism_are_never_closed_or_redialled(tmp_path):
    s, dialled = session(tmp_path, 4)
    for _ in range(3):
        for h in ("a", "b", "c", "d"):
            s.connect(t(h))
    assert [c.name for c in dialled] == ["a", "b", "c", "d"]
    assert not any(c.closed for c in dialled)


def test_least_recently_used_idle_connection_is_closed_to_make_room(tmp_path):
    s, dialled = session(tmp_path, 2)
    s.connect(t("a"))
    s.connect(t("b"))
    s.connect(t("a"))  # a used again: b is now the least recently used
    s.connect(t("c"))
    assert open_names(s) == ["a", "c"]
    assert [c.name for c in dialled if c.closed] == ["b"]
    s.connect(t("b"))  # reopened when needed; a is the least recently used now
    assert open_names(s) == ["c", "b"]
    assert [c.name for c in dialled] == ["a", "b", "c", "b"]
    assert [(c.name, c.closed) for c in dialled] == [("a", True), ("b", True), ("c", False), ("b", False)]


def test_a_connection_another_thread_uses_is_not_closed(tmp_path):
    s, dialled = session(tmp_path, 2)
    holding, release = threading.Event(), threading.Event()

    def worker():
        s.connect(t("a"))  # this thread uses a until it asks for another host
        holding.set()
        release.wait(10)

    th = threading.Thread(target=worker)
    th.start()
    holding.wait(10)
    s.connect(t("b"))
    s.connect(t("c"))  # a is older but in use: b (this thread's previous host) goes
    assert open_names(s) == ["a", "c"]
    s.connect(t("d"))  # a is still in use, c is this thread's previous host
    assert open_names(s) == ["a", "d"]
    release.set()
    th.join()
    s.connect(t("e"))  # the worker ended: a is idle now
    assert open_names(s) == ["d", "e"]
    assert {c.name for c in dialled if c.closed} == {"a", "b", "c"}


def test_no_idle_connection_means_one_more_rather_than_waiting(tmp_path):
    s, dialled = session(tmp_path, 1)
    holding, release = threading.Event(), threading.Event()

    def worker():
        s.connect(t("a"))
        holding.set()
        release.wait(10)

    th = threading.Thread(target=worker)
    th.start()
    holding.wait(10)
    s.connect(t("b"))
    assert open_names(s) == ["a", "b"]
    release.set()
    th.join()
    s.close()
    assert dialled and all(c.closed for c in dialled)


def test_a_lost_connection_is_closed_and_redialled(tmp_path):
    s, dialled = session(tmp_path, 2)
    s.connect(t("a"))
    dialled[0].is_connected = False
    s.connect(t("a"))
    assert [c.name for c in dialled] == ["a", "a"]
    assert dialled[0].closed and not dialled[1].closed
    assert open_names(s) == ["a"]


def test_map_opens_at_most_parallelism_connections(tmp_path):
    s, dialled = session(tmp_path, 3)
    peak = 0
    lock = threading.Lock()

    def fn(target: Target) -> str:
        nonlocal peak
        s.connect(target)
        with lock:
            peak = max(peak, sum(not c.closed for c in dialled))
        return target.name

    out = s.map(fn, [t(f"h{i}") for i in range(20)])
    assert sorted(out) == sorted(f"h{i}" for i in range(20))
    assert peak <= 3 + 1  # the main thread may hold one it used last
    assert len(s._conns) <= 3


def test_connections_being_opened_count_against_parallelism(tmp_path):
    s, dialled = session(tmp_path, 2)
    dial = s._dial
    both = threading.Barrier(2, timeout=10)
    peak = [0]

    def slow_dial(target: Target) -> FakeConn:
        if target.name in ("c", "d"):
            both.wait()  # c and d are being opened at the same time
        conn = dial(target)
        peak[0] = max(peak[0], sum(not c.closed for c in dialled))
        return conn

    s._dial = slow_dial  # type: ignore[method-assign]
    opener = threading.Thread(target=lambda: (s.connect(t("a")), s.connect(t("b"))))
    opener.start()
    opener.join()  # a and b open and idle (the thread that used them ended)
    workers = [threading.Thread(target=s.connect, args=(t(h),)) for h in ("c", "d")]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(open_names(s)) == ["c", "d"]
    assert {c.name for c in dialled if c.closed} == {"a", "b"}
    assert peak[0] == 2  # a and b were both closed before c and d were opened
