"""The service's database (`provision serve`): the only code that talks to it.

Two backends, one schema (tables prefixed `provision_service_`):
- the embedded default, a SQLite file (WAL) at $PROVISION_SERVICE_DB or
  ~/.local/state/provision/service.sqlite (0600, its directory 0700): one person, one
  workstation, no server;
- a team's PostgreSQL (the state backend's database), via psycopg as io/pgstate.py.

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
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from provision.core.errors import ProvisionError
from provision.rules.priority import DEFAULT_CLASSES, queue_key

DB_ENV = "PROVISION_SERVICE_DB"
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


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one time: utilization %, memory (None: the GPU did not say), who held it."""

    host: str
    gpu: int
    t: float  # the database's clock
    util: int | None
    memory_mib: int | None
    memory_total_mib: int | None
    job: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class HistoryRow:
    """One history row: a run, a trial or a queue wait."""

    kind: str  # "study", "trial", "run" (an applied job's), "wait" (a queued apply's)
    job: str
    owner: str
    started: float
    ended: float | None
    how: str  # how it ended, in words ("" while it runs)
    hosts: tuple[str, ...] = ()
    gpus: int = 0
    submission: str = ""


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
    """CREATE TABLE IF NOT EXISTS provision_service_history (
        id {serial}, kind TEXT NOT NULL, job TEXT NOT NULL, owner TEXT NOT NULL,
        started {real} NOT NULL, ended {real}, how TEXT NOT NULL, hosts TEXT NOT NULL, gpus INTEGER NOT NULL,
        submission TEXT NOT NULL)""",
    # The Usage page reads the history by when a row started (gpu_hours_in).
    "CREATE INDEX IF NOT EXISTS provision_service_history_started ON provision_service_history (started)",
    # The dashboard's tokens: only their sha256 (a token is printed once, when made).
    """CREATE TABLE IF NOT EXISTS provision_service_tokens (
        id TEXT PRIMARY KEY, hash TEXT NOT NULL UNIQUE, owner TEXT NOT NULL, admin INTEGER NOT NULL,
        created {real} NOT NULL)""",
)
# What the GPUs did (the service samples every host it watches): the last GPU_KEEP seconds.
_DDL += (
    """CREATE TABLE IF NOT EXISTS provision_service_gpu_samples (
        host TEXT NOT NULL, gpu INTEGER NOT NULL, t {real} NOT NULL, util INTEGER, memory_mib INTEGER,
        memory_total_mib INTEGER, job TEXT, owner TEXT)""",
    """CREATE INDEX IF NOT EXISTS provision_service_gpu_samples_t ON provision_service_gpu_samples (t)""",
    # Each GPU's samples in order (its latest, the idle candidates' runs: gpu_samples).
    """CREATE INDEX IF NOT EXISTS provision_service_gpu_samples_gpu ON provision_service_gpu_samples (host, gpu, t)""",
)
GPU_KEEP = 3600.0  # an hour at the full rate (the Cluster page's "last hour"); older rows are dropped
_GPU_COLS = "host, gpu, t, util, memory_mib, memory_total_mib, job, owner"
_SUB_COLS = (
    "id, kind, job, owner, backend, state_path, inventory, manifest, options, created, status, claimed_by, "
    "why, cancel, started, ended"
)


def default_db() -> Path:
    """The embedded database's file: $PROVISION_SERVICE_DB, else under ~/.local/state."""
    named = os.environ.get(DB_ENV, "").strip()
    if named:
        return Path(named).expanduser().resolve()
    return Path.home() / ".local" / "state" / "provision" / "service.sqlite"


class ServiceStore:
    """One connection to the service's database (module docstring). Thread-safe: calls are
    serialised (the service's loop and its followers are few and short)."""

    def __init__(self, place: str, conn: Any, pg: bool, url: str = ""):
        self.place = place  # "local" (the file is `path`) or the PostgreSQL place
        self._conn = conn
        self._pg = pg
        self._mutex = threading.Lock()
        self.path: Path | None = None
        self._url = url  # PostgreSQL: to connect again after the server went away

    # -- opening

    @classmethod
    def open_local(cls, path: Path | None = None) -> ServiceStore:
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
            for statement in _DDL:
                conn.execute(statement.format(blob="BLOB", real="REAL", serial="INTEGER PRIMARY KEY AUTOINCREMENT"))
        except (OSError, sqlite3.Error) as e:
            raise ProvisionError(f"{path}: cannot open the service's database: {e}") from None
        store = cls("local", conn, pg=False)
        store.path = path
        return store

    @classmethod
    def open_pg(cls, url: str, place: str) -> ServiceStore:
        # Here, not at the top: only a team's service needs psycopg (start-up of the embedded path).
        import psycopg

        from provision.io.pgstate import why  # (start-up, as above)

        try:
            conn = _pg_connect(url)
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_PG_SCHEMA_LOCK,))
                for statement in _DDL:
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

    # -- history

    def record(self, e: HistoryRow) -> int:
        """A new history row; its id (to close it with `closed`)."""
        args = (e.kind, e.job, e.owner, e.started, e.ended, e.how, json.dumps(list(e.hosts)), e.gpus, e.submission)
        sql = (
            "INSERT INTO provision_service_history (kind, job, owner, started, ended, how, hosts, gpus, submission) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        with self._sql() as c:
            if self._pg:
                row = c.execute(self._q(sql + " RETURNING id"), args).fetchone()
                return int(row[0])
            return int(c.execute(sql, args).lastrowid or 0)

    def open_event(self, submission: str, kind: str) -> int | None:
        """The submission's row of this kind that has not ended (a restarted worker goes on with it)."""
        rows = self._all(
            "SELECT id FROM provision_service_history WHERE submission = ? AND kind = ? AND ended IS NULL ORDER BY id",
            (submission, kind),
        )
        return int(rows[-1][0]) if rows else None

    def closed(self, row_id: int, ended: float, how: str) -> None:
        self._do("UPDATE provision_service_history SET ended = ?, how = ? WHERE id = ?", (ended, how, row_id))

    def history(self, *, owner: str | None = None, since: float | None = None) -> list[HistoryRow]:
        sql = "SELECT kind, job, owner, started, ended, how, hosts, gpus, submission FROM provision_service_history WHERE 1 = 1"
        args: list[Any] = []
        if owner:
            sql += " AND owner = ?"
            args.append(owner)
        if since is not None:
            sql += " AND (ended IS NULL OR ended >= ?)"
            args.append(since)
        rows = self._all(sql + " ORDER BY started, id", args)
        return [
            HistoryRow(str(r[0]), str(r[1]), str(r[2]), float(r[3]), None if r[4] is None else float(r[4]), str(r[5]),
                  tuple(json.loads(r[6])), int(r[7]), str(r[8]))
            for r in rows
        ]  # fmt: skip

    # -- what the GPUs did

    def add_gpu_samples(self, samples: Sequence[GpuSample], keep: float = GPU_KEEP) -> None:
        """One round of samples, in one transaction with dropping what is older than `keep`
        seconds before the newest (the table stays bounded: hosts x GPUs x an hour's rounds)."""
        rows = [(s.host, s.gpu, s.t, s.util, s.memory_mib, s.memory_total_mib, s.job, s.owner) for s in samples]
        if not rows:
            return
        insert = self._q(f"INSERT INTO provision_service_gpu_samples ({_GPU_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
        drop = self._q("DELETE FROM provision_service_gpu_samples WHERE t < ?")
        oldest = max(r[2] for r in rows) - keep
        with self._sql() as c:
            if self._pg:  # one COPY: a round of 1,000 hosts x 8 GPUs row by row was ~1 s of the service's CPU
                copy = f"COPY provision_service_gpu_samples ({_GPU_COLS}) FROM STDIN"
                with c.transaction(), c.cursor() as cur:
                    with cur.copy(copy) as cp:
                        for r in rows:
                            cp.write_row(r)
                    cur.execute(drop, (oldest,))
                return
            c.execute("BEGIN")
            try:
                c.executemany(insert, rows)
                c.execute(drop, (oldest,))
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")

    def gpu_samples(self, since: float) -> list[GpuSample]:
        """Every sample from `since` on (the database's clock), by host, GPU and time."""
        rows = self._all(
            f"SELECT {_GPU_COLS} FROM provision_service_gpu_samples WHERE t >= ? ORDER BY host, gpu, t", (since,)
        )
        return [
            GpuSample(str(r[0]), int(r[1]), float(r[2]), _opt_int(r[3]), _opt_int(r[4]), _opt_int(r[5]),
                      None if r[6] is None else str(r[6]), None if r[7] is None else str(r[7]))
            for r in rows
        ]  # fmt: skip

    def gpu_idle_runs(
        self, since: float, held_below: int, latest_after: float
    ) -> list[tuple[str, int, str, str | None, float]]:
        """(host, gpu, job, owner, t) of each GPU whose latest sample since `latest_after` is held
        and below `held_below`: t begins its trailing run below that from `since` on, under that
        job (rules/gpuuse.idle_since as gpusample.idle_json applies it; reading the candidates'
        30,000 samples into Python held the GIL ~1 s a Usage sum: issue 41's benchmark)."""
        sql = (
            "WITH m AS (SELECT host, gpu, MAX(t) AS t FROM provision_service_gpu_samples WHERE t >= ? "
            "GROUP BY host, gpu), "
            "c AS (SELECT l.host, l.gpu, MAX(l.job) AS job, MAX(l.owner) AS owner FROM provision_service_gpu_samples l "
            "JOIN m ON l.host = m.host AND l.gpu = m.gpu AND l.t = m.t WHERE l.t >= ? AND l.job IS NOT NULL "
            "AND l.util < ? GROUP BY l.host, l.gpu), "
            "b AS (SELECT c.host, c.gpu, MAX(x.t) AS t FROM c JOIN provision_service_gpu_samples x "
            "ON x.host = c.host AND x.gpu = c.gpu AND x.job = c.job WHERE x.t >= ? AND (x.util IS NULL OR x.util >= ?) "
            "GROUP BY c.host, c.gpu) "
            "SELECT c.host, c.gpu, c.job, c.owner, MIN(x.t) FROM c JOIN provision_service_gpu_samples x "
            "ON x.host = c.host AND x.gpu = c.gpu AND x.job = c.job LEFT JOIN b ON b.host = c.host AND b.gpu = c.gpu "
            "WHERE x.t >= ? AND (b.t IS NULL OR x.t > b.t) GROUP BY c.host, c.gpu, c.job, c.owner ORDER BY c.host, c.gpu"
        )
        # (l.t >= ? as m's: PostgreSQL read the whole table for the latest rows otherwise.)
        latest = max(since, latest_after)
        rows = self._all(sql, (latest, latest, held_below, since, held_below, since))
        return [(str(r[0]), int(r[1]), str(r[2]), None if r[3] is None else str(r[3]), float(r[4])) for r in rows]

    def gpu_history(self, since: float, step: float | None) -> list[tuple[str, int, float, float, float, int]]:
        """(host, gpu, slot, t, utilization %, samples) of every GPU from `since` on, by host,
        GPU and time: each sample (step None: its slot is its t), or the samples averaged
        over slots of `step` seconds by the database (slot: floor(t / step); the Cluster
        page's last hour: 2.9 million samples of 8,000 GPUs were read one by one)."""
        if step is None:
            sql = (
                "SELECT host, gpu, t, t, util, 1 FROM provision_service_gpu_samples WHERE t >= ? AND util IS NOT NULL "
                "ORDER BY host, gpu, t"
            )
            rows = self._all(sql, (since,))
        else:
            slot = "FLOOR(t / ?)" if self._pg else "CAST(t / ? AS INTEGER)"  # SQLite's CAST truncates: t > 0
            rows = self._all(
                f"SELECT host, gpu, {slot} AS slot, AVG(t), AVG(util), COUNT(*) FROM provision_service_gpu_samples "
                "WHERE t >= ? AND util IS NOT NULL GROUP BY host, gpu, slot ORDER BY host, gpu, slot",
                (float(step), since),
            )
        return [(str(r[0]), int(r[1]), float(r[2]), float(r[3]), float(r[4]), int(r[5])) for r in rows]

    def gpu_round_times(self, since: float) -> list[float]:
        """When the latest sampled GPU's samples from `since` on were taken (a round samples
        every GPU at once: the rounds the history holds), through the indexes."""
        last = self._all("SELECT host, gpu FROM provision_service_gpu_samples ORDER BY t DESC LIMIT 1")
        if not last:
            return []
        sql = "SELECT t FROM provision_service_gpu_samples WHERE host = ? AND gpu = ? AND t >= ? ORDER BY t"
        return [float(r[0]) for r in self._all(sql, (last[0][0], last[0][1], since))]

    def gpu_hours_in(
        self, windows: Sequence[tuple[float, float]], now: float, kinds: Sequence[str]
    ) -> list[dict[str, float]]:
        """owner -> GPU-hours in each [start, end) window, summed by the database with
        rules/usage.gpu_hours's rule (rows of `kinds`, clipped to the window; an open row
        until now): the Usage page over a long history without reading it whole (100,000
        runs read and summed here took seconds: issue 41's benchmark)."""
        if not windows or not kinds:
            return [{} for _ in windows]
        values = ", ".join("(?, ?, ?)" for _ in windows)
        ended = "COALESCE(h.ended, ?)"
        held = f"h.gpus > 0 AND h.kind IN ({', '.join('?' for _ in kinds)})"
        # l.d, the longest row: a window reads only the rows that started at most that long
        # before it (the index on started), not the whole history once per window.
        sql = (
            f"WITH w(i, s, e) AS (VALUES {values}), "
            f"l(d) AS (SELECT COALESCE(MAX({ended} - h.started), 0) FROM provision_service_history h WHERE {held}) "
            f"SELECT w.i, h.owner, SUM(h.gpus * ((CASE WHEN {ended} < w.e THEN {ended} ELSE w.e END) "
            "- (CASE WHEN h.started > w.s THEN h.started ELSE w.s END))) "
            "FROM w CROSS JOIN l JOIN provision_service_history h ON h.started >= w.s - l.d AND h.started < w.e "
            f"WHERE {ended} > w.s AND {ended} > h.started AND {held} GROUP BY w.i, h.owner"
        )
        args: list[Any] = [x for i, (start, end) in enumerate(windows) for x in (i, float(start), float(min(end, now)))]
        args += [float(now), *kinds, float(now), float(now), float(now), float(now), *kinds]
        out: list[dict[str, float]] = [{} for _ in windows]
        for i, owner, seconds in self._all(sql, args):
            if seconds and seconds > 0:
                out[int(i)][str(owner)] = float(seconds) / 3600.0
        return [dict(sorted(d.items())) for d in out]

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


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def priority_of(s: Submission) -> int:
    """The level the submitter's policy gave it (options["priority"]; older ones: normal)."""
    p = s.options.get("priority")
    return p if isinstance(p, int) and not isinstance(p, bool) else DEFAULT_CLASSES["normal"]


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _pg_connect(url: str) -> Any:
    # Here, not at the top: only a team's service needs psycopg (start-up of the embedded path).
    from provision.io.pgstate import connect_url
    from provision.io.servicelead import CUT_OFF  # (start-up, as above)

    # A word the server never acknowledges fails after CUT_OFF s, not the kernel's ~15 min of
    # retries: a service cut off from its database says so, and its leader stops leading.
    return connect_url(url, "provision serve", tcp_user_timeout=CUT_OFF * 1000)


_PG_SCHEMA_LOCK = 0x70726F7673657276  # "provserv": the tables are made by one service at a time


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
