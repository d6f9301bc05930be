"""A round: every watched host probed once (one round trip each, all at once), as one frozen
value. The service's sampler (serve/rounds.py) makes one every 10-60 s and hands it to
its subscribers (the service's loop, the GPU samples, the event stream, the dashboard); each
reads the same value, none asks the hosts again.

What a round holds per host is what `provision jobs --json` is made from (the ledger's
entries judged: rules/tenancy.py), the states of the units those entries name, and each
job's runs and end marker there (ProbeReport.ledger_records): enough to tell, without
another look, that a job started, ended and how (rules/events.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from provision.core import runs
from provision.core.devsession import logins_of
from provision.core.recovery import CheckpointSpec, ProgressSpec, RecoveryRecord, RecoverySpec
from provision.host.protocol import ProbeReport
from provision.rules import health as hl
from provision.rules.jobsdoc import JobsDoc
from provision.rules.priority import Policy
from provision.rules.progress import Seen as ProgressSeen
from provision.rules.tenancy import HostView, host_view


@dataclass(frozen=True)
class HostSeen:
    """One host in a round: its ledger judged (view.error: it did not answer), the states of
    the units its entries name, and each job's records there ({"runs", "lifecycle"})."""

    view: HostView
    units: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    records: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Its health record, what this round's health read found (rules/health.py), the time of
    # the newest Xid line it found past the last look, and the host's clock then.
    health: hl.HostHealth = hl.HostHealth()
    signals: tuple[hl.Signal, ...] = ()
    xid_after: float | None = None
    clock: float | None = None
    # Each dev session's connections here (unit -> `user@pts/3`, ...), as bounded as read.
    logins: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def answered(self) -> bool:
        return self.view.error is None

    def run_of(self, job: str) -> int | None:
        """The job's latest run recorded here (core/runs.py), None before its first start."""
        got = runs.parse((self.records.get(job) or {}).get("runs"))
        return got[-1].number if got else None

    def exits_of(self, job: str, unit: str) -> list[list[str]] | None:
        """The unit's .exits records here (systemd forgets an ended unit's outcome)."""
        got = ((self.records.get(job) or {}).get("exits") or {}).get(unit)
        return got if isinstance(got, list) else None

    def run_started(self, job: str) -> float | None:
        """When the job's latest run started here (the host's clock)."""
        got = runs.parse((self.records.get(job) or {}).get("runs"))
        return got[-1].started_at if got else None

    def marker_of(self, job: str) -> Mapping[str, Any] | None:
        """The job's end marker here (`provision stop`, a preemption), if any."""
        m = (self.records.get(job) or {}).get("lifecycle")
        return m if isinstance(m, dict) and "_unreadable" not in m else None


def host_seen(
    name: str,
    gpus: int,
    report: ProbeReport,
    now: float,
    job: str,
    policy: hl.HealthPolicy = hl.HealthPolicy(),
    outputs: str | None = None,
) -> HostSeen:
    """A host as a round sees it from a tenancy probe of `job` (whose own units, runs and
    marker the probe reports apart from the other jobs'), with its health read when the
    probe asked it."""
    records: dict[str, Mapping[str, Any]] = dict(report.ledger_records or {})
    records[job] = {"runs": report.runs, "lifecycle": report.lifecycle, "exits": report.exits}
    units = {**(report.ledger_units or {}), **report.units}
    got = report.logins if isinstance(report.logins, dict) else {}
    logins = {u: ls for u, v in list(got.items())[:256] if isinstance(u, str) and (ls := logins_of(v))}
    read = (report.checks or {}).get("health")
    clock = ((read or {}).get("xid") or {}).get("now") if isinstance(read, dict) else None
    return HostSeen(
        host_view(name, gpus, report, now),
        units,
        records,
        hl.of_report(report),
        hl.signals(gpus, report, policy, outputs) if isinstance(read, dict) else (),
        hl.xid_after(report) if isinstance(read, dict) else None,
        float(clock) if isinstance(clock, (int, float)) else None,
        logins,
    )


@dataclass(frozen=True)
class JobWatch:
    """A job the round watches for its progress or recovers (`progress:`, `recovery:`):
    its inventory file, what it asks, where its tasks are placed now (task -> host), the
    hosts set aside for it, and its progress as this round saw it."""

    file: str
    progress: ProgressSpec | None
    recovery: RecoverySpec | None
    tasks: Mapping[str, str]
    seen: ProgressSeen
    aside: tuple[str, ...] = ()
    record: RecoveryRecord = RecoveryRecord()  # its recoveries, as its state had them
    elastic: str = ""  # its elastic pool's role (`elastic:`), if any: a lost worker is a scale-up
    checkpoint: CheckpointSpec | None = None  # its checkpoint copied off its host (rules/checkpoints.py)


def unreachable(name: str, gpus: int, why: str) -> HostSeen:
    return HostSeen(HostView(name, gpus, error=why))


@dataclass(frozen=True)
class Round:
    """One round: when it began (this machine's clock), every host, and the hosts' document
    the pages and /api/v1/hosts show (`provision jobs --json` with each host's labels and
    GPU use). Of the inventories surveyed, by job: `jobs` the hosts each names, `success`
    its success policy, `demand` its replicas' GPUs and hosts; `studies` those with a study
    (their trials' runners tell their ends)."""

    number: int
    began: float
    hosts: Mapping[str, HostSeen]
    doc: JobsDoc
    studies: frozenset[str] = frozenset()
    success: Mapping[str, str] = field(default_factory=dict)
    jobs: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # ... and what each replica needs: (its GPUs, the hosts it may run on), one per replica.
    demand: Mapping[str, tuple[tuple[int, frozenset[str]], ...]] = field(default_factory=dict)
    # The jobs watched for progress or recovered (rules/recovery.py), by job.
    watch: Mapping[str, JobWatch] = field(default_factory=dict)
    policy: Policy | None = None  # the team's (priority classes, guarantees), as the inventories' state says

    @property
    def answered(self) -> frozenset[str]:
        return frozenset(n for n, h in self.hosts.items() if h.answered)
