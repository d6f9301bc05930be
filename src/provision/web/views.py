"""What the pages show, from the Source's JSON: the cluster's hosts grouped by label with each
GPU's holder, the jobs filtered and paginated in their sections, a study's trials sorted and
paginated. Pure."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from provision.core.events import iso
from provision.core.tuning import TrialJson
from provision.rules.historyview import KINDS as HISTORY_KINDS
from provision.rules.historyview import SHOWN_STATES, HistoryQuery
from provision.rules.jobsdoc import GpuAppJson, HostJson, JobJson, JobsDoc
from provision.rules.tenancy import doc_queue_key

ACTIONS = ("stop", "rerun", "cancel")
PAGE_SIZE = 50
# The states of `provision jobs --json` (rules/tenancy.Hold; "preempted": rules/jobrows.py),
# and where each is listed: a preempted job waits for room to resume.
SECTIONS = {
    "queued": ("queued", "preempted"),
    "running": ("running", "reserved", "held", "stale"),
    "finished": ("ended",),
}
LIVE = tuple(s for states in SECTIONS.values() for s in states)
# ... and how finished work ended (the history's: rules/historyview.STATES).
PHASES = LIVE + tuple(s for s in SHOWN_STATES if s not in LIVE)
SINCE = {"1h": 3600.0, "1d": 86400.0, "7d": 7 * 86400.0, "30d": 30 * 86400.0}  # the pages' "ended within"
KINDS = ("run", "trial", "study")  # the finished work the Jobs page lists (the History page: waits too)


class BadFilter(ValueError):
    """A malformed query parameter: 400, naming it."""


@dataclass(frozen=True)
class JobFilter:
    owner: str = ""
    phase: str = ""  # a live state (LIVE), or how finished work ended
    text: str = ""
    page: int = 1
    kind: str = ""  # finished work: run, trial or study
    since: str = ""  # finished work: ended within (SINCE)
    fpage: int = 1  # the Finished section's page

    def matches(self, j: JobJson) -> bool:
        if self.owner and j.get("owner") != self.owner:
            return False
        if self.phase and (j.get("state") != self.phase if self.phase in LIVE else True):
            return False
        if self.kind or self.since:
            return False  # those pick finished work only
        t = self.text.lower()
        return not t or t in j["job"].lower() or t in (j.get("owner") or "").lower()

    def finished(self, now: float, size: int) -> HistoryQuery | None:
        """The history rows the Finished section lists (None: a live state was picked)."""
        if self.phase in LIVE and self.phase != "ended":
            return None
        state = "" if self.phase in ("", "ended") else self.phase
        since = now - SINCE[self.since] if self.since else None
        kinds = (self.kind,) if self.kind else KINDS
        return HistoryQuery(
            self.owner, kinds, state, since, True, self.text, size, (self.fpage - 1) * size
        )  # fmt: skip

    def link(self, **changed: object) -> str:
        """This filter's query string with `changed` given."""
        fields: dict[str, object] = {"owner": self.owner, "phase": self.phase, "q": self.text, "kind": self.kind}
        fields.update({"since": self.since, "page": self.page, "fpage": self.fpage})
        fields.update({("q" if k == "text" else k): v for k, v in changed.items()})
        return urlencode({k: v for k, v in fields.items() if v not in ("", None)})


MAX_NUMBER = 999_999_999  # a page or trial number past this is no page or trial


def whole_number(raw: str, name: str) -> int:
    """A parameter's number from 1 to MAX_NUMBER; BadFilter naming it. ASCII digits only
    ('²' is a digit to str.isdigit, not to int), at most 9 of them (int refuses 4,300)."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(MAX_NUMBER)) or int(raw) < 1:
        shown = repr(raw[:20]) + ("..." if len(raw) > 20 else "")
        raise BadFilter(f"{name}: expected a number from 1 to {MAX_NUMBER}, got {shown}")
    return int(raw)


def page_number(q: Mapping[str, str]) -> int:
    return whole_number(q.get("page", "1") or "1", "page")


def job_filter(q: Mapping[str, str]) -> JobFilter:
    phase = q.get("phase", "")
    if phase and phase not in PHASES:
        raise BadFilter(f"phase: expected one of {', '.join(PHASES)}, got {phase[:40]!r}")
    kind, since = _choice(q, "kind", KINDS), _choice(q, "since", tuple(SINCE))
    fpage = whole_number(q.get("fpage", "1") or "1", "fpage")
    return JobFilter(q.get("owner", "")[:200], phase, q.get("q", "")[:200], page_number(q), kind, since, fpage)


def _choice(q: Mapping[str, str], name: str, allowed: Sequence[str]) -> str:
    got = q.get(name, "") or ""
    if got and got not in allowed:
        raise BadFilter(f"{name}: expected one of {', '.join(allowed)}, got {got[:40]!r}")
    return got


HISTORY_PAGE = 50  # rows a page of the History page (and the Jobs page's Finished section) lists


@dataclass(frozen=True)
class HistoryFilter:
    """The History page's filters: an owner's rows, of a kind, ended how, within a time, whose
    job's name holds a text; a page of HISTORY_PAGE."""

    owner: str = ""
    kind: str = ""
    state: str = ""
    since: str = ""
    text: str = ""
    page: int = 1

    def query(self, now: float) -> HistoryQuery:
        since = now - SINCE[self.since] if self.since else None
        kinds = (self.kind,) if self.kind else ()
        off = (self.page - 1) * HISTORY_PAGE
        return HistoryQuery(self.owner, kinds, self.state, since, False, self.text, HISTORY_PAGE, off)

    def link(self, **changed: object) -> str:
        fields: dict[str, object] = {"owner": self.owner, "kind": self.kind, "state": self.state}
        fields.update({"since": self.since, "q": self.text, "page": self.page})
        fields.update({("q" if k == "text" else k): v for k, v in changed.items()})
        return urlencode({k: v for k, v in fields.items() if v not in ("", None)})


def history_filter(q: Mapping[str, str]) -> HistoryFilter:
    states = (*SHOWN_STATES, "running", "waiting")
    return HistoryFilter(
        q.get("owner", "")[:200], _choice(q, "kind", HISTORY_KINDS), _choice(q, "state", states),
        _choice(q, "since", tuple(SINCE)), q.get("q", "")[:200], page_number(q),
    )  # fmt: skip


def sig(v: object, digits: int = 4) -> str:
    """A number as a page shows it: `digits` significant digits (0.0002029370528231493 ->
    0.0002029; 123456.7 -> 1.235e+05); integers whole; anything else as it is. The full
    value goes in the cell's tooltip and the JSON."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "" if v is None else str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def hours(h: float | None) -> str:
    """GPU-hours as a table shows them: one decimal, two significant digits below 0.1."""
    if h is None:
        return ""
    return f"{h:.1f}" if h >= 0.1 or h == 0 else f"{h:.2g}"


def took(seconds: float | None) -> str:
    """A duration in words a table holds: 45 s, 12 min, 3.5 h, 2.1 d."""
    if seconds is None:
        return ""
    s = float(seconds)
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    if s < 2 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def page_of(items: Sequence[Any], page: int, size: int = PAGE_SIZE) -> tuple[list[Any], int]:
    """The items of page `page` (from 1) and how many pages there are."""
    pages = max(1, -(-len(items) // size))
    return list(items[(page - 1) * size : page * size]), pages


def job_sections(jobs: Sequence[JobJson]) -> dict[str, list[JobJson]]:
    out: dict[str, list[JobJson]] = {k: [] for k in SECTIONS}
    for j in jobs:
        for section, states in SECTIONS.items():
            if j.get("state") in states:
                out[section].append(j)
    # Queued work in the queue's order: the higher priority first, then first come.
    out["queued"].sort(key=doc_queue_key)
    return out


@dataclass(frozen=True)
class Gpu:
    index: int
    state: str  # free, held, drained, unreachable, unknown; quarantined, draining, testing (its health)
    job: str | None = None
    owner: str | None = None
    utilization: float | None = None
    memory_mib: float | None = None
    history: tuple[tuple[float, float], ...] = ()  # (epoch seconds, utilization %), the last hour
    apps: tuple[str, ...] = ()  # its compute processes: "pid name, N MiB (job)"
    health: str = "healthy"  # rules/health.State: healthy, suspect, quarantined, draining, testing
    health_reason: str = ""  # why, and since when


@dataclass(frozen=True)
class HostRow:
    name: str
    error: str | None
    gpus: tuple[Gpu, ...]
    foreign_ports: tuple[int, ...]


def _gpus(h: HostJson, owners: Mapping[str, str | None]) -> tuple[Gpu, ...]:
    holder = {g: job for job, held in (h.get("held") or {}).items() for g in held.get("gpus", [])}
    free = set(h.get("free_gpus") or [])
    use = h.get("gpu_use") or {}
    past = h.get("gpu_history") or {}
    out = []
    for g in range(int(h.get("gpus") or 0)):
        u = use.get(str(g))
        job = holder.get(g)
        health, why = _health_of(h, g)
        if h.get("error"):
            state = "unreachable"
        elif job is not None:
            state = "held"
        elif h.get("drain"):
            state = "drained"
        elif health in BLOCKING:  # not free: no new work goes there
            state = health
        else:
            state = "free" if g in free else "unknown"
        history = tuple((float(t), float(v)) for t, v in past.get(str(g)) or ())
        owner = owners.get(job) if job else None
        apps = tuple(_app_words(a) for a in (u.get("apps") or () if u else ()))
        util, mib = (u.get("utilization"), u.get("memory_mib")) if u else (None, None)
        out.append(Gpu(g, state, job, owner, util, mib, history, apps, health, why))
    return tuple(out)


BLOCKING = ("quarantined", "draining", "testing")  # the health states no new work goes to


def _health_of(h: Mapping[str, Any], g: int) -> tuple[str, str]:
    """A GPU's health (its host's, when the host's keeps new work off it) and why."""
    health = h.get("health") or {}
    host = health.get("host") or {}
    mark = (health.get("gpus") or {}).get(str(g)) or {}
    if host.get("state") in BLOCKING and mark.get("state", "healthy") == "healthy":
        mark = {**host, "reason": f"the host: {host.get('reason') or ''}"}
    state = str(mark.get("state") or "healthy")
    since = mark.get("since")
    when = f" (since {iso(since)})" if isinstance(since, int | float) else ""
    return state, (str(mark.get("reason") or "") + when) if state != "healthy" else ""


def _app_words(a: GpuAppJson) -> str:
    mib = f", {a['used_mib']} MiB" if a.get("used_mib") is not None else ""
    whose = f" ({a['job']})" if a.get("job") else " (not a provision job)"
    return f"{a.get('pid') or '?'} {a.get('name') or ''}{mib}{whose}"


def _group_of(h: HostJson) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((h.get("labels") or {}).items())) or "no labels"


def _group_order(label: str) -> tuple[bool, str]:
    return (label == "no labels", label)


def cluster_groups(doc: JobsDoc) -> list[tuple[str, list[HostRow]]]:
    """The hosts of `provision jobs --json` grouped by their labels ("k=v, ..."), unlabelled last."""
    owners = {j["job"]: j.get("owner") for j in doc.get("jobs") or []}
    groups: dict[str, list[HostRow]] = {}
    for name, h in sorted((doc.get("hosts") or {}).items()):
        row = HostRow(name, h.get("error"), _gpus(h, owners), tuple(h.get("foreign_ports") or ()))
        groups.setdefault(_group_of(h), []).append(row)
    return sorted(groups.items(), key=lambda kv: _group_order(kv[0]))


HOSTS_PAGE = 32  # hosts (and their GPUs' rows) on a page of the Cluster page: 1,000 hosts x 8 GPUs were 8,000 rows


@dataclass(frozen=True)
class GroupSummary:
    """A label group of the whole cluster, as the Cluster page's first table counts it."""

    label: str
    hosts: int
    unreachable: int  # hosts
    gpus: int
    held: int
    free: int
    utilization: float | None  # the mean of its GPUs that report one, now
    page: int  # the page its first host is on


@dataclass(frozen=True)
class ClusterPage:
    groups: tuple[GroupSummary, ...]
    shown: list[tuple[str, list[HostRow]]]  # this page's hosts, by group
    sparks: dict[str, tuple[tuple[float, float], ...]]  # host -> its GPUs' mean utilization over the last hour
    page: int
    pages: int
    hosts: int


def host_spark(h: HostJson) -> tuple[tuple[float, float], ...]:
    """A host's GPUs' mean utilization over its history (the GPUs' points are of the same
    rounds: matched from the newest)."""
    series = [s for s in (h.get("gpu_history") or {}).values() if s]
    if not series:
        return ()
    n = min(len(s) for s in series)
    return tuple(
        (float(series[0][-n + k][0]), sum(float(s[-n + k][1]) for s in series) / len(series)) for k in range(n)
    )


def cluster_page(doc: JobsDoc, page: int, size: int = HOSTS_PAGE) -> ClusterPage:
    """The Cluster page: every label group counted, and page `page` of the hosts (by group,
    then name) with each GPU's row; only those rows are made."""
    hosts = doc.get("hosts") or {}
    order = sorted(hosts, key=lambda n: (*_group_order(_group_of(hosts[n])), n))
    counts: dict[str, list[Any]] = {}
    for i, name in enumerate(order):
        h = hosts[name]
        c = counts.setdefault(_group_of(h), [0, 0, 0, 0, 0, 0.0, 0, i // size + 1])
        n = int(h.get("gpus") or 0)
        c[0] += 1
        c[2] += n
        if h.get("error"):
            c[1] += 1
            continue
        c[3] += sum(len(held.get("gpus") or ()) for held in (h.get("held") or {}).values())
        c[4] += 0 if h.get("drain") else len(h.get("free_gpus") or ())
        for u in (h.get("gpu_use") or {}).values():
            if isinstance(u.get("utilization"), int | float):
                c[5] += u["utilization"]
                c[6] += 1
    groups = tuple(
        GroupSummary(label, c[0], c[1], c[2], c[3], c[4], c[5] / c[6] if c[6] else None, c[7])
        for label, c in counts.items()
    )
    names, pages = page_of(order, page, size)
    some: JobsDoc = {
        "format_version": doc.get("format_version", 1),
        "jobs": doc.get("jobs") or [],
        "hosts": {n: hosts[n] for n in names},
    }
    shown = cluster_groups(some)
    return ClusterPage(groups, shown, {n: host_spark(hosts[n]) for n in names}, min(page, pages), pages, len(order))


# ------------------------------------------------------------------ a study's trials table

TRIALS_PAGE = 100  # rows of a study's trials table per page (10,000 rows were ~4 MB of markup)
TRIAL_COLUMNS = ("number", "state", "value", "steps", "why")  # and "param.NAME" for each parameter


@dataclass(frozen=True)
class TrialOrder:
    """The trials table's page: sorted by `sort` (a TRIAL_COLUMNS name or "param.NAME"), on
    the server, over every trial (a page sorted alone would mislead)."""

    sort: str = "number"
    desc: bool = False
    page: int = 1

    def link(self, sort: str | None = None, desc: bool | None = None, page: int | None = None) -> str:
        """The query string of this order with what is given changed."""
        s = self.sort if sort is None else sort
        d = self.desc if desc is None else desc
        return f"sort={quote(s)}&order={'desc' if d else 'asc'}&page={self.page if page is None else page}"

    def toggled(self, col: str) -> str:
        """A header's link: by `col` from page 1; on the column sorted by, the other way."""
        return self.link(sort=col, desc=not self.desc if col == self.sort else False, page=1)


def trial_order(q: Mapping[str, str], params: Sequence[str]) -> TrialOrder:
    sort = q.get("sort", "number") or "number"
    known = (*TRIAL_COLUMNS, *(f"param.{p}" for p in params))
    if sort not in known:
        raise BadFilter(f"sort: expected one of {', '.join(known)}, got {sort!r}")
    order = q.get("order", "asc") or "asc"
    if order not in ("asc", "desc"):
        raise BadFilter(f"order: expected asc or desc, got {order!r}")
    return TrialOrder(sort, order == "desc", page_number(q))


def sorted_trials(trials: Sequence[TrialJson], sort: str, desc: bool) -> list[TrialJson]:
    """The trials by one column ("number", "value", "param.lr"...): the numbers, then the
    texts, each either way; the empty cells last either way; ties in trial order."""

    def cell(t: TrialJson) -> Any:
        if sort.startswith("param."):
            return (t.get("params") or {}).get(sort[len("param.") :])
        return t.get(sort)

    base = sorted(trials, key=lambda t: t.get("number") or 0)
    nums = [t for t in base if isinstance(cell(t), int | float) and not isinstance(cell(t), bool)]
    counted = {id(t) for t in nums}
    empty = [t for t in base if id(t) not in counted and cell(t) in (None, "")]
    gone = counted | {id(t) for t in empty}
    texts = [t for t in base if id(t) not in gone]
    return (
        sorted(nums, key=lambda t: float(cell(t)), reverse=desc)
        + sorted(texts, key=lambda t: str(cell(t)), reverse=desc)
        + empty
    )


def pager(page: int, pages: int, around: int = 2) -> list[int | None]:
    """The page links to show: the first, the last and `around` each side of `page`; None
    where some are left out."""
    want = sorted({1, pages, *range(max(1, page - around), min(pages, page + around) + 1)})
    out: list[int | None] = []
    for n in want:
        if out and isinstance(out[-1], int) and n > out[-1] + 1:
            out.append(None)
        out.append(n)
    return out
