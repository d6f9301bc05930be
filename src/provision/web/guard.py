"""What a request must be before the app looks at it (docs/dashboard.md, "Limits"). Pure but
for reading the request.

- Its Host is one the service answers as (Site): a loopback service's own names on its
  port, the address it listens on, the --public-url's host. A page of another site whose
  name resolves to 127.0.0.1 (DNS rebinding) sends its own name: 400, nothing acted on.
- A POST whose Origin (or Referer, when it sends no Origin) is another site: 403.
- A body of at most Bounds.body bytes (the pages send forms of a few hundred), sent within
  Bounds.body_seconds: 413 before more is read (Content-Length, and the bytes counted as
  they come), 408 after the time. The body is read here and handed to the app whole.

    app = Guard(starlette_app, Site.listening("127.0.0.1", 8470))
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
DEFAULT_PORT = {"http": 80, "https": 443}
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
SHOWN = 80  # characters of a refused Host or Origin said back (a client may send 8 KiB)


class BadURL(ValueError):
    """A --public-url that is not http(s)://HOST[:PORT][/PATH]."""


def public_origin(url: str) -> tuple[str, str, int]:
    """(scheme, host as a Host header writes it, port) of a --public-url; BadURL else."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as e:
        raise BadURL(f"expected http(s)://HOST[:PORT][/PATH], got {url!r} ({e})") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORT or not parts.hostname or parts.username or parts.query or parts.fragment:
        raise BadURL(f"expected http(s)://HOST[:PORT][/PATH], got {url!r}")
    host = parts.hostname.lower()
    return scheme, f"[{host}]" if ":" in host else host, port or DEFAULT_PORT[scheme]


def _forms(host: str, port: int, scheme: str = "http") -> set[str]:
    """How a Host header writes host:port (the port left out when it is the scheme's own)."""
    return {f"{host}:{port}", host} if port == DEFAULT_PORT[scheme] else {f"{host}:{port}"}


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header's (name, port or None); None when it is no host[:port]."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value.partition("]")
        name += sep
        if not sep or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    else:
        name, sep, port_text = value.partition(":")
        port = port_text if sep else None
    if not name or (port is not None and not (port.isascii() and port.isdigit() and 0 < len(port) <= 5)):
        return None
    return name, int(port) if port is not None else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name[1:-1] if name.startswith("[") else name)
    except ValueError:
        return False
    return name.startswith("[") == (":" in name)  # an IPv6 literal is bracketed, an IPv4 one not


@dataclass(frozen=True)
class Site:
    """The Host values (and so the origins) the service answers as."""

    hosts: frozenset[str] = frozenset()  # exact Host values, lowercase ("127.0.0.1:8470")
    origins: frozenset[str] = frozenset()  # exact origins ("http://127.0.0.1:8470", "https://dash.example.com")
    any_ip_port: int | None = None  # a wildcard listen (0.0.0.0): any IP literal on this port
    loopback_any_port: bool = False  # an app run by hand: the loopback names on whatever port
    public_url: str | None = None  # where people reach the dashboard (links to it use this)

    @classmethod
    def loopback(cls) -> Site:
        """For make_app without a Site (an app run by hand under uvicorn): the loopback names."""
        return cls(loopback_any_port=True)

    @classmethod
    def listening(cls, host: str, port: int, public_url: str | None = None, names: Sequence[str] = ()) -> Site:
        """A service bound to host:port (the port bound, not 0); `names`: the machine's own
        names a wildcard listen answers as too. BadURL for a malformed public_url."""
        hosts: set[str] = set()
        origins: set[str] = set()
        bare = host.strip("[]").lower()
        wildcard = bare in ("0.0.0.0", "::", "")
        if wildcard or bare == "localhost" or _loopback(bare):
            for name in LOOPBACK_NAMES:
                hosts |= _forms(name, port)
        if not wildcard:
            hosts |= _forms(f"[{bare}]" if ":" in bare else bare, port)
        for name in names if wildcard else ():
            hosts |= _forms(name.lower(), port)
        origins |= {f"http://{h}" for h in hosts}
        if public_url:
            scheme, name, public_port = public_origin(public_url)
            forms = _forms(name, public_port, scheme)
            hosts |= forms
            origins |= {f"{scheme}://{f}" for f in forms}
        return cls(frozenset(hosts), frozenset(origins), port if wildcard else None, False, public_url)

    def host_ok(self, value: str | None) -> bool:
        if value is None:
            return False
        value = value.strip().lower()
        if value in self.hosts:
            return True
        return self._by_rule(value)

    def _by_rule(self, value: str) -> bool:
        """A host[:port] the rules take (no list could hold): any IP literal on a wildcard
        listen's port, the loopback names on any port for an app run by hand."""
        got = split_host(value)
        if got is None:
            return False
        name, port = got
        if self.loopback_any_port:
            return name in LOOPBACK_NAMES
        if self.any_ip_port is not None and _is_ip(name):
            # An IP literal is no name another site owns: a browser sends one only to the
            # address it connected to.
            return (port or DEFAULT_PORT["http"]) == self.any_ip_port
        return False

    def origin_ok(self, value: str) -> bool:
        """An Origin (or a Referer's scheme://host) of this dashboard, its scheme too."""
        try:
            parts = urlsplit(value.strip().lower())
        except ValueError:
            return False
        if f"{parts.scheme}://{parts.netloc}" in self.origins:
            return True
        return parts.scheme == "http" and self._by_rule(parts.netloc)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Bounds:
    body: int = 64 * 1024  # bytes: a form or a JSON body (the pages' are a few hundred)
    body_seconds: float = 30.0  # to send the body once the headers are in


class Guard:
    """ASGI middleware: the Host, a POST's Origin and the body's size and time checked
    before `app` sees the request; each refusal one line, with Connection: close."""

    def __init__(self, app: ASGIApp, site: Site, bounds: Bounds = Bounds()):
        self.app, self.site, self.bounds = app, site, bounds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        api = str(scope.get("path", "")).startswith("/api/")
        refused = self.refusal(scope)
        if refused is not None:
            await _refuse(send, *refused, api)
            return
        if str(scope.get("method", "GET")).upper() in SAFE_METHODS:
            await self.app(scope, receive, send)  # the app reads no body of a GET
            return
        try:
            async with asyncio.timeout(self.bounds.body_seconds):
                body = await _read(receive, self.bounds.body)
        except TimeoutError:
            await _refuse(send, 408, f"refused: the body did not come within {self.bounds.body_seconds:g} s", api)
            return
        if body is None:
            await _refuse(send, 413, f"refused: a body over {self.bounds.body} bytes", api)
            return
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, why) for a request refused on its headers alone; None: it may go on."""
        headers = Headers(scope=scope)
        host = headers.get("host")
        if not self.site.host_ok(host):
            shown = repr(host[:SHOWN]) if host is not None else "none"
            return 400, f"refused: Host {shown} is not an address of this dashboard (see provision serve --public-url)"
        if str(scope.get("method", "GET")).upper() not in SAFE_METHODS:
            origin = headers.get("origin") or headers.get("referer")  # a Referer's scheme://host counts as well
            if origin and not self.site.origin_ok(origin):
                return 403, f"refused: a request from another site ({origin[:SHOWN]})"
        length = headers.get("content-length")
        if length is not None and not (length.isascii() and length.isdigit() and len(length) <= 18):
            return 400, "refused: a malformed Content-Length"
        if length is not None and int(length) > self.bounds.body:
            return 413, f"refused: a body over {self.bounds.body} bytes"
        return None


async def _read(receive: Receive, limit: int) -> bytes | None:
    """The whole body; None as soon as it is over `limit` (the rest is never read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)  # the client left: the app sees a short body, answers no one
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _refuse(send: Send, status: int, message: str, api: bool) -> None:
    body = json.dumps({"error": message}).encode() if api else (message + "\n").encode()
    kind = b"application/json" if api else b"text/plain; charset=utf-8"
    headers: list[tuple[bytes, bytes]] = [
        (b"content-type", kind),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),  # the rest of what it sends is not read: no next request on it
    ]
    start: dict[str, Any] = {"type": "http.response.start", "status": status, "headers": headers}
    await send(start)
    await send({"type": "http.response.body", "body": body})
