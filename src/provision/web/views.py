"""What the pages show, from the Source's JSON: the cluster's hosts grouped by label with each
GPU's holder, the jobs filtered and paginated in their sections. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def job_filter(q: Mapping[str, str]) -> JobFilter:
    phase = q.get("phase", "")
    if phase and phase not in PHASES:
        raise BadFilter(f"phase: expected one of {', '.join(PHASES)}, got {phase!r}")
    raw = q.get("page", "1") or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise BadFilter(f"page: expected a number from 1, got {raw!r}")
    return JobFilter(q.get("owner", ""), phase, q.get("q", ""), int(raw))


def page_of(items: Sequence[Any], page: int, size: int = PAGE_SIZE) -> tuple[list[Any], int]:
    """The items of page `page` (from 1) and how many pages there are."""
    pages = max(1, -(-len(items) // size))
    return list(items[(page - 1) * size : page * size]), pages


def _queue_order(j: Mapping[str, Any]) -> tuple[int, str, str]:
    level = j.get("priority_level")
    submitted = j.get("submitted") or (j.get("queued") or {}).get("since") or ""
    return (-(level if isinstance(level, int) else 500), str(submitted), str(j.get("job")))


def job_sections(jobs: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {k: [] for k in SECTIONS}
    for j in jobs:
        for section, states in SECTIONS.items():
            if j.get("state") in states:
                out[section].append(j)
    # Queued work in the queue's order (issue 42): the higher priority first, then first come.
    out["queued"].sort(key=_queue_order)
    return out


@dataclass(frozen=True)
class Gpu:
    index: int
    state: str  # free, held, drained, unreachable, unknown
    job: str | None = None
    owner: str | None = None
    utilization: float | None = None
    memory_mib: float | None = None
    history: tuple[tuple[float, float], ...] = ()  # (epoch seconds, utilization %), the last hour


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
        if h.get("error"):
            state = "unreachable"
        elif job is not None:
            state = "held"
        elif h.get("drain"):
            state = "drained"
        else:
            state = "free" if g in free else "unknown"
        history = tuple((float(t), float(v)) for t, v in past.get(str(g)) or ())
        owner = owners.get(job) if job else None
        out.append(Gpu(g, state, job, owner, u.get("utilization"), u.get("memory_mib"), history))
    return tuple(out)


def cluster_groups(doc: Mapping[str, Any]) -> list[tuple[str, list[HostRow]]]:
    """The hosts of `provision jobs --json` grouped by their labels ("k=v, ..."), unlabelled last."""
    owners = {j["job"]: j.get("owner") for j in doc.get("jobs") or []}
    groups: dict[str, list[HostRow]] = {}
    for name, h in sorted((doc.get("hosts") or {}).items()):
        labels = h.get("labels") or {}
        key = ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "no labels"
        row = HostRow(name, h.get("error"), _gpus(h, owners), tuple(h.get("foreign_ports") or ()))
        groups.setdefault(key, []).append(row)
    return sorted(groups.items(), key=lambda kv: (kv[0] == "no labels", kv[0]))
