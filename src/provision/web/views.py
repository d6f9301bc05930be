"""What the pages show, from the Source's JSON: the cluster's hosts grouped by label with each
GPU's holder, the jobs filtered and paginated in their sections, a study's trials sorted and
paginated. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from provision.core.events import iso
from provision.rules.tenancy import doc_queue_key

ACTIONS = ("stop", "rerun", "cancel")
PAGE_SIZE = 50
# The states of `provision jobs --json` (rules/tenancy.Hold), and where each is listed.
SECTIONS = {
    "queued": ("queued",),
    "running": ("running", "reserved", "held", "stale"),
    "finished": ("ended",),
}
PHASES = tuple(s for states in SECTIONS.values() for s in states)


class BadFilter(ValueError):
    """A malformed query parameter: 400, naming it."""


@dataclass(frozen=True)
class JobFilter:
    owner: str = ""
    phase: str = ""
    text: str = ""
    page: int = 1

    def matches(self, j: Mapping[str, Any]) -> bool:
        if self.owner and j.get("owner") != self.owner:
            return False
        if self.phase and j.get("state") != self.phase:
            return False
        t = self.text.lower()
        return not t or t in j["job"].lower() or t in (j.get("owner") or "").lower()


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
        raise BadFilter(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
    return JobFilter(q.get("owner", ""), phase, q.get("q", ""), page_number(q))


def page_of(items: Sequence[Any], page: int, size: int = PAGE_SIZE) -> tuple[list[Any], int]:
    """The items of page `page` (from 1) and how many pages there are."""
    pages = max(1, -(-len(items) // size))
    return list(items[(page - 1) * size : page * size]), pages


def job_sections(jobs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {k: [] for k in SECTIONS}
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


def _gpus(h: Mapping[str, Any], owners: Mapping[str, str | None]) -> tuple[Gpu, ...]:
    holder = {g: job for job, held in (h.get("held") or {}).items() for g in held.get("gpus", [])}
    free = set(h.get("free_gpus") or [])
    use = h.get("gpu_use") or {}
    past = h.get("gpu_history") or {}
    out = []
    for g in range(int(h.get("gpus") or 0)):
        u = use.get(str(g)) or {}
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
        apps = tuple(_app_words(a) for a in u.get("apps") or ())
        out.append(Gpu(g, state, job, owner, u.get("utilization"), u.get("memory_mib"), history, apps, health, why))
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


def _app_words(a: Mapping[str, Any]) -> str:
    mib = f", {a['used_mib']} MiB" if a.get("used_mib") is not None else ""
    whose = f" ({a['job']})" if a.get("job") else " (not a provision job)"
    return f"{a.get('pid') or '?'} {a.get('name') or ''}{mib}{whose}"


def _group_of(h: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((h.get("labels") or {}).items())) or "no labels"


def _group_order(label: str) -> tuple[bool, str]:
    return (label == "no labels", label)


def cluster_groups(doc: Mapping[str, Any]) -> list[tuple[str, list[HostRow]]]:
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


def host_spark(h: Mapping[str, Any]) -> tuple[tuple[float, float], ...]:
    """A host's GPUs' mean utilization over its history (the GPUs' points are of the same
    rounds: matched from the newest)."""
    series = [s for s in (h.get("gpu_history") or {}).values() if s]
    if not series:
        return ()
    n = min(len(s) for s in series)
    return tuple(
        (float(series[0][-n + k][0]), sum(float(s[-n + k][1]) for s in series) / len(series)) for k in range(n)
    )


def cluster_page(doc: Mapping[str, Any], page: int, size: int = HOSTS_PAGE) -> ClusterPage:
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
    shown = cluster_groups({"jobs": doc.get("jobs") or [], "hosts": {n: hosts[n] for n in names}})
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


def sorted_trials(trials: Sequence[Mapping[str, Any]], sort: str, desc: bool) -> list[Mapping[str, Any]]:
    """The trials by one column ("number", "value", "param.lr"...): the numbers, then the
    texts, each either way; the empty cells last either way; ties in trial order."""

    def cell(t: Mapping[str, Any]) -> Any:
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
