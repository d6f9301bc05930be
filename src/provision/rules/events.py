"""What happened between two rounds, as events (core/events.py): the one function that turns
rounds into the stream. Pure: the last `Seen` and a new Round in, the events and the next
`Seen` out. The store keeps `Seen` with the events it led to, in one transaction, so a
service killed after a round and restarted (or a follower that takes the lead) goes on
from the same place: nothing is lost and nothing is said twice.

The rules, in one place:
- a job is judged only on the hosts that answered; while a host it was seen on does not
  answer and no answering host shows it running, what it was is kept (a host that only
  blinked changes nothing);
- a job's run is its latest run number on its hosts (core/runs.py); a new run is
  `job.started` (`job.resumed` after a preemption); a run that ended is `job.ended` with
  how (core/lifecycle.job_phase over its tasks' units, the end marker and the job's success
  policy where the service knows its inventory, else the chief's); a run that started and
  ended between two rounds gives both;
- a job a recovery stopped (its marker says so, run/recover.py) is recovering: its run ends
  (`job.ended`, how failed) if it had not ended already, and its next run is `job.started`
  (the recovery itself says `job.recovered`);
- a preempted job is `job.preempted` and ends (`job.ended`, how preempted); a job gone from
  every host it was on while it ran was destroyed; a run whose tasks were all stopped with
  no end marker is judged at the next round: gone, it was destroyed (destroy stops the
  tasks first), still there, it was stopped;
- a trial (a job `STUDY-tN` of a study surveyed) says nothing here: its study's runner tells
  its end (`trial.ended`), as it tells the study its result;
- a task seen failed, or restarted since the last round (systemd's NRestarts), is
  `task.failed` once;
- a host that stops answering is `host.unreachable`, and `host.back` when it answers again;
- what a host runs the first time it is watched is where the watch begins: no event.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from provision.core.events import Event, How, Kind, ended_key, started_key
from provision.core.lifecycle import (
    PREEMPT_PHASE,
    STOP_PHASE,
    JobPhase,
    TaskRow,
    TaskState,
    job_phase,
    recovering,
    task_state,
)
from provision.host import layout
from provision.rules.rounds import HostSeen, Round
from provision.rules.status import JobStatus
from provision.rules.tenancy import Hold, Holder


class State(StrEnum):
    WAITING = "waiting"  # reserved or queued, not started
    RUNNING = "running"
    STOPPING = "stopping"  # every task stopped, no end marker: destroy under way, or a stop by hand
    PREEMPTED = "preempted"
    RECOVERING = "recovering"  # a recovery stopped it (run/recover.py): its next run follows
    ENDED = "ended"


@dataclass(frozen=True)
class JobSeen:
    state: State
    run: int | None
    owner: str
    hosts: tuple[str, ...]
    gpus: int = 0
    failed: tuple[str, ...] = ()  # its tasks already said failed in this run
    restarts: tuple[tuple[str, int], ...] = ()  # task -> systemd's NRestarts in this run

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "run": self.run,
            "owner": self.owner,
            "hosts": list(self.hosts),
            "gpus": self.gpus,
            "failed": list(self.failed),
            "restarts": [list(r) for r in self.restarts],
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> JobSeen:
        run = d.get("run")
        return cls(
            State(str(d.get("state"))),
            run if isinstance(run, int) else None,
            str(d.get("owner", "")),
            tuple(str(h) for h in d.get("hosts") or ()),
            int(d.get("gpus") or 0),
            tuple(str(t) for t in d.get("failed") or ()),
            tuple((str(t), int(n)) for t, n in d.get("restarts") or ()),
        )


@dataclass(frozen=True)
class Seen:
    """What the rounds have seen so far: each job, the hosts watched, each host's outages
    (how many so far) and which hosts are away now."""

    jobs: Mapping[str, JobSeen] = field(default_factory=dict)
    hosts: frozenset[str] = frozenset()
    outages: Mapping[str, int] = field(default_factory=dict)
    away: frozenset[str] = frozenset()

    def to_json(self) -> dict[str, Any]:
        return {
            "jobs": {j: s.to_json() for j, s in sorted(self.jobs.items())},
            "hosts": sorted(self.hosts),
            "outages": dict(sorted(self.outages.items())),
            "away": sorted(self.away),
        }

    @classmethod
    def from_json(cls, d: Any) -> Seen:
        """Seen as the store kept it; anything it cannot read is where a watch begins."""
        if not isinstance(d, dict):
            return cls()
        try:
            return cls(
                {str(j): JobSeen.from_json(s) for j, s in (d.get("jobs") or {}).items()},
                frozenset(str(h) for h in d.get("hosts") or ()),
                {str(h): int(n) for h, n in (d.get("outages") or {}).items()},
                frozenset(str(h) for h in d.get("away") or ()),
            )
        except (TypeError, ValueError, AttributeError):
            return cls()


@dataclass(frozen=True)
class _Now:
    """A job in this round, on the hosts that answered."""

    state: State
    run: int | None
    owner: str
    hosts: tuple[str, ...]
    how: How | None
    words: str
    preempted_by: str
    gpus: int
    tasks: tuple[tuple[str, str, TaskState, str, int], ...]  # (task, host, state, detail, NRestarts)


_TRIAL = re.compile(r"^(?P<study>.+)-t(?P<n>[1-9][0-9]*)$")


def study_of(job: str, studies: Iterable[str]) -> str | None:
    """The study whose trial `job` is (core/tuning.trial_job), among `studies`."""
    m = _TRIAL.match(job)
    return m.group("study") if m is not None and m.group("study") in set(studies) else None


def diff(prev: Seen, cur: Round) -> tuple[list[Event], Seen]:
    """The events between the last rounds' `prev` and round `cur`, and what is seen now."""
    events: list[Event] = []
    answered = cur.answered
    outages, away = dict(prev.outages), set(prev.away)
    for name in sorted(set(cur.hosts) & prev.hosts):
        if name in answered and name in away:
            away.discard(name)
            words = f"{name} answers again"
            events.append(Event(Kind.HOST_BACK, f"back:{name}:{outages.get(name, 0)}", host=name, words=words))
        elif name not in answered and name not in away:
            away.add(name)
            outages[name] = outages.get(name, 0) + 1
            words = f"{name} stopped answering: {cur.hosts[name].view.error or 'no answer'}"
            events.append(Event(Kind.HOST_UNREACHABLE, f"down:{name}:{outages[name]}", host=name, words=words))
    now = _jobs(cur)
    jobs: dict[str, JobSeen] = {}
    for job in sorted(set(prev.jobs) | set(now)):
        p, c = prev.jobs.get(job), now.get(job)
        kept, more = _job(job, p, c, prev.hosts, answered)
        if study_of(job, cur.studies) is None:
            events += more
        if kept is not None:
            jobs[job] = kept
    return events, Seen(jobs, prev.hosts | frozenset(cur.hosts), outages, frozenset(away))


def _job(
    job: str, p: JobSeen | None, c: _Now | None, watched: frozenset[str], answered: frozenset[str]
) -> tuple[JobSeen | None, list[Event]]:
    """One job's events, and what is kept of it."""
    if c is None:
        return _gone(job, p, answered)
    if p is not None and not set(p.hosts) <= answered and c.state is not State.RUNNING:
        return p, []  # part of it is away and what answers does not run it: unknown
    events: list[Event] = []
    new_run = c.run is not None and (p is None or p.run is None or c.run > p.run)
    known = p is not None or bool(set(c.hosts) & watched)  # else: the watch begins here
    if known and new_run and c.state in (State.RUNNING, State.ENDED, State.PREEMPTED):
        resumed = p is not None and p.state is State.PREEMPTED
        kind = Kind.JOB_RESUMED if resumed else Kind.JOB_STARTED
        what = "resumed after its preemption" if resumed else "started"
        words = f"job {job} {what} (run {c.run}) on {', '.join(c.hosts)}"
        events.append(
            Event(kind, started_key(job, c.run), job, c.owner, c.hosts[0], words, None, c.run, c.hosts, c.gpus)
        )
    if c.state is State.STOPPING and p is not None and p.state is State.ENDED and not new_run:
        c = replace(c, state=State.ENDED)  # said already
    ran = p is not None and p.state in (State.RUNNING, State.STOPPING) and not new_run
    if known and (new_run or ran):
        c, more = _run_events(job, c, p, new_run)
        events += more
    failed = tuple(sorted({t for t, _, s, _, _ in c.tasks if s is TaskState.FAILED}))
    restarts = tuple(sorted((t, n) for t, _, _, _, n in c.tasks))
    if p is not None and not new_run:
        failed = tuple(sorted(set(failed) | set(p.failed)))
    return JobSeen(c.state, c.run, c.owner, c.hosts, c.gpus, failed, restarts), events


def _run_events(job: str, c: _Now, p: JobSeen | None, new_run: bool) -> tuple[_Now, list[Event]]:
    """The events of a run that is new or ran at the last round: its tasks' failures and
    its end (stopped, preempted, ended, or stopped by a recovery); `c` as it is kept."""
    events = _failures(job, c, p if not new_run else None)
    if c.state is State.STOPPING and p is not None and p.state is State.STOPPING and not new_run:
        events.append(_end(job, c.run, c.owner, How.STOPPED, c.words, c.hosts, c.gpus))
        c = replace(c, state=State.ENDED)
    elif c.state is State.PREEMPTED:
        words = f"job {job} was preempted" + (f" by {c.preempted_by}" if c.preempted_by else "")
        events.append(Event(Kind.JOB_PREEMPTED, f"preempt:{job}:{c.run}", job, c.owner, c.hosts[0], words, run=c.run))
        events.append(_end(job, c.run, c.owner, How.PREEMPTED, words, c.hosts, c.gpus))
    elif c.state is State.ENDED and c.how is not None:
        events.append(_end(job, c.run, c.owner, c.how, c.words, c.hosts, c.gpus))
    elif c.state is State.RECOVERING:  # it ran until the recovery stopped it (a hang): its run ends
        events.append(_end(job, c.run, c.owner, How.FAILED, c.words, c.hosts, c.gpus))
    return c, events


def _gone(job: str, p: JobSeen | None, answered: frozenset[str]) -> tuple[JobSeen | None, list[Event]]:
    """A job no answering host has: destroyed if it ran; unknown while a host it was on is away."""
    if p is None:
        return None, []
    if not set(p.hosts) <= answered:
        return p, []
    if p.state in (State.RUNNING, State.STOPPING):
        words = f"job {job} was destroyed while it ran (gone from {', '.join(p.hosts)})"
        return None, [_end(job, p.run, p.owner, How.DESTROYED, words, p.hosts, p.gpus)]
    return None, []


def _failures(job: str, c: _Now, p: JobSeen | None) -> list[Event]:
    """task.failed for each task that failed, or restarted, since `p` (None: a new run)."""
    before = dict(p.restarts) if p is not None else {}
    said = set(p.failed) if p is not None else set()
    out = []
    for task, host, state, detail, n in c.tasks:
        if state is TaskState.FAILED and task not in said:
            words = f"{task} of job {job} on {host} failed: {detail}"
            out.append(Event(Kind.TASK_FAILED, f"fail:{job}:{c.run}:{task}", job, c.owner, host, words, run=c.run))
        elif n > before.get(task, 0):
            words = f"{task} of job {job} on {host} exited and was restarted (restart {n} of this run)"
            out.append(
                Event(Kind.TASK_FAILED, f"restart:{job}:{c.run}:{task}:{n}", job, c.owner, host, words, run=c.run)
            )
    return out


def _end(job: str, run: int | None, owner: str, how: How, words: str, hosts: tuple[str, ...], gpus: int) -> Event:
    return Event(
        Kind.JOB_ENDED, ended_key(job, run), job, owner, hosts[0] if hosts else "", words, how, run, hosts, gpus
    )


_HOW = {
    JobPhase.SUCCEEDED: How.SUCCEEDED,
    JobPhase.FAILED: How.FAILED,
    JobPhase.STOPPED: How.STOPPED,
    JobPhase.PREEMPTED: How.PREEMPTED,
}


def _jobs(cur: Round) -> dict[str, _Now]:
    """Every job on the hosts that answered, as this round sees it."""
    by_job: dict[str, list[tuple[HostSeen, Holder]]] = {}
    for name in sorted(cur.hosts):
        hs = cur.hosts[name]
        if not hs.answered:
            continue
        for h in hs.view.holders:
            by_job.setdefault(h.job, []).append((hs, h))
    return {job: _now(job, on, cur.success.get(job, "chief")) for job, on in by_job.items()}


def _now(job: str, on: list[tuple[HostSeen, Holder]], success: str) -> _Now:
    holds = {h.hold for _, h in on}
    marker = next((m for hs, _ in on if (m := hs.marker_of(job)) is not None), None)
    runs = [r for hs, _ in on if (r := hs.run_of(job)) is not None]
    run = max(runs) if runs else None
    owner = next((h.who for _, h in on if h.owner is not None), "unknown owner")
    preempted_by = next((h.preempted_by for _, h in on if h.preempted_by), "")
    tasks = []
    rows = []
    for hs, h in on:
        for unit in h.units:
            task = layout.task_of_unit(job, unit)
            exits = hs.exits_of(job, unit)
            got = task_state(hs.units.get(unit), exits, marker)
            role = task.rsplit("-", 1)[0]
            n = _int(hs.units.get(unit, {}).get("NRestarts"))
            tasks.append((task, h.host, got.state, got.detail, n))
            rows.append(TaskRow(task, role, h.host, got.state, got.detail, _ended_at(got.state, exits)))
    if Hold.RUNNING in holds:
        state = State.RUNNING
    elif recovering(marker) or preempted_by == job:
        state = State.RECOVERING
    elif Hold.PREEMPTED in holds or (marker is not None and marker.get("phase") == JobPhase.PREEMPTED.value):
        state = State.PREEMPTED
    elif run is None or holds <= {Hold.RESERVED, Hold.QUEUED, Hold.STALE}:
        state = State.WAITING if run is None else State.ENDED
    else:
        state = State.ENDED
    how, words = None, ""
    if state is State.RECOVERING:
        words = f"job {job} run {run} ended: " + str((marker or {}).get("reason") or "recovering")
    if state is State.ENDED and marker is None and rows and all(r.state is TaskState.STOPPED for r in rows):
        state, how = State.STOPPING, How.STOPPED
        words = f"job {job} stopped: {rows[0].task} was {rows[0].detail}"
    elif state is State.ENDED:
        # Only a stop's or a preemption's marker decides the phase (status' rule): the end
        # marker of a job that ended by itself says what its tasks already say.
        stop = marker if marker is not None and marker.get("phase") in (STOP_PHASE, PREEMPT_PHASE) else None
        phase, why = job_phase(success, rows, stop)
        how = _HOW.get(phase)
        words = f"job {job} {phase.value.lower()}" + (f": {why}" if why else "")
    hosts = tuple(sorted({h.host for _, h in on}))
    gpus = sum(len(h.gpus) for _, h in on)
    return _Now(state, run, owner, hosts, how, words, preempted_by, gpus, tuple(sorted(tasks)))


def _ended_at(state: TaskState, exits: list[list[str]] | None) -> float | None:
    """When a task's last run ended (its exit record's host time), as status reads it."""
    if not state.ended or not exits:
        return None
    try:
        return float(exits[-1][0])
    except (TypeError, ValueError, IndexError):
        return None


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def of_status(st: JobStatus, owner: str, gpus: int, started: bool, resumed: bool = False) -> list[Event]:
    """A run's own events, as the one that applied it sees its status (a handed-over apply's
    worker): `started` when it just applied it (`resumed`: a run after a preemption), and
    its end once the job ended or was preempted; the same keys as the rounds' (the store
    keeps one of each)."""
    run = st.run.number if st.run is not None else None
    hosts = tuple(sorted({t.host for t in st.tasks}))
    host = hosts[0] if hosts else ""
    out = []
    if started and run is not None:
        kind, what = (Kind.JOB_RESUMED, "resumed after its preemption") if resumed else (Kind.JOB_STARTED, "started")
        words = f"job {st.job} {what} (run {run}) on {', '.join(hosts)}"
        out.append(Event(kind, started_key(st.job, run), st.job, owner, host, words, None, run, hosts, gpus))
    how = _HOW.get(st.phase)
    if how is None or (st.phase is JobPhase.PREEMPTED and any(t.state.live for t in st.tasks)):
        return out
    words = f"job {st.job} {st.phase.value.lower()}" + (f": {st.reason}" if st.reason else "")
    if how is How.PREEMPTED:
        out.append(
            Event(Kind.JOB_PREEMPTED, f"preempt:{st.job}:{run}", st.job, owner, host, words, None, run, hosts, gpus)
        )
    out.append(Event(Kind.JOB_ENDED, ended_key(st.job, run), st.job, owner, host, words, how, run, hosts, gpus))
    return out
