"""The service's database (`provision serve`), as the service and the CLI use it: one
ServiceStore made of the tables of io/servicedb.py (the connection), io/servicehistory.py
and io/serviceevents.py, and those here.

What it holds: content-addressed blobs (sha256 -> bytes, stored once whoever submits them),
submissions (what was handed over, by whom, its status and which service holds it), the
services that run (their heartbeat, on the database's clock, and the NAMES of the
environment variables they carry: never values), and the history of every run, trial and
queue wait (kept after the job is destroyed), and the dashboard's tokens (their sha256 only).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from provision.core.errors import ProvisionError
from provision.io.serviceevents import EventTables
from provision.io.servicehistory import HistoryTables
from provision.rules.priority import DEFAULT_CLASSES, queue_key

ALIVE_AFTER = 10.0  # seconds: a service whose last heartbeat is older is taken for gone


class Status(StrEnum):
    WAITING = "waiting"  # handed over, no service runs it yet
    RUNNING = "running"  # a service's worker drives it (a queued apply waits for room here)
    # Applied: the service watches its run with its one round per host (serve/watch.py), no
    # worker of its own; a worker comes back to look when the hosts say it ended, or to cancel.
    WATCHING = "watching"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (Status.DONE, Status.FAILED, Status.CANCELLED)


_LIVE = (Status.WAITING.value, Status.RUNNING.value, Status.WATCHING.value)  # not finished


class Kind(StrEnum):
    TUNE = "tune"
    APPLY = "apply"


@dataclass(frozen=True)
class Submission:
    id: str
    kind: Kind
    job: str
    owner: str  # tenancy.identity() of the submitter
    backend: str  # the state backend: "local" or a postgresql:// URL
    state_path: str  # the submitter's resolved state path (local), or "" (database)
    inventory: str  # the inventory's path inside the snapshot
    manifest: dict[str, tuple[str, int]]  # relative path -> (sha256, mode)
    options: dict[str, Any] = field(default_factory=dict)  # take_over, timeout, seed, ...
    created: float = 0.0
    status: Status = Status.WAITING
    claimed_by: str = ""
    why: str = ""
    cancel: str = ""  # who asked to cancel it (the service stops it)
    started: float | None = None
    ended: float | None = None


@dataclass(frozen=True)
class ServiceRow:
    id: str  # host:pid:nonce
    host: str
    pid: int
    place: str  # the database it serves ("local" or postgresql://HOST:PORT/DB)
    env_names: tuple[str, ...]
    leader: bool
    heartbeat: float


@dataclass(frozen=True)
class TokenRow:
    """A dashboard token as listed: never the token itself."""

    id: str
    owner: str
    admin: bool
    created: float


_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_blobs (sha TEXT PRIMARY KEY, data {blob} NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS provision_service_submissions (
        id TEXT PRIMARY KEY, kind TEXT NOT NULL, job TEXT NOT NULL, owner TEXT NOT NULL,
        backend TEXT NOT NULL, state_path TEXT NOT NULL, inventory TEXT NOT NULL, manifest TEXT NOT NULL,
        options TEXT NOT NULL, created {real} NOT NULL, status TEXT NOT NULL, claimed_by TEXT NOT NULL DEFAULT '',
        why TEXT NOT NULL DEFAULT '', cancel TEXT NOT NULL DEFAULT '', started {real}, ended {real})""",
    """CREATE TABLE IF NOT EXISTS provision_service_services (
        id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, place TEXT NOT NULL,
        env_names TEXT NOT NULL, leader INTEGER NOT NULL, heartbeat {real} NOT NULL)""",
    # The dashboard's tokens: only their sha256 (a token is printed once, when made).
    """CREATE TABLE IF NOT EXISTS provision_service_tokens (
        id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, admin INTEGER NOT NULL,
        created {real} NOT NULL)""",
)
_SUB_COLS = (
    "id, kind, job, owner, backend, state_path, inventory, manifest, options, created, status, claimed_by, "
    "why, cancel, started, ended"
)


class ServiceStore(EventTables, HistoryTables):
    """One connection to the service's database (module docstring). Thread-safe: calls are
    serialised (the service's loop and its followers are few and short)."""

    DDL = _DDL

    # -- blobs

    def put_blob(self, sha: str, data: bytes) -> bool:
        """Stored once: False when it was there already."""
        if self._all("SELECT 1 FROM provision_service_blobs WHERE sha = ?", (sha,)):
            return False
        return (
            self._do(
                "INSERT INTO provision_service_blobs (sha, data) VALUES (?, ?) ON CONFLICT DO NOTHING", (sha, data)
            )
            > 0
        )

    def blob(self, sha: str) -> bytes:
        rows = self._all("SELECT data FROM provision_service_blobs WHERE sha = ?", (sha,))
        if not rows:
            raise ProvisionError(f"{self.place}: the service's database has no blob {sha[:12]}")
        return bytes(rows[0][0])

    def blob_count(self) -> int:
        return int(self._all("SELECT count(*) FROM provision_service_blobs")[0][0])

    # -- submissions

    def submit(self, s: Submission) -> Submission:
        created = self.now()
        manifest = json.dumps({k: list(v) for k, v in s.manifest.items()}, sort_keys=True)
        self._do(
            f"INSERT INTO provision_service_submissions ({_SUB_COLS}) VALUES ({', '.join('?' * 16)})",
            (
                s.id, s.kind.value, s.job, s.owner, s.backend, s.state_path, s.inventory, manifest,
                json.dumps(s.options), created, Status.WAITING.value, "", "", "", None, None,
            ),
        )  # fmt: skip
        got = self.get(s.id)
        assert got is not None
        return got

    def get(self, sid: str) -> Submission | None:
        rows = self._all(f"SELECT {_SUB_COLS} FROM provision_service_submissions WHERE id = ?", (sid,))
        return _submission(rows[0]) if rows else None

    def submissions(self, *, unfinished: bool = False, job: str | None = None) -> list[Submission]:
        sql = f"SELECT {_SUB_COLS} FROM provision_service_submissions WHERE 1 = 1"
        args: list[Any] = []
        if unfinished:
            sql += " AND status IN (?, ?, ?)"
            args += [Status.WAITING.value, Status.RUNNING.value, Status.WATCHING.value]
        if job is not None:
            sql += " AND job = ?"
            args.append(job)
        subs = [_submission(r) for r in self._all(sql + " ORDER BY created, id", args)]
        # The queue's order (issue 42): the higher priority first, then the earlier submission.
        return sorted(subs, key=lambda s: queue_key(priority_of(s), s.created, s.id)) if unfinished else subs

    def claim(self, sid: str, service: str) -> bool:
        """This service drives it (a leader's claim: a dead leader's is taken over)."""
        n = self._do(
            "UPDATE provision_service_submissions SET claimed_by = ?, status = ?, "
            "started = coalesce(started, ?) WHERE id = ? AND status IN (?, ?, ?)",
            (service, Status.RUNNING.value, self.now(), sid, *_LIVE),
        )
        return n > 0

    def watching(self, sid: str, why: str) -> None:
        """Applied: the service's rounds watch it from now on (its worker ends)."""
        self._do(
            "UPDATE provision_service_submissions SET status = ?, why = ? WHERE id = ? AND status = ?",
            (Status.WATCHING.value, why, sid, Status.RUNNING.value),
        )

    def finish(self, sid: str, status: Status, why: str) -> None:
        self._do(
            "UPDATE provision_service_submissions SET status = ?, why = ?, ended = ? WHERE id = ? AND status IN (?, ?, ?)",
            (status.value, why, self.now(), sid, *_LIVE),
        )

    def cancel(self, sid: str, who: str) -> Status | None:
        """Taken back when no service holds it yet (CANCELLED); else the service is asked to
        stop it (RUNNING); None: it had finished."""
        taken = self._do(
            "UPDATE provision_service_submissions SET status = ?, why = ?, cancel = ?, ended = ? "
            "WHERE id = ? AND status = ?",
            (Status.CANCELLED.value, f"taken back by {who}", who, self.now(), sid, Status.WAITING.value),
        )
        if taken:
            return Status.CANCELLED
        asked = self._do(
            "UPDATE provision_service_submissions SET cancel = ? WHERE id = ? AND status IN (?, ?)",
            (who, sid, Status.RUNNING.value, Status.WATCHING.value),
        )
        return Status.RUNNING if asked else None

    # -- services

    def beat(self, s: ServiceRow) -> None:
        """The service is here (its row, written on the database's clock)."""
        args = (s.host, s.pid, s.place, json.dumps(list(s.env_names)), int(s.leader))
        with self._sql() as c:
            now_sql = "extract(epoch from now())" if self._pg else "(julianday('now') - 2440587.5) * 86400.0"
            n = c.execute(
                self._q(
                    "UPDATE provision_service_services SET host = ?, pid = ?, place = ?, env_names = ?, leader = ?, "
                    f"heartbeat = {now_sql} WHERE id = ?"
                ),
                (*args, s.id),
            ).rowcount
            if not n:
                c.execute(
                    self._q(
                        "INSERT INTO provision_service_services (id, host, pid, place, env_names, leader, heartbeat) "
                        f"VALUES (?, ?, ?, ?, ?, ?, {now_sql})"
                    ),
                    (s.id, *args),
                )

    def leave(self, service_id: str) -> None:
        self._do("DELETE FROM provision_service_services WHERE id = ?", (service_id,))

    def services(self, *, alive_only: bool = True, everywhere: bool = False) -> list[ServiceRow]:
        """The services of this database (everywhere: also those a team's service on this
        machine said it runs, in the embedded file)."""
        rows = self._all("SELECT id, host, pid, place, env_names, leader, heartbeat FROM provision_service_services")
        now = self.now()
        out = [
            ServiceRow(str(r[0]), str(r[1]), int(r[2]), str(r[3]), tuple(json.loads(r[4])), bool(r[5]), float(r[6]))
            for r in rows
        ]
        out = [s for s in out if everywhere or s.place == self.place]
        return [s for s in out if not alive_only or now - s.heartbeat <= ALIVE_AFTER]

    # -- the dashboard's tokens

    def create_token(self, owner: str, admin: bool) -> tuple[TokenRow, str]:
        """A new token (32 random bytes); the row and the token, which is not kept."""
        token = secrets.token_urlsafe(32)
        tid = secrets.token_hex(4)
        self._do(
            "INSERT INTO provision_service_tokens (id, hash, owner, admin, created) VALUES (?, ?, ?, ?, ?)",
            (tid, token_hash(token), owner, int(admin), self.now()),
        )
        return TokenRow(tid, owner, admin, self.now()), token

    def tokens(self) -> list[TokenRow]:
        rows = self._all("SELECT id, owner, admin, created FROM provision_service_tokens ORDER BY created, id")
        return [TokenRow(str(r[0]), str(r[1]), bool(r[2]), float(r[3])) for r in rows]

    def revoke_token(self, tid: str) -> bool:
        return self._do("DELETE FROM provision_service_tokens WHERE id = ?", (tid,)) > 0

    def owner_of(self, token: str) -> tuple[str, bool] | None:
        """(owner, admin) of a valid token (web/auth.TokenCheck); looked up by its hash, then
        compared in constant time."""
        want = token_hash(token)
        rows = self._all("SELECT hash, owner, admin FROM provision_service_tokens WHERE hash = ?", (want,))
        for r in rows:
            if hmac.compare_digest(str(r[0]), want):
                return str(r[1]), bool(r[2])
        return None


def priority_of(s: Submission) -> int:
    """The level the submitter's policy gave it (options["priority"]; older ones: normal)."""
    p = s.options.get("priority")
    return p if isinstance(p, int) and not isinstance(p, bool) else DEFAULT_CLASSES["normal"]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _submission(r: Any) -> Submission:
    return Submission(
        id=str(r[0]),
        kind=Kind(r[1]),
        job=str(r[2]),
        owner=str(r[3]),
        backend=str(r[4]),
        state_path=str(r[5]),
        inventory=str(r[6]),
        manifest={k: (str(v[0]), int(v[1])) for k, v in json.loads(r[7]).items()},
        options=json.loads(r[8]),
        created=float(r[9]),
        status=Status(r[10]),
        claimed_by=str(r[11]),
        why=str(r[12]),
        cancel=str(r[13]),
        started=None if r[14] is None else float(r[14]),
        ended=None if r[15] is None else float(r[15]),
    )
