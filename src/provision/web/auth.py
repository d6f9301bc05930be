"""Who is asking, and what they may do. Pure but for reading the request.

Three modes (the service picks one; it binds the socket):
- LOOPBACK: no token; only a client on the loopback interface is served (anyone who can
  reach it can run the CLI on this machine too), and may act as an admin. A request that
  sends `Authorization: Bearer T` is T's owner's, as in TOKEN mode (a wrong T: 401).
- TOKEN: every request carries a token (`Authorization: Bearer T`, or the cookie the login
  form sets); `TokenCheck.owner_of` names its owner and whether they are an admin. Reading
  needs any valid token; an action needs the job's owner or an admin.
- HEADER: a single sign-on proxy in front names the user in a header (X-Forwarded-User);
  only when the service listens on loopback (else anyone could send the header).

Actions are POSTs. A browser's carry the per-session CSRF token: a random value in a cookie
that the form repeats in a field (another site can make the browser send the cookie, not
read it); web/guard.py refuses one whose Origin is another site. A request authenticated by
its Authorization header needs no CSRF token (a browser never adds that header on its own).
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from starlette.requests import Request

TOKEN_COOKIE = "provision_token"
CSRF_COOKIE = "provision_csrf"
CSRF_FIELD = "csrf"
LOCAL_USER = "local"


class TokenCheck(Protocol):
    def owner_of(self, token: str) -> tuple[str, bool] | None:
        """(owner, admin) of a valid token; None for an unknown or revoked one (the store
        keeps hashes: compare in constant time)."""
        ...


class Mode(StrEnum):
    LOOPBACK = "loopback"
    TOKEN = "token"
    HEADER = "header"


@dataclass(frozen=True)
class Viewer:
    who: str
    admin: bool
    by_header: bool = False  # authenticated by the Authorization header: no CSRF token needed

    def may_act_on(self, owner: str | None) -> bool:
        return self.admin or (owner is not None and owner == self.who)


class Denied(Exception):
    """401 (who are you?) or 403 (not you); one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def is_loopback(host: str | None) -> bool:
    """An IP literal of the loopback interface (a client's address is never a name)."""
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Auth:
    mode: Mode = Mode.LOOPBACK
    tokens: TokenCheck | None = None
    header: str = "X-Forwarded-User"
    admins: frozenset[str] = frozenset()  # HEADER mode: the users who may act on any job

    @classmethod
    def loopback(cls, tokens: TokenCheck | None = None) -> Auth:
        """`tokens`: what a request that sends a bearer token is checked against (none: every
        such request is refused)."""
        return cls(Mode.LOOPBACK, tokens=tokens)

    @classmethod
    def token(cls, check: TokenCheck) -> Auth:
        return cls(Mode.TOKEN, tokens=check)

    @classmethod
    def trusted_header(
        cls, *, listening: str, header: str = "X-Forwarded-User", admins: frozenset[str] = frozenset()
    ) -> Auth:
        """`listening`: the address the service binds (a host, or a unix socket's path)."""
        if not (listening.startswith("/") or listening == "localhost" or is_loopback(listening)):
            raise ValueError(f"a trusted header is only for a service on loopback or a socket, not {listening}")
        return cls(Mode.HEADER, header=header, admins=admins)

    def viewer(self, request: Request) -> Viewer:
        """Who asks; Denied(401) when they may not read."""
        bearer = _bearer(request)
        if self.mode is Mode.LOOPBACK:
            # No client address: a unix socket, whose file permissions decide who connects.
            if request.client is not None and not is_loopback(request.client.host):
                raise Denied(401, "this dashboard serves only its own machine (loopback)")
            if bearer is not None:  # a script's token: its owner's rights, no CSRF token (as off loopback)
                return self._owner(bearer, by_header=True)
            return Viewer(LOCAL_USER, admin=True)
        if self.mode is Mode.HEADER:
            user = request.headers.get(self.header, "").strip()
            if not user:
                raise Denied(401, f"no {self.header} header: sign in through the proxy")
            return Viewer(user, admin=user in self.admins)
        if bearer is not None:
            return self._owner(bearer, by_header=True)
        token = request.cookies.get(TOKEN_COOKIE, "")
        if not token:
            raise Denied(401, "a token is needed: sign in at /login or send Authorization: Bearer TOKEN")
        return self._owner(token, by_header=False)

    def _owner(self, token: str, *, by_header: bool) -> Viewer:
        found = self.tokens.owner_of(token) if self.tokens is not None and token else None
        if found is None:
            raise Denied(401, "this token is not valid (wrong or revoked)")
        return Viewer(found[0], admin=found[1], by_header=by_header)


def _bearer(request: Request) -> str | None:
    """The token of `Authorization: Bearer T` ("" for an empty one); None without one."""
    value = request.headers.get("authorization", "")
    scheme, _, token = value.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def new_csrf() -> str:
    return secrets.token_urlsafe(24)


def check_csrf(request: Request, viewer: Viewer, form_value: str | None) -> None:
    """Denied(403) unless the POST carries this session's CSRF token (its Origin is checked
    before: web/guard.py)."""
    if viewer.by_header:
        return
    cookie = request.cookies.get(CSRF_COOKIE, "")
    if not cookie or not form_value or not hmac.compare_digest(cookie, form_value):
        raise Denied(403, "refused: the form's CSRF token is missing or stale (reload the page)")
