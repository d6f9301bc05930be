"""A job's state in PostgreSQL, shared by a team (`state: postgresql://...` or PROVISION_STATE).

Tables, created on first use (under a transaction advisory lock, so two first users do not
collide), with their schema version in provision_meta (a newer one is refused):

- provision_state: one row per job: the same JSON document the local file holds (`doc`,
  text, byte for byte), with its lineage, serial and format_version beside it, the document
  as the last changing run read it (`backup`), and where a `state migrate` moved it;
- provision_keys: the job's checksum key (HMAC), shared by everyone who uses the backend,
  never printed;
- provision_history: who changed the job when, with which command and its summary line;
- provision_locks: who holds the job's lock (what a refused run names);
- provision_policy: the team's priority classes and GPU guarantees (io/policystore.py).

The lock is a session advisory lock (pg_try_advisory_lock) on a key derived from the job
name, held on a connection of its own for the command's duration: the server frees it when
the session ends, however the client ends (SIGKILL, a lost laptop: bound_session makes the
server see a vanished machine within LOCK_BOUND seconds). Saves go through that
connection and are compare-and-set on the serial this run read: a state is never written by
two runs, nor by one whose lock was taken from it (force-unlock ends its session).

Credentials come from libpq's environment (PGPASSWORD, PGUSER, ...) or ~/.pgpass, never
from the inventory (inventory/statebackend.py refuses a password in the URL). Every database
error is one line naming the URL (without a password: it cannot hold one).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from provision.core.errors import ProvisionError
from provision.inventory.statebackend import Backend
from provision.io.statestore import FORMAT_VERSION, Change, LockInfo, Store, locked_error
from provision.rules.tenancy import identity

SCHEMA_VERSION = 1
CONNECT_TIMEOUT = 10  # seconds, unless PGCONNECT_TIMEOUT or the URL says otherwise
_SCHEMA_LOCK = int.from_bytes(hashlib.sha256(b"provision-schema").digest()[:8], "big", signed=True)
TABLES = (
    "provision_meta",
    "provision_state",
    "provision_keys",
    "provision_history",
    "provision_locks",
    "provision_policy",
)
DDL = (
    "CREATE TABLE IF NOT EXISTS provision_meta (name text PRIMARY KEY, value text NOT NULL)",
    """CREATE TABLE IF NOT EXISTS provision_state (
        job text PRIMARY KEY,
        lineage text NOT NULL,
        serial bigint NOT NULL,
        format_version integer NOT NULL,
        doc text NOT NULL,
        backup text,
        updated_at timestamptz NOT NULL DEFAULT now(),
        updated_by text NOT NULL DEFAULT '',
        moved_to text,
        moved_at timestamptz)""",
    "CREATE TABLE IF NOT EXISTS provision_keys (job text PRIMARY KEY, key text NOT NULL)",
    """CREATE TABLE IF NOT EXISTS provision_history (
        id bigserial PRIMARY KEY,
        job text NOT NULL,
        at text NOT NULL,
        who text NOT NULL,
        operation text NOT NULL,
        serial bigint NOT NULL,
        summary text NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS provision_history_job ON provision_history (job, id)",
    # The team's policy (io/policystore.py): one row, name 'team', the JSON document.
    """CREATE TABLE IF NOT EXISTS provision_policy (
        name text PRIMARY KEY,
        doc text NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now(),
        updated_by text NOT NULL DEFAULT '')""",
    """CREATE TABLE IF NOT EXISTS provision_locks (
        job text PRIMARY KEY,
        id text NOT NULL,
        who text NOT NULL,
        pid integer NOT NULL,
        machine text NOT NULL,
        operation text NOT NULL,
        created text NOT NULL,
        session integer NOT NULL)""",
)

T = TypeVar("T")

# A lock's session ends on the server within LOCK_BOUND s of its client's machine vanishing
# (power off, network gone: no FIN or RST reaches the server, which by default keeps the
# session, and its lock, for the kernel's 2 hours of keepalive). libpq's keepalives are the
# client's; the server's are session settings any user may set (PostgreSQL >= 12).
LOCK_BOUND = 10


def lock_session_settings(bound: int = LOCK_BOUND) -> dict[str, int]:
    """The server's side of a lock's connection, ending a silent client's session within
    `bound` s of its last word: keepalive probes after bound - 6 s idle, 2 s apart, 3 unanswered
    (Linux ends it at tcp_user_timeout once a probe went unanswered), and tcp_user_timeout for
    data the server sent that the client never acknowledged (it died mid-answer)."""
    interval, count = 2, 3
    return {
        "tcp_keepalives_idle": max(1, bound - interval * count),
        "tcp_keepalives_interval": interval,
        "tcp_keepalives_count": count,
        "tcp_user_timeout": bound * 1000,
    }


def bound_session(conn: psycopg.Connection[Any], bound: int = LOCK_BOUND) -> None:
    """Apply lock_session_settings to this session (before it takes a lock: never unbounded).
    On a Unix socket the server ignores them (a local client's death is always seen)."""
    settings = lock_session_settings(bound)
    conn.execute(
        "SELECT " + ", ".join("set_config(%s, %s, false)" for _ in settings),
        [x for name, value in settings.items() for x in (name, str(value))],
    )


def lock_key(job: str) -> int:
    """The job's advisory lock key: 64 bits of a hash of its name."""
    return int.from_bytes(hashlib.sha256(b"provision-state:" + job.encode()).digest()[:8], "big", signed=True)


def why(e: BaseException) -> str:
    """A database error as one phrase: libpq's first line (the last attempt's, when it
    tried several addresses), without FATAL:/ERROR: prefixes; with where the password comes
    from when that failed."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    line = lines[0]
    if line.startswith("Multiple connection attempts failed"):
        line = next((x for x in reversed(lines) if x.startswith("- ")), line).lstrip("- ")
        line = re.sub(r"^host: [^:]*(?::[^,]*)?, port: [^,]*(?:, hostaddr: '[^']*')?: ", "", line)
    line = line.removeprefix("connection failed: ")
    line = re.sub(r"\b(?:FATAL|ERROR):\s+", "", line)
    if "password" in line and ("authentication failed" in line or "no password" in line):
        line += " (libpq takes the password from PGPASSWORD or ~/.pgpass)"
    return line


def connect_url(url: str, application_name: str, **extra: Any) -> psycopg.Connection[Any]:
    """An autocommit connection to `url`, given up after CONNECT_TIMEOUT unless
    PGCONNECT_TIMEOUT or the URL says otherwise (the state's and the service's alike)."""
    if "PGCONNECT_TIMEOUT" not in os.environ and "connect_timeout" not in url:
        extra["connect_timeout"] = CONNECT_TIMEOUT
    return psycopg.connect(url, autocommit=True, application_name=application_name, **extra)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


class PgStore(Store):
    """One job's state in a PostgreSQL database (module docstring)."""

    def __init__(self, backend: Backend, job: str, local_path: Path):
        self.backend, self.job, self.local_path = backend, job, local_path
        self.where = backend.url
        self.noun = f"state of job {job}"
        self.unreadable_hint = (
            f"restore it (the row's `backup` column holds the last one read) or delete job {job}'s row "
            "from provision_state"
        )
        self.who = identity(socket.gethostname())
        self._conn: psycopg.Connection[Any] | None = None
        # While this process holds the job's lock: the lock's connection, which saves go
        # through, so that a run whose lock is gone (force-unlock ended its session, the
        # server restarted) cannot save.
        self._locked: psycopg.Connection[Any] | None = None

    @property
    def owner_ref(self) -> str:
        return self.backend.place

    # -- connections

    def connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection, the tables made sure of."""
        try:
            conn = connect_url(self.backend.url, "provision")
        except psycopg.Error as e:
            raise ProvisionError(f"{self.where}: cannot connect: {why(e)}") from None
        try:
            self._schema(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _schema(self, conn: psycopg.Connection[Any]) -> None:
        try:
            found = conn.execute("SELECT " + ", ".join(f"to_regclass('{t}') IS NOT NULL" for t in TABLES)).fetchone()
            if found is None or not all(found):
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                    for statement in DDL:
                        conn.execute(statement)
                    conn.execute(
                        "INSERT INTO provision_meta (name, value) VALUES ('schema_version', %s) ON CONFLICT DO NOTHING",
                        (str(SCHEMA_VERSION),),
                    )
            row = conn.execute("SELECT value FROM provision_meta WHERE name = 'schema_version'").fetchone()
        except psycopg.Error as e:
            raise ProvisionError(f"{self.where}: cannot set up provision's tables: {why(e)}") from None
        version = int(row[0]) if row and str(row[0]).isdigit() else None
        if version is None or version > SCHEMA_VERSION:
            raise ProvisionError(
                f"{self.where}: provision's tables are at schema version {row[0] if row else '?'}, newer than this "
                f"provision knows ({SCHEMA_VERSION}): upgrade provision; nothing was changed"
            )

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = self.connect()
        return self._conn

    @contextmanager
    def _db(self, what: str, then: str = "", *, locked: bool = False) -> Iterator[psycopg.Connection[Any]]:
        """The store's connection (locked: the lock's, when this process holds the lock); a
        database error becomes one line: WHERE: WHAT: why[. THEN]."""
        try:
            yield (self._locked if locked and self._locked is not None else self.conn)
        except psycopg.Error as e:
            raise ProvisionError(f"{self.where}: {what}: {why(e)}" + (f". {then}" if then else "")) from None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- the document

    def read(self) -> bytes | None:
        doc, moved = self.peek()
        if moved is not None:
            raise ProvisionError(
                f"{self.where}: job {self.job}'s state was moved to {moved} by `provision state migrate`; "
                "point `state:` in the inventory or PROVISION_STATE there"
            )
        return doc

    def peek(self) -> tuple[bytes | None, str | None]:
        with self._db(f"cannot read job {self.job}'s state") as c:
            row = c.execute("SELECT doc, moved_to FROM provision_state WHERE job = %s", (self.job,)).fetchone()
        return (None, None) if row is None else (str(row[0]).encode(), row[1])

    def write(self, data: bytes, *, serial: int, lineage: str, expect: int | None, backup: bytes | None) -> None:
        what = f"cannot save job {self.job}'s state (serial {serial})"
        then = (
            "What this run did on the hosts stays there; the next apply (with the database back) finds it and converges"
        )
        args = (data.decode(), serial, lineage, FORMAT_VERSION, backup.decode() if backup else None, self.who)
        with self._db(what, then, locked=True) as c:
            if expect is None:
                cur = c.execute(
                    "INSERT INTO provision_state (doc, serial, lineage, format_version, backup, updated_by, job) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (job) DO NOTHING",
                    (*args, self.job),
                )
            else:
                cur = c.execute(
                    "UPDATE provision_state SET doc = %s, serial = %s, lineage = %s, format_version = %s, "
                    "backup = COALESCE(%s, backup), updated_by = %s, updated_at = now() "
                    "WHERE job = %s AND serial = %s AND lineage = %s AND moved_to IS NULL",
                    (*args, self.job, expect, lineage),
                )
            if cur.rowcount == 1:
                return
            now = c.execute(
                "SELECT serial, updated_by, updated_at FROM provision_state WHERE job = %s", (self.job,)
            ).fetchone()
        seen = f"serial {now[0]}, saved by {now[1] or '?'} at {now[2]:%Y-%m-%dT%H:%M:%SZ}" if now else "no row"
        raise ProvisionError(
            f"{self.where}: job {self.job}'s state was changed by another run ({seen}; this run read "
            f"{'none' if expect is None else f'serial {expect}'}): not saved over it. Run the command again"
        )

    def key(self) -> bytes:
        with self._db(f"cannot read job {self.job}'s checksum key") as c:
            c.execute(
                "INSERT INTO provision_keys (job, key) VALUES (%s, %s) ON CONFLICT (job) DO NOTHING",
                (self.job, secrets.token_hex(32)),
            )
            row = c.execute("SELECT key FROM provision_keys WHERE job = %s", (self.job,)).fetchone()
        try:
            return bytes.fromhex(str(row[0]) if row else "")
        except ValueError:
            raise ProvisionError(
                f"{self.where}: job {self.job}'s checksum key (provision_keys) is not hex; delete its row "
                "(the next apply makes a new one and compares the hosts' files again)"
            ) from None

    # -- history

    def record(self, change: Change) -> None:
        with self._db(f"cannot add to job {self.job}'s history") as c:
            c.execute(
                "INSERT INTO provision_history (job, at, who, operation, serial, summary) VALUES (%s, %s, %s, %s, %s, %s)",
                (self.job, change.at, change.who, change.operation, change.serial, change.summary),
            )

    def history(self, n: int) -> list[Change]:
        with self._db(f"cannot read job {self.job}'s history") as c:
            rows = c.execute(
                "SELECT at, who, operation, serial, summary FROM provision_history WHERE job = %s "
                "ORDER BY id DESC LIMIT %s",
                (self.job, n),
            ).fetchall()
        return [Change(str(a), str(w), str(o), int(s), str(m)) for a, w, o, s, m in rows]

    # -- migrate

    def adopt(self, data: bytes, *, lineage: str, serial: int, key: bytes, history: list[Change]) -> None:
        with self._db(f"cannot write job {self.job}'s state", locked=True) as c, c.transaction():
            c.execute(
                "INSERT INTO provision_state (job, doc, serial, lineage, format_version, updated_by) "
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (job) DO UPDATE SET doc = EXCLUDED.doc, "
                "serial = EXCLUDED.serial, lineage = EXCLUDED.lineage, format_version = EXCLUDED.format_version, "
                "backup = provision_state.doc, updated_by = EXCLUDED.updated_by, updated_at = now(), "
                "moved_to = NULL, moved_at = NULL",
                (self.job, data.decode(), serial, lineage, FORMAT_VERSION, self.who),
            )
            c.execute(
                "INSERT INTO provision_keys (job, key) VALUES (%s, %s) ON CONFLICT (job) DO UPDATE SET key = EXCLUDED.key",
                (self.job, key.hex()),
            )
            have = set(
                c.execute(
                    "SELECT at, who, operation, serial, summary FROM provision_history WHERE job = %s", (self.job,)
                ).fetchall()
            )
            for ch in reversed(history):  # oldest first; what is here already is not repeated
                if (ch.at, ch.who, ch.operation, ch.serial, ch.summary) not in have:
                    c.execute(
                        "INSERT INTO provision_history (job, at, who, operation, serial, summary) "
                        "VALUES (%s, %s, %s, %s, %s, %s)",
                        (self.job, ch.at, ch.who, ch.operation, ch.serial, ch.summary),
                    )

    def retire(self, to: str) -> None:
        with self._db(f"cannot mark job {self.job}'s state as moved", locked=True) as c:
            c.execute("UPDATE provision_state SET moved_to = %s, moved_at = now() WHERE job = %s", (to, self.job))

    # -- the lock

    def lock(self, operation: str) -> PgLock:
        return PgLock(self, operation)

    def _holder(self, c: psycopg.Connection[Any]) -> LockInfo | None:
        row = c.execute(
            "SELECT id, who, pid, machine, operation, created FROM provision_locks WHERE job = %s", (self.job,)
        ).fetchone()
        return LockInfo(str(row[0]), str(row[1]), int(row[2]), str(row[3]), str(row[4]), str(row[5])) if row else None

    def _session(self, c: psycopg.Connection[Any]) -> int | None:
        """The database session that holds the job's advisory lock, if one does."""
        key = lock_key(self.job)
        row = c.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND classid::bigint = %s AND objid::bigint = %s",
            ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
        ).fetchone()
        return int(row[0]) if row else None

    def held(self) -> LockInfo | None:
        with self._db(f"cannot read job {self.job}'s lock") as c:
            if self._session(c) is None:
                return None
            return self._holder(c) or LockInfo("?", "?", 0, "?", "an operation that is still writing its lock", "?")

    def force_unlock(self, lock_id: str) -> LockInfo:
        with self._db(f"cannot remove job {self.job}'s lock") as c:
            holder, session = self._holder(c), self._session(c)
            if session is None:
                if holder is not None:
                    c.execute("DELETE FROM provision_locks WHERE job = %s", (self.job,))
                raise ProvisionError(f"{self.where}: no lock is held on job {self.job}")
            if holder is None:  # a teammate removed the row and ends the session next, or a taker writes it
                raise ProvisionError(
                    f"{self.where}: no lock {lock_id} is held on job {self.job} (someone removed it just now, "
                    "or a new holder has not written its name yet)"
                )
            if holder.id != lock_id:
                raise ProvisionError(f"lock id {lock_id} does not match the lock held: {holder.describe()}")
            # Two teammates at once: the row's removal decides who removed the lock; the
            # other ends no session and says so.
            gone = c.execute(
                "DELETE FROM provision_locks WHERE job = %s AND id = %s RETURNING id", (self.job, lock_id)
            ).fetchone()
            if gone is None:
                raise ProvisionError(f"{self.where}: no lock is held on job {self.job} (someone removed it just now)")
            c.execute("SELECT pg_terminate_backend(%s)", (session,))
            _poll(lambda: self._session(c) != session, 10)
        return holder


def _poll(pred: Callable[[], bool], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


class PgLock:
    """The job's lock: a session advisory lock on a connection of its own, held until
    release() or until the session ends (the server frees it: a killed client holds
    nothing). Who holds it is written in provision_locks while holding it."""

    def __init__(self, store: PgStore, operation: str):
        self.store, self.operation = store, operation
        self.info: LockInfo | None = None
        self.notice: str | None = None
        self._conn: psycopg.Connection[Any] | None = None

    def try_acquire(self) -> LockInfo | None:
        """Take the lock, or return who holds it."""
        s = self.store
        conn = s.connect()
        try:
            bound_session(conn)  # a dead operator's machine holds the job's lock seconds, not hours
            for _ in range(3):
                row = conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_key(s.job),)).fetchone()
                if row and row[0]:
                    self._took(conn)
                    return None
                holder = s._holder(conn)
                if holder is not None:
                    conn.close()
                    return holder
                time.sleep(0.2)  # taken, its holder's name not written yet (or just released)
            conn.close()
            return LockInfo("?", "?", 0, "?", "an operation that is still writing its lock", "?")
        except psycopg.Error as e:
            conn.close()
            raise ProvisionError(f"{s.where}: cannot take the state's lock: {why(e)}") from None

    def _took(self, conn: psycopg.Connection[Any]) -> None:
        s = self.store
        before = s._holder(conn)
        if before is not None:
            self.notice = (
                f"the last holder of the lock ended without releasing it ({before.describe()}); "
                "the database freed it when its session ended"
            )
        me = LockInfo(str(uuid.uuid4()), s.who, os.getpid(), socket.gethostname(), self.operation, _now())
        conn.execute(
            "INSERT INTO provision_locks (job, id, who, pid, machine, operation, created, session) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, pg_backend_pid()) ON CONFLICT (job) DO UPDATE SET "
            "id = EXCLUDED.id, who = EXCLUDED.who, pid = EXCLUDED.pid, machine = EXCLUDED.machine, "
            "operation = EXCLUDED.operation, created = EXCLUDED.created, session = EXCLUDED.session",
            (s.job, me.id, me.who, me.pid, me.machine, me.operation, me.created),
        )
        self._conn, self.info = conn, me
        s._locked = conn

    def acquire(self) -> PgLock:
        holder = self.try_acquire()
        if holder is not None:
            raise ProvisionError(f"{self.store.where}: " + locked_error(holder, server_frees=True))
        return self

    def release(self) -> None:
        conn, info = self._conn, self.info
        self._conn, self.info = None, None
        if conn is None or info is None:
            return
        if self.store._locked is conn:
            self.store._locked = None
        try:
            conn.execute("DELETE FROM provision_locks WHERE job = %s AND id = %s", (self.store.job, info.id))
            conn.execute("SELECT pg_advisory_unlock(%s)", (lock_key(self.store.job),))
        except psycopg.Error:
            pass  # the connection is gone: so is the session, and with it the lock
        finally:
            conn.close()

    def __enter__(self) -> PgLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
