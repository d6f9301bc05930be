"""Shared hosts: who holds what on each host, judged from the ledger the host reports.

The host keeps one ledger entry per job (host/ledger.py); the probe brings them back with
the states of the units each names and the ports something listens on. The rules, in one
place:
- an entry HOLDS its GPUs and ports while any unit of it is active or waiting to restart
  (RUNNING), or while it was reserved and not started yet by an apply still under way
  (RESERVED);
- an entry whose units have all ended (the job Succeeded, Failed or was stopped) holds
  nothing any more (ENDED): finished jobs release what they held; destroy removes the entry;
- unless `provision stop --hold` kept it (HELD): the stopped job keeps its GPUs and ports
  for its rerun, until that apply or destroy replaces the entry;
- a reservation never started whose apply is gone (its process is dead, when it ran on this
  machine, or STALE_AFTER passed) is STALE: shown, and reclaimable;
- a listening port that no provision job holds belongs to someone else (a notebook, a
  leftover server): it is held too;
- the job's own entry names its owner: a different state (lineage) may not change the job
  without --take-over, unless it is the same state file recreated on the same machine, or
  the same shared backend (a team's database: everyone who uses it reads the same lineage).
"""

from __future__ import annotations

import calendar
import functools
import getpass
import os
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from provision.core.devsession import DevTerms
from provision.core.scheduling import PreemptMark
from provision.core.text import duration, printable
from provision.host import layout
from provision.host.protocol import ProbeReport, Reservation
from provision.placement.tasks import Held, PlacedTask
from provision.rules.health import HostHealth, blocked_words, of_report
from provision.rules.health import summary as health_summary
from provision.rules.jobsdoc import JOBS_FORMAT_VERSION, DevJson, HostJson, JobJson, JobsDoc
from provision.rules.liveness import process_alive
from provision.rules.priority import DEFAULT_CLASSES, Policy, name_of, queue_key

STALE_AFTER = float(os.environ.get("PROVISION_STALE_AFTER", 600))  # seconds
# Listeners below this (sshd, DNS...) are the host's own services: held, but not worth a
# line in messages; provision's ports are 1024 and up unless an inventory says otherwise.
SHOWN_PORTS = 1024
NORMAL = DEFAULT_CLASSES["normal"]  # the level of an entry that names none


class Hold(StrEnum):
    RUNNING = "running"
    RESERVED = "reserved"
    STALE = "stale"
    HELD = "held"  # stopped with --hold
    QUEUED = "queued"  # an `apply --queue` waits for room: holds nothing yet
    # Preempted, its units ended: its GPUs wait for the preemptor (held for every other job)
    # until the preemptor's reserve takes them, or the preemptor is gone.
    PREEMPTED = "preempted"
    ENDED = "ended"

    @property
    def holds(self) -> bool:
        return self in (Hold.RUNNING, Hold.RESERVED, Hold.HELD, Hold.PREEMPTED)


@dataclass(frozen=True)
class Owner:
    lineage: str
    who: str  # user@machine
    host: str  # the controller's hostname
    pid: int
    state: str  # the state file's absolute path

    @classmethod
    def here(cls, lineage: str, state: Path | str) -> Owner:
        """This run's owner. state: the state file (a path), or a shared backend's URL."""
        host = socket.gethostname()
        ref = state if isinstance(state, str) and "://" in state else str(Path(state).resolve())
        return cls(lineage, identity(host), host, os.getpid(), ref)

    def to_json(self) -> dict[str, Any]:
        return {"lineage": self.lineage, "who": self.who, "host": self.host, "pid": self.pid, "state": self.state}

    @classmethod
    def from_json(cls, d: Any) -> Owner | None:
        if not isinstance(d, dict) or not isinstance(d.get("lineage"), str):
            return None
        pid = d.get("pid")
        return cls(
            d["lineage"],
            str(d.get("who", "?")),
            str(d.get("host", "")),
            pid if isinstance(pid, int) else 0,
            str(d.get("state", "")),
        )


@functools.lru_cache(maxsize=1)
def identity(host: str) -> str:
    """Who applies, as teammates recognise them: PROVISION_OWNER, else git's user.email
    (what their commits say), else user@host (`root@vm` says little: set one of the others)."""
    named = os.environ.get("PROVISION_OWNER", "").strip()
    if named:
        return named
    try:
        # A start-up cost only of commands that reach hosts (~2 ms): git knows its config rules.
        out = subprocess.run(["git", "config", "user.email"], capture_output=True, text=True, timeout=5)
        email = out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        email = ""
    if email and "\n" not in email:
        return email
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{host}"


MAX_OWNER = 200  # characters: an email address, a user@host, a team's name


def owner_name_problem(name: str) -> str | None:
    """Why `name` cannot be an owner (a token's, who acts on jobs), else None: one line of
    at most MAX_OWNER characters, no control characters (a newline would forge a row of
    `token list`, an escape sequence rewrite a teammate's terminal)."""
    if not name:
        return "expected a name (as teammates know them, e.g. ann@example.com), got an empty one"
    if printable(name) != name:
        return f"a name has no control characters (newlines, escapes, ...), got '{printable(name)[:60]}'"
    if len(name) > MAX_OWNER:
        return f"at most {MAX_OWNER} characters, got {len(name)}"
    return None


@dataclass(frozen=True)
class Holder:
    """One job's entry in one host's ledger, judged."""

    host: str
    job: str
    owner: Owner | None
    gpus: tuple[int, ...]
    ports: tuple[int, ...]
    since: float | None
    hold: Hold
    token: str
    units: tuple[str, ...] = ()
    queued: tuple[float, str] | None = None  # an `apply --queue` waits: since (host clock), for what
    # The turn (entries written before priorities existed: normal, not preemptible, submitted at `since`).
    priority: int = NORMAL
    preemptible: bool = False
    submitted: float | None = None  # the controller's clock (the submitter's)
    queued_gpus: int = 1  # a queued apply's largest task's GPUs here (marks before it: 1)
    preempted_by: str = ""  # the job that preempted it (its entry's mark)
    dev: DevTerms | None = None  # a dev session's terms (`provision dev`)

    @property
    def who(self) -> str:
        return self.owner.who if self.owner else "unknown owner"

    def holds_for(self, job: str) -> bool:
        """Does this entry keep `job` off its GPUs and ports? A preempted entry's are the
        preemptor's; they are held for the preempted job itself too."""
        if self.hold is Hold.PREEMPTED:
            return self.preempted_by != job
        return self.job != job and self.hold.holds

    def describe(self, now: float) -> str:
        """e.g. 'GPUs 0-1, port 2222 held by job bert (alice@ws-3, running 2h)'."""
        what = ", ".join(x for x in (_gpus_words(self.gpus), _ports_words(self.ports)) if x) or "nothing"
        if self.hold is Hold.PREEMPTED:
            return f"{what} reserved for job {self.preempted_by}, which preempted job {self.job} ({self.who})"
        age = f" {duration(int(max(0, now - self.since)))}" if self.since else ""
        verb = "held" if self.hold.holds else "was held"
        return f"{what} {verb} by job {self.job} ({self.who}, {self.hold.value}{age})"


def _span(xs: Iterable[int]) -> str:
    """0,1,2,5 → '0-2, 5'."""
    xs = sorted(set(xs))
    out: list[str] = []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _gpus_words(g: Iterable[int]) -> str:
    g = tuple(g)
    return f"GPU{'s' if len(g) != 1 else ''} {_span(g)}" if g else ""


def _ports_words(p: Iterable[int]) -> str:
    p = tuple(p)
    return f"port{'s' if len(p) != 1 else ''} {_span(p)}" if p else ""


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(sorted(x for x in v if isinstance(x, int))) if isinstance(v, list) else ()


def judge(entry: dict[str, Any], units: Mapping[str, Mapping[str, str]], now: float) -> Hold:
    """The hold rule (module docstring) for one entry, given its units' states."""
    mine = [units.get(u, {}) for u in entry.get("units") or []]
    if any(
        st.get("ActiveState") in ("active", "activating", "deactivating", "reloading")
        or st.get("SubState") == "auto-restart"
        for st in mine
    ):
        return Hold.RUNNING
    mark = PreemptMark.of_entry(entry)
    if mark is not None and mark.follows:
        return Hold.ENDED  # stopped by its own side, preempted elsewhere: its GPUs wait for nobody
    if mark is not None:
        # Its GPUs wait for the preemptor while the preemptor lives (its pid here, else its
        # last renewal of the mark), so a preemptor killed on the way gives them back.
        alive = process_alive(mark.host, mark.pid, mark.updated, now, STALE_AFTER)
        return Hold.PREEMPTED if alive and (entry.get("gpus") or entry.get("ports")) else Hold.ENDED
    if entry.get("held"):
        return Hold.HELD
    if entry.get("started"):
        return Hold.ENDED
    waiting = Hold.QUEUED if entry.get("queued") and not entry.get("gpus") else Hold.RESERVED
    owner = Owner.from_json(entry.get("owner"))
    updated = entry.get("updated")
    # The apply that reserved it: its pid on this machine, else its last word on the host's clock.
    alive = process_alive(
        owner.host if owner else "",
        owner.pid if owner else None,
        float(updated) if isinstance(updated, (int, float)) else None,
        now,
        STALE_AFTER,
    )
    return waiting if alive else Hold.STALE


def holders(host: str, report: ProbeReport, now: float | None = None) -> list[Holder]:
    """Every job's entry in host's ledger (the report must come from a tenancy probe).
    Ages are judged on the host's clock when the report has it (the entries' times are the
    host's): a host clock behind or ahead of the controller's does not make an entry look
    stale or fresh."""
    now = time.time() if now is None else now
    host_now = report.now if report.now is not None else now
    skew = host_now - now  # shown times are moved to the controller's clock
    units = {**(report.ledger_units or {}), **report.units}  # other jobs' units, and this job's
    out = []
    for job, e in sorted((report.ledger or {}).items()):
        if not isinstance(e, dict) or "_unreadable" in e:
            continue
        since = e.get("since")
        since = min(since, host_now) - skew if isinstance(since, (int, float)) else None  # never in the future
        out.append(
            Holder(
                host,
                job,
                Owner.from_json(e.get("owner")),
                _ints(e.get("gpus")),
                _ints(e.get("ports")),
                since,
                judge(e, units, host_now),
                str(e.get("token", "")),
                tuple(u for u in e.get("units") or [] if isinstance(u, str)),
                _queued(e.get("queued"), host_now, skew),
                *_turn(e, since),
                _queued_gpus(e.get("queued")),
                _preempted_by(PreemptMark.of_entry(e)),
                DevTerms.parse(e.get("dev")),
            )
        )
    return out


def _queued_gpus(q: Any) -> int:
    n = q.get("gpus") if isinstance(q, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 1


def _turn(e: dict[str, Any], since: float | None) -> tuple[int, bool, float | None]:
    """An entry's priority, preemptible and submitted (older entries have none of them)."""
    p, sub = e.get("priority"), e.get("submitted")
    return (
        p if isinstance(p, int) and not isinstance(p, bool) else NORMAL,
        e.get("preemptible") is True,
        float(sub) if isinstance(sub, (int, float)) and not isinstance(sub, bool) else since,
    )


def _preempted_by(mark: PreemptMark | None) -> str:
    return mark.by if mark is not None else ""


def _queued(q: Any, host_now: float, skew: float) -> tuple[float, str] | None:
    if not isinstance(q, dict) or not isinstance(q.get("since"), (int, float)):
        return None
    return min(q["since"], host_now) - skew, str(q.get("waiting_for") or "room")


def unreadable_entries(report: ProbeReport, but: str = "") -> list[str]:
    """Ledger entries (other than job `but`'s) that are not a readable entry, as
    'PATH (why)': what they hold is unknown, so they are taken to hold anything."""
    out = []
    for job, e in sorted((report.ledger or {}).items()):
        if job != but and (not isinstance(e, dict) or "_unreadable" in e):
            why = e.get("_unreadable") if isinstance(e, dict) else "not an object"
            out.append(f"{layout.ledger_path(job)} ({why})")
    return out


def unreadable_problem(entries: list[str]) -> str:
    return (
        f"ledger entry {entries[0]} cannot be read: it may hold any GPU or port here, so nothing is "
        "placed on this host until it is fixed or removed (provision jobs lists it)"
        + (f"; {len(entries) - 1} more" if len(entries) > 1 else "")
    )


def held_for(
    job: str,
    hs: list[Holder],
    listening: Iterable[int],
    now: float,
    local: Iterable[int] = (),
    health: HostHealth | None = None,
) -> Held:
    """What placement of `job` may not use on a host: what other jobs hold, and ports that
    something other than provision's jobs listens on (`local`: those only on loopback, the
    host's own services: avoided, not named as holders), and what the host's health keeps
    from new work (rules/health.py: a quarantined GPU; a draining host takes no new task,
    the job's own tasks that run there keep their slots)."""
    gpus: set[int] = set()
    ports: set[int] = set()
    by = []
    closed = ""
    if health is not None:
        gpus |= health.blocked
        by += blocked_words(health)
        if health.host is not None and health.host.state.blocks:
            closed = "new" if any(h.job == job and h.hold is Hold.RUNNING for h in hs) else "all"
    for h in hs:
        if not h.holds_for(job):
            continue
        gpus |= set(h.gpus)
        ports |= set(h.ports)
        by.append(h.describe(now))
    ours = {p for h in hs for p in h.ports}  # provision's tasks listen on their own ports
    foreign = set(listening) - ours
    shown = sorted(p for p in foreign - set(local) if p >= SHOWN_PORTS)
    if shown:
        by.append(f"{_ports_words(shown)} in use by processes provision did not start")
    return Held(frozenset(gpus), frozenset(ports | foreign), tuple(by), closed)


def owner_problem(job: str, own: Holder | None, me: Owner, take_over: bool) -> str | None:
    """Refuse to change a job another state applied (reading it is fine)."""
    if own is None or own.owner is None or own.owner.lineage == me.lineage or take_over:
        return None
    if own.owner.state == me.state and (own.owner.host == me.host or "://" in me.state):
        return None  # this very state file (or shared backend), recreated (lost, moved away): adopt
    return (
        f"job {job} here belongs to {own.owner.who} (another state: {own.owner.state or '?'}); "
        "nothing was changed. Run from that state, or add --take-over to make this state its owner"
    )


@dataclass(frozen=True)
class Turn:
    """A job's turn on a shared cluster as the ledger records it: its level
    (rules/priority.level with the team's policy), whether it may be preempted, and when it
    was submitted (None: at the reserve)."""

    priority: int = NORMAL
    preemptible: bool = False
    submitted: float | None = None
    dev: DevTerms | None = None  # a dev session's terms, written with its reservation


def reservation(
    job: str,
    tasks: list[PlacedTask],
    units: list[str],
    hs: list[Holder],
    me: Owner,
    gpu_uuids: Mapping[int, str],
    more_ports: Iterable[int] = (),
    turn: Turn | None = None,
) -> Reservation | None:
    """What to write in the host's ledger for job's tasks there (and `more_ports` the job
    listens on: a TPU job's JAX coordinator); None when it is there already (with the
    same turn)."""
    turn = turn or Turn()
    own = next((h for h in hs if h.job == job), None)
    gpus = sorted({a for t in tasks for a in t.accelerators})
    ports = sorted({t.port for t in tasks} | set(more_ports))
    if (
        own is not None
        and own.owner is not None
        and own.owner.lineage == me.lineage
        and list(own.gpus) == gpus
        and list(own.ports) == ports
        and sorted(own.units) == sorted(units)
        and (own.priority, own.preemptible) == (turn.priority, turn.preemptible)
        and (turn.dev is None or own.dev == turn.dev)
    ):
        return None
    return Reservation(
        job=job,
        owner=me.to_json(),
        gpus=gpus,
        gpu_uuids=[gpu_uuids.get(g, "") for g in gpus],
        ports=ports,
        units=sorted(units),
        # Its own entry too, when a preemption of it lapsed (ledger.conflicts).
        free={h.job: h.token for h in hs if not h.hold.holds or (h.job != job and not h.holds_for(job))},
        expect_lineage=own.owner.lineage if own is not None and own.owner is not None else None,
        priority=turn.priority,
        preemptible=turn.preemptible,
        submitted=turn.submitted,
        dev=turn.dev.to_json() if turn.dev is not None else None,
    )


def gpu_uuids(report: ProbeReport) -> dict[int, str]:
    gpus = (report.facts or {}).get("gpus") or []
    return {g["index"]: g.get("uuid", "") for g in gpus if isinstance(g, dict) and isinstance(g.get("index"), int)}


# --------------------------------------------------------------------------- `provision jobs`


@dataclass(frozen=True)
class HostView:
    name: str
    gpus: int  # how many the inventory declares
    holders: tuple[Holder, ...] = ()
    foreign_ports: tuple[int, ...] = ()
    error: str | None = None
    unreadable: tuple[str, ...] = ()  # ledger entries that cannot be read (unreadable_entries)
    health: HostHealth = HostHealth()  # what the host's health keeps from new work (rules/health.py)

    @property
    def free_gpus(self) -> list[int]:
        if self.unreadable or (self.health.host is not None and self.health.host.state.blocks):
            return []  # an entry that cannot be read may hold any of them; a draining host takes none
        taken = {g for h in self.holders if h.hold.holds for g in h.gpus} | self.health.blocked
        return [g for g in range(self.gpus) if g not in taken]


def job_hold(hs: Iterable[Holder]) -> Hold:
    """A job's state across hosts: running anywhere wins, then reserved, then stale."""
    holds = {h.hold for h in hs}
    for x in (Hold.RUNNING, Hold.RESERVED, Hold.HELD, Hold.QUEUED, Hold.STALE):
        if x in holds:
            return x
    return Hold.ENDED


def jobs_json(hosts: list[HostView], now: float, policy: Policy | None = None) -> JobsDoc:
    """`provision jobs --json`. Each job's "priority" is shown as the team's policy names it
    (its class, else the number as text), "priority_level" is the number."""
    policy = policy or Policy()
    by_job: dict[str, list[Holder]] = {}
    for hv in hosts:
        for h in hv.holders:
            by_job.setdefault(h.job, []).append(h)

    def iso(t: float | None) -> str | None:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if t is not None else None

    jobs: list[JobJson] = []
    for job, hs in sorted(by_job.items()):
        since = min((h.since for h in hs if h.since is not None), default=None)
        owner = next((h.owner for h in hs if h.owner is not None), None)
        queued = min((h.queued for h in hs if h.queued is not None), default=None)
        prio = max(h.priority for h in hs)
        submitted = min((h.submitted for h in hs if h.submitted is not None), default=None)
        dev = next((h.dev for h in hs if h.dev is not None), None)
        jobs.append(
            {
                "job": job,
                "owner": owner.who if owner else None,
                "lineage": owner.lineage if owner else None,
                "state": job_hold(hs).value,
                "since": iso(since),
                "age_seconds": int(now - since) if since is not None else None,
                "queued": {"since": iso(queued[0]), "waiting_for": queued[1]} if queued else None,
                "priority": name_of(prio, policy),
                "priority_level": prio,
                "preemptible": any(h.preemptible for h in hs),
                "submitted": iso(submitted),
                "dev": dev_json(dev, now) if dev is not None else None,
                "hosts": {
                    h.host: {
                        "state": h.hold.value,
                        "gpus": list(h.gpus),
                        "ports": list(h.ports),
                        "preempted_by": h.preempted_by or None,  # its entry there is marked
                    }
                    for h in hs
                },
            }
        )
    return {"format_version": JOBS_FORMAT_VERSION, "jobs": jobs, "hosts": {hv.name: _host_json(hv) for hv in hosts}}


def _host_json(hv: HostView) -> HostJson:
    return {
        "error": hv.error,
        "gpus": hv.gpus,
        "free_gpus": hv.free_gpus if hv.error is None else None,
        "held": {h.job: {"gpus": list(h.gpus), "ports": list(h.ports)} for h in hv.holders if h.hold.holds},
        "foreign_ports": list(hv.foreign_ports),
        "unreadable": list(hv.unreadable),
        "health": health_summary(hv.health, range(hv.gpus)),
    }


def dev_json(d: DevTerms, now: float) -> DevJson:
    """A dev session's terms as `provision jobs --json` and the dashboard show them."""
    return {
        "name": d.name,
        "user": d.user or None,
        "image": d.image or None,
        "until": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(d.until)),
        "left_seconds": max(0, int(d.until - now)),
        "idle_limit_seconds": d.idle_s,
        "idle_below_pct": d.idle_below,
    }


def jobs_lines(hosts: list[HostView], now: float, policy: Policy | None = None) -> list[list[list[str]]]:
    """Two tables (jobs, then hosts) as rows; the first row of each is its header."""
    data = jobs_json(hosts, now, policy)
    jobs = [["JOB", "OWNER", "STATE", "PRIORITY", "SINCE", "HOSTS"]]
    for j in data["jobs"]:
        age = duration(j["age_seconds"]) if j["age_seconds"] is not None else "-"
        state = j["state"] + (f" (dev session {d['name']})" if (d := j["dev"]) else "")
        jobs.append([j["job"], j["owner"] or "-", state, j["priority"], age, ", ".join(sorted(j["hosts"]))])
    rows = [["HOST", "GPUS", "FREE GPUS", "HELD (job: GPUs / ports)"]]
    for hv in hosts:
        if hv.error is not None:
            rows.append([hv.name, str(hv.gpus), "?", f"unreachable: {hv.error}"])
            continue
        held = [
            f"{h.job}: {_span(h.gpus) or '-'} / {_span(h.ports) or '-'}"
            + ("" if h.hold.holds else f" ({h.hold.value})")
            for h in hv.holders
            if h.hold is not Hold.QUEUED  # holds nothing: queued_lines says what it waits for
        ]
        if hv.foreign_ports:
            held.append(f"other processes: - / {_span(hv.foreign_ports)}")
        held += [f"unreadable ledger entry {x}: may hold anything" for x in hv.unreadable]
        held += blocked_words(hv.health)
        rows.append([hv.name, str(hv.gpus), _span(hv.free_gpus) or "-", "; ".join(held) or "-"])
    return [jobs, rows]


def queued_lines(hosts: list[HostView], now: float, policy: Policy | None = None) -> list[str]:
    """One line per queued apply, in the queue's order: who, its priority, since when, what
    it waits for."""
    out = []
    for j in sorted(jobs_json(hosts, now, policy)["jobs"], key=doc_queue_key):
        q = j["queued"]
        if q is not None:
            who = j["owner"] or "unknown owner"
            out.append(f"{j['job']} ({who}, priority {j['priority']}) is queued since {q['since']}: {q['waiting_for']}")
    return out


def doc_queue_key(j: Mapping[str, Any]) -> tuple[int, float, str]:
    """rules/priority.queue_key of a job as `provision jobs --json` shows it: its level, and
    when it was submitted (else since when it is queued)."""
    level = j.get("priority_level")
    when = j.get("submitted") or (j.get("queued") or {}).get("since") or ""
    try:
        submitted = float(calendar.timegm(time.strptime(str(when), "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        submitted = 0.0
    return queue_key(
        level if isinstance(level, int) and not isinstance(level, bool) else NORMAL, submitted, str(j.get("job"))
    )


def host_view(name: str, gpus: int, report: ProbeReport, now: float) -> HostView:
    hs = holders(name, report, now)
    ours = {p for h in hs for p in h.ports}
    local = set(report.listening_local or [])  # the host's own services (held_for)
    foreign = tuple(p for p in sorted(set(report.listening or []) - ours - local) if p >= SHOWN_PORTS)
    return HostView(
        name, gpus, tuple(hs), foreign, unreadable=tuple(unreadable_entries(report)), health=of_report(report)
    )
