"""What a preemptor's look at the hosts finds, before the decision (rules/preemption.decide):
who is leaving for it already, who else runs (the candidates), what is free, and where it
would go if every candidate left. Pure: the hosts' ledger entries in, a Candidates out; the
preemption step (run/preempt.py) probes the hosts and acts on the decision."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from provision.core.model import Inventory
from provision.placement.tasks import Held
from provision.rules.preemption import Replica, Running
from provision.rules.tenancy import Hold, Holder, held_for


@dataclass(frozen=True)
class Candidates:
    """What one look at the hosts found: who leaves for this job (already preempted by it),
    and who else is running (candidates)."""

    leaving: tuple[tuple[str, str], ...]  # (job, host) preempted by this job, not yet taken
    running: tuple[Running, ...]
    free: tuple[tuple[str, int], ...]  # host -> GPUs free for this job once `leaving` left
    need: tuple[tuple[str, int], ...] | None  # host -> GPUs it would take; None: no fit anyway


def candidates(
    job: str,
    gpus: Mapping[str, int],
    by_host: Mapping[str, list[Holder]],
    place_without: Callable[[Mapping[str, Held]], dict[str, int] | None],
    listening: Mapping[str, tuple[list[int], list[int]]],
    now: float,
) -> Candidates:
    """Pure: group the hosts' ledger entries by job (other than `job`), find the victims
    already leaving for it, count free GPUs, and place the job as if every preemptible
    job and every leaving one were gone (the most preemption could give)."""
    leaving = sorted(
        (h.job, h.host)
        for hs in by_host.values()
        for h in hs
        if h.preempted_by == job and h.hold in (Hold.RUNNING, Hold.PREEMPTED)
    )
    gone = {j for j, _ in leaving}
    jobs: dict[str, list[Holder]] = {}
    for hs in by_host.values():
        for h in hs:
            if h.job != job and h.hold in (Hold.RUNNING, Hold.RESERVED, Hold.HELD) and not h.preempted_by:
                jobs.setdefault(h.job, []).append(h)
    running = tuple(
        Running(
            j,
            hs[0].who,
            hs[0].priority,
            all(h.preemptible for h in hs),
            min((h.submitted or h.since or now) for h in hs),
            tuple((h.host, len(h.gpus)) for h in hs if h.gpus),
        )
        for j, hs in sorted(jobs.items())
    )
    free = {}
    for host, count in gpus.items():
        if host not in by_host:
            continue  # not reached: nothing is known of it, nothing is given there
        taken = {g for h in by_host[host] if h.holds_for(job) and h.job not in gone for g in h.gpus}
        free[host] = len([g for g in range(count) if g not in taken])
    candidates = gone | {r.job for r in running if r.preemptible}
    need = place_without(held_without(job, by_host, candidates, listening, now))
    return Candidates(
        tuple(leaving), running, tuple(sorted(free.items())), tuple(sorted(need.items())) if need else None
    )


def held_without(
    job: str,
    by_host: Mapping[str, list[Holder]],
    gone: Collection[str],
    listening: Mapping[str, tuple[list[int], list[int]]],
    now: float,
) -> dict[str, Held]:
    """What placement may not give `job` on each host once the jobs `gone` have left."""
    held = {}
    for host, hs in by_host.items():
        listen, local = listening.get(host, ([], []))
        held[host] = held_for(job, [h for h in hs if h.job not in gone], listen, now, local)
    return held


def replicas(inv: Inventory, hosts: Collection[str]) -> tuple[Replica, ...]:
    """The job's tasks that need GPUs, each on any host of `hosts` its pool may run on."""
    return tuple(
        Replica(p.accelerators, tuple(h.name for h in inv.hosts if h.name in hosts and p.eligible(h)))
        for p in inv.pools
        if p.accelerators
        for _ in range(p.replicas)
    )
