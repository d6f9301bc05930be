"""The dashboard over real HTTP (uvicorn on 127.0.0.1, tests/webserve.py): what a hostile
client may send. A Host that is not the service's (DNS rebinding) and a POST from another
site are refused and act on nothing; what an action said comes from the service, never the
URL; bodies, slow clients and connections are bounded and a valid request is still
answered; malformed numbers are a 400 naming the parameter; a bearer token acts on loopback
as elsewhere."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

import pytest

from clirun import wait_until
from provision.io.servicestore import Kind, ServiceStore, Status, Submission
from provision.serve import dashboard
from provision.serve.source import ServiceSource
from provision.web.auth import CSRF_COOKIE
from test_web import FakeSource
from webserve import QUICK, ask, served, service_pages

EVIL_HOST = "attacker.example"


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("PROVISION_SERVICE_DB", str(tmp_path / "svc" / "service.sqlite"))
    s = ServiceStore.open_local()
    yield s
    s.close()


def _waiting(store: ServiceStore) -> None:
    """A queued apply of job bert, by ana, not started (the dashboard's Cancel takes it back)."""
    store.submit(Submission("s1", Kind.APPLY, "bert", "ana", "local", "", "inv.yaml", {}))


def _csrf(port: int, path: str = "/usage", headers: dict[str, str] | None = None) -> tuple[str, str]:
    """(the CSRF cookie header a page sets, the token its forms repeat: the same value), as
    a browser gets them."""
    page = ask(port, "GET", path, headers)
    assert page.status == 200, page.text
    m = re.match(rf"{CSRF_COOKIE}=([^;]+);", page.headers["set-cookie"])
    assert m, page.headers
    return f"{CSRF_COOKIE}={m.group(1)}", m.group(1)


def _form(**fields: str) -> bytes:
    return urlencode(fields).encode()


# --------------------------------------------------------------------------- Host and Origin


def test_a_foreign_host_is_refused_and_cancels_nothing(store, tmp_path):
    """DNS rebinding: another site's name resolving to 127.0.0.1. Its page reaches the
    loopback service with its own name as the Host (and its own Origin): 400 before
    anything is read or done; the service's own names on its port are served."""
    _waiting(store)
    with service_pages(store, ServiceSource(store, tmp_path / "work")) as port:
        foreign = {"Host": f"{EVIL_HOST}:{port}"}
        for path in ("/api/v1/jobs", "/jobs/bert", "/metrics", "/"):
            r = ask(port, "GET", path, foreign)
            assert r.status == 400, (path, r.status, r.text)
            assert EVIL_HOST in r.text and len(r.text.strip().splitlines()) == 1
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
            assert ask(port, "GET", "/api/v1/jobs", {"Host": host}).status == 200, host
        assert ask(port, "GET", "/api/v1/jobs", {"Host": "127.0.0.1:1"}).status == 400  # another port
        # The page's own CSRF cookie and token, sent with the other site's Host and Origin.
        cookie, token = _csrf(port)
        r = ask(
            port,
            "POST",
            "/jobs/bert/cancel",
            {**foreign, "Origin": f"http://{EVIL_HOST}:{port}", "Cookie": cookie},
            _form(csrf=token),
        )
        assert r.status == 400, r.text
        # The right Host, another site's Origin (or Referer): 403.
        for sent in (
            {"Origin": f"http://{EVIL_HOST}:{port}"},
            {"Referer": f"http://{EVIL_HOST}/x"},
            {"Origin": "null"},
        ):
            r = ask(port, "POST", "/jobs/bert/cancel", {**sent, "Cookie": cookie}, _form(csrf=token))
            assert r.status == 403 and "another site" in r.text, (sent, r.text)
        r = ask(port, "POST", "/api/v1/jobs/bert/cancel", {"Origin": f"http://{EVIL_HOST}"})
        assert r.status == 403 and "another site" in json.loads(r.text)["error"]
        assert store.get("s1").status is Status.WAITING
        # Its own Origin: the cancel is done.
        r = ask(
            port,
            "POST",
            "/jobs/bert/cancel",
            {"Origin": f"http://127.0.0.1:{port}", "Cookie": cookie},
            _form(csrf=token),
        )
        assert r.status == 303, r.text
    assert store.get("s1").status is Status.CANCELLED


def test_a_trusted_header_service_checks_the_host_too(store, tmp_path):
    with service_pages(store, ServiceSource(store, tmp_path / "work"), trust_header="X-Forwarded-User") as port:
        user = {"X-Forwarded-User": "ana"}
        assert ask(port, "GET", "/api/v1/jobs", {**user, "Host": f"{EVIL_HOST}:{port}"}).status == 400
        assert ask(port, "GET", "/api/v1/jobs", user).status == 200


def test_the_public_url_is_answered_as(store, tmp_path):
    """Behind a proxy at https://dash.example.com: its Host and Origin are the service's too."""
    _waiting(store)
    src = ServiceSource(store, tmp_path / "work")
    with service_pages(store, src, trust_header="X-Forwarded-User", public_url="https://Dash.example.com/") as port:
        proxied = {"X-Forwarded-User": "ana", "Host": "dash.example.com"}
        assert ask(port, "GET", "/api/v1/jobs", proxied).status == 200
        assert ask(port, "GET", "/api/v1/jobs", {**proxied, "Host": "dash.example.com:443"}).status == 200
        assert ask(port, "GET", "/api/v1/jobs", {**proxied, "Host": "dash.example.org"}).status == 400
        cookie, token = _csrf(port, headers=proxied)
        r = ask(
            port,
            "POST",
            "/jobs/bert/cancel",
            {**proxied, "Origin": "https://dash.example.com", "Cookie": cookie},
            _form(csrf=token),
        )
        assert r.status == 303, r.text
    assert store.get("s1").status is Status.CANCELLED


def test_serve_refuses_a_malformed_public_url(store, tmp_path):
    from clirun import run

    for bad in ("dash.example.com", "ftp://dash.example.com", "https://", "https://dash:99999/"):
        code, _, err = run("serve", "--listen", "127.0.0.1:0", "--public-url", bad, cwd=tmp_path)
        assert code != 0 and err.startswith("Error: --public-url:") and len(err.strip().splitlines()) == 1, err
    assert not store.services()


# --------------------------------------------------------------------------- what an action said


def test_what_an_action_said_comes_from_the_service_not_the_url():
    src = FakeSource()
    with served(src) as port:
        forged = "Session expired: sign in at http://evil.example/login"
        page = ask(port, "GET", "/jobs/bert?" + urlencode({"done": forged}))
        assert page.status == 200 and "evil.example" not in page.text and 'class="done"' not in page.text
        cookie, token = _csrf(port, "/jobs/bert")
        assert f'value="{token}"' in ask(port, "GET", "/jobs/bert", {"Cookie": cookie}).text
        r = ask(port, "POST", "/jobs/bert/stop", {"Cookie": cookie}, _form(csrf=token))
        assert r.status == 303 and r.headers["location"].startswith("/jobs/bert?done=")
        assert "stop" not in r.headers["location"]  # an id, not the words
        shown = ask(port, "GET", r.headers["location"])
        assert '<p class="done">stop bert by local</p>' in shown.text
        assert 'class="done"' not in ask(port, "GET", "/jobs/bert?done=x" + r.headers["location"][-4:]).text


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "raw",
    ["\u00b2", "9" * 5000, "0", "-1", "1e3", "\uff11"],
    ids=["superscript", "5000-digits", "0", "-1", "1e3", "fullwidth"],
)
def test_a_malformed_number_is_a_400_naming_it(raw):
    with served(FakeSource()) as port:
        q = urlencode({"page": raw})
        for path in (f"/jobs?{q}", f"/studies/s?{q}", f"/?{q}"):
            r = ask(port, "GET", path)
            assert r.status == 400 and r.text.startswith("page: expected a number from 1"), (
                path,
                r.status,
                r.text[:200],
            )
            assert len(r.text) < 200
        r = ask(port, "GET", f"/api/v1/jobs?{q}")
        assert r.status == 400 and json.loads(r.text)["error"].startswith("page:")
        cookie, token = _csrf(port, "/studies/s")
        for study in ("s", "nope"):
            r = ask(port, "POST", f"/studies/{study}/promote", {"Cookie": cookie}, _form(csrf=token, trial=raw))
            assert r.status == 400 and r.text.startswith("trial: expected a number from 1"), (study, r.text[:200])
            r = ask(port, "POST", f"/api/v1/studies/{study}/promote", {"Cookie": cookie}, _form(csrf=token, trial=raw))
            assert r.status == 400 and json.loads(r.text)["error"].startswith("trial:"), r.text[:200]


# --------------------------------------------------------------------------- a token on loopback


def test_a_bearer_token_acts_on_loopback_and_a_wrong_one_is_refused(store, tmp_path):
    _waiting(store)
    _, ana = store.create_token("ana", admin=False)
    _, bob = store.create_token("bob", admin=False)
    with service_pages(store, ServiceSource(store, tmp_path / "work")) as port:
        for wrong in ("Bearer nope", "Bearer ", "bearer x"):
            for method, path in (("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs/bert/cancel"), ("GET", "/metrics")):
                r = ask(port, method, path, {"Authorization": wrong})
                assert r.status == 401 and "not valid" in r.text, (wrong, path, r.text)
        r = ask(port, "POST", "/api/v1/jobs/bert/cancel", {"Authorization": f"Bearer {bob}"})
        assert r.status == 403 and "bob may not cancel bert" in r.text  # the token's owner, as off loopback
        assert store.get("s1").status is Status.WAITING
        assert ask(port, "GET", "/api/v1/jobs", {"Authorization": f"Bearer {ana}"}).status == 200
        r = ask(port, "POST", "/api/v1/jobs/bert/cancel", {"Authorization": f"Bearer {ana}"})
        assert r.status == 200 and json.loads(r.text)["ok"], r.text
    assert store.get("s1").status is Status.CANCELLED


def test_a_bearer_token_needs_no_csrf_on_the_pages_route(store, tmp_path):
    _waiting(store)
    _, ana = store.create_token("ana", admin=False)
    with service_pages(store, ServiceSource(store, tmp_path / "work")) as port:
        r = ask(port, "POST", "/jobs/bert/cancel", {"Authorization": f"Bearer {ana}"})
        assert r.status == 303, r.text
    assert store.get("s1").status is Status.CANCELLED


# --------------------------------------------------------------------------- bounds


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_big(port: int, path: str, size: int, chunked: bool) -> int | None:
    """POST `size` bytes of zeros to `path` (Content-Length, or chunked), stopping when the
    answer comes; the answer's status (None: the connection was reset before it)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/x-www-form-urlencoded\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {size}\r\n\r\n"
    block = b"0" * (1 << 20)
    piece = f"{len(block):x}\r\n".encode() + block + b"\r\n" if chunked else block
    got = b""
    try:
        s.sendall(head.encode())
        for _ in range(size // len(block)):
            if select.select([s], [], [], 0)[0]:
                break
            s.sendall(piece)
        got = s.recv(4096)
    except OSError:  # refused while it sent: the answer may be there still
        with contextlib.suppress(OSError):
            got = s.recv(4096)
    finally:
        s.close()
    m = re.match(rb"HTTP/1\.1 (\d+)", got)
    return int(m.group(1)) if m else None


def _peak_growth_mib(fn: Callable[[], object]) -> tuple[object, float]:
    """fn()'s result, and how far this process's RSS rose above where it was while it ran."""
    before = _rss_kib()
    peak = [before]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib())
            time.sleep(0.005)

    t = threading.Thread(target=watch)
    t.start()
    try:
        got = fn()
    finally:
        done.set()
        t.join()
    return got, (peak[0] - before) / 1024


def test_an_oversized_body_is_refused_before_it_is_read():
    """800 MiB to /login unauthenticated peaked the service at 2.8 GiB: now a 413 after at
    most the limit (64 KiB), whether it says its length or streams it, and the process's
    memory stays where it was."""
    with served(FakeSource()) as port:
        for chunked in (False, True):
            status, grew = _peak_growth_mib(lambda c=chunked: _send_big(port, "/login", 256 << 20, c))
            assert status == 413, (chunked, status)
            assert grew < 8, f"the process grew {grew:.0f} MiB (chunked={chunked})"
        # A small form still signs in as before (a wrong token: 401, its own answer).
        assert ask(port, "POST", "/login", body=_form(token="nope")).status == 401


def test_a_body_that_does_not_come_is_a_408():
    with served(FakeSource()) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"POST /login HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100\r\n\r\ntoken=".encode())
        took = time.monotonic()
        answer = s.recv(4096)
        s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - took < 10


def _slow_clients(port: int, n: int) -> list[socket.socket]:
    """n clients that start a request and never finish its headers."""
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode())
        out.append(s)
    return out


def _closed(s: socket.socket) -> bool:
    """The server closed (or reset) it."""
    if not select.select([s], [], [], 0)[0]:
        return False
    try:
        return s.recv(1024) == b""
    except OSError:
        return True


def _server_end(client: socket.socket) -> socket.socket | None:
    """The served end of `client`'s connection (the server runs in this process): the socket
    among this process's descriptors whose peer is `client`."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue  # not a socket (or gone meanwhile)
        try:
            if s.getpeername() == client.getsockname():
                return s
        except OSError:
            pass  # not connected
        s.close()
    return None


def test_answers_go_out_without_waiting_for_an_ack():
    """TCP_NODELAY on every connection served: without it (socket.create_server's sockets
    have proto 0, and asyncio sets it only for IPPROTO_TCP) Nagle held an answer's body
    behind its headers until the client's delayed ACK, 40 ms on each page."""
    with served(FakeSource()) as port:
        c = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            c.sendall(f"GET /static/logs.js HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            wait_until(lambda: b"200 OK" in c.recv(65536), timeout=10, what="the answer")
            end = _server_end(c)
            assert end is not None
            with end:
                assert end.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        finally:
            c.close()


def test_clients_that_never_finish_their_headers_are_dropped():
    """Slowloris: uvicorn held such a client for good. Each is dropped after the header
    time (1 s here, 10 s in the service), and a valid request is answered while they wait."""
    with served(FakeSource()) as port:
        slow = _slow_clients(port, 40)
        try:
            assert ask(port, "GET", "/api/v1/jobs").status == 200
            wait_until(lambda: all(_closed(s) for s in slow), timeout=30, every=0.1, what="the slow clients dropped")
            # A kept-alive connection that starts its next request and never ends it: dropped too.
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(f"GET /static/logs.js HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            wait_until(lambda: b"200 OK" in s.recv(65536), timeout=10, what="the first answer")
            s.sendall(b"GET / HTTP/1.1\r\n")
            slow.append(s)
            for _ in range(3):  # a byte now and then cancels uvicorn's keep-alive timer, not this one
                time.sleep(QUICK.header_seconds / 3)
                if not _closed(s):
                    s.sendall(b"X")
            wait_until(lambda: _closed(s), timeout=30, every=0.1, what="the kept-alive slow client dropped")
        finally:
            for s in slow:
                s.close()


def test_connections_are_capped_and_a_valid_request_is_still_answered():
    """1,100 slow clients took a unit's 1,024 descriptors (a valid token then got
    "Connection refused"): at most max_connections stay open, the one waiting longest for
    its headers making room, so a valid request is answered while they connect."""
    limits = dashboard.Limits(header_seconds=60.0, write_seconds=2.0, max_connections=16)
    with served(FakeSource(), limits=limits) as port:
        slow = _slow_clients(port, 60)
        try:
            wait_until(
                lambda: sum(not _closed(s) for s in slow) <= limits.max_connections,
                timeout=30,
                every=0.1,
                what="at most the cap open",
            )
            for _ in range(5):
                assert ask(port, "GET", "/api/v1/jobs").status == 200
                slow += _slow_clients(port, 10)
        finally:
            for s in slow:
                s.close()


class HeldSource(FakeSource):
    """Its jobs() answer when the test says (the requests stay under way until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.asked = 0

    def jobs(self) -> dict:
        self.asked += 1
        self.go.wait(60)
        return super().jobs()


def test_at_the_cap_with_every_request_under_way_a_newcomer_gets_a_503():
    src = HeldSource()
    limits = dashboard.Limits(header_seconds=60.0, write_seconds=2.0, max_connections=4)
    with served(src, limits=limits) as port:
        busy = []
        try:
            for _ in range(limits.max_connections):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.sendall(f"GET /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
                busy.append(s)
            wait_until(lambda: src.asked == limits.max_connections, timeout=30, what="every request under way")
            r = ask(port, "GET", "/api/v1/usage")
            assert r.status == 503 and r.text == "refused: too many connections at once; try again soon\n"
            src.go.set()
            for s in busy:
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            assert ask(port, "GET", "/api/v1/usage").status == 200
        finally:
            src.go.set()
            for s in busy:
                s.close()


def test_repeated_errors_are_one_line_per_kind():
    """The log said each of a flood's errors (84 MB in 20 s): one line of each kind a minute."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    keep = Keep()
    logger = logging.getLogger("uvicorn.error")
    dashboard.QUIET.clear()  # what another test logged before
    with served(FakeSource()) as port:
        logger.addHandler(keep)
        try:
            for _ in range(30):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
                s.recv(4096)
                s.close()
            assert ask(port, "GET", "/api/v1/jobs").status == 200
        finally:
            logger.removeHandler(keep)
    invalid = [x for x in lines if "Invalid HTTP request" in x]
    assert len(invalid) == 1, lines


class BigSource(FakeSource):
    """Hosts whose JSON is `size` bytes and more (16 MiB: more than the socket buffers
    between a client and the service hold)."""

    def __init__(self, size: int = 16 << 20):
        super().__init__()
        self.size = size

    def hosts(self) -> dict:
        doc = super().hosts()
        doc["hosts"]["gpu-1"]["labels"] = {"big": "x" * self.size}
        return doc


def _held(port: int, client: int) -> bool:
    """Whether a process holds the service's end of the connection from `client` (a socket
    the kernel still sends on after its process closed it has inode 0)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].split(":")[1], 16) == port and int(f[2].split(":")[1], 16) == client:
            return f[9] != "0"
    return False


def _unread(port: int, path: str, *headers: str) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall("\r\n".join([f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *headers, "", ""]).encode())
    return s


def test_a_client_that_never_reads_its_answer_is_dropped():
    """A client that asks for a big answer and reads none of it: held for good, closing or
    not (uvicorn's close waits until the answer is taken). Dropped after the header time,
    while one that reads slowly gets its whole answer."""
    with served(BigSource()) as port:
        stuck = [_unread(port, "/api/v1/hosts"), _unread(port, "/api/v1/hosts", "Connection: close")]
        try:
            ends = [s.getsockname()[1] for s in stuck]
            wait_until(lambda: all(_held(port, e) for e in ends), timeout=10, what="both connected")
            wait_until(lambda: not any(_held(port, e) for e in ends), timeout=60, every=0.2, what="both dropped")
            assert ask(port, "GET", "/api/v1/jobs").status == 200
        finally:
            for s in stuck:
                s.close()
    with served(BigSource(4 << 20)) as port:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(f"GET /api/v1/hosts HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
        got = bytearray()
        try:
            while chunk := s.recv(64 << 10):  # a few seconds at this pace; the header time is 1 s
                got += chunk
                time.sleep(0.05)
        finally:
            s.close()
        head, _, body = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["hosts"]["gpu-1"]["labels"]["big"]) == 4 << 20
