"""The service's database (`provision serve`), as the service and the CLI use it: one
ServiceStore made of the tables of io/servicedb.py (the connection), io/servicehistory.py,
io/serviceevents.py and io/servicenotify.py, and those here.

What it holds (beside the kept logs, io/servicelogs.py): content-addressed blobs (sha256 -> bytes, stored once whoever submits them),
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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from provision.core.errors import ProvisionError
from provision.core.submission import MOVES, BadRow, Kind, Options, Status, valid_id
from provision.io.serviceevents import EventTables
from provision.io.servicehealth import HealthTables
from provision.io.servicehistory import HistoryTables
from provision.io.servicelogs import LogTables
from provision.io.servicenotify import NotifyTables
from provision.rules.priority import queue_key

ALIVE_AFTER = 10.0  # seconds: a service whose last heartbeat is older is taken for gone


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
    options: Options = field(default_factory=Options)
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
    # A large blob in pieces of CHUNK bytes (its blobs row then holds no data): written and
    # read a piece at a time, never whole in memory.
    """CREATE TABLE IF NOT EXISTS provision_service_blob_chunks (
        sha TEXT NOT NULL, n INTEGER NOT NULL, data {blob} NOT NULL, PRIMARY KEY (sha, n))""",
    """CREATE TABLE IF NOT EXISTS provision_service_submissions (
        id TEXT PRIMARY KEY, kind TEXT NOT NULL, job TEXT NOT NULL, owner TEXT NOT NULL,
        backend TEXT NOT NULL, state_path TEXT NOT NULL, inventory TEXT NOT NULL, manifest TEXT NOT NULL,
        options TEXT NOT NULL, created {real} NOT NULL, status TEXT NOT NULL, claimed_by TEXT NOT NULL DEFAULT '',
        why TEXT NOT NULL DEFAULT '', cancel TEXT NOT NULL DEFAULT '', started {real}, ended {real})""",
    """CREATE TABLE IF NOT EXISTS provision_service_services (
        id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL, place TEXT NOT NULL,
        env_names TEXT NOT NULL, leader INTEGER NOT NULL, heartbeat {real} NOT NULL)""",
    # Which server session holds the lead (PostgreSQL): a follower ends a frozen leader's.
    """CREATE TABLE IF NOT EXISTS provision_service_leads (service TEXT PRIMARY KEY, backend INTEGER NOT NULL)""",
    # The dashboard's tokens: only their sha256 (a token is printed once, when made).
    """CREATE TABLE IF NOT EXISTS provision_service_tokens (
        id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, admin INTEGER NOT NULL,
        created {real} NOT NULL)""",
)
_SUB_COLS = (
    "id, kind, job, owner, backend, state_path, inventory, manifest, options, created, status, claimed_by, "
    "why, cancel, started, ended"
)


class ServiceStore(NotifyTables, EventTables, HistoryTables, LogTables, HealthTables):
    """One connection to the service's database (module docstring). Thread-safe: calls are
    serialised (the service's loop and its followers are few and short)."""

    DDL = _DDL

    # -- blobs

    def has_blob(self, sha: str) -> bool:
        return bool(self._all("SELECT 1 FROM provision_service_blobs WHERE sha = ?", (sha,)))

    def put_blob(self, sha: str, data: bytes) -> bool:
        """Stored once: False when it was there already."""
        return self.put_blob_parts(sha, iter([data]))

    def put_blob_parts(self, sha: str, parts: Iterator[bytes]) -> bool:
        """A blob from its pieces (each at most CHUNK bytes: a file read a piece at a time),
        in one transaction, its row last; False when it was there already."""
        if self.has_blob(sha):
            return False
        chunk = "INSERT INTO provision_service_blob_chunks (sha, n, data) VALUES (?, ?, ?) ON CONFLICT DO NOTHING"
        with self._tx() as c:
            for n, data in enumerate(parts):
                c.execute(self._q(chunk), (sha, n, data))
            c.execute(
                self._q("INSERT INTO provision_service_blobs (sha, data) VALUES (?, ?) ON CONFLICT DO NOTHING"),
                (sha, b""),
            )
        return True

    def blob_parts(self, sha: str) -> Iterator[bytes]:
        """The blob a piece at a time (one query each: never whole in memory)."""
        if not self.has_blob(sha):
            raise ProvisionError(f"{self.place}: the service's database has no blob {sha[:12]}")
        n = 0
        while True:
            rows = self._all("SELECT data FROM provision_service_blob_chunks WHERE sha = ? AND n = ?", (sha, n))
            if not rows:
                break
            yield bytes(rows[0][0])
            n += 1
        if n == 0:  # stored whole (before blobs were stored in pieces)
            yield bytes(self._all("SELECT data FROM provision_service_blobs WHERE sha = ?", (sha,))[0][0])

    def blob(self, sha: str) -> bytes:
        return b"".join(self.blob_parts(sha))

    def blob_count(self) -> int:
        return int(self._all("SELECT count(*) FROM provision_service_blobs")[0][0])

    # -- submissions

    def submit(self, s: Submission) -> Submission:
        if not valid_id(s.id):
            raise ProvisionError(f"submission id {s.id!r}: letters, digits, '-' and '_' only")
        created = self.now()
        manifest = json.dumps({k: list(v) for k, v in s.manifest.items()}, sort_keys=True)
        self._do(
            f"INSERT INTO provision_service_submissions ({_SUB_COLS}) VALUES ({', '.join('?' * 16)})",
            (
                s.id, s.kind.value, s.job, s.owner, s.backend, s.state_path, s.inventory, manifest,
                s.options.to_json(), created, Status.WAITING.value, "", "", "", None, None,
            ),
        )  # fmt: skip
        got = self.get(s.id)
        assert got is not None
        return got

    def get(self, sid: str) -> Submission | None:
        """The submission; None when there is none, or its row cannot be read (set_aside)."""
        rows = self._all(f"SELECT {_SUB_COLS} FROM provision_service_submissions WHERE id = ?", (sid,))
        if not rows:
            return None
        try:
            return _submission(rows[0])
        except BadRow:
            return None

    def submissions(self, *, unfinished: bool = False, job: str | None = None) -> list[Submission]:
        """The readable submissions (unfinished: in the queue's order); a row that cannot
        be read is left out (bad_rows names it)."""
        return [s for s in self._rows(unfinished, job) if isinstance(s, Submission)]

    def finished_submissions(self, jobs: int) -> list[Submission]:
        """The latest finished submission of each of the `jobs` jobs that finished last (the
        dashboard keeps showing their work), newest first."""
        finished = [s.value for s in Status if s.finished]
        rows = self._all(
            f"SELECT {_SUB_COLS} FROM provision_service_submissions WHERE status IN ({', '.join('?' for _ in finished)}) "
            "ORDER BY COALESCE(ended, created) DESC, id DESC LIMIT ?",
            [*finished, 4 * jobs],
        )
        out: dict[str, Submission] = {}
        for r in rows:
            try:
                sub = _submission(r)
            except BadRow:
                continue
            if sub.job not in out and len(out) < jobs:
                out[sub.job] = sub
        return list(out.values())

    def bad_rows(self) -> list[tuple[str, str]]:
        """(id, why) of each unfinished row this version cannot read: set aside by the
        service (never run), each said once."""
        return self.unfinished()[1]

    def unfinished(self) -> tuple[list[Submission], list[tuple[str, str]]]:
        """The unfinished submissions in the queue's order, and the rows it cannot read."""
        rows = self._rows(True, None)
        return [s for s in rows if isinstance(s, Submission)], [s for s in rows if not isinstance(s, Submission)]

    def _rows(self, unfinished: bool, job: str | None) -> list[Submission | tuple[str, str]]:
        sql = f"SELECT {_SUB_COLS} FROM provision_service_submissions WHERE 1 = 1"
        args: list[Any] = []
        if unfinished:
            # Not finished: any status but the finished ones (a status this version does not
            # know is a row to set aside, not one to skip).
            sql += " AND status NOT IN (?, ?, ?)"
            args += [s.value for s in Status if s.finished]
        if job is not None:
            sql += " AND job = ?"
            args.append(job)
        out: list[Submission | tuple[str, str]] = []
        for r in self._all(sql + " ORDER BY created, id", args):
            try:
                out.append(_submission(r))
            except BadRow as e:
                out.append((str(r[0]), str(e)))
        if unfinished:  # the queue's order: the higher priority first, then the earlier submission
            out.sort(
                key=lambda s: (
                    queue_key(s.options.priority, s.created, s.id) if isinstance(s, Submission) else (0, 0.0, s[0])
                )
            )
        return out

    def _move(
        self,
        sid: str,
        to: Status,
        sets: str = "",
        args: Sequence[Any] = (),
        frm: Iterable[Status] | None = None,
        unread: bool = False,
    ) -> bool:
        """The one place a submission's status changes: a compare-and-set from the states
        core/submission.MOVES allows (or `frm`, a part of them; `unread`: from any status
        not finished, even one this version does not know); whether it took."""
        if unread:
            finished = [s.value for s in Status if s.finished]
            where, states = f"status NOT IN ({', '.join('?' for _ in finished)})", finished
        else:
            allowed = sorted(MOVES[to] if frm is None else set(frm) & MOVES[to])
            if not allowed:
                return False
            where, states = f"status IN ({', '.join('?' for _ in allowed)})", [s.value for s in allowed]
        n = self._do(
            f"UPDATE provision_service_submissions SET status = ?{sets} WHERE id = ? AND {where}",
            (to.value, *args, sid, *states),
        )
        return n > 0

    def claim(self, sid: str, service: str) -> bool:
        """This service drives it (a leader's claim: a dead leader's is taken over)."""
        return self._move(
            sid, Status.RUNNING, ", claimed_by = ?, started = coalesce(started, ?)", (service, self.now())
        )

    def watching(self, sid: str, why: str) -> bool:
        """Applied: the service's rounds watch it from now on (its worker ends)."""
        return self._move(sid, Status.WATCHING, ", why = ?", (why,))

    def queued(self, sid: str, why: str) -> bool:
        """No room: it waits as a row, with no worker, until a round admits it."""
        return self._move(sid, Status.QUEUED, ", why = ?", (why,))

    def finish(self, sid: str, status: Status, why: str) -> bool:
        """Done, failed or cancelled; False when it had finished already (or cannot end so)."""
        assert status.finished
        return self._move(sid, status, ", why = ?, ended = ?", (why, self.now()))

    def set_aside(self, sid: str, why: str) -> bool:
        """A row this version cannot read: failed, with why, never run."""
        return self._move(sid, Status.FAILED, ", why = ?, ended = ?", (f"set aside: {why}", self.now()), unread=True)

    def cancel(self, sid: str, who: str) -> Status | None:
        """Taken back when no worker holds it (waiting or queued: CANCELLED); else the service
        is asked to stop it (RUNNING); None: it had finished."""
        if self._move(
            sid, Status.CANCELLED, ", why = ?, cancel = ?, ended = ?", (f"taken back by {who}", who, self.now()),
            frm=(Status.WAITING, Status.QUEUED),
        ):  # fmt: skip
            wait = self.open_event(sid, "wait")  # a queued apply's wait ends with it
            if wait is not None:
                self.closed(wait, self.now(), "cancelled")
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

    def lead_is(self, service_id: str, backend: int | None) -> None:
        """The leader's lock session (PostgreSQL's backend pid), written once per lead."""
        if backend is None or self._said_lead == (service_id, backend):
            return
        self._do("DELETE FROM provision_service_leads WHERE service <> ?", (service_id,))
        self._do(
            "INSERT INTO provision_service_leads (service, backend) VALUES (?, ?) "
            "ON CONFLICT (service) DO UPDATE SET backend = excluded.backend",
            (service_id, backend),
        )
        self._said_lead = (service_id, backend)

    _said_lead: tuple[str, int] | None = None

    def frozen_leader(self, me: str) -> str | None:
        """A service that says it leads, whose heartbeat is older than ALIVE_AFTER, and whose
        lock's session is known: it is frozen (or its machine is), and holds the lead."""
        if not self._pg:
            return None  # a file lock: the kernel frees it when the process dies, not before
        now = self.now()
        for s in self.services(alive_only=False):
            if s.leader and s.id != me and now - s.heartbeat > ALIVE_AFTER:
                if self._all("SELECT 1 FROM provision_service_leads WHERE service = ?", (s.id,)):
                    return s.id
        return None

    def end_lead(self, service_id: str) -> None:
        """End the lock's session of a frozen leader (its lock goes with it); its row says it
        leads no more."""
        rows = self._all("SELECT backend FROM provision_service_leads WHERE service = ?", (service_id,))
        for (backend,) in rows:
            try:
                self._all("SELECT pg_terminate_backend(?)", (int(backend),))
            except ProvisionError:
                pass  # gone already, or not ours to end: the lead stays where it is
        self._do("DELETE FROM provision_service_leads WHERE service = ?", (service_id,))
        self._do("UPDATE provision_service_services SET leader = 0 WHERE id = ?", (service_id,))

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


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _submission(r: Any) -> Submission:
    """A row as a Submission; BadRow names what this version cannot read in it."""
    sid = str(r[0])
    if not valid_id(sid):
        raise BadRow(f"id {sid[:80]!r} is not a submission id (letters, digits, '-' and '_')")
    try:
        kind, status = Kind(r[1]), Status(r[10])
    except ValueError as e:
        raise BadRow(str(e)) from None
    inventory = str(r[6])
    if not inventory or inventory.startswith("/") or ".." in inventory.split("/"):
        raise BadRow(f"inventory {inventory[:80]!r} is not a path inside its snapshot")
    try:
        manifest = {str(k): (str(v[0]), int(v[1])) for k, v in json.loads(r[7]).items()}
    except (ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise BadRow(f"manifest: {e}") from None
    return Submission(
        id=sid,
        kind=kind,
        job=str(r[2]),
        owner=str(r[3]),
        backend=str(r[4]),
        state_path=str(r[5]),
        inventory=inventory,
        manifest=manifest,
        options=Options.from_json(str(r[8])),
        created=float(r[9]),
        status=status,
        claimed_by=str(r[11]),
        why=str(r[12]),
        cancel=str(r[13]),
        started=None if r[14] is None else float(r[14]),
        ended=None if r[15] is None else float(r[15]),
    )
