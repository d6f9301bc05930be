"""The notification rules (core/notify.py) and the team's SMTP relay: tables of the
service's database (io/servicedb.py). A rule is added with its cursor in the event stream
(io/serviceevents.py) set to the stream's end, in one transaction: it is told every event
after it was added, even when no service ran then; removed with its cursor.

A webhook's URL is stored as it is: the service must post to it. Whoever can read the
database can read it (the embedded file is its owner's alone, mode 0600; a team's
PostgreSQL is the team's): no printer shows more than rules/notify.masked. The relay's
password and a webhook's signing key are never stored, only the names of the service's
environment variables that hold them.
"""

from __future__ import annotations

import json
from typing import Any

from provision.core.events import Kind
from provision.core.notify import Channel, Relay, Rule
from provision.io.serviceevents import EventTables

_RELAY = "relay"
_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_notify (
        id TEXT PRIMARY KEY, channel TEXT NOT NULL, target TEXT NOT NULL, owner TEXT NOT NULL,
        job TEXT NOT NULL, kinds TEXT NOT NULL, secret_env TEXT NOT NULL, created {real} NOT NULL,
        created_by TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS provision_service_smtp (
        name TEXT PRIMARY KEY, host TEXT NOT NULL, port INTEGER NOT NULL, sender TEXT NOT NULL,
        login TEXT NOT NULL, password_env TEXT NOT NULL)""",
)
_COLS = "id, channel, target, owner, job, kinds, secret_env, created, created_by"


class NotifyTables(EventTables):
    """The rules and the relay, beside the event stream's tables (their cursors)."""

    DDL = _DDL

    def add_rule(self, rule: Rule) -> Rule:
        """Store the rule with its cursor at the stream's end (its created time: the
        database's clock)."""
        with self._tx() as c:
            now = self._now_in(c)
            c.execute(
                self._q(
                    f"INSERT INTO provision_service_notify ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                ),
                (
                    rule.id, rule.channel.value, rule.target, rule.owner, rule.job,
                    json.dumps([k.value for k in rule.kinds]), rule.secret_env, now, rule.created_by,
                ),
            )  # fmt: skip
            last = c.execute("SELECT MAX(id) FROM provision_service_events").fetchone()
            c.execute(
                self._q(
                    "INSERT INTO provision_service_cursors (name, after) VALUES (?, ?) "
                    "ON CONFLICT (name) DO UPDATE SET after = excluded.after"
                ),
                (rule.cursor, int(last[0] or 0) if last else 0),
            )
        got = self.rule(rule.id)
        assert got is not None
        return got

    def rules(self) -> list[Rule]:
        rows = self._all(f"SELECT {_COLS} FROM provision_service_notify ORDER BY created, id")
        return [r for row in rows if (r := _rule(row)) is not None]

    def rule(self, rid: str) -> Rule | None:
        rows = self._all(f"SELECT {_COLS} FROM provision_service_notify WHERE id = ?", (rid,))
        return _rule(rows[0]) if rows else None

    def remove_rule(self, rid: str) -> bool:
        """The rule and its cursor gone; False: no such rule."""
        with self._tx() as c:
            cur = c.execute(self._q("DELETE FROM provision_service_notify WHERE id = ?"), (rid,))
            gone = bool(cur.rowcount)
            c.execute(self._q("DELETE FROM provision_service_cursors WHERE name = ?"), (f"notify:{rid}",))
        return gone

    def forget_cursor(self, name: str) -> None:
        """A removed rule's cursor, moved once more by its delivery as it ended: gone."""
        self._do("DELETE FROM provision_service_cursors WHERE name = ?", (name,))

    def set_relay(self, relay: Relay) -> None:
        self._do(
            "INSERT INTO provision_service_smtp (name, host, port, sender, login, password_env) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET host = excluded.host, port = excluded.port, "
            "sender = excluded.sender, login = excluded.login, password_env = excluded.password_env",
            (_RELAY, relay.host, relay.port, relay.sender, relay.user, relay.password_env),
        )

    def relay(self) -> Relay | None:
        rows = self._all(
            "SELECT host, port, sender, login, password_env FROM provision_service_smtp WHERE name = ?", (_RELAY,)
        )
        if not rows:
            return None
        r = rows[0]
        return Relay(str(r[0]), int(r[1]), str(r[2]), str(r[3]), str(r[4]))


def _rule(r: Any) -> Rule | None:
    """A row as a rule; one this version cannot read (a newer service's channel or kind)
    is left out, never delivered half-understood."""
    try:
        kinds = tuple(Kind(k) for k in json.loads(r[5]))
        channel = Channel(r[1])
    except (ValueError, TypeError):
        return None
    return Rule(str(r[0]), channel, str(r[2]), str(r[3]), str(r[4]), kinds, str(r[6]), float(r[7]), str(r[8]))
