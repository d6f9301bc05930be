"""Benchmark ("Measured"): the service's kept logs (io/servicelogs.py) under a job that prints
a gigabyte, against their bounds (docs/dashboard.md, "What the service keeps": a line 2,048
bytes, a job 8 MiB, all jobs 256 MiB).

The lines go in through the store's own ingest API, as the log keeper hands them over:
serve/keeper.LogKeeper.handle of a `job.ended` event, its `tail` answering with the lines
(made as they are read: the gigabyte is never this bench's). Not through a sandbox host's
journal: journald would have to take the gigabyte first, and the keeper asks a host for a
task's last serve/keeper.TAIL lines only. Two jobs:

- one run of one job that prints --bytes (1 GiB) in lines of --width bytes: the store keeps
  the job's last 8 MiB;
- the same gigabyte from --jobs jobs (128 x 8 MiB): the store keeps its 256 MiB in all.

For each: the bytes kept (the table's `bytes`) and the table on disk (SQLite: the database
file and its WAL, as `provision serve` keeps it without a team database; --pg: PostgreSQL's
pg_total_relation_size, tests/pgserver.py on loopback) against the bound, the memory the
ingest took (this process's peak RSS over its RSS before; with --tracemalloc, Python's
own peak of allocations too), and the ingest rate (MiB of lines offered a second).

    PYTHONPATH=$PWD/src python bench/keptlogs.py [--bytes 1073741824] [--width 200] [--jobs 128] [--pg]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from servebench import Report

from provision.core.answers import LogLine
from provision.core.events import Event, Kind, Stored
from provision.io.servicelogs import JOB_BYTES, LINE_BYTES, TOTAL_BYTES
from provision.io.servicestore import ServiceStore
from provision.serve.keeper import LogKeeper

MiB = 1 << 20
SLACK = 1.10  # the table on disk: its bound and a tenth (pages, rows' headers, the index)


class Printed(list):  # type: ignore[type-arg]
    """What `tail` hands the keeper: a job's lines, made as the store reads them (a list to
    the keeper's eye; the keeper only iterates it)."""

    def __init__(self, total: int, width: int, task: str):
        super().__init__()
        self.total, self.width, self.task = total, width, task
        self.rows = 0  # bytes of the rows the store made of them

    def __bool__(self) -> bool:
        return self.total > 0

    def __iter__(self) -> Iterator[LogLine]:  # type: ignore[override]
        n = k = 0
        pad = "x" * self.width
        while n < self.total:
            text = f"{k:012d} step {k} loss 0.{k % 9973:04d} " + pad
            text = text[: self.width]
            yield {"time": f"2026-12-02T06:{k // 60 % 60:02d}:{k % 60:02d}Z", "task": self.task, "host": "gpu-1",
                   "text": text}  # fmt: skip
            n += len(text) + 1
            self.rows += len(text) + 1 + len(self.task) + 33  # the store's row: time, task, host, 3 tabs
            k += 1


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def on_disk(store: ServiceStore, db: Path | None) -> tuple[int, str]:
    """The table and its index on disk (SQLite's dbstat; PostgreSQL's relation size, with its
    TOAST and indexes), and what else the database holds for them."""
    if db is not None:
        rows: Any = store._all(  # noqa: SLF001
            "SELECT SUM(pgsize) FROM dbstat WHERE name LIKE 'provision_service_logs%'", ()
        )
        wal = Path(f"{db}-wal")
        files = f"the file {db.stat().st_size / MiB:.2f} MiB, its WAL {wal.stat().st_size / MiB if wal.exists() else 0:.2f} MiB"
        return int(rows[0][0] or 0), files
    rows = store._all("SELECT pg_total_relation_size('provision_service_logs')", ())  # noqa: SLF001
    return int(rows[0][0]), "pg_total_relation_size"


def ended(job: str, run: int, n: int) -> Stored:
    return Stored(n, time.time(), Event(Kind.JOB_ENDED, f"end:{job}:{run}", job, run=run, words=f"{job} ended"))


def ingest(
    store: ServiceStore, jobs: list[tuple[str, int]], width: int, trace: bool
) -> tuple[float, float, float, int]:
    """Each (job, bytes) ended and kept by the keeper; seconds, the RSS it took, Python's peak,
    the bytes of the rows made of the lines."""
    said: list[str] = []
    printed = {job: Printed(total, width, "chief-0") for job, total in jobs}
    keeper = LogKeeper(store, lambda job, _lines: printed[job], said.append)
    before = rss_mib()
    if trace:
        tracemalloc.start()
    t = time.perf_counter()
    keeper.handle([ended(job, 1, k + 1) for k, (job, _) in enumerate(jobs)])
    took = time.perf_counter() - t
    traced = tracemalloc.get_traced_memory()[1] / MiB if trace else float("nan")
    if trace:
        tracemalloc.stop()
    assert not said, said
    return took, max(0.0, peak_mib() - before), traced, sum(p.rows for p in printed.values())


def case(rep: Report, store: ServiceStore, db: Path | None, what: str, jobs: list[tuple[str, int]], args: Any) -> None:
    offered = sum(n for _, n in jobs)  # the lines' text (the store's rows add time, task and host)
    took, rss, traced, rows = ingest(store, jobs, args.width, args.tracemalloc)
    kept = store.kept_bytes()
    disk, files = on_disk(store, db)
    bound = min(TOTAL_BYTES, JOB_BYTES * len(jobs))
    lines, _ = store.kept_logs(jobs[-1][0], 10)
    last = int(lines[-1].text.split()[0]) if lines else -1
    py = f", Python's peak {traced:.1f} MiB" if args.tracemalloc else ""
    rep.say(
        f"{what}: {offered / MiB:.0f} MiB printed ({rows / MiB:.0f} MiB as the store's rows) in {took:.1f} s "
        f"({offered / MiB / took:.0f} MiB/s); "
        f"kept {kept / MiB:.2f} MiB of lines, the table {disk / MiB:.2f} MiB on disk ({files}; bound {bound / MiB:.0f} MiB); "
        f"the ingest's memory: RSS +{rss:.1f} MiB{py}; the newest kept line is line {last}"
    )
    rep.verdict(f"{what}: lines kept <= {bound / MiB:.0f} MiB", f"{kept / MiB:.2f} MiB", kept <= bound)
    rep.verdict(
        f"{what}: on disk <= {bound / MiB:.0f} MiB + {SLACK - 1:.0%}", f"{disk / MiB:.2f} MiB", disk <= bound * SLACK
    )
    rep.verdict(f"{what}: the ingest's memory <= a job's bound x 2", f"+{rss:.1f} MiB", rss <= 2 * JOB_BYTES / MiB)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=1 << 30, help="what the job prints")
    ap.add_argument("--width", type=int, default=200, help="bytes a line (past 2,048: cut by the store)")
    ap.add_argument("--jobs", type=int, default=128, help="the second case's jobs, sharing --bytes")
    ap.add_argument("--pg", action="store_true", help="the store in PostgreSQL (else SQLite)")
    ap.add_argument("--tracemalloc", action="store_true", help="Python's own peak too (slower)")
    ap.add_argument("--name", default=time.strftime("%Y-%m-%d-keptlogs-1gb", time.gmtime()))
    args = ap.parse_args()
    rep = Report(args.name, "the service's kept logs under a job that prints a gigabyte")
    tmp = Path(tempfile.mkdtemp(prefix="bench-keptlogs-"))
    server = None
    try:
        for what, jobs in (
            ("one job, one run", [("loud", args.bytes)]),
            (f"{args.jobs} jobs", [(f"job-{j}", args.bytes // args.jobs) for j in range(args.jobs)]),
        ):
            if args.pg:
                from pgserver import start_server

                server = start_server()
                os.environ.update(server.env())  # its password, as the service's environment has it
                url = server.url()
                store, db = ServiceStore.open_pg(url, url.split("@")[-1]), None
            else:
                db = tmp / f"{len(jobs)}.sqlite"
                store = ServiceStore.open_local(db)
            try:
                case(rep, store, db, what, jobs, args)
            finally:
                store.close()
                if server is not None:
                    server.cleanup()
                    server = None
        where = "PostgreSQL (tests/pgserver.py)" if args.pg else "SQLite (the service's own file)"
        rep.say(f"the store: {where}; lines of {args.width} bytes (the store cuts at {LINE_BYTES})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rep.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
