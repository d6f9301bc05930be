"""What changed in the hosts' health between two looks, as events and incidents, and the
incidents ranked (`provision health --report`, the dashboard's Health page). Pure.

The service's health keeper (serve/health.py) knows each host's marks as it last saw them
(`Known`, kept in its database with the events they led to); each round's marks, after it
acted, are compared with them:
- a GPU newly quarantined (or quarantined again: a failed test) is `gpu.quarantined`, one
  back from quarantine or a test is `gpu.released`; a host newly draining or quarantined is
  `host.drained`, one back is `host.released`. Each event's key names the mark (its host,
  GPU and since), so one happening is one event whoever saw it;
- every mark is an incident from its `since` until it goes (a suspect too, a test too), and so
  is a host's outage (from the round that found it away until one that reached it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from provision.core.events import Event, Kind, iso
from provision.rules.health import HostHealth, Mark, State, target_words

UNREACHABLE = "unreachable"  # an incident's state when the host did not answer


@dataclass(frozen=True)
class Incident:
    key: str
    host: str
    gpu: int | None
    state: str  # a health state, or UNREACHABLE
    reason: str
    evidence: str
    started: float
    ended: float | None = None
    by: str = ""
    job: str = ""
    owner: str = ""
    gpus: int = 1  # the GPUs it took from work (a host's: all it declares)

    @property
    def target(self) -> str:
        return f"{self.host}:{self.gpu}" if self.gpu is not None else self.host

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "gpu": self.gpu,
            "state": self.state,
            "reason": self.reason,
            "evidence": self.evidence,
            "started": self.started,
            "ended": self.ended,
            "by": self.by,
            "job": self.job,
            "owner": self.owner,
            "gpus": self.gpus,
        }


@dataclass(frozen=True)
class Known:
    """One host as the keeper last saw it: each mark ("host", or a GPU's number), how many
    GPUs it declares, and since when it is away (None: it answered)."""

    marks: Mapping[str, Mark] = field(default_factory=dict)
    declared: int = 0
    away: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"marks": {k: m.to_json() for k, m in sorted(self.marks.items())}, "declared": self.declared,
                "away": self.away}  # fmt: skip

    @classmethod
    def from_json(cls, d: Any) -> Known:
        if not isinstance(d, Mapping):
            return cls()
        marks = {str(k): m for k, v in (d.get("marks") or {}).items() if (m := Mark.from_json(v)) is not None}
        away = d.get("away")
        n = d.get("declared")
        return cls(marks, n if isinstance(n, int) else 0, float(away) if isinstance(away, (int, float)) else None)

    def health(self) -> HostHealth:
        gpus = {int(k): m for k, m in self.marks.items() if k.isdigit()}
        return HostHealth(self.marks.get("host"), dict(sorted(gpus.items())))


def known_of(health: HostHealth, declared: int, away: float | None = None) -> Known:
    marks: dict[str, Mark] = {str(g): m for g, m in health.gpus.items()}
    if health.host is not None:
        marks["host"] = health.host
    return Known(marks, declared, away)


def incident_key(host: str, where: str, state: str, since: float | None) -> str:
    return f"{host}:{where}:{state}:{since if since is not None else '-'}"


def _event(host: str, where: str, m: Mark, back: bool, prev: Mark | None) -> Event | None:
    gpu = int(where) if where.isdigit() else None
    what = target_words(host, gpu)
    if gpu is not None and not back and m.state is State.QUARANTINED:
        kind, key = Kind.GPU_QUARANTINED, f"quarantine:{host}:{gpu}:{m.since}"
        held = f"; job {m.job} ({m.owner}) held it" if m.job else ""
        words = f"{what} quarantined by {m.by or '?'}: {m.reason}{held}"
    elif gpu is None and not back and m.state.blocks and m.state is not State.TESTING:
        kind, key = Kind.HOST_DRAINED, f"drain:{host}:{m.since}"
        words = f"{host} {m.state.value} by {m.by or '?'}: {m.reason}"
    elif back and prev is not None:
        kind = Kind.GPU_RELEASED if gpu is not None else Kind.HOST_RELEASED
        key = f"release:{host}:{where}:{prev.since}"
        words = f"{what} released ({m.reason or 'back to work'}), {prev.state.value} since by {prev.by or '?'}"
    else:
        return None
    job = m.job if not back else (prev.job if prev is not None else "")
    owner = m.owner if not back else (prev.owner if prev is not None else "")
    return Event(kind, key, job, owner, host, words, hosts=(host,), gpus=1 if gpu is not None else 0)


def transitions(
    host: str, prev: Known | None, cur: HostHealth, declared: int, at: float, answered: bool = True
) -> tuple[list[Event], list[Incident], list[tuple[str, float]], Known]:
    """Between what was known of a host and its marks now (at: when, the host's clock): the
    events, the incidents begun, those over (key, when), and what is known now."""
    before = prev or Known()
    if not answered:  # its marks are as they were; the outage is an incident of its own
        away = before.away if before.away is not None else at
        began = [] if before.away is not None else [_outage(host, away, declared)]
        return [], began, [], Known(before.marks, declared, away)
    now = known_of(cur, declared)
    events: list[Event] = []
    opened: list[Incident] = []
    closed: list[tuple[str, float]] = []
    if before.away is not None:
        closed.append((incident_key(host, "-", UNREACHABLE, before.away), at))
    for where in sorted(set(before.marks) | set(now.marks)):
        p, c = before.marks.get(where), now.marks.get(where)
        if p is not None and c is not None and (p.state, p.since) == (c.state, c.since):
            continue
        if p is not None:
            closed.append((incident_key(host, where, p.state.value, p.since), at))
        if c is not None:
            gpu = int(where) if where.isdigit() else None
            opened.append(
                Incident(
                    incident_key(host, where, c.state.value, c.since),
                    host,
                    gpu,
                    c.state.value,
                    c.reason,
                    c.evidence,
                    c.since if c.since is not None else at,
                    None,
                    c.by,
                    c.job,
                    c.owner,
                    1 if gpu is not None else max(declared, 0),
                )  # fmt: skip
            )
        back = p is not None and p.state.blocks and (c is None or not c.state.blocks)
        if c is not None or back:
            e = _event(host, where, c if c is not None else Mark(State.HEALTHY, "released"), back, p)
            if e is not None:
                events.append(e)
    return events, opened, closed, now


def _outage(host: str, since: float, declared: int) -> Incident:
    key = incident_key(host, "-", UNREACHABLE, since)
    return Incident(key, host, None, UNREACHABLE, "did not answer", "", since, None, "the service's rounds", "", "",
                    max(declared, 0))  # fmt: skip


# --------------------------------------------------------------------------- the report

COUNTED = frozenset({State.QUARANTINED.value, State.DRAINING.value, State.SUSPECT.value, UNREACHABLE})
LOST = frozenset({State.QUARANTINED.value, State.DRAINING.value, State.TESTING.value, UNREACHABLE})


@dataclass(frozen=True)
class Ranked:
    target: str  # HOST or HOST:GPU
    incidents: int
    gpu_hours_lost: float
    last: str  # the latest incident's reason
    last_at: float


def lost_hours(i: Incident, now: float, since: float | None) -> float:
    """GPU-hours an incident took from work within [since, now]: its time in a state that
    gives no work (quarantined, draining, testing, away) times the GPUs it took."""
    if i.state not in LOST:
        return 0.0
    start = max(i.started, since) if since is not None else i.started
    end = i.ended if i.ended is not None else now
    return max(0.0, end - start) * i.gpus / 3600.0


def rank(incidents: Iterable[Incident], now: float, since: float | None = None) -> list[Ranked]:
    """Hosts and GPUs by their incidents (quarantines, drains, suspects, outages; a test is
    none) and then by the GPU-hours lost to them, the worst first. A GPU's incidents count
    for the GPU; a host's for the host."""
    by: dict[str, list[Incident]] = {}
    for i in incidents:
        by.setdefault(i.target, []).append(i)
    out = []
    for target, got in by.items():
        last = max(got, key=lambda i: i.started)
        out.append(
            Ranked(
                target,
                sum(1 for i in got if i.state in COUNTED),
                round(sum(lost_hours(i, now, since) for i in got), 3),
                last.reason,
                last.started,
            )  # fmt: skip
        )
    return sorted(out, key=lambda r: (-r.incidents, -r.gpu_hours_lost, r.target))


class RankedJson(TypedDict):
    target: str
    incidents: int
    gpu_hours_lost: float
    last: str
    last_at: str


class HealthReportDoc(TypedDict):
    """`provision health --report --json` and the Health page's document."""

    format_version: int
    now: str | None
    since: str | None
    ranked: list[RankedJson]
    incidents: list[dict[str, Any]]


def report_doc(incidents: list[Incident], now: float, since: float | None) -> HealthReportDoc:
    """`provision health --report --json` (and the Health page): the ranking, then every
    incident, the latest first."""
    return {
        "format_version": 1,
        "now": iso(now),
        "since": iso(since) if since is not None else None,
        "ranked": [
            {
                "target": r.target,
                "incidents": r.incidents,
                "gpu_hours_lost": r.gpu_hours_lost,
                "last": r.last,
                "last_at": iso(r.last_at),
            }
            for r in rank(incidents, now, since)
        ],  # fmt: skip
        "incidents": [
            {
                **i.to_json(),
                "started": iso(i.started),
                "ended": iso(i.ended) if i.ended is not None else None,
                "gpu_hours_lost": round(lost_hours(i, now, since), 3),
            }
            for i in sorted(incidents, key=lambda i: -i.started)
        ],  # fmt: skip
    }
