"""The service's health history (kept after a host leaves the inventory): every health mark
a host had (a GPU quarantined, a host drained, a suspect, a test) and every outage, opened
when the rounds first see it and closed when it ends, by its key (rules/healthlog.py), so
`provision health --report` and the dashboard's Health page rank hosts and GPUs by their
incidents and the GPU-hours lost to them. A table of the service's database
(io/servicedb.py)."""

from __future__ import annotations

from collections.abc import Sequence

from provision.io.servicedb import ServiceDB, opt_int
from provision.rules.healthlog import Incident

_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_health (
        id {serial}, key TEXT NOT NULL UNIQUE, host TEXT NOT NULL, gpu INTEGER, state TEXT NOT NULL,
        reason TEXT NOT NULL, evidence TEXT NOT NULL, started {real} NOT NULL, ended {real}, by TEXT NOT NULL,
        job TEXT NOT NULL, owner TEXT NOT NULL, gpus INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS provision_service_health_started ON provision_service_health (started)",
)
_COLS = "key, host, gpu, state, reason, evidence, started, ended, by, job, owner, gpus"
KEEP = 100_000  # incidents kept (the oldest go first): years of a large cluster's


class HealthTables(ServiceDB):
    DDL = _DDL

    def opened(self, rows: Sequence[Incident]) -> None:
        """Incidents begun (one already kept, by its key, is left as it is)."""
        if not rows:
            return
        sql = (
            f"INSERT INTO provision_service_health ({_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (key) DO NOTHING"
        )
        with self._tx() as c:
            for r in rows:
                args = (r.key, r.host, r.gpu, r.state, r.reason, r.evidence, r.started, r.ended, r.by, r.job,
                        r.owner, r.gpus)  # fmt: skip
                c.execute(self._q(sql), args)
            c.execute(
                self._q(
                    "DELETE FROM provision_service_health WHERE id <= (SELECT MAX(id) FROM provision_service_health) - ?"
                ),
                (KEEP,),
            )

    def ended(self, keys: Sequence[tuple[str, float]]) -> None:
        """Incidents over: (key, when); one closed already keeps its end."""
        with self._tx() as c:
            for key, at in keys:
                c.execute(
                    self._q("UPDATE provision_service_health SET ended = ? WHERE key = ? AND ended IS NULL"),
                    (at, key),
                )

    def incidents(self, since: float | None = None) -> list[Incident]:
        """Every incident not over before `since`, oldest first."""
        sql = f"SELECT {_COLS} FROM provision_service_health"
        args: list[float] = []
        if since is not None:
            sql += " WHERE ended IS NULL OR ended >= ?"
            args.append(since)
        return [
            Incident(str(r[0]), str(r[1]), opt_int(r[2]), str(r[3]), str(r[4]), str(r[5]), float(r[6]),
                     None if r[7] is None else float(r[7]), str(r[8]), str(r[9]), str(r[10]), int(r[11]))
            for r in self._all(sql + " ORDER BY started, id", args)
        ]  # fmt: skip
