"""The team's policy in its PostgreSQL state: priority classes, GPU guarantees and
groups of owners, one row of provision_policy (made with provision's other tables,
io/pgstate.py). The local default state has none: one person, nothing to share, so
DEFAULT_CLASSES and no guarantee (rules/priority.Policy())."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from provision.core.errors import ProvisionError
from provision.inventory.statebackend import Backend
from provision.io.pgstate import PgStore, why
from provision.rules import policyfile
from provision.rules.priority import Policy
from provision.rules.tenancy import identity

ROW = "team"

# Who the team is: every name the backend's records hold (the state's saves, its history,
# its locks; the service's submissions, history and dashboard tokens, when it has them).
OWNER_SOURCES = (
    ("provision_state", "updated_by"),
    ("provision_history", "who"),
    ("provision_locks", "who"),
    ("provision_service_submissions", "owner"),
    ("provision_service_history", "owner"),
    ("provision_service_tokens", "owner"),
)
KNOWN_FROM = "the state's saves, history and locks, and the service's submissions, history and tokens"


@dataclass(frozen=True)
class Stored:
    policy: Policy
    set: bool  # False: no row yet (the defaults)
    updated_at: str | None = None
    updated_by: str | None = None


def open_team(backend: Backend) -> PgStore:
    """A store on the team's database (its tables made sure of), for the policy alone."""
    return PgStore(backend, "-", Path("."))


def read(store: PgStore) -> Stored:
    try:
        row = store.conn.execute(
            "SELECT doc, to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), updated_by "
            "FROM provision_policy WHERE name = %s",
            (ROW,),
        ).fetchone()
    except psycopg.Error as e:
        raise ProvisionError(f"{store.where}: cannot read the team's policy: {why(e)}") from None
    if row is None:
        return Stored(Policy(), False)
    try:
        doc = json.loads(str(row[0]))
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        return Stored(policyfile.from_json(doc), True, str(row[1]), str(row[2]))
    except (ValueError, RecursionError) as e:
        raise ProvisionError(
            f"{store.where}: the team's policy (provision_policy) cannot be read ({e}): set it again with "
            "`provision policy set FILE`"
        ) from None


def write(store: PgStore, p: Policy) -> None:
    doc = json.dumps(policyfile.to_json(p), sort_keys=True)
    who = identity(socket.gethostname())
    try:
        store.conn.execute(
            "INSERT INTO provision_policy (name, doc, updated_by) VALUES (%s, %s, %s) ON CONFLICT (name) DO UPDATE "
            "SET doc = EXCLUDED.doc, updated_by = EXCLUDED.updated_by, updated_at = now()",
            (ROW, doc, who),
        )
    except psycopg.Error as e:
        raise ProvisionError(f"{store.where}: cannot save the team's policy: {why(e)}") from None


def known_owners(store: PgStore) -> set[str]:
    """Every owner the backend's records name (OWNER_SOURCES), and whoever asks."""
    names = {identity(socket.gethostname())}
    try:
        c: Any = store.conn
        for table, column in OWNER_SOURCES:
            found = c.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
            if found and found[0]:
                names |= {str(r[0]) for r in c.execute(f"SELECT DISTINCT {column} FROM {table}").fetchall() if r[0]}
    except psycopg.Error as e:
        raise ProvisionError(f"{store.where}: cannot read who the team is: {why(e)}") from None
    return names


def policy_of(backend: Backend) -> Policy:
    """The policy in effect for work on `backend`: the local state's defaults, or the team's."""
    if backend.local:
        return Policy()
    store = open_team(backend)
    try:
        return read(store).policy
    finally:
        store.close()
