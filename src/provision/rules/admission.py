"""Which queued submissions get a worker now. A queued apply waits as a row, with no process
(core/submission.py); after each round the service admits, in the queue's order, those
the round says may fit now, so 1,000 queued applies cost 1,000 rows and the few workers
that have a chance. Pure: the round and the queued rows in, the ids to start out.

The rule, in one place:
- in the queue's order (rules/priority.queue_key), each queued apply whose replicas fit the
  GPUs the round shows free on the hosts each may use (first fit, each replica whole on
  one host) is admitted, and what it takes is taken from what is free for the next;
- one whose priority is above a preemptible job's on a host it may use is admitted too:
  its worker asks the preemption rule (rules/preemption.py) whether that job leaves;
- one a worker looked at, not again for RECHECK_S, is admitted anyway (what a round cannot
  see: ports, a host's own services, a stale mark); one looked at less than AGAIN_S ago is
  not (its worker just found no room); one not in the round yet (its snapshot is new) is;
- at most AT_ONCE at a time: the others wait for the next round;
- a queue is strict: one that does not fit keeps the lower ones off the hosts it may use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from provision.rules.priority import queue_key
from provision.rules.rounds import Round

AT_ONCE = 4  # queued applies admitted at a time (each is a worker process)
RECHECK_S = 300.0  # seconds after which a queued apply is looked at whatever the rounds say
AGAIN_S = 30.0  # ... and before which one looked at is not looked at again (its worker found no room)


@dataclass(frozen=True)
class Queued:
    sid: str
    job: str
    priority: int
    submitted: float
    looked: float  # when a worker last looked at it (time.time()), 0: never


def admit(queued: Sequence[Queued], r: Round | None, now: float, running: int = 0) -> list[str]:
    """The queued submissions to start a worker for, in the queue's order."""
    room = max(0, AT_ONCE - running)
    if room == 0:
        return []
    free = _free(r) if r is not None else {}
    blocked: set[str] = set()  # hosts a queued apply ahead may use and did not fit on
    out: list[str] = []
    for q in sorted(queued, key=lambda q: queue_key(q.priority, q.submitted, q.sid)):
        if len(out) >= room:
            break
        if now - q.looked < AGAIN_S:
            continue
        demand = r.demand.get(q.job) if r is not None else None
        if demand is None or (q.looked and now - q.looked >= RECHECK_S):
            out.append(q.sid)  # not in the round yet (its snapshot is new), or due a look anyway
            continue
        hosts = frozenset().union(*(h for _, h in demand)) if demand else frozenset()
        if hosts & blocked:
            continue
        took = _fit(demand, {h: n for h, n in free.items() if h not in blocked})
        if took is not None:
            out.append(q.sid)
            for h, n in took.items():
                free[h] -= n
        elif r is not None and _may_preempt(q.priority, hosts, r):
            out.append(q.sid)
        else:
            blocked |= hosts
    return out


def _free(r: Round) -> dict[str, int]:
    """GPUs free on each host that answered (the round's `free_gpus`)."""
    out = {}
    for name, h in (r.doc.get("hosts") or {}).items():
        free = h.get("free_gpus")
        if h.get("error") is None and isinstance(free, list):
            out[name] = len(free)
    return out


def _fit(demand: Sequence[tuple[int, frozenset[str]]], free: Mapping[str, int]) -> dict[str, int] | None:
    """GPUs taken per host when each replica goes whole on the first host with room (the
    largest replicas first); None when one does not fit."""
    left = dict(free)
    took: dict[str, int] = {}
    for gpus, hosts in sorted(demand, key=lambda d: -d[0]):
        where = next((h for h in sorted(hosts) if left.get(h, 0) >= gpus), None)
        if where is None:
            return None
        left[where] -= gpus
        took[where] = took.get(where, 0) + gpus
    return took


def _may_preempt(priority: int, hosts: frozenset[str], r: Round) -> bool:
    """A preemptible job of a lower priority holds GPUs on one of `hosts`."""
    for name in hosts:
        hs = r.hosts.get(name)
        if hs is None or not hs.answered:
            continue
        if any(h.hold.holds and h.preemptible and h.priority < priority and h.gpus for h in hs.view.holders):
            return True
    return False
