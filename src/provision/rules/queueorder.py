"""The queue's order on a shared host, as Kueue's StrictFIFO orders a queue: work
that would fit does not take GPUs on a host where waiting work ahead of it needs GPUs.

Ahead means an earlier rules/priority.queue_key: the higher priority, then the earlier
submission. Waiting work is what the hosts' ledgers mark as queued (an `apply --queue`
alive, whether run by hand or by the service); a mark whose apply is gone (STALE) holds
no one back. Strict, not best-effort: small work does not slip past the head of the queue
on its host while the head waits for room (it would keep the head waiting for ever on a
busy host); work that takes no new GPU there, or whose host has no waiting work ahead,
goes on."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from provision.core.model import Inventory
from provision.core.text import duration
from provision.placement.tasks import Placement, PlacementError
from provision.rules.priority import Policy, name_of, queue_key
from provision.rules.tenancy import Hold, Holder, Turn


@dataclass(frozen=True)
class Behind:
    """The waiting work that goes first on `host`."""

    host: str
    ahead: Holder

    def describe(self, now: float, policy: Policy) -> str:
        """e.g. 'bert (ana@lab, priority high, queued 3m ago)'."""
        h = self.ahead
        since = h.queued[0] if h.queued is not None else h.since
        age = f", queued {duration(int(max(0.0, now - since)))} ago" if since is not None else ""
        return f"{h.job} ({h.who}, priority {name_of(h.priority, policy)}{age})"


def need_on(inv: Inventory, host: str) -> int:
    """The GPUs the largest of the job's tasks that may run on `host` needs (what its queue
    mark there says: 0 holds no GPU taker back)."""
    h = next((x for x in inv.hosts if x.name == host), None)
    return max((p.accelerators for p in inv.pools if h is not None and p.eligible(h)), default=0)


def _key(h: Holder) -> tuple[int, float, str]:
    submitted = h.submitted if h.submitted is not None else (h.queued[0] if h.queued else 0.0)
    return queue_key(h.priority, submitted, h.job)


def waits_behind(
    job: str,
    priority: int,
    submitted: float,
    takes: Mapping[str, Collection[int]],
    held_by: Mapping[str, Sequence[Holder]],
) -> tuple[Behind, ...]:
    """Per host where this placement takes GPUs (`takes`: host -> the GPUs it takes there that
    the job does not hold already), the first waiting work ahead of the job that needs GPUs
    there; () when the job may go."""
    mine = queue_key(priority, submitted, job)
    out = []
    for host in sorted(takes):
        if not takes[host]:
            continue
        ahead = sorted(
            (
                h
                for h in held_by.get(host, ())
                if h.job != job and h.hold is Hold.QUEUED and h.queued_gpus > 0 and _key(h) < mine
            ),
            key=_key,
        )
        if ahead:
            out.append(Behind(host, ahead[0]))
    return tuple(out)


def place_in_queue(job: str, hosts: Collection[str], held_by: Mapping[str, Sequence[Holder]]) -> int | None:
    """The job's place in the queue on `hosts` (a preempted job's: where it held GPUs), 1
    first: one more than the waiting work there that needs GPUs and goes before it (its own
    entry's priority, then submission; work counted once however many hosts it waits on).
    None: the job has no entry there to order it by."""
    own = next((h for host in sorted(hosts) for h in held_by.get(host, ()) if h.job == job), None)
    if own is None:
        return None
    mine = _key(own)
    ahead = {
        h.job
        for host in hosts
        for h in held_by.get(host, ())
        if h.job != job and h.hold is Hold.QUEUED and h.queued_gpus > 0 and _key(h) < mine
    }
    return 1 + len(ahead)


def behind_line(behind: Sequence[Behind], now: float, policy: Policy) -> str:
    """The reason in one line: 'waiting behind bert (ana@lab, priority high, queued 3m ago)
    for GPUs on gpu-1'."""
    first = behind[0]
    more = f" (and {len(behind) - 1} more host{'s' if len(behind) > 2 else ''})" if len(behind) > 1 else ""
    return f"waiting behind {first.describe(now, policy)} for GPUs on {first.host}{more}"


def takes(job: str, placement: Placement, held_by: Mapping[str, Sequence[Holder]]) -> dict[str, set[int]]:
    """host -> the GPUs the placement takes there that the job does not hold already (an
    ended job's entry holds nothing: its rerun takes its GPUs anew, in turn)."""
    out: dict[str, set[int]] = {}
    for t in placement.tasks:
        # ... nor those a job it preempted keeps for it (the preemptor's already).
        own = {
            g
            for h in held_by.get(t.host.name, ())
            if (h.job == job and h.hold.holds) or (h.hold is Hold.PREEMPTED and h.preempted_by == job)
            for g in h.gpus
        }
        new = set(t.accelerators) - own
        if new:
            out.setdefault(t.host.name, set()).update(new)
    return out


def check_turn(
    job: str,
    turn: Turn,
    placement: Placement,
    held_by: Mapping[str, Sequence[Holder]],
    now: float,
    policy: Policy,
) -> None:
    """Raise the held PlacementError (an `apply --queue` waits on it; a plain apply fails
    naming the work ahead) when waiting work ahead of the job needs GPUs where it would take
    some."""
    submitted = turn.submitted if turn.submitted is not None else now
    behind = waits_behind(job, turn.priority, submitted, takes(job, placement, held_by), held_by)
    if not behind:
        return
    role = next(t.role for t in placement.tasks if t.host.name == behind[0].host and t.accelerators)
    line = behind_line(behind, now, policy)
    details = tuple(f"{b.host}: waiting work {b.describe(now, policy)} goes first" for b in behind)
    raise PlacementError(role, line, held=True, details=details, hint=" (`provision apply --queue` waits its turn)")
