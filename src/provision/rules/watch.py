"""Which applied jobs the service must look at again (the service watches 128 hosts and 100
idle jobs in < 5 % of a core and < 200 MiB).

An applied job is watched from the service's one round per host (serve/gpusample.py's, the
hosts' ledgers and units as `provision jobs --json` reports them), not by a process of its
own: a worker comes back only when a round says something changed (or that the job is
preempted on some of its hosts only: the worker preempts it whole). Pure: the round's
document in, the submissions to look at out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from provision.rules.preempted import to_stop

# A job in these states runs as applied: nothing to look at (tenancy.Hold's values).
QUIET = frozenset({"running", "reserved", "queued"})
AGAIN_S = 60.0  # a look that found the job still running is not asked again sooner


@dataclass(frozen=True)
class Watched:
    sid: str
    job: str
    hosts: frozenset[str]  # the hosts its inventory lists
    since: float  # when the service began watching it (time.time())
    looked: float = 0.0  # when a worker last looked and found it running (time.time())


def to_look_at(doc: Mapping[str, Any], at: float, watched: Collection[Watched]) -> tuple[set[str], set[str]]:
    """(submissions whose job a worker must look at, submissions whose job is gone from every
    host) after a round that began at `at`. Only a round begun after the watch began counts
    (an earlier one may predate the apply); a host that did not answer tells nothing."""
    jobs = {j["job"]: j for j in doc.get("jobs") or []}
    answered = {n for n, h in (doc.get("hosts") or {}).items() if not h.get("error")}
    look, gone = set(), set()
    for w in watched:
        if at < w.since:
            continue
        j = jobs.get(w.job)
        if j is None:
            if w.hosts and w.hosts <= answered:
                gone.add(w.sid)
            continue
        # Preempted in part: at once, but once a round (the look's worker may still be at it).
        if (j.get("state") not in QUIET and at - w.looked >= AGAIN_S) or (preempted_in_part(j) and w.looked < at):
            look.add(w.sid)
    return look, gone


def preempted_in_part(job: Mapping[str, Any]) -> bool:
    """Preempted on a host (its entry there marked) and running on another: a job is
    preempted whole (rules/preempted.to_stop), so a worker looks at once, without waiting
    AGAIN_S: its preemptor may not know the other hosts, and nobody else stops it there."""
    hosts = {n: h for n, h in (job.get("hosts") or {}).items() if isinstance(h, Mapping)}
    marked = {n for n, h in hosts.items() if h.get("preempted_by")}
    return bool(to_stop(marked, {n: h.get("state") == "running" for n, h in hosts.items()}))
