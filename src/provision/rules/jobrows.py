"""The Jobs page's numbers, made right from what the service knows beside the hosts' ledgers
(`provision jobs --json` itself stays as the ledgers say it). Pure.

- a job preempted on its hosts is "preempted" (the ledgers' entries there are PREEMPTED or
  ENDED: `jobs` names the job ended), waiting for room to resume;
- its GPUs are those it holds, else those its inventory asks for (a queued job holds none,
  a preempted one fewer than it ran with): its replicas' GPUs (Round.demand), else what the
  history's last row says it held;
- its GPU-hours and when it last ended come from the history (every run of it);
- "since" is when its latest run started (the hosts' runs records), not the ledger entry's
  first reservation (a rerun keeps the entry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from provision.core import runs
from provision.rules.historyview import iso
from provision.rules.jobsdoc import JobJson, JobsDoc
from provision.rules.rounds import HostSeen

PREEMPTED = "preempted"


def shown_state(j: JobJson) -> str:
    """The job's state as the pages list it: "preempted" where its hosts say so."""
    if j["state"] in ("ended", "stale") and any(h.get("state") == PREEMPTED for h in j["hosts"].values()):
        return PREEMPTED
    return j["state"]


def held_gpus(j: JobJson) -> int:
    return sum(len(h.get("gpus") or ()) for h in j["hosts"].values() if h.get("state") != "queued")


def with_extras(
    doc: JobsDoc,
    *,
    demand: Mapping[str, Sequence[tuple[int, frozenset[str]]]],
    started: Mapping[str, float],
    hours: Mapping[str, tuple[float, float | None, int, int]],
    now: float,
) -> JobsDoc:
    """The hosts' document with each job's "gpus", "gpu_hours", "ended" and "since" right
    (module docstring). `demand`: job -> its replicas' (GPUs, hosts); `started`: job -> when
    its latest run started; `hours`: job -> (GPU-hours, last ended or None while a run is
    open, rows, the most GPUs a row held: the history's, io/servicehistory.jobs_hours)."""
    jobs: list[JobJson] = []
    for j in doc["jobs"]:
        name = j["job"]
        state = shown_state(j)
        asks = sum(g for g, _ in demand.get(_study_of(name, demand), ()))
        held = held_gpus(j)
        h = hours.get(name)
        had = h[3] if h is not None else 0
        if state in ("running", "reserved", "held") and held:
            gpus = held
        elif state == "ended":  # what its last run held
            gpus = had or asks or held
        else:  # queued, preempted, stale: what it asks for
            gpus = asks or had or held
        since = started.get(name)
        out: JobJson = {
            **j,
            "state": state,
            "gpus": gpus,
            "gpu_hours": round(h[0], 3) if h is not None else None,
            "ended": iso(h[1]) if h is not None and h[1] is not None and state not in ("running", "reserved") else None,
        }
        if since is not None and state in ("running", "reserved", "held", PREEMPTED):
            out["since"] = iso(since)
            out["age_seconds"] = int(max(0.0, now - since))
        jobs.append(out)
    return {**doc, "jobs": jobs}


def latest_starts(hosts: Mapping[str, HostSeen]) -> dict[str, float]:
    """job -> when its latest run started, from the runs every host of a round records."""
    latest: dict[str, tuple[int, float]] = {}
    for hs in hosts.values():
        for job, rec in hs.records.items():
            got = runs.parse(rec.get("runs"))
            if not got:
                continue
            r = got[-1]
            seen = latest.get(job)
            if seen is None or r.number > seen[0] or (r.number == seen[0] and r.started_at < seen[1]):
                latest[job] = (r.number, r.started_at)
    return {job: at for job, (_, at) in latest.items()}


def _study_of(job: str, demand: Mapping[str, object]) -> str:
    """A trial's (STUDY-tN) demand is its study's: the same pools."""
    if job in demand:
        return job
    base, sep, n = job.rpartition("-t")
    return base if sep and n.isdigit() and base in demand else job
