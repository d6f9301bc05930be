"""When a job's hardware fails: where it broke, and what recovery does about it. Pure.

The rules, in one place:
- recovery acts on evidence that a task ended (it failed, or waits to restart after a
  failure) or that the job stopped progressing past its bound (rules/progress.py), never on
  a missed look: a host that does not answer while the others run on is waited for;
- where it broke: a host of the job that does not answer when the others ended or stopped
  progressing ("chief-0's host gpu-3 stopped answering at 14:02"), else the first task
  that failed (by its exit's time) and its host, else the hang; that host is set aside for
  the job (its replicas there are placed again, on a spare or a free GPU elsewhere); a hang
  with no culprit sets nothing aside (the stacks may name one: run/recover.py); where the
  evidence is a GPU's (the host answers and the task held GPUs), only those GPUs are set
  aside, or of them the ones a fatal health mark names (`aside_of`), and the replica may
  go to the same host's other free GPUs;
- a recovery under way (the state records it, stopping or placing) is finished first,
  whoever looks: the next leader of a service killed in the middle, or the owner's apply;
- at most `recovery.max` recoveries within `recovery.window`; a job that fails the same
  way twice in a row on different hosts (its own bug, not its hosts') is not recovered
  again, and the host set aside for the first one is given back;
- a set-aside host that answers again and runs the job's tasks there is stopped there at
  once (a frozen host's tasks wake with it): the job never runs twice;
- an elastic job (a pool's `elastic:`) whose lost hosts held only elastic workers goes on
  at its smaller size (torchrun's); once such a host has not answered for LOST_S while the
  job runs on, its workers are placed again (a spare, a free GPU elsewhere) and started
  there alone: a scale-up, the running tasks left as they are.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

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
from provision.core.model import Inventory
from provision.core.recovery import Broke, Gpus, Incident, RecoveryRecord, RecoverySpec, Stage, goodput
from provision.host import layout
from provision.rules.health import HostHealth, Mark
from provision.rules.progress import ProgressView, Stall, bound, learnt, stalled
from provision.rules.progress import Seen as ProgressSeen
from provision.rules.rounds import JobWatch, Round
from provision.rules.status import JobStatus
from provision.rules.tenancy import Hold


@dataclass(frozen=True)
class TaskFact:
    task: str
    role: str
    host: str
    state: TaskState
    detail: str = ""
    ended_at: float | None = None  # this machine's clock: when its last run ended


@dataclass(frozen=True)
class Facts:
    """A job as one look saw it: its tasks (on the hosts that answered), the hosts of its
    placement that did not (host -> since when, when known), whether it stopped
    progressing, and the hosts set aside for it that run some of it again."""

    job: str
    tasks: tuple[TaskFact, ...]
    away: Mapping[str, float | None] = field(default_factory=dict)
    stall: Stall | None = None
    run: int | None = None
    aside_live: tuple[str, ...] = ()
    succeeded: bool = False  # the job's success policy holds: nothing to recover
    stopped: bool = False  # ended on request (`provision stop`, a preemption): nothing to recover
    checkpoint: float | None = None  # its newest checkpoint (this machine's clock)
    # host -> a fatal health mark there on the job's GPUs or the host (health_notes)
    health: Mapping[str, str] = field(default_factory=dict)
    started: float | None = None  # when its run started (this machine's clock, near enough)
    elastic: str = ""  # the job's elastic pool (its role), if it has one


# A host of an elastic job not answering for this long (two rounds, and the trainer's
# collectives' usual timeout) is lost, not blinking: its workers are placed again.
LOST_S = 20.0


class Do(StrEnum):
    NONE = "none"  # it runs (or ended well, or was stopped): nothing to do
    WAIT = "wait"  # a host does not answer but nothing says the job broke: look again
    RECOVER = "recover"  # a new incident: stop it everywhere, set the culprit aside, run again
    FINISH = "finish"  # a recovery under way: go on with it
    GIVE_UP = "give up"  # broke, but it is not recovered (why)
    REPORT = "report"  # broke (a hang), and the job has no `recovery:`: said, not acted on
    STOP_THERE = "stop there"  # a set-aside host runs some of the job again: stop it there
    CLOSE = "close"  # the recovery's new run runs (an apply got there): the incident is done
    SCALE_UP = "scale up"  # an elastic job's lost workers placed again and started alone


@dataclass(frozen=True)
class Verdict:
    do: Do
    incident: Incident | None = None
    words: str = ""
    give_back: tuple[str, ...] = ()  # hosts set aside before that are given back (its own bug)
    hosts: tuple[str, ...] = ()  # STOP_THERE: where; SCALE_UP: the lost hosts
    tasks: tuple[str, ...] = ()  # SCALE_UP: the workers placed again


def clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "?"


def health_notes(job: str, hosts: Iterable[str], healths: Mapping[str, HostHealth]) -> dict[str, str]:
    """host -> its fatal health mark, in a few words: a GPU quarantined while the job held
    it, or the host drained or quarantined ("GPU 5 of gpu-3 quarantined at 14:01: Xid 79").
    A mark this job's own recovery set is not news."""
    out: dict[str, str] = {}
    for host in sorted(set(hosts)):
        h = healths.get(host)
        if h is None:
            continue
        marks: list[tuple[int | None, Mark]] = [(None, h.host)] if h.host is not None and h.host.state.blocks else []
        marks += [(g, m) for g, m in h.gpus.items() if m.state.blocks and m.job == job]
        for g, m in marks:
            if m is not None and not m.by.startswith("provision recovery of "):
                what = f"GPU {g} of {host}" if g is not None else host
                out[host] = f"{what} {m.state.value} at {clock(m.since)}: {m.reason}"[:200]
                break
    return out


def broken(f: Facts) -> Incident | None:
    """How the run broke, from the evidence (module docstring), as an incident not yet
    numbered (n 0); None when nothing says it broke."""
    if f.succeeded or f.stopped:
        return None
    live = [t for t in f.tasks if t.state.live]
    # A task that ended on a host with a fatal health mark comes first: the likeliest cause.
    failed = sorted(
        (t for t in f.tasks if t.state is TaskState.FAILED or (t.state is TaskState.RESTARTING and t.ended_at)),
        key=lambda t: (t.host not in f.health, t.ended_at if t.ended_at is not None else float("inf"), t.task),
    )
    if not failed and (f.stall is None or not live):
        return None
    at = failed[0].ended_at if failed else f.stall.since if f.stall is not None else None
    if f.away:
        host = sorted(f.away)[0]
        task = _first_task_on(f, host)
        since = f.away[host]
        when = f" at {clock(since)}" if since is not None else ""
        words = f"{task}'s host {host} stopped answering{when}" if task else f"host {host} stopped answering{when}"
        words += _noted(f, host)
        return Incident(
            0, Broke.HOST, task, host, words, "host", f.run, since or at, checkpoint=f.checkpoint, started=f.started
        )
    if failed:
        t = failed[0]
        words = f"{t.task} on {t.host} failed first ({t.detail or 'failed'}), at {clock(t.ended_at)}{_noted(f, t.host)}"
        return Incident(
            0,
            Broke.FAILED,
            t.task,
            t.host,
            words,
            f"failed:{t.detail}",
            f.run,
            at,
            checkpoint=f.checkpoint,
            started=f.started,
        )
    assert f.stall is not None
    sick = sorted(h for h in f.health if any(t.host == h for t in f.tasks))
    host = sick[0] if sick else ""  # a hang on a host with a fatal mark: that host's
    words = f"hung: {f.stall.words()}{_noted(f, host)}"
    return Incident(0, Broke.HUNG, "", host, words, "hung", f.run, at, checkpoint=f.checkpoint, started=f.started)


def _noted(f: Facts, host: str) -> str:
    """The health mark of `host`, else of any host of the job, after the words."""
    note = f.health.get(host) or next(iter(f.health.values()), "")
    return f"; {note}" if note else ""


def _first_task_on(f: Facts, host: str) -> str:
    return next((t.task for t in sorted(f.tasks, key=lambda t: t.task) if t.host == host), "")


def decide(
    spec: RecoverySpec | None, record: RecoveryRecord, f: Facts, now: float, tasks_on: Mapping[str, str] | None = None
) -> Verdict:
    """What to do about the job now. `tasks_on`: task -> host as placed (to name the task
    of a host that does not answer, whose tasks no look reports)."""
    if f.aside_live:
        return Verdict(Do.STOP_THERE, words=f"{', '.join(f.aside_live)} runs the job again", hosts=f.aside_live)
    opened = record.open
    live = any(t.state.live for t in f.tasks)
    if opened is not None and opened.stage is Stage.PLACING and _newer(f.run, opened.run) and live:
        return Verdict(Do.CLOSE, opened, opened.words)
    if opened is not None:
        return Verdict(Do.FINISH, opened, opened.words)
    if tasks_on is not None:
        f = _with_away_tasks(f, tasks_on)
    inc = broken(f)
    if inc is None:
        return scale_up(f, tasks_on or {}, now) or Verdict(Do.WAIT if f.away else Do.NONE)
    if spec is None:
        return Verdict(Do.REPORT, inc, inc.words)
    last = record.incidents[-1] if record.incidents else None
    if last is not None and last.run is not None and inc.run is not None and inc.run <= last.run:
        # The run the last incident ended: it is that one (a look before its stop was seen).
        return Verdict(Do.NONE) if last.stage is not Stage.GAVE_UP else Verdict(Do.NONE, last, last.words)
    inc = replace(inc, n=record.next_number(), detected=now, aside=(inc.host,) if inc.host else ())
    recent = [i for i in record.incidents if i.detected is not None and i.detected >= now - spec.window_s]
    if len([i for i in recent if i.stage is not Stage.GAVE_UP]) >= spec.max:
        why = f"recovered {len(recent)} times within {_span(spec.window_s)} already (recovery.max {spec.max})"
        return Verdict(Do.GIVE_UP, _gave_up(inc, why), f"{inc.words}; not recovered: {why}")
    if last is not None and _same_way(last, inc):
        why = f"it failed the same way on {last.host} and {inc.host} ({_how(inc)}): the job's own bug, not its hosts'"
        return Verdict(Do.GIVE_UP, _gave_up(inc, why), f"{inc.words}; not recovered: {why}", give_back=last.aside)
    return Verdict(Do.RECOVER, inc, inc.words)


def scale_up(f: Facts, tasks_on: Mapping[str, str], now: float) -> Verdict | None:
    """SCALE_UP when the job is elastic, runs on (a live task, nothing failed: `decide`
    asks only then), and hosts of it holding only its elastic workers have not answered
    for LOST_S: those workers are placed again; else None."""
    if not f.elastic or f.succeeded or f.stopped or not any(t.state.live for t in f.tasks):
        return None
    lost: list[str] = []
    for host, since in sorted(f.away.items()):
        on = [t for t, h in tasks_on.items() if h == host]
        if since is not None and now - since >= LOST_S and on and all(t.rsplit("-", 1)[0] == f.elastic for t in on):
            lost.append(host)
    if not lost:
        return None
    tasks = tuple(sorted(t for t, h in tasks_on.items() if h in lost))
    first = {h: min(t for t, x in tasks_on.items() if x == h) for h in lost}
    words = "; ".join(f"{first[h]}'s host {h} stopped answering at {clock(f.away[h])}" for h in lost)
    return Verdict(Do.SCALE_UP, words=words, hosts=tuple(lost), tasks=tasks)


def _newer(run: int | None, than: int | None) -> bool:
    return run is not None and (than is None or run > than)


def _with_away_tasks(f: Facts, tasks_on: Mapping[str, str]) -> Facts:
    """The facts with the tasks of hosts that do not answer named (as UNKNOWN)."""
    seen = {t.task for t in f.tasks}
    more = tuple(
        TaskFact(task, task.rsplit("-", 1)[0], host, TaskState.UNKNOWN)
        for task, host in sorted(tasks_on.items())
        if host in f.away and task not in seen
    )
    return replace(f, tasks=f.tasks + more) if more else f


def _same_way(a: Incident, b: Incident) -> bool:
    """Two failures of the job's own, on different hosts: a task failing with the same words,
    or a hang, twice in a row (a host lost twice is its hardware's)."""
    return (
        a.broke is b.broke
        and a.broke is not Broke.HOST
        and a.signature == b.signature
        and a.host != b.host
        and a.stage is not Stage.GAVE_UP
    )


def _how(i: Incident) -> str:
    return i.signature.partition(":")[2] or i.broke.value


def _gave_up(i: Incident, why: str) -> Incident:
    return replace(i, stage=Stage.GAVE_UP, why=why, aside=())


def _span(s: int) -> str:
    if s % 3600 == 0:
        return f"{s // 3600} h"
    if s % 60 == 0:
        return f"{s // 60} min"
    return f"{s} s"


def aside_of(
    inc: Incident,
    held: Mapping[str, Sequence[int]],
    answers: Collection[str],
    sick: Mapping[str, Sequence[int | None]] | None = None,
) -> tuple[tuple[str, ...], Gpus]:
    """What of each host of `inc.aside` is set aside for the job: the whole host, or only
    some of its GPUs where the evidence is a GPU's: the host answers (`answers`) and the
    job's tasks that broke there held GPUs (`held`: host -> their GPUs); then those GPUs,
    or of them only the ones a fatal health mark names (`sick`: host -> the GPUs marked,
    None for the host itself, which sets the host aside whole). A host that does not
    answer, a task that held no GPU: the whole host. (whole hosts, host -> GPUs)."""
    whole: list[str] = []
    part: list[tuple[str, tuple[int, ...]]] = []
    for host in inc.aside:
        gpus = tuple(sorted(set(held.get(host, ()))))
        marked = tuple((sick or {}).get(host, ()))
        if host not in answers or (inc.broke is Broke.HOST and host == inc.host) or not gpus or None in marked:
            whole.append(host)
            continue
        named = tuple(g for g in gpus if g in marked)
        part.append((host, named or gpus))
    return tuple(sorted(whole)), tuple(sorted(part))


def sick_of(h: HostHealth) -> tuple[int | None, ...]:
    """What a fatal health mark names on a host: its GPUs marked, None for the host itself."""
    host: tuple[int | None, ...] = (None,) if h.host is not None and h.host.state.blocks else ()
    return host + tuple(sorted(g for g, m in h.gpus.items() if m.state.blocks))


def stacks_culprits(states: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The hosts whose task processes a hang's look found stopped (T: SIGSTOP, a debugger)
    or in uninterruptible sleep (D: a device that does not answer): `states` host -> each
    task process's state letter there."""
    return tuple(sorted(h for h, letters in states.items() if any(s in ("T", "t", "D") for s in letters)))


# --------------------------------------------------------------------------- a job's status


def facts_of_status(
    st: JobStatus, seen: ProgressSeen | None, stall: Stall | None, healths: Mapping[str, HostHealth] | None = None
) -> Facts:
    """The facts of one look at the job (its status): the hosts that did not answer are
    away (since when is not known from one look); `healths`: the health records of the
    hosts that answered."""
    tasks = tuple(
        TaskFact(t.task, t.role, t.host, t.state, t.detail, t.ended_at)
        for t in st.tasks
        if t.state is not TaskState.UNKNOWN
    )
    away = {t.host: None for t in st.tasks if t.state is TaskState.UNKNOWN}
    return Facts(
        st.job,
        tasks,
        away,
        stall,
        st.run.number if st.run is not None else None,
        succeeded=st.phase is JobPhase.SUCCEEDED,
        stopped=st.phase in (JobPhase.STOPPED, JobPhase.PREEMPTED),
        checkpoint=seen.checkpoint if seen is not None else None,
        health=health_notes(st.job, {t.host for t in st.tasks}, healths or {}),
        started=st.run.started_at if st.run is not None else None,
    )


def stall_of(
    inv: Inventory, st: JobStatus, seen: ProgressSeen | None, now: float, learnt: float | None = None
) -> Stall | None:
    """One look's judgement of a live job's progress (`auto`: nothing learnt in one look,
    so what the service learnt, `learnt`, else AUTO_START_S)."""
    if inv.progress is None or not any(t.state.live for t in st.tasks):
        return None
    started = st.run.started_at if st.run is not None else None
    return stalled(inv.progress, (), seen.latest if seen is not None else None, started, now, learnt)


def judged(
    inv: Inventory,
    st: JobStatus,
    seen: ProgressSeen | None,
    record: RecoveryRecord,
    now: float,
    healths: Mapping[str, HostHealth] | None = None,
) -> JobStatus:
    """The status with its progress, where it broke (one line) and its recoveries (the
    state's record), for `status`, `--json` and the job's page."""
    view, stall = None, stall_of(inv, st, seen, now, record.learnt)
    if inv.progress is not None:
        last = seen.latest if seen is not None else None
        ck = seen.checkpoint if seen is not None else None
        b = bound(inv.progress, (), record.learnt)
        view = ProgressView(last, ck, b, inv.progress.auto, stall is not None, record.learnt is not None)
    v = decide(inv.recovery, record, facts_of_status(st, seen, stall, healths), now)
    broke = v.words if v.do is not Do.NONE or v.incident is not None else ""
    if st.phase is JobPhase.RECOVERING and record.open is not None:
        broke = record.open.words
    started = st.run.started_at if st.run is not None else None
    return replace(
        st,
        progress=view,
        broke=broke,
        recovery=record if record.incidents or record.aside else None,
        goodput=goodput(record, started, now),
    )


# --------------------------------------------------------------------------- the service's rounds


@dataclass(frozen=True)
class Memory:
    """What the service's rounds learnt of a watched job between two rounds: its latest sign
    of progress, the intervals between signs (`auto` learns its bound from them), since
    which round each host of it has not answered, and its newest checkpoint seen."""

    latest: float | None = None
    intervals: tuple[float, ...] = ()
    away: Mapping[str, float] = field(default_factory=dict)
    # Not one round's: the saving host gone, a round sees only the others' checkpoint
    # directories, which the saving rank never wrote (their mtimes are the run's start).
    checkpoint: float | None = None


def remember(m: Memory, w: JobWatch, r: Round) -> Memory:
    """The memory after round `r`."""
    latest = w.seen.latest
    intervals = learnt(m.intervals, m.latest, latest)
    hosts = set(w.tasks.values())
    away = {h: m.away.get(h, r.began) for h in hosts if h in r.hosts and not r.hosts[h].answered}
    return Memory(latest if latest is not None else m.latest, intervals, away, _newest(m.checkpoint, w.seen.checkpoint))


def facts_of_round(job: str, w: JobWatch, r: Round, m: Memory) -> Facts:
    """The job as round `r` saw it (its tasks on the hosts that answered, judged as status
    judges them), with what the rounds remember (`m`: remember's after this round)."""
    tasks, runs, starts, markers = [], [], [], []
    for task, host in sorted(w.tasks.items()):
        hs = r.hosts.get(host)
        if hs is None or not hs.answered:
            continue
        unit = layout.unit_name(job, task)
        marker = hs.marker_of(job)
        got = task_state(hs.units.get(unit), hs.exits_of(job, unit), marker)
        exits = hs.exits_of(job, unit) or []
        ended = _num(exits[-1][0]) if exits and exits[-1] else None
        tasks.append(TaskFact(task, task.rsplit("-", 1)[0], host, got.state, got.detail, ended))
        runs += [n for n in [hs.run_of(job)] if n is not None]
        starts += [t for t in [hs.run_started(job)] if t is not None]
        markers += [marker] if marker is not None else []
    rows = [TaskRow(t.task, t.role, t.host, t.state, t.detail, t.ended_at) for t in tasks]
    phase, _ = job_phase(r.success.get(job, "chief"), rows) if rows else (JobPhase.UNKNOWN, "")
    stopped = any(mk.get("phase") in (STOP_PHASE, PREEMPT_PHASE) and not recovering(mk) for mk in markers)
    live = any(t.state.live for t in tasks)
    stall = None
    if w.progress is not None and live:
        stall = stalled(w.progress, m.intervals, m.latest, max(starts) if starts else None, r.began)
    aside_live = tuple(
        sorted(
            h
            for h in w.aside
            if h in r.hosts
            and r.hosts[h].answered
            and any(x.job == job and x.hold is Hold.RUNNING for x in r.hosts[h].view.holders)
        )
    )
    healths = {h: hs.health for h, hs in r.hosts.items() if hs.answered}
    return Facts(
        job, tuple(tasks), dict(m.away), stall, max(runs) if runs else None, aside_live,
        succeeded=phase is JobPhase.SUCCEEDED, stopped=stopped, checkpoint=m.checkpoint,
        health=health_notes(job, set(w.tasks.values()), healths), started=max(starts) if starts else None,
        elastic=w.elastic,
    )  # fmt: skip


def _newest(*at: float | None) -> float | None:
    return max((a for a in at if a is not None), default=None)


def troubled(f: Facts, recovering_now: bool, tasks_on: Mapping[str, str] | None = None, now: float = 0.0) -> bool:
    """Is there anything for the service to look at closer (the job's state is read only
    then): evidence it broke, a set-aside host running it, a recovery under way, or an
    elastic job's lost workers to place again."""
    if recovering_now or bool(f.aside_live) or broken(f) is not None:
        return True
    return tasks_on is not None and scale_up(f, tasks_on, now) is not None


def _num(v: object) -> float | None:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def awaits(inv: Inventory, st: JobStatus, record: RecoveryRecord) -> bool:
    """Is a run that ended badly (Failed, or a host lost: Unknown) to be recovered rather
    than ended: the job has `recovery:` and no recovery of this run was given up. Status
    and the service's worker leave it then (no end marker, no submission done)."""
    if inv.recovery is None or st.phase not in (JobPhase.FAILED, JobPhase.UNKNOWN, JobPhase.RECOVERING):
        return False
    last = record.incidents[-1] if record.incidents else None
    run = st.run.number if st.run is not None else None
    return not (last is not None and last.stage is Stage.GAVE_UP and last.run == run)
