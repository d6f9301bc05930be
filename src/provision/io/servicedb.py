"""The service's database: its connection, dialects and transactions, under the store's
tables (io/servicestore.py: submissions, services, blobs, tokens; io/servicehistory.py: runs,
trials, waits and GPU samples; io/serviceevents.py: the event stream). Only these modules talk
to the service's database.

Two backends, one schema (tables prefixed `provision_service_`):
- the embedded default, a SQLite file (WAL) at $PROVISION_SERVICE_DB or
  ~/.local/state/provision/service.sqlite (0600, its directory 0700): one person, one
  workstation, no server;
- a team's PostgreSQL (the state backend's database), via psycopg as io/pgstate.py.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Self

from provision.core.errors import ProvisionError

DB_ENV = "PROVISION_SERVICE_DB"


def default_db() -> Path:
    """The embedded database's file: $PROVISION_SERVICE_DB, else under ~/.local/state."""
    named = os.environ.get(DB_ENV, "").strip()
    if named:
        return Path(named).expanduser().resolve()
    return Path.home() / ".local" / "state" / "provision" / "service.sqlite"


class ServiceDB:
    """One connection to the service's database. Thread-safe: calls are serialised (the
    service's loop, its rounds and its pages are few and short). Each table module adds its
    statements to DDL, made when the database is opened."""

    DDL: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def ddl(cls) -> list[str]:
        """Every table's statements, from the classes this one is made of (bases first)."""
        out: list[str] = []
        for c in reversed(cls.__mro__):
            out += [s for s in c.__dict__.get("DDL", ()) if s not in out]
        return out

    def __init__(self, place: str, conn: Any, pg: bool, url: str = ""):
        self.place = place  # "local" (the file is `path`) or the PostgreSQL place
        self._conn = conn
        self._pg = pg
        self._mutex = threading.Lock()
        self.path: Path | None = None
        self._url = url  # PostgreSQL: to connect again after the server went away

    # -- opening

    @classmethod
    def open_local(cls, path: Path | None = None) -> Self:
        path = path or default_db()
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Created private, and only when missing: an open() and close() of a database file
            # this process already has open drops SQLite's POSIX locks on it (close releases
            # every lock of the process on the file), and the other connection's writes were
            # lost (a service's claim, when its pages or rounds opened their own connection).
            if not path.exists():
                try:
                    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
                except FileExistsError:
                    pass
            conn = sqlite3.connect(str(path), timeout=30, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")
            for statement in cls.ddl():
                conn.execute(statement.format(blob="BLOB", real="REAL", serial="INTEGER PRIMARY KEY AUTOINCREMENT"))
        except (OSError, sqlite3.Error) as e:
            raise ProvisionError(f"{path}: cannot open the service's database: {e}") from None
        store = cls("local", conn, pg=False)
        store.path = path
        return store

    @classmethod
    def open_pg(cls, url: str, place: str) -> Self:
        # Here, not at the top: only a team's service needs psycopg (start-up of the embedded path).
        import psycopg

        from provision.io.pgstate import why  # (start-up, as above)

        try:
            conn = _pg_connect(url)
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                for statement in cls.ddl():
                    conn.execute(
                        statement.format(blob="BYTEA", real="DOUBLE PRECISION", serial="BIGSERIAL PRIMARY KEY")
                    )
        except psycopg.Error as e:
            raise ProvisionError(f"{place}: the service's tables: {why(e)}") from None
        return cls(place, conn, pg=True, url=url)

    def close(self) -> None:
        with self._mutex:
            self._conn.close()

    # -- SQL

    @contextmanager
    def _sql(self) -> Iterator[Any]:
        with self._mutex:
            try:
                if self._pg and self._conn.closed:
                    self._conn = _pg_connect(self._url)
                yield self._conn
            except sqlite3.Error as e:
                raise ProvisionError(f"{self.path}: the service's database: {e}") from None
            except Exception as e:
                if type(e).__module__.startswith("psycopg"):
                    # One line (libpq's run over several): the service says it once per outage.
                    # Here, not at the top: psycopg loads only for a team's service (start-up, as in open_pg).
                    from provision.io.pgstate import why

                    raise ProvisionError(f"{self.place}: the service's database: {why(e)}") from None
                raise

    def _q(self, sql: str) -> str:
        return sql.replace("?", "%s") if self._pg else sql

    def _all(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._sql() as c:
            return list(c.execute(self._q(sql), tuple(args)).fetchall())

    def _do(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._sql() as c:
            cur = c.execute(self._q(sql), tuple(args))
            return int(cur.rowcount or 0)

    def now(self) -> float:
        """The database's clock (heartbeats are compared on it, never on a machine's)."""
        sql = "SELECT extract(epoch from now())" if self._pg else "SELECT (julianday('now') - 2440587.5) * 86400.0"
        return float(self._all(sql)[0][0])

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """The statements of the with block in one transaction (all or none)."""
        with self._sql() as c:
            if self._pg:
                with c.transaction():
                    yield c
                return
            c.execute("BEGIN IMMEDIATE")
            try:
                yield c
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")


def opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _pg_connect(url: str) -> Any:
    # Here, not at the top: only a team's service needs psycopg (start-up of the embedded path).
    from provision.io.pgstate import connect_url
    from provision.io.servicelead import CUT_OFF  # (start-up, as above)

    # A word the server never acknowledges fails after CUT_OFF s, not the kernel's ~15 min of
    # retries: a service cut off from its database says so, and its leader stops leading.
    return connect_url(url, "provision serve", tcp_user_timeout=CUT_OFF * 1000)


_PG_SCHEMA_LOCK = 0x70726F7673657276  # "provserv": the tables are made by one service at a time
