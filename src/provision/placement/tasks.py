"""Deterministic placement: every task → a host, a port and concrete accelerator indices.

Rules, in one place:
- tasks are placed index-major (chief-0, worker-0, ps-0, ..., worker-1, ps-1, ...), so a
  pool's first replicas are placed before any pool's later ones;
- a replica's accelerators come from one host, never split; the lowest free indices;
- hosts are chosen least-loaded first (one replica per host when there are enough, as
  the managed services give each replica its own VM), then best fit on accelerators,
  then inventory order; tasks that need no accelerators (ps and reduction servers above
  all) prefer hosts without any, keeping accelerator hosts for the work that needs them;
- ports: the pool's port (default 2222; 8476, libtpu's, on TPU hosts), or the next free one on a shared host;
- `previous` (the placement recorded in state) is kept for every task whose slot is still
  valid, so growing or shrinking a pool never moves a task that already exists;
- `held` (what other jobs hold on shared hosts, and ports something else listens on, as
  tenancy.py reads them from the hosts' ledgers; GPUs their health keeps from new work) is
  never given out: neither kept from `previous` nor chosen; a host it closes gets no new
  task (rules/health.py: draining).
- `spares:` hosts come last while every host is in service: a replica goes to one only
  when no other eligible host has room; once a host (or some of its GPUs) is drained or
  set aside for the job (a recovery: core/recovery.py), the spares are hosts like the
  others, so the replicas that move go to them or the same host's other free GPUs (least
  loaded, then best fit); a replica placed on a spare stays there. GPUs set aside for the
  job (`Host.withheld`) are never given to it: a replica kept there moves.
- `placement: {prefer_same: [label, ...]}`: the hosts are grouped by each label's value (a
  switch, an NVLink domain), and a new task goes to the best group's hosts first (least
  loaded within it), so the job spans as few groups as fit it. The best group is the
  smallest that holds every task of the job (one per host, or as many as its free
  accelerators take), else the largest; ties go to the group first in the inventory, and
  hosts without the label come last. The first label counts most: a later label's groups
  are ranked within the earlier labels' group.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from provision.core.errors import ProvisionError
from provision.core.model import ROLES, Host, Inventory, Pool, default_port


@dataclass(frozen=True)
class Slot:
    host: str
    port: int
    accelerators: tuple[int, ...] = ()


@dataclass(frozen=True)
class PlacedTask:
    role: str
    index: int
    host: Host
    port: int
    accelerators: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def address(self) -> str:
        """host:port as every other task reaches it (IPv6 literals bracketed)."""
        a = self.host.cluster_address
        return f"[{a}]:{self.port}" if ":" in a else f"{a}:{self.port}"

    @property
    def slot(self) -> Slot:
        return Slot(self.host.name, self.port, self.accelerators)


@dataclass(frozen=True)
class Placement:
    tasks: tuple[PlacedTask, ...]  # ROLES order, then index

    def by_role(self, role: str) -> list[PlacedTask]:
        return [t for t in self.tasks if t.role == role]

    def on_host(self, host: str) -> list[PlacedTask]:
        return [t for t in self.tasks if t.host.name == host]

    def task(self, name: str) -> PlacedTask:
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)

    def slots(self) -> dict[str, Slot]:
        return {t.name: t.slot for t in self.tasks}


@dataclass(frozen=True)
class Held:
    """What placement may not give out on one host, and who holds it (for messages)."""

    gpus: frozenset[int] = frozenset()
    ports: frozenset[int] = frozenset()
    by: tuple[str, ...] = ()  # e.g. "GPUs 0-1 held by job bert (alice@ws-3, running 2h)"
    # The host takes no new task (its health: draining, quarantined): "new" keeps the
    # job's previous slots there (they run), "all" keeps none either.
    closed: str = ""


class PlacementError(ProvisionError):
    def __init__(self, role: str, reason: str, *, held: bool = False, details: tuple[str, ...] = (), hint: str = ""):
        super().__init__(f"pools.{role}: {reason}{hint}", details=list(details))
        self.role = role
        self.reason = reason
        self.held = held  # it would fit were it not for what other jobs hold: worth waiting

    @property
    def waiting(self) -> str:
        """What a queued apply or a study's trial says it waits for: the reason without the
        hint an apply that fails gives (`apply --queue` waits...), which those are doing."""
        return f"pools.{self.role}: {self.reason}"


def set_aside(inv: Inventory, hosts: Collection[str], gpus: Mapping[str, Collection[int]] | None = None) -> Inventory:
    """The job with `hosts` drained for it alone and `gpus` (host -> GPUs) withheld from it:
    a recovery set them aside (the job's state keeps them: core/recovery.RecoveryRecord), so
    its replicas there are placed again elsewhere (another host, or the host's other free
    GPUs) and no other of its replicas goes there; other jobs are not concerned."""
    gpus = {h: tuple(sorted(set(g))) for h, g in (gpus or {}).items() if g and h not in hosts}

    def aside(h: Host) -> Host:
        if h.name in hosts and not h.drain:
            return dataclasses.replace(h, drain=True)
        if h.name in gpus and set(gpus[h.name]) - set(h.withheld):
            return dataclasses.replace(h, withheld=tuple(sorted(set(h.withheld) | set(gpus[h.name]))))
        return h

    changed = tuple(aside(h) for h in inv.hosts)
    return inv if changed == inv.hosts else dataclasses.replace(inv, hosts=changed)


def task_order(pools: Iterable[Pool]) -> list[tuple[Pool, int]]:
    """Index-major order: growing one pool appends, it never reorders earlier replicas."""
    pools = sorted(pools, key=lambda p: ROLES.index(p.role))
    most = max((p.replicas for p in pools), default=0)
    return [(p, i) for i in range(most) for p in pools if i < p.replicas]


class _HostState:
    __slots__ = ("host", "order", "free", "ports", "tasks", "version", "closed")

    def __init__(self, host: Host, order: int, held: Held | None = None):
        self.host = host
        self.order = order
        self.closed = held.closed if held else ""
        taken = (held.gpus if held else frozenset()) | set(host.withheld)
        self.free = [a for a in range(host.accelerator_count) if a not in taken]  # sorted, free
        self.ports: set[int] = set(held.ports) if held else set()
        self.tasks = 0
        self.version = 0


def place(  # noqa: C901  the placement rule's two passes (keep, then place) share its state
    inv: Inventory, previous: Mapping[str, Slot] | None = None, held: Mapping[str, Held] | None = None
) -> Placement:
    held = held or {}
    states = {h.name: _HostState(h, i, held.get(h.name)) for i, h in enumerate(inv.hosts)}
    order = task_order(inv.pools)
    chosen: dict[tuple[str, int], PlacedTask] = {}

    def take(st: _HostState, pool: Pool, index: int, port: int, accs: tuple[int, ...]) -> None:
        st.free = [a for a in st.free if a not in accs]
        st.ports.add(port)
        st.tasks += 1
        st.version += 1
        chosen[(pool.role, index)] = PlacedTask(pool.role, index, st.host, port, accs)

    # 1. Keep every still-valid slot from the previous placement, in task order.
    for pool, index in order if previous else ():
        st, slot = _kept(pool, index, previous or {}, states)
        if st is not None and slot is not None:
            take(st, pool, index, slot.port, tuple(slot.accelerators))

    # 2. Place the rest. One heap per pool over its eligible hosts, keyed by the rule
    # above; entries go stale when a host takes a task (version check), which keeps a
    # 1,000-host placement at O(tasks · log hosts).
    heaps: dict[str, list[tuple[object, ...]]] = {}

    spares = _waiting_spares(inv, states)
    prefer, slots = _preference(inv, states, len(order))
    spent = (len(inv.placement.prefer_same) + 1) * (len(states) + 1,)  # a host whose slots are taken

    def key(pool: Pool, st: _HostState) -> tuple[object, ...]:
        avoid = pool.accelerators == 0 and st.host.accelerator_count > 0
        fit = len(st.free) if pool.accelerators else 0
        rank = prefer.get(st.host.name, ()) if st.tasks < slots.get(st.host.name, 0) else spent
        return (st.host.name in spares, avoid, rank, st.tasks, fit, st.order, st.version, st.host.name)

    def heap_for(pool: Pool) -> list[tuple[object, ...]]:
        if pool.role not in heaps:
            h = [
                key(pool, st)
                for st in states.values()
                if pool.eligible(st.host) and len(st.free) >= pool.accelerators and not st.closed
            ]
            heapq.heapify(h)
            heaps[pool.role] = h
        return heaps[pool.role]

    for pool, index in order:
        if (pool.role, index) in chosen:
            continue
        heap = heap_for(pool)
        st = _best(heap, states, pool, key)
        if st is None:
            raise _no_fit(pool, index, states, held)
        take(st, pool, index, _port(pool, index, st), tuple(st.free[: pool.accelerators]))
        if len(st.free) >= pool.accelerators:
            heapq.heappush(heap, key(pool, st))

    tasks = sorted(chosen.values(), key=lambda t: (ROLES.index(t.role), t.index))
    return Placement(tuple(tasks))


def _waiting_spares(inv: Inventory, states: Mapping[str, _HostState]) -> frozenset[str]:
    """The spares that come last: all of them while every host is in service; once one (or
    some of its GPUs) is drained, set aside or closed by its health, a spare is a host like
    the others (least loaded first): the displaced replica's."""
    if any(h.drain or h.withheld for h in inv.hosts) or any(st.closed for st in states.values()):
        return frozenset()
    return frozenset(inv.spares)


def _port(pool: Pool, index: int, st: _HostState) -> int:
    """The pool's port on the host, or the next one no task of it takes."""
    port = pool.port or default_port(st.host)
    while port in st.ports:
        port += 1
    if port > 65535:
        raise PlacementError(pool.role, f"replica {index}: no free port left on {st.host.name}")
    return port


def _preference(
    inv: Inventory, states: Mapping[str, _HostState], need: int
) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
    """Under `placement.prefer_same`: each host's rank (lower first; a number per label: its
    group's, where a group that holds the job's `need` tasks comes first, the smallest of
    those first, then the others largest first), and its slots: the tasks it takes at that
    rank (one, or as many replicas of the largest as its free accelerators hold), past
    which it ranks last and the job spills into the next group (the module docstring)."""
    labels = inv.placement.prefer_same
    if not labels:
        return {}, {}
    per = max((p.accelerators for p in inv.pools), default=0)
    slots = {name: max(1, len(st.free) // per) if per else 1 for name, st in states.items()}

    def rank(members: list[_HostState]) -> tuple[object, ...]:
        cap, first = sum(slots[st.host.name] for st in members), min(st.order for st in members)
        return (0, cap, first) if cap >= need else (1, -cap, first)

    out: dict[str, list[int]] = {name: [] for name in states}
    for k, label in enumerate(labels):
        # A label's groups are ranked within its group of the labels before it.
        groups: dict[tuple[str | None, ...], dict[str, list[_HostState]]] = {}
        for st in states.values():
            value = st.host.label_map.get(label)
            if value is not None and not st.host.drain:
                prefix = tuple(st.host.label_map.get(x) for x in labels[:k])
                groups.setdefault(prefix, {}).setdefault(value, []).append(st)
        ranked = {
            (prefix, value): i
            for prefix, by_value in groups.items()
            for i, (value, _) in enumerate(sorted(by_value.items(), key=lambda item: rank(item[1])))
        }
        for name, st in states.items():
            prefix = tuple(st.host.label_map.get(x) for x in labels[:k])
            out[name].append(ranked.get((prefix, st.host.label_map.get(label, "")), len(states)))
    return {name: tuple(r) for name, r in out.items()}, slots


def _kept(
    pool: Pool, index: int, previous: Mapping[str, Slot], states: dict[str, _HostState]
) -> tuple[_HostState | None, Slot | None]:
    """The task's previous slot and its host, if the slot is still valid there."""
    slot = previous.get(f"{pool.role}-{index}")
    st = states.get(slot.host) if slot else None
    if slot is None or st is None or not pool.eligible(st.host) or st.closed == "all":
        return None, None
    base = pool.port or default_port(st.host)
    accs = tuple(slot.accelerators)
    if (
        len(accs) == pool.accelerators
        and all(a in st.free for a in accs)
        and base <= slot.port <= 65535
        and slot.port not in st.ports
    ):
        return st, slot
    return None, None


def _best(
    heap: list[tuple[object, ...]],
    states: dict[str, _HostState],
    pool: Pool,
    key: Callable[[Pool, _HostState], tuple[object, ...]],
) -> _HostState | None:
    """The best host left for one of pool's tasks: stale entries (the host took a task
    since) are pushed back with their key of now."""
    while heap:
        entry = heapq.heappop(heap)
        cand = states[str(entry[-1])]
        if entry[-2] != cand.version:
            if len(cand.free) >= pool.accelerators:
                heapq.heappush(heap, key(pool, cand))
            continue
        if len(cand.free) >= pool.accelerators:
            return cand
    return None


def _no_fit(pool: Pool, index: int, states: dict[str, _HostState], held: Mapping[str, Held]) -> PlacementError:
    eligible = [s for s in states.values() if pool.eligible(s.host)]
    free = ", ".join(f"{s.host.name} {len(s.free)}" for s in eligible[:6])
    more = f", ... ({len(eligible) - 6} more)" if len(eligible) > 6 else ""
    # Would it fit on an eligible host were it not for other jobs? Then say who holds what.
    by = tuple(f"{s.host.name}: {line}" for s in eligible for line in held.get(s.host.name, Held()).by)
    could = any(s.host.accelerator_count >= pool.accelerators for s in eligible) and bool(by)
    reason = (
        f"replica {index} does not fit: it needs {pool.accelerators} "
        f"accelerator{'' if pool.accelerators == 1 else 's'} on one host; "
        f"free on eligible hosts: {free}{more}"
    )
    hint = " (held by other jobs, below; `provision apply --queue` waits until it fits)" if could else ""
    return PlacementError(pool.role, reason, held=could, details=by, hint=hint)
