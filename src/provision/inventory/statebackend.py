"""Where a job's state lives: the inventory's `state:` key, or PROVISION_STATE, which wins.

`local` (the default) is the file beside the inventory (io/state.py); a `postgresql://`
URL is a database the team shares (io/pgstate.py). A URL may not carry a password, in the
inventory or in the variable: it would be kept in clear in the file, in every host's
ledger (the owner's state is recorded there) and in messages. libpq finds it in
PGPASSWORD or ~/.pgpass (or PGPASSFILE), as psql does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

from provision.core.errors import ProvisionError
from provision.core.model import Inventory

LOCAL = "local"
ENV = "PROVISION_STATE"
SCHEMES = ("postgresql", "postgres")
# libpq's URL parameters that carry a secret.
SECRET_PARAMS = ("password", "sslpassword")


@dataclass(frozen=True)
class Backend:
    """`local`, or a PostgreSQL URL without a password."""

    url: str = LOCAL
    source: str = "default"  # where it was chosen: PROVISION_STATE, the inventory's key, or default

    @property
    def local(self) -> bool:
        return self.url == LOCAL

    @property
    def kind(self) -> str:
        return "local" if self.local else "postgresql"

    @property
    def place(self) -> str:
        """The database as the team names it, whoever logs in: postgresql://HOST:PORT/DB
        (no user, no parameters). Owners and locks are told apart by it."""
        if self.local:
            return LOCAL
        u = urlsplit(self.url)
        host = u.hostname or "localhost"
        host = f"[{host}]" if ":" in host else host
        db = u.path.lstrip("/") or (u.username or "")
        return f"postgresql://{host}:{u.port or 5432}/{db}"


def problem(value: object) -> str | None:
    """Why `value` is not a state setting (one phrase, never echoing a password), or None."""
    if not isinstance(value, str) or not value.strip():
        return f"expected {LOCAL} or a postgresql:// URL"
    if value == LOCAL:
        return None
    scheme = value.split(":", 1)[0].lower() if ":" in value else ""
    if scheme not in SCHEMES or not value[len(scheme) :].startswith("://"):
        # Never echo what may hold a password (user:secret@...): a scheme, or a short plain word.
        if "://" in value:
            shown = f"a {value.split('://', 1)[0][:20]}:// URL"
        elif "@" in value or ":" in value or len(value) > 40:
            shown = "something else"
        else:
            shown = repr(value)
        return f"expected {LOCAL} or a postgresql:// URL (postgresql://USER@HOST:PORT/DATABASE), got {shown}"
    try:
        u = urlsplit(value)
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "the URL's host and port cannot be read: postgresql://USER@HOST:PORT/DATABASE"
    if u.password is not None or any(k in SECRET_PARAMS for k, _ in parse_qsl(u.query)):
        return (
            "a password in the URL is not accepted (it would be kept in clear): give it in "
            "PGPASSWORD or ~/.pgpass, as for psql"
        )
    if u.fragment:
        return "the URL may not have a #fragment"
    return None


def chosen(inventory_value: str, where: str, environ: Mapping[str, str] | None = None) -> Backend:
    """The backend in effect: PROVISION_STATE when set (and not empty), else the
    inventory's `state:` (already validated; `where` names it), else local."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip()
    if value:
        why = problem(value)
        if why:
            raise ProvisionError(f"{ENV}: {why}")
        return Backend(value, ENV)
    if inventory_value and inventory_value != LOCAL:
        return Backend(inventory_value, f"{where}: state")
    return Backend(LOCAL, "default")


def backend_of(inv: Inventory, inventory_path: str, state_path: str | None = None) -> Backend:
    """The state's backend: PROVISION_STATE, else the inventory's `state:`, else local. A
    --state file is a local state: refused beside a database, so no run reads one state
    while the team writes the other."""
    backend = chosen(inv.state, inventory_path)
    if state_path and not backend.local:
        raise ProvisionError(
            f"--state {state_path} names a local state file, but job {inv.job}'s state is in {backend.url} "
            f"(from {backend.source}); leave out --state, or set PROVISION_STATE=local"
        )
    return backend
