"""Placement (src/provision/placement.py): properties over random clusters and jobs.

What is proved, for every generated inventory that places at all:
- deterministic: the same inventory (even rebuilt from scratch) gives the same placement;
- no host gets more accelerators than it has; a replica's accelerators are exactly its
  pool's count, all on its one host, indices in range and unique per host;
- every task has its own host:port, at or above its pool's port;
- `hosts:` restrictions (names and label selectors) are respected;
- tasks that need no accelerators (ps, reduction servers, ...) land on accelerator-free
  hosts whenever the pool may use one;
- growth is stable: with `previous=<old placement>.slots()` no existing task moves, whatever
  grows (pools, new pools, new hosts anywhere in the list); without `previous`, no task
  moves when only the last-placed pool grows (the guarantee index-major order gives).
  Growing another pool without `previous` may move tasks: `test_growth_without_previous_
  can_move_tasks` pins the smallest such example, which is why `apply` places with the
  slots recorded in state.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from provision.core.model import ROLES, Accelerators, Host, Inventory, Pool, SSHSettings
from provision.placement.tasks import PlacementError, place, task_order

# Modest by default (the whole offline suite stays fast); PROVISION_HYPOTHESIS_EXAMPLES=5000
# for a longer hunt.
EXAMPLES = int(os.environ.get("PROVISION_HYPOTHESIS_EXAMPLES", "150"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
SSH = SSHSettings()
ACC_COUNTS = (0, 1, 2, 4, 8)


def host(i: int, count: int | None, rack: str = "r1", kind: str = "nvidia-h100") -> Host:
    acc = Accelerators(kind, count) if count else None
    return Host(f"h{i}", f"192.0.2.{i + 1}", SSH, f"10.0.0.{i + 1}", acc, (("rack", rack),))


def pool(role: str, replicas: int, accelerators: int = 0, **kw) -> Pool:
    return Pool(role=role, replicas=replicas, accelerators=accelerators, command=("/bin/true",), **kw)


def inventory(hosts, pools) -> Inventory:
    pools = sorted(pools, key=lambda p: ROLES.index(p.role))
    return Inventory(path=None, job="j", ssh=SSH, hosts=tuple(hosts), pools=tuple(pools))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- strategies


@st.composite
def hosts_st(draw, min_size=1, max_size=7):
    n = draw(st.integers(min_size, max_size))
    return [host(i, draw(st.sampled_from(ACC_COUNTS)), draw(st.sampled_from(("r1", "r2")))) for i in range(n)]


@st.composite
def pools_st(draw, hosts):
    roles = draw(st.lists(st.sampled_from(ROLES), min_size=1, max_size=5, unique=True))
    out = []
    for role in roles:
        most = 1 if role in ("chief", "evaluator") else 5
        replicas = draw(st.integers(0, most))
        accelerators = 0 if role in ("ps", "reduction_server") else draw(st.sampled_from((0, 0, 1, 2, 4, 8)))
        restriction = draw(st.sampled_from(("none", "none", "names", "selector")))
        kw: dict = {}
        if restriction == "names":
            names = draw(st.lists(st.sampled_from([h.name for h in hosts]), min_size=1, unique=True))
            kw["host_names"] = tuple(names)
        elif restriction == "selector":
            kw["host_selector"] = (("rack", draw(st.sampled_from(("r1", "r2")))),)
        kw["port"] = draw(st.sampled_from((None, None, 2222, 3000, 40000)))
        out.append(pool(role, replicas, accelerators, **kw))
    # Pools with a port of their own never share it (validation refuses that).
    seen: set[int] = set()
    for i, p in enumerate(out):
        if p.port is not None:
            if p.port in seen:
                out[i] = Pool(**{**p.__dict__, "port": None})
            seen.add(p.port)
    return out


@st.composite
def job_st(draw):
    hosts = draw(hosts_st())
    return inventory(hosts, draw(pools_st(hosts)))


def place_or_skip(inv, previous=None):
    try:
        return place(inv, previous)
    except PlacementError:
        assume(False)


# --------------------------------------------------------------------------- invariants


def check_invariants(inv: Inventory, placement) -> None:
    pools = {p.role: p for p in inv.pools}
    # every replica of every pool, once, in ROLES-then-index order
    assert [(t.role, t.index) for t in placement.tasks] == sorted(
        ((p.role, i) for p in inv.pools for i in range(p.replicas)), key=lambda x: (ROLES.index(x[0]), x[1])
    )
    used: dict[str, list[int]] = {}
    addresses = Counter()
    for t in placement.tasks:
        p = pools[t.role]
        h = inv.host(t.host.name)
        assert t.host == h
        # never split, exactly the pool's count, real indices on that host
        assert len(t.accelerators) == p.accelerators
        assert all(0 <= a < h.accelerator_count for a in t.accelerators)
        used.setdefault(h.name, []).extend(t.accelerators)
        # restrictions
        assert p.eligible(h), f"{t.name} on {h.name} outside pools.{p.role}.hosts"
        # ports
        assert (p.port or 2222) <= t.port <= 65535
        addresses[(h.name, t.port)] += 1
        assert t.address == f"{h.cluster_address}:{t.port}"
    for name, accs in used.items():
        assert len(accs) == len(set(accs)), f"{name}: an accelerator given twice"
        assert len(accs) <= inv.host(name).accelerator_count
    assert max(addresses.values(), default=1) == 1, "two tasks share a host:port"


@SETTINGS
@given(job_st())
def test_invariants(inv):
    check_invariants(inv, place_or_skip(inv))


@SETTINGS
@given(job_st())
def test_deterministic(inv):
    first = place_or_skip(inv)
    rebuilt = inventory([Host(**h.__dict__) for h in inv.hosts], [Pool(**p.__dict__) for p in inv.pools])
    assert place(rebuilt) == first
    assert place(inv) == first
    # and placing again from its own slots changes nothing
    assert place(inv, first.slots()) == first


@SETTINGS
@given(job_st())
def test_no_accelerator_tasks_prefer_hosts_without(inv):
    placement = place_or_skip(inv)
    for t in placement.tasks:
        p = inv.pool(t.role)
        if p.accelerators == 0 and any(h.accelerator_count == 0 and p.eligible(h) for h in inv.hosts):
            assert t.host.accelerator_count == 0, f"{t.name} took {t.host.name}, an accelerator host"


@SETTINGS
@given(job_st())
def test_placement_errors_are_validation_errors(inv):
    """place() fails only with a PlacementError naming a pool (never another exception)."""
    try:
        place(inv)
    except PlacementError as e:
        assert e.role in ROLES
        assert str(e).startswith(f"pools.{e.role}: ")


# --------------------------------------------------------------------------- growth


@st.composite
def growth_st(draw):
    """(old, grown): pools grow, new pools may appear, hosts may be added anywhere."""
    old = draw(job_st())
    hosts = list(old.hosts)
    for _ in range(draw(st.integers(0, 3))):
        new = host(len(hosts) + 100, draw(st.sampled_from(ACC_COUNTS)), draw(st.sampled_from(("r1", "r2"))))
        hosts.insert(draw(st.integers(0, len(hosts))), new)
    pools = []
    for p in old.pools:
        most = 1 if p.role in ("chief", "evaluator") else p.replicas + 3
        pools.append(Pool(**{**p.__dict__, "replicas": draw(st.integers(p.replicas, max(p.replicas, most)))}))
    for role in ROLES:
        if old.pool(role) is None and draw(st.booleans()):
            pools.append(pool(role, 1, 0))
    return old, inventory(hosts, pools)


@SETTINGS
@given(growth_st())
def test_growth_with_previous_moves_nothing(pair):
    old, grown = pair
    before = place_or_skip(old)
    after = place_or_skip(grown, before.slots())
    check_invariants(grown, after)
    now = after.slots()
    for name, slot in before.slots().items():
        assert now[name] == slot, f"{name} moved: {slot} -> {now[name]}"


@SETTINGS
@given(job_st(), st.integers(1, 4))
def test_growing_last_placed_pool_moves_nothing(inv, more):
    order = task_order(inv.pools)
    assume(order)
    last = order[-1][0]
    assume(last.role not in ("chief", "evaluator"))  # at most one replica: cannot grow
    grown = inventory(
        inv.hosts, [Pool(**{**p.__dict__, "replicas": p.replicas + more}) if p is last else p for p in inv.pools]
    )
    # the old order is a prefix of the new one: new tasks are appended...
    assert task_order(grown.pools)[: len(order)] == [(grown.pool(p.role), i) for p, i in order]
    before = place_or_skip(inv)
    after = place_or_skip(grown)
    # ...so placement, which is greedy in that order, keeps every existing task
    now = after.slots()
    for name, slot in before.slots().items():
        assert now[name] == slot


def test_growth_without_previous_can_move_tasks():
    """The limit of the guarantee without `previous`: growing a pool that is not placed
    last inserts its new replica before existing ones in the index-major order. Here
    worker-1 is placed before ps-1 once it exists; the job's ps-1 then moves. With the
    slots from state (`previous`), nothing moves."""
    hosts = [host(0, None), host(1, None)]
    old = inventory(hosts, [pool("worker", 1), pool("ps", 2)])
    grown = inventory(hosts, [pool("worker", 2), pool("ps", 2)])
    before = place(old).slots()
    assert place(grown).slots()["ps-1"] != before["ps-1"]
    kept = place(grown, before).slots()
    assert before and all(kept[name] == slot for name, slot in before.items())


def test_shrink_with_previous_keeps_the_rest():
    hosts = [host(i, 8) for i in range(4)]
    big = inventory(hosts, [pool("chief", 1, 8), pool("worker", 3, 8)])
    small = inventory(hosts, [pool("chief", 1, 8), pool("worker", 2, 8)])
    before = place(big).slots()
    after = place(small, before).slots()
    assert after == {k: v for k, v in before.items() if k != "worker-2"}


def test_previous_slot_no_longer_valid_is_replaced():
    """A recorded slot on a host that left the inventory, or now outside the pool's
    restriction, is re-placed; the others stay."""
    hosts = [host(i, 8) for i in range(3)]
    inv = inventory(hosts, [pool("chief", 1, 8), pool("worker", 2, 8)])
    before = place(inv).slots()
    gone = before["worker-0"].host
    rest = [h for h in hosts if h.name != gone] + [host(9, 8)]
    after = place(inventory(rest, inv.pools), before).slots()
    assert after["worker-0"].host != gone
    assert after["chief-0"] == before["chief-0"] and after["worker-1"] == before["worker-1"]


# --------------------------------------------------------------------------- examples


def test_one_replica_per_host_when_there_are_enough():
    hosts = [host(i, 8) for i in range(5)]
    p = place(inventory(hosts, [pool("chief", 1, 2), pool("worker", 4, 2)]))
    assert len({t.host.name for t in p.tasks}) == 5
    assert all(t.port == 2222 for t in p.tasks)


def test_shared_host_gets_next_free_port_and_lowest_free_accelerators():
    p = place(inventory([host(0, 8)], [pool("chief", 1, 2), pool("worker", 3, 2)]))
    assert [(t.name, t.port, t.accelerators) for t in p.tasks] == [
        ("chief-0", 2222, (0, 1)),
        ("worker-0", 2223, (2, 3)),
        ("worker-1", 2224, (4, 5)),
        ("worker-2", 2225, (6, 7)),
    ]


def test_ps_and_reduction_servers_take_cpu_hosts():
    hosts = [host(0, 8), host(1, 8), host(2, None, "r2"), host(3, None, "r2")]
    for role in ("ps", "reduction_server"):
        p = place(inventory(hosts, [pool("chief", 1, 8), pool("worker", 1, 8), pool(role, 4)]))
        assert {t.host.name for t in p.by_role(role)} == {"h2", "h3"}
        assert {t.host.name for t in p.by_role("worker") + p.by_role("chief")} == {"h0", "h1"}


def test_ps_on_gpu_hosts_when_restricted_there():
    hosts = [host(0, 8), host(1, None)]
    p = place(inventory(hosts, [pool("chief", 1, 4), pool("worker", 1, 4), pool("ps", 1, host_names=("h0",))]))
    assert p.task("ps-0").host.name == "h0"


def test_best_fit_keeps_big_hosts_for_big_replicas():
    """A 2-GPU replica goes to the 2-GPU host, leaving the 8-GPU host whole."""
    hosts = [host(0, 8), host(1, 2)]
    p = place(inventory(hosts, [pool("chief", 1, 2), pool("worker", 1, 8)]))
    assert p.task("chief-0").host.name == "h1"
    assert p.task("worker-0").host.name == "h0"


def test_selector_and_names():
    hosts = [host(0, 8, "r1"), host(1, 8, "r2"), host(2, 8, "r2")]
    p = place(
        inventory(
            hosts,
            [pool("chief", 1, 8, host_names=("h0",)), pool("worker", 2, 8, host_selector=(("rack", "r2"),))],
        )
    )
    assert p.task("chief-0").host.name == "h0"
    assert {t.host.name for t in p.by_role("worker")} == {"h1", "h2"}


def test_does_not_fit_names_the_pool_and_replica():
    hosts = [host(0, 8), host(1, 8)]
    with pytest.raises(PlacementError) as e:
        place(inventory(hosts, [pool("chief", 1, 6), pool("worker", 2, 5)]))
    assert str(e.value) == (
        "pools.worker: replica 1 does not fit: it needs 5 accelerators on one host; free on eligible hosts: h0 2, h1 3"
    )


def test_large_cluster_is_fast():
    import time

    hosts = [host(i, 8) for i in range(1000)] + [host(2000 + i, None) for i in range(4)]
    inv = inventory(hosts, [pool("chief", 1, 8), pool("worker", 999, 8), pool("ps", 4)])
    t0 = time.process_time()
    p = place(inv)
    assert time.process_time() - t0 < 1.0
    assert len({t.host.name for t in p.tasks}) == 1004
    check_invariants(inv, p)
