"""The service's history (kept after a job is destroyed): every run, trial, study and queue
wait, and what the GPUs did (samples kept an hour), with the sums the Usage page reads.
Tables of the service's database (io/servicedb.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from provision.io.servicedb import ServiceDB, opt_int
from provision.rules.historyview import HistoryQuery


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

    kind: str  # "study", "trial", "run" (an applied job's), "wait" (a queued apply's), "incident" (a recovery's)
    job: str
    owner: str
    started: float
    ended: float | None
    how: str  # how it ended, in words ("" while it runs)
    hosts: tuple[str, ...] = ()
    gpus: int = 0
    submission: str = ""


# Runs, trials, studies and queue waits; and what the GPUs did (the service samples every host it
# watches): the last GPU_KEEP seconds.
_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_history (
        id {serial}, kind TEXT NOT NULL, job TEXT NOT NULL, owner TEXT NOT NULL,
        started {real} NOT NULL, ended {real}, how TEXT NOT NULL, hosts TEXT NOT NULL, gpus INTEGER NOT NULL,
        submission TEXT NOT NULL)""",
    # The Usage page reads the history by when a row started (gpu_hours_in).
    "CREATE INDEX IF NOT EXISTS provision_service_history_started ON provision_service_history (started)",
    # The Jobs page's finished work, newest first; a job's runs (its page, the Jobs page's sums).
    "CREATE INDEX IF NOT EXISTS provision_service_history_ended ON provision_service_history (ended)",
    "CREATE INDEX IF NOT EXISTS provision_service_history_job ON provision_service_history (job, started)",
    """CREATE TABLE IF NOT EXISTS provision_service_gpu_samples (
        host TEXT NOT NULL, gpu INTEGER NOT NULL, t {real} NOT NULL, util INTEGER, memory_mib INTEGER,
        memory_total_mib INTEGER, job TEXT, owner TEXT)""",
    """CREATE INDEX IF NOT EXISTS provision_service_gpu_samples_t ON provision_service_gpu_samples (t)""",
    # Each GPU's samples in order (its latest, the idle candidates' runs: gpu_samples).
    """CREATE INDEX IF NOT EXISTS provision_service_gpu_samples_gpu ON provision_service_gpu_samples (host, gpu, t)""",
)

_HISTORY_COLS = "kind, job, owner, started, ended, how, hosts, gpus, submission"


def _where(q: HistoryQuery) -> tuple[str, list[Any]]:
    sql, args = "WHERE 1 = 1", list[Any]()
    if q.owner:
        sql += " AND owner = ?"
        args.append(q.owner)
    if q.kinds:
        sql += f" AND kind IN ({', '.join('?' for _ in q.kinds)})"
        args += list(q.kinds)
    if q.state:
        # Its words begin with the state's (a terminal job's row is the event's sentence: it names it).
        words = q.words() or (q.state,)
        begins = " OR ".join("LOWER(how) LIKE ?" for _ in words)
        within = " OR ".join("LOWER(how) LIKE ?" for _ in words)
        sql += f" AND (({begins}) OR (submission LIKE ? AND ({within})))"
        args += [w + "%" for w in words] + ["event:%"] + ["%" + w + "%" for w in words]
    if q.finished:
        sql += " AND ended IS NOT NULL"
    if q.since is not None:
        sql += " AND (ended IS NULL OR ended >= ?)" if not q.finished else " AND ended >= ?"
        args.append(float(q.since))
    if q.job:  # a text in the job's name, not a pattern
        sql += " AND job LIKE ? ESCAPE '!'"
        args.append("%" + q.job.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%")
    return sql, args


def _row(r: Any) -> HistoryRow:
    return HistoryRow(
        str(r[0]), str(r[1]), str(r[2]), float(r[3]), None if r[4] is None else float(r[4]), str(r[5]),
        tuple(json.loads(r[6])), int(r[7]), str(r[8]),
    )  # fmt: skip


GPU_KEEP = 3600.0  # an hour at the full rate (the Cluster page's "last hour"); older rows are dropped
_GPU_COLS = "host, gpu, t, util, memory_mib, memory_total_mib, job, owner"


class HistoryTables(ServiceDB):
    DDL = _DDL

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

    def open_row_of(self, job: str, kind: str, submission_prefix: str) -> int | None:
        """The job's latest row of this kind not ended, among those whose submission begins
        with the prefix (the history writer's: "event:")."""
        rows = self._all(
            "SELECT id FROM provision_service_history WHERE job = ? AND kind = ? AND ended IS NULL "
            "AND submission LIKE ? ORDER BY id DESC LIMIT 1",
            (job, kind, submission_prefix + "%"),
        )
        return int(rows[0][0]) if rows else None

    def has_rows(self, submission: str) -> bool:
        return bool(self._all("SELECT 1 FROM provision_service_history WHERE submission = ? LIMIT 1", (submission,)))

    def closed(self, row_id: int, ended: float, how: str) -> None:
        self._do("UPDATE provision_service_history SET ended = ?, how = ? WHERE id = ?", (ended, how, row_id))

    def history(self, *, owner: str | None = None, since: float | None = None) -> list[HistoryRow]:
        sql = f"SELECT {_HISTORY_COLS} FROM provision_service_history WHERE 1 = 1"
        args: list[Any] = []
        if owner:
            sql += " AND owner = ?"
            args.append(owner)
        if since is not None:
            sql += " AND (ended IS NULL OR ended >= ?)"
            args.append(since)
        return [_row(r) for r in self._all(sql + " ORDER BY started, id", args)]

    def history_page(self, q: HistoryQuery, now: float) -> tuple[list[HistoryRow], int]:
        """One page of the rows `q` picks, newest first: those still open (unless
        `q.finished`), then the ended ones by when they ended (through its index: 100,000
        rows sorted for each page took a tenth of a second); and how many it picks in all."""
        where, args = _where(q)
        cols = f"SELECT {_HISTORY_COLS} FROM provision_service_history {where}"
        opened: list[Any] = []
        if not q.finished:
            opened = self._all(f"{cols} AND ended IS NULL ORDER BY started DESC, id DESC LIMIT ?", [*args, 1000])
        shown = opened[q.offset : q.offset + q.limit]
        more = q.limit - len(shown)
        if more > 0:
            skip = max(0, q.offset - len(opened))
            shown += self._all(
                f"{cols} AND ended IS NOT NULL ORDER BY ended DESC, id DESC LIMIT ? OFFSET ?", [*args, more, skip]
            )
        done = int(
            self._all(f"SELECT count(*) FROM provision_service_history {where} AND ended IS NOT NULL", args)[0][0]
        )
        return [_row(r) for r in shown], len(opened) + done

    def job_history(self, job: str, limit: int = 200) -> list[HistoryRow]:
        """The job's rows (its runs, waits; a trial's), the last `limit`, oldest first."""
        rows = self._all(
            f"SELECT {_HISTORY_COLS} FROM provision_service_history WHERE job = ? ORDER BY started DESC, id DESC LIMIT ?",
            (job, int(limit)),
        )
        return [_row(r) for r in reversed(rows)]

    def jobs_hours(
        self, jobs: Sequence[str], now: float, kinds: Sequence[str]
    ) -> dict[str, tuple[float, float | None, int, int]]:
        """job -> (GPU-hours over its rows of `kinds`, an open one until now; when its last
        row ended, None while one is open; how many rows; the most GPUs a row held), for
        the jobs named."""
        out: dict[str, tuple[float, float | None, int, int]] = {}
        names = sorted(set(jobs))
        for i in range(0, len(names), 500):
            part = names[i : i + 500]
            marks = ", ".join("?" for _ in part)
            sql = (
                "SELECT job, SUM(gpus * (COALESCE(ended, ?) - started)), MAX(COALESCE(ended, ?)), "
                "MAX(CASE WHEN ended IS NULL THEN 1 ELSE 0 END), COUNT(*), MAX(gpus) FROM provision_service_history "
                f"WHERE job IN ({marks}) AND kind IN ({', '.join('?' for _ in kinds)}) GROUP BY job"
            )
            for job, seconds, last, open_, n, gpus in self._all(sql, [float(now), float(now), *part, *kinds]):
                out[str(job)] = (
                    max(0.0, float(seconds or 0)) / 3600.0, None if open_ else float(last), int(n), int(gpus or 0)
                )  # fmt: skip
        return out

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
            GpuSample(str(r[0]), int(r[1]), float(r[2]), opt_int(r[3]), opt_int(r[4]), opt_int(r[5]),
                      None if r[6] is None else str(r[6]), None if r[7] is None else str(r[7]))
            for r in rows
        ]  # fmt: skip

    def gpu_idle_runs(
        self, since: float, held_below: int, latest_after: float
    ) -> list[tuple[str, int, str, str | None, float]]:
        """(host, gpu, job, owner, t) of each GPU whose latest sample since `latest_after` is held
        and below `held_below`: t begins its trailing run below that from `since` on, under that
        job (rules/gpuuse.idle_since as gpusample.idle_json applies it; reading the candidates'
        30,000 samples into Python held the GIL ~1 s a Usage sum: the benchmark)."""
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
        runs read and summed here took seconds: the benchmark)."""
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
