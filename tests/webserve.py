"""The dashboard served for real in a test: uvicorn on 127.0.0.1, port 0, in a thread of the
test's process, through the code `provision serve` runs (serve/dashboard.py), and raw HTTP
to it (any Host, Origin or body a client may send).

with served(FakeSource()) as port: ...            # make_app over a Source, short limits
with service_pages(store, source) as port: ...    # cli/servecmd._web itself (as `serve` wires it)
ask(port, "GET", "/api/v1/jobs", {"Host": "attacker.example"})  # -> Reply(status, headers, text)
"""

from __future__ import annotations

import contextlib
import http.client
import io
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from clirun import wait_until
from provision.serve import dashboard
from provision.serve.source import Listen
from provision.web.app import make_app
from provision.web.auth import Auth
from provision.web.guard import Bounds, Site

QUICK = dashboard.Limits(header_seconds=1.0, write_seconds=2.0, max_connections=64)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    text: str


def ask(port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes = b"") -> Reply:
    """One request on its own connection; `headers` may name another Host."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        h = {"Host": f"127.0.0.1:{port}", **(headers or {})}
        if body:
            h.setdefault("Content-Type", "application/x-www-form-urlencoded")
        c.request(method, path, body=body or None, headers=h)
        r = c.getresponse()
        return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace"))
    finally:
        c.close()


def _up(port: int) -> None:
    wait_until(lambda: ask(port, "GET", "/static/logs.js").status == 200, timeout=30, what="the dashboard answering")


@contextlib.contextmanager
def served(
    source: Any,
    *,
    auth: Auth | None = None,
    public_url: str | None = None,
    limits: dashboard.Limits = QUICK,
    bounds: Bounds = Bounds(body_seconds=1.0),
) -> Iterator[int]:
    """make_app(source) served on 127.0.0.1 (a free port) as the service serves it; its port."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    site = Site.listening("127.0.0.1", port, public_url)
    stop = dashboard.start(make_app(source, auth=auth or Auth.loopback(), site=site, bounds=bounds), sock, limits)
    try:
        _up(port)
        yield port
    finally:
        stop()


@contextlib.contextmanager
def service_pages(
    store: Any, source: Any, *, trust_header: str | None = None, public_url: str | None = None
) -> Iterator[int]:
    """The pages as `provision serve --listen 127.0.0.1:0` starts them (cli/servecmd._web:
    its Auth, Site and limits); the port it says it bound."""
    from provision.cli.servecmd import _web  # (the code under test)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        stop = _web(store, source, Listen("127.0.0.1", 0), trust_header, public_url)
    m = re.search(r"Dashboard on http://127\.0\.0\.1:(\d+)/", out.getvalue())
    assert m, out.getvalue()
    port = int(m.group(1))
    try:
        _up(port)
        yield port
    finally:
        stop()
