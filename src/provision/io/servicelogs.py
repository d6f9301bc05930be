"""The logs the service keeps of the jobs it followed, for when their hosts no longer have them
(a job destroyed, a host gone, a submission finished): a table of the service's database
(io/servicedb.py), filled by the log keeper (serve/keeper.py) when a run ends.

Bounded, oldest first out (docs/dashboard.md says so):
- a line: at most LINE_BYTES of UTF-8 (cut, with "…");
- a job: at most `job_bytes` (JOB_BYTES) of lines, its oldest blocks dropped first;
- in all: at most `total_bytes` (TOTAL_BYTES), the oldest blocks of any job dropped first.

Lines are kept in blocks of at most BLOCK_BYTES (one row each: "TIME\\tTASK\\tHOST\\tTEXT"
lines), so that a bound is a sum over a few rows and dropping the oldest is deleting a few
rows, whatever a job printed. A block is dropped whole: a job keeps at most its bound and
at least its bound less a block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from provision.core.answers import LogLine
from provision.io.servicedb import ServiceDB

LINE_BYTES = 2048
BLOCK_BYTES = 64 << 10
JOB_BYTES = 8 << 20
TOTAL_BYTES = 256 << 20

_DDL: tuple[str, ...] = (
    """CREATE TABLE IF NOT EXISTS provision_service_logs (
        id {serial}, job TEXT NOT NULL, run INTEGER, lines INTEGER NOT NULL, bytes INTEGER NOT NULL,
        data TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS provision_service_logs_job ON provision_service_logs (job, id)",
)


@dataclass(frozen=True)
class KeptLine:
    time: str  # ISO 8601, UTC
    task: str
    host: str
    text: str
    run: int | None = None  # the job's run it came from


@dataclass(frozen=True)
class LogBounds:
    line_bytes: int = LINE_BYTES
    block_bytes: int = BLOCK_BYTES
    job_bytes: int = JOB_BYTES
    total_bytes: int = TOTAL_BYTES


def cut(text: str, most: int) -> str:
    """`text` in at most `most` bytes of UTF-8 (cut at a character, with "…"); no newline or tab
    (a block's separators)."""
    text = text.replace("\n", "\\n").replace("\t", "    ")
    raw = text.encode("utf-8", "replace")
    if len(raw) <= most:
        return text
    return raw[: max(0, most - 3)].decode("utf-8", "ignore") + "…"


def _blocks(lines: Iterable[LogLine], b: LogBounds) -> Iterator[tuple[list[str], int]]:
    """(its lines, their bytes) a block at a time, each at most b.block_bytes; lazily: a
    job's gigabyte of output is never in memory at once."""
    block: list[str] = []
    size = 0
    for ln in lines:
        row = "\t".join(
            (cut(ln["time"], 40), cut(ln["task"], 200), cut(ln["host"], 200), cut(ln["text"], b.line_bytes))
        )
        n = len(row.encode("utf-8")) + 1
        if block and size + n > b.block_bytes:
            yield block, size
            block, size = [], 0
        block.append(row)
        size += n
    if block:
        yield block, size


def _line(row: str, run: int | None) -> KeptLine:
    time, task, host, text = (row.split("\t", 3) + ["", "", "", ""])[:4]
    return KeptLine(time, task, host, text, run)


class LogTables(ServiceDB):
    DDL = _DDL
    log_bounds = LogBounds()

    def keep_logs(self, job: str, run: int | None, lines: Iterable[LogLine]) -> int:
        """The lines (in time order) of the job's run `run`, kept; the bytes kept. Only the
        last job_bytes can stay: the blocks before them are dropped as they come (a ring of
        at most job_bytes and a block in memory), the rest written in one transaction, then
        the bounds kept."""
        b = self.log_bounds
        ring: deque[tuple[list[str], int]] = deque()
        held = 0
        for blk in _blocks(lines, b):
            ring.append(blk)
            held += blk[1]
            while held > b.job_bytes and ring:
                held -= ring.popleft()[1]
        if not ring:
            return 0
        insert = self._q("INSERT INTO provision_service_logs (job, run, lines, bytes, data) VALUES (?, ?, ?, ?, ?)")
        with self._tx() as c:
            for block, size in ring:
                c.execute(insert, (job, run, len(block), size, "\n".join(block)))
        self._trim("WHERE job = ?", (job,), b.job_bytes)
        self._trim("", (), b.total_bytes)
        return held

    def _trim(self, where: str, args: tuple[Any, ...], most: int) -> None:
        """The oldest blocks (of `where`) dropped until their bytes are at most `most`."""
        rows = self._all(f"SELECT id, bytes FROM provision_service_logs {where} ORDER BY id DESC", args)
        total, drop = 0, None
        for rid, n in rows:
            total += int(n)
            if total > most:
                drop = int(rid)
                break
        if drop is not None:
            self._do(f"DELETE FROM provision_service_logs {where} {'AND' if where else 'WHERE'} id <= ?", (*args, drop))

    def kept_logs(self, job: str, last: int) -> tuple[list[KeptLine], int]:
        """The job's last `last` kept lines (in time order) and the id of its newest block (0:
        none kept): its newest blocks read a few at a time, only as many as hold them."""
        out: list[KeptLine] = []
        newest, below = 0, None
        while len(out) < last:
            sql = "SELECT id, run, data FROM provision_service_logs WHERE job = ?"
            args: tuple[Any, ...] = (job,) if below is None else (job, below)
            got = self._all(sql + ("" if below is None else " AND id < ?") + " ORDER BY id DESC LIMIT 4", args)
            if not got:
                break
            for rid, run, data in got:
                newest, below = max(newest, int(rid)), int(rid)
                rows = str(data).split("\n")
                out[:0] = [_line(r, None if run is None else int(run)) for r in rows[-(last - len(out)) :]]
                if len(out) >= last:
                    break
        return out, newest

    def has_kept_logs(self, job: str) -> bool:
        return bool(self._all("SELECT 1 FROM provision_service_logs WHERE job = ? LIMIT 1", (job,)))

    def kept_runs(self, job: str) -> set[int]:
        """The runs of `job` whose lines are kept (the keeper keeps a run once)."""
        rows = self._all("SELECT DISTINCT run FROM provision_service_logs WHERE job = ?", (job,))
        return {int(r[0]) for r in rows if r[0] is not None}

    def kept_bytes(self) -> int:
        return int(self._all("SELECT COALESCE(SUM(bytes), 0) FROM provision_service_logs")[0][0])
