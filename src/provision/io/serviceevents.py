"""The event stream's tables (core/events.py): each event once, by its key, with an id in the
order every reader sees; a cursor per subscriber (the last id it has dealt with); and what
the rounds have seen (rules/events.Seen), written in the same transaction as the events it
led to. Tables of the service's database (io/servicedb.py).

Bounded: the oldest events go once there are more than EVENTS_KEEP (a subscriber whose
cursor is older than the oldest kept one goes on from the oldest kept).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from provision.core.events import Event, How, Kind, Stored
from provision.io.servicedb import ServiceDB

EVENTS_KEEP = 200_000  # rows: months of a busy team's events; docs/service.md says so
_PRUNE_EVERY = 1000  # events between two prunes
_COLS = "id, t, kind, key, job, owner, host, words, how, run, hosts, gpus"

_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_events (
        id {serial}, t {real} NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL UNIQUE, job TEXT NOT NULL,
        owner TEXT NOT NULL, host TEXT NOT NULL, words TEXT NOT NULL, how TEXT, run INTEGER,
        hosts TEXT NOT NULL, gpus INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS provision_service_events_t ON provision_service_events (t)",
    "CREATE INDEX IF NOT EXISTS provision_service_events_job ON provision_service_events (job, id)",
    """CREATE TABLE IF NOT EXISTS provision_service_cursors (name TEXT PRIMARY KEY, after BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS provision_service_seen (name TEXT PRIMARY KEY, doc TEXT NOT NULL)""",
)


class EventTables(ServiceDB):
    DDL = _DDL
    _since_prune = 0

    def emit(self, events: Sequence[Event], seen: tuple[str, Any] | None = None) -> list[int]:
        """Store the events not stored yet (by key), and `seen` (its name, a JSON value) with
        them, in one transaction; the new events' ids."""
        insert = (
            "INSERT INTO provision_service_events (t, kind, key, job, owner, host, words, how, run, hosts, gpus) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING"
        )
        ids: list[int] = []
        with self._tx() as c:
            now = self._now_in(c)
            for e in events:
                args = (
                    now,
                    e.kind.value,
                    e.key,
                    e.job,
                    e.owner,
                    e.host,
                    e.words,
                    e.how.value if e.how else None,
                    e.run,
                    json.dumps(list(e.hosts)),
                    e.gpus,
                )
                if self._pg:
                    row = c.execute(self._q(insert + " RETURNING id"), args).fetchone()
                    if row is not None:
                        ids.append(int(row[0]))
                else:
                    cur = c.execute(insert, args)
                    if cur.rowcount:
                        ids.append(int(cur.lastrowid or 0))
            if seen is not None:
                upsert = (
                    "INSERT INTO provision_service_seen (name, doc) VALUES (?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET doc = excluded.doc"
                )
                c.execute(self._q(upsert), (seen[0], json.dumps(seen[1], sort_keys=True)))
        self._since_prune += len(ids)
        if self._since_prune >= _PRUNE_EVERY:
            self._since_prune = 0
            self._do(
                "DELETE FROM provision_service_events WHERE id <= (SELECT MAX(id) FROM provision_service_events) - ?",
                (EVENTS_KEEP,),
            )
        return ids

    def _now_in(self, c: Any) -> float:
        sql = "SELECT extract(epoch from now())" if self._pg else "SELECT (julianday('now') - 2440587.5) * 86400.0"
        return float(c.execute(sql).fetchone()[0])

    def seen(self, name: str) -> Any:
        """The JSON value last stored as `name` (None: none)."""
        rows = self._all("SELECT doc FROM provision_service_seen WHERE name = ?", (name,))
        if not rows:
            return None
        try:
            return json.loads(rows[0][0])
        except ValueError:
            return None

    def events(
        self,
        *,
        after: int = 0,
        since: float | None = None,
        job: str | None = None,
        kinds: Sequence[Kind] = (),
        limit: int = 1000,
    ) -> list[Stored]:
        """Events after id `after` (and from time `since` on, of `job`, of `kinds`), oldest
        first, at most `limit`."""
        sql = f"SELECT {_COLS} FROM provision_service_events WHERE id > ?"
        args: list[Any] = [int(after)]
        if since is not None:
            sql += " AND t >= ?"
            args.append(float(since))
        if job is not None:
            sql += " AND job = ?"
            args.append(job)
        if kinds:
            sql += f" AND kind IN ({', '.join('?' for _ in kinds)})"
            args += [k.value for k in kinds]
        rows = self._all(sql + " ORDER BY id LIMIT ?", [*args, int(limit)])
        return [s for r in rows if (s := _stored(r)) is not None]

    def job_events(self, job: str, limit: int) -> list[Stored]:
        """The job's last `limit` events, oldest first (its page's timeline)."""
        rows = self._all(
            f"SELECT {_COLS} FROM provision_service_events WHERE job = ? ORDER BY id DESC LIMIT ?", (job, int(limit))
        )
        return [s for r in reversed(rows) if (s := _stored(r)) is not None]

    def last_event_id(self) -> int:
        rows = self._all("SELECT MAX(id) FROM provision_service_events")
        return int(rows[0][0] or 0)

    def cursor(self, name: str) -> int | None:
        """The last event id subscriber `name` dealt with; None: it never read."""
        rows = self._all("SELECT after FROM provision_service_cursors WHERE name = ?", (name,))
        return int(rows[0][0]) if rows else None

    def advance(self, name: str, after: int) -> None:
        """Subscriber `name` dealt with every event up to id `after` (never moves back)."""
        self._do(
            "INSERT INTO provision_service_cursors (name, after) VALUES (?, ?) ON CONFLICT (name) DO UPDATE "
            "SET after = CASE WHEN excluded.after > provision_service_cursors.after THEN excluded.after "
            "ELSE provision_service_cursors.after END",
            (name, int(after)),
        )


def _stored(r: Any) -> Stored | None:
    """A row as an event; one of a kind this version does not know is left out (a newer
    service's, or a row written by hand)."""
    try:
        kind, how = Kind(r[2]), None if r[8] is None else How(r[8])
    except ValueError:
        return None
    run = None if r[9] is None else int(r[9])
    try:
        hosts = tuple(str(h) for h in json.loads(r[10]))
    except (ValueError, TypeError):
        hosts = ()
    event = Event(kind, str(r[3]), str(r[4]), str(r[5]), str(r[6]), str(r[7]), how, run, hosts, int(r[11] or 0))
    return Stored(int(r[0]), float(r[1]), event)
