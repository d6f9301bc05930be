"""Which running work leaves so waiting work can start (issue 42): a pure function of the
GPUs each holds and needs, their priorities and the owners' guarantees, as Kueue decides
its preemptions; run/ acts on the answer.

Waiting work may preempt running work that is preemptible and either
- of a lower priority, or
- borrowing (its owner's quota uses more GPUs than it is guaranteed) while the waiting work
  fits within its own owner's guarantee.
Candidates are taken borrowing first, then the lowest priority, then the most recently
started (the least work lost), until the waiting work fits on every host it needs; then
any victim not needed after all is spared, last taken first."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from provision.rules.priority import Policy


class Why(StrEnum):
    LOWER_PRIORITY = "lower priority"
    BORROWING = "borrowing beyond its owner's guarantee"


@dataclass(frozen=True)
class Running:
    job: str
    owner: str
    priority: int
    preemptible: bool
    started: float
    gpus: tuple[tuple[str, int], ...]  # (host, GPUs held there); a job leaves whole


@dataclass(frozen=True)
class Waiting:
    job: str
    owner: str
    priority: int
    need: tuple[tuple[str, int], ...]  # (host, GPUs it needs there), as placed


@dataclass(frozen=True)
class Victim:
    job: str
    owner: str
    why: Why


def _usage(running: Sequence[Running], policy: Policy) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in running:
        q = policy.quota_of(r.owner)
        out[q] = out.get(q, 0) + sum(n for _, n in r.gpus)
    return out


def _deficit(need: Mapping[str, int], free: Mapping[str, int]) -> dict[str, int]:
    return {h: n - free.get(h, 0) for h, n in need.items() if n > free.get(h, 0)}


def _room(free: Mapping[str, int], leaving: Sequence[Running]) -> dict[str, int]:
    room = dict(free)
    for r in leaving:
        for h, n in r.gpus:
            room[h] = room.get(h, 0) + n
    return room


def _fits(need: Mapping[str, int], free: Mapping[str, int], leaving: Sequence[Running]) -> bool:
    return not _deficit(need, _room(free, leaving))


def _why(w: Waiting, r: Running, within: bool, usage: Mapping[str, int], policy: Policy) -> Why | None:
    if not r.preemptible or r.job == w.job:
        return None
    if r.priority < w.priority:
        return Why.LOWER_PRIORITY
    q = policy.quota_of(r.owner)
    if within and q != policy.quota_of(w.owner) and usage.get(q, 0) > policy.guarantee(r.owner):
        return Why.BORROWING
    return None


def decide(
    w: Waiting, running: Sequence[Running], free: Mapping[str, int], policy: Policy
) -> tuple[Victim, ...] | None:
    """The work to preempt so `w` fits: () when it fits already, None when it cannot fit even
    with every candidate gone (it waits, and nothing is preempted for nothing)."""
    need = dict(w.need)
    if not _deficit(need, free):
        return ()
    usage = _usage(running, policy)
    within = usage.get(policy.quota_of(w.owner), 0) + sum(need.values()) <= policy.guarantee(w.owner)
    why = {r.job: y for r in running if (y := _why(w, r, within, usage, policy)) is not None}
    # Kueue's order: borrowing first, then the lowest priority, then the latest started.
    order = sorted(
        (r for r in running if r.job in why),
        key=lambda r: (why[r.job] is not Why.BORROWING, r.priority, -r.started, r.job),
    )
    taken: list[Running] = []
    for r in order:
        if _fits(need, free, taken):
            break
        # Only work holding GPUs where some are missing helps; a borrower stays above its
        # guarantee: preempting it must not take the owner below what it is guaranteed.
        missing = _deficit(need, _room(free, taken))
        if not any(h in missing for h, _ in r.gpus):
            continue
        if why[r.job] is Why.BORROWING:
            q = policy.quota_of(r.owner)
            left = usage.get(q, 0) - sum(n for x in taken if policy.quota_of(x.owner) == q for _, n in x.gpus)
            if left <= policy.guarantee(r.owner):
                continue
        taken.append(r)
    if not _fits(need, free, taken):
        return None
    for r in reversed(list(taken)):
        rest = [x for x in taken if x is not r]
        if _fits(need, free, rest):
            taken = rest
    return tuple(Victim(r.job, r.owner, why[r.job]) for r in taken)
