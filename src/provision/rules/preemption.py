"""Which running work leaves so waiting work can start: a pure function of the
GPUs each holds and needs, their priorities and the owners' guarantees, as Kueue decides
its preemptions; run/ acts on the answer.

Waiting work may preempt running work that is preemptible and either
- of a lower priority, or
- borrowing (its owner's quota uses more GPUs than it is guaranteed) while the waiting work
  fits within its own owner's guarantee. A borrower is preempted only while its owner,
  counting the borrower's work taken before it, still uses more than its guarantee.
Candidates go in the order borrowing first, then the lowest priority, then the most
recently started (the least work lost), then by name. Of every set of candidates whose
leaving lets the waiting work fit, the one taken spares work late in that order first:
the last candidate leaves only when no set of those before it would do, and so on down
the order; so no victim is taken that is not needed.

The waiting work fits where its replicas do: each replica's GPUs on one host among those it
may run on, never split. Where it goes is part of the question: a job of two 4-GPU
replicas fits on any two emptied hosts, and preempting one borrower may empty two (a fixed
placement, chosen before, could name a host whose only way to empty is a borrower within
its guarantee)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from provision.rules.priority import Policy

# Search steps per decision (replicas into hosts, and the sets of borrowers). The shapes of
# a team's cluster take a few hundred; beyond the budget no fit is claimed, so nothing is
# preempted on a guess (the waiting work waits, as it would for room).
BUDGET = 200_000


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
class Replica:
    """One task of the waiting work that needs GPUs: all of them on one of `hosts`."""

    gpus: int
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class Waiting:
    job: str
    owner: str
    priority: int
    replicas: tuple[Replica, ...]

    @classmethod
    def placed(cls, job: str, owner: str, priority: int, need: Mapping[str, int]) -> Waiting:
        """Waiting work whose place is fixed: `need` GPUs on each of its hosts."""
        return cls(job, owner, priority, tuple(Replica(n, (h,)) for h, n in sorted(need.items()) if n))

    @property
    def gpus(self) -> int:
        return sum(r.gpus for r in self.replicas)


@dataclass(frozen=True)
class Victim:
    job: str
    owner: str
    why: Why


class _OutOfSteps(Exception):
    pass


class _Steps:
    def __init__(self, budget: int) -> None:
        self.left = budget

    def take(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise _OutOfSteps


def fit(replicas: Sequence[Replica], room: Mapping[str, int], budget: int = BUDGET) -> dict[str, int] | None:
    """Where the replicas go within `room` (host -> GPUs free there): host -> the GPUs they
    take there, each replica whole on one of its hosts; None when they do not fit (or the
    search ran out of steps). An exact search, not a first fit: a fit it missed would
    leave waiting work waiting with room to be made."""
    try:
        return _fit(replicas, room, _Steps(budget))
    except (_OutOfSteps, RecursionError):
        return None


def _fit(replicas: Sequence[Replica], room: Mapping[str, int], steps: _Steps) -> dict[str, int] | None:
    reps = sorted((r for r in replicas if r.gpus > 0), key=lambda r: (-r.gpus, r.hosts))
    hosts = sorted({h for r in reps for h in r.hosts})
    left = {h: max(0, room.get(h, 0)) for h in hosts}
    if sum(r.gpus for r in reps) > sum(left.values()):
        return None
    # Hosts the same replicas may use, with as much room, are alike: one of them is tried.
    kind = {h: tuple(i for i, r in enumerate(reps) if h in r.hosts) for h in hosts}
    failed: set[tuple[int, tuple[tuple[tuple[int, ...], int], ...]]] = set()
    out: dict[str, int] = {}

    def go(i: int) -> bool:
        if i == len(reps):
            return True
        key = (i, tuple(sorted((kind[h], left[h]) for h in hosts)))
        if key in failed:
            return False
        steps.take()
        r, tried = reps[i], set()
        for h in sorted(r.hosts, key=lambda h: (left[h], h)):  # the best fit first
            if left[h] < r.gpus or (kind[h], left[h]) in tried:
                continue
            tried.add((kind[h], left[h]))
            left[h] -= r.gpus
            if go(i + 1):
                out[h] = out.get(h, 0) + r.gpus
                return True
            left[h] += r.gpus
        failed.add(key)
        return False

    return dict(sorted(out.items())) if go(0) else None


def _usage(running: Sequence[Running], policy: Policy) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in running:
        q = policy.quota_of(r.owner)
        out[q] = out.get(q, 0) + _held(r)
    return out


def _held(r: Running) -> int:
    return sum(n for _, n in r.gpus)


def room(free: Mapping[str, int], leaving: Sequence[Running]) -> dict[str, int]:
    """GPUs free on each host once `leaving` left."""
    out = dict(free)
    for r in leaving:
        for h, n in r.gpus:
            out[h] = out.get(h, 0) + n
    return out


def _why(w: Waiting, r: Running, within: bool, usage: Mapping[str, int], policy: Policy) -> Why | None:
    if not r.preemptible or r.job == w.job:
        return None
    if r.priority < w.priority:
        return Why.LOWER_PRIORITY
    q = policy.quota_of(r.owner)
    if within and q != policy.quota_of(w.owner) and usage.get(q, 0) > policy.guarantee(r.owner):
        return Why.BORROWING
    return None


def candidates(w: Waiting, running: Sequence[Running], policy: Policy) -> list[tuple[Running, Why]]:
    """The work `w` may preempt, in the order it is taken (Kueue's): borrowing first, then
    the lowest priority, then the latest started, then by name."""
    usage = _usage(running, policy)
    within = usage.get(policy.quota_of(w.owner), 0) + w.gpus <= policy.guarantee(w.owner)
    why = {r.job: y for r in running if (y := _why(w, r, within, usage, policy)) is not None}
    order = sorted(
        (r for r in running if r.job in why),
        key=lambda r: (why[r.job] is not Why.BORROWING, r.priority, -r.started, r.job),
    )
    return [(r, why[r.job]) for r in order]


def admissible(victims: Sequence[tuple[Running, Why]], running: Sequence[Running], policy: Policy) -> bool:
    """Is every borrower among `victims` (in the order taken) preempted while its owner,
    counting the victims of its owner before it, still uses more than its guarantee?"""
    left = _usage(running, policy)
    for r, why in victims:
        q = policy.quota_of(r.owner)
        if why is Why.BORROWING and left.get(q, 0) <= policy.guarantee(r.owner):
            return False
        left[q] = left.get(q, 0) - _held(r)
    return True


class _Search:
    """Is there a set of victims among some candidates that lets `w` fit, and which."""

    def __init__(
        self, w: Waiting, running: Sequence[Running], free: Mapping[str, int], policy: Policy, steps: _Steps
    ) -> None:
        self.w, self.free, self.policy, self.steps = w, free, policy, steps
        self.usage = _usage(running, policy)
        self.fits_seen: dict[tuple[tuple[str, int], ...], bool] = {}

    def fits(self, leaving: Sequence[Running]) -> bool:
        r = room(self.free, leaving)
        key = tuple(sorted(r.items()))
        if key not in self.fits_seen:
            self.fits_seen[key] = _fit(self.w.replicas, r, self.steps) is not None
        return self.fits_seen[key]

    def among(self, allowed: Sequence[tuple[Running, Why]]) -> list[tuple[Running, Why]] | None:
        """An admissible set of `allowed` (in its order) with which `w` fits, else None.
        Work of a lower priority may always leave (it goes after every borrower, so it
        never counts against one): only which borrowers leave is searched."""
        if not self.fits([r for r, _ in allowed]):
            return None
        lower = [r for r, y in allowed if y is Why.LOWER_PRIORITY]
        borrowers = [r for r, y in allowed if y is Why.BORROWING]
        guarantee, quota = self.policy.guarantee, self.policy.quota_of
        taken: dict[str, int] = {}
        chosen: list[Running] = []
        # What is left to decide depends on the room made and each owner's GPUs taken so
        # far, not on which jobs made them: sets alike are searched once.
        failed: set[tuple[int, tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]]] = set()

        def go(i: int) -> bool:
            if self.fits(lower + chosen):
                return True
            key = (i, tuple(sorted(room(self.free, chosen).items())), tuple(sorted(taken.items())))
            if i == len(borrowers) or key in failed or not self.fits(lower + chosen + borrowers[i:]):
                return False
            self.steps.take()
            r = borrowers[i]
            q = quota(r.owner)
            if self.usage.get(q, 0) - taken.get(q, 0) > guarantee(r.owner):  # still borrowing
                chosen.append(r)
                taken[q] = taken.get(q, 0) + _held(r)
                if go(i + 1):
                    return True
                chosen.pop()
                taken[q] -= _held(r)
            if go(i + 1):
                return True
            failed.add(key)
            return False

        if not go(0):
            return None
        gone = {r.job for r in (*chosen, *lower)}
        return [(r, y) for r, y in allowed if r.job in gone]


def decide(
    w: Waiting, running: Sequence[Running], free: Mapping[str, int], policy: Policy, budget: int = BUDGET
) -> tuple[Victim, ...] | None:
    """The work to preempt so `w` fits (`free`: host -> GPUs free for it, on every host
    reached): () when it fits already, None when it cannot fit even with every candidate
    gone (it waits, and nothing is preempted for nothing)."""
    search = _Search(w, running, free, policy, _Steps(budget))
    best: list[tuple[Running, Why]] | None = None
    try:
        if search.fits(()):
            return ()
        allowed = candidates(w, running, policy)
        best = search.among(allowed)
        if best is None:
            return None
        # Spare the latest in the order first: each leaves only if no set without it does.
        for r, _ in reversed(list(allowed)):
            rest = [x for x in allowed if x[0] is not r]
            found = search.among(rest)
            if found is not None:
                allowed, best = rest, found
    except (_OutOfSteps, RecursionError):  # thousands of replicas or borrowers: as out of steps
        if best is None:  # out of steps: the last set found (it fits, and is admissible), else none
            return None
    return tuple(Victim(r.job, r.owner, why) for r, why in best)


def need_of(w: Waiting, free: Mapping[str, int], leaving: Sequence[Running]) -> dict[str, int] | None:
    """Where `w` would take GPUs once `leaving` left (host -> GPUs), None when it does not fit."""
    return fit(w.replicas, room(free, leaving))
