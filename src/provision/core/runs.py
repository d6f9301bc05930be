"""A job's runs: each start of the job is a run with a number, as Slurm numbers a job's
restarts. Pure.

The rule (one place): an apply starts a new run when it starts tasks of the job while none
of them runs (the first apply, `--rerun`, a start after a failure or a stop) or when it
(re)starts every task; a task started beside running ones (a `--replace` of one worker of
a parameter-server job, say) joins the current run.

Each host of the job keeps its runs (layout.runs_path, written by the agent with the host's
clock when apply writes the files of a start): [{"run": N, "at": epoch, "by": who}, ...].
Hosts may hold different lists (a host added later knows fewer runs): the job's runs are
their union, each run starting at the earliest time a host recorded for it.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypedDict


class RunJson(TypedDict):
    number: int
    started_at: str  # ISO 8601, UTC
    by: str


@dataclass(frozen=True)
class Run:
    number: int
    started_at: float  # the hosts' clock, epoch seconds
    by: str

    def to_json(self) -> RunJson:
        at = _dt.datetime.fromtimestamp(self.started_at, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"number": self.number, "started_at": at, "by": self.by}

    def words(self) -> str:
        """'run 3, started 2026-11-26 12:00:03 UTC by ana@lab'"""
        at = _dt.datetime.fromtimestamp(self.started_at, _dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"run {self.number}, started {at} by {self.by}"


def parse(records: Any) -> list[Run]:
    """A host's runs.json as Runs (anything malformed is left out: a record, not an input)."""
    out = []
    for r in records if isinstance(records, list) else []:
        if isinstance(r, dict) and isinstance(r.get("run"), int) and isinstance(r.get("at"), (int, float)):
            out.append(Run(r["run"], float(r["at"]), str(r.get("by") or "?")))
    return out


def merged(per_host: Iterable[Any]) -> list[Run]:
    """The job's runs from every host's records, oldest first."""
    first: dict[int, Run] = {}
    for records in per_host:
        for r in parse(records):
            if r.number not in first or r.started_at < first[r.number].started_at:
                first[r.number] = r
    return [first[n] for n in sorted(first)]


def next_number(runs: list[Run]) -> int:
    return (runs[-1].number if runs else 0) + 1


def starts_run(starting: int, kept: int, running: int) -> bool:
    """Does an apply that starts `starting` of the job's `kept` tasks, `running` of which
    run now, begin a new run (module docstring)?"""
    return starting > 0 and (starting == kept or running == 0)


def pick(runs: list[Run], number: int | None, previous: bool) -> tuple[Run, Run | None] | str:
    """The run `logs --run N` / `--previous` shows and the one after it (its end), or why
    there is none."""
    if not runs:
        return "the job has no recorded runs on its hosts (it was applied before runs were kept, or never)"
    if previous:
        if len(runs) < 2:
            return f"--previous: the job has only one run ({runs[0].words()})"
        i = len(runs) - 2
    else:
        found = [i for i, r in enumerate(runs) if r.number == number]
        if not found:
            return f"--run {number}: no such run; the job's runs are {', '.join(str(r.number) for r in runs)}"
        i = found[0]
    return runs[i], runs[i + 1] if i + 1 < len(runs) else None
