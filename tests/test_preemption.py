"""rules/preemption.py and rules/priority.py as tables: who leaves so waiting work fits;
and the rule as a property over every shape of a small cluster (hypothesis): hosts and
their GPUs, running jobs of several owners spanning hosts, guarantees, and waiting work
whose replicas may go on any of several hosts."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provision.rules.preemption import Replica, Running, Victim, Waiting, Why, decide, fit, need_of
from provision.rules.priority import DEFAULT_CLASSES, Policy, PriorityError, level, name_of, queue_key

LOW, NORMAL, HIGH = DEFAULT_CLASSES["low"], DEFAULT_CLASSES["normal"], DEFAULT_CLASSES["high"]


def run(
    job: str, owner: str = "bo", prio: int = LOW, *, started: float = 0.0, preemptible: bool = True, **gpus: int
) -> Running:
    return Running(job, owner, prio, preemptible, started, tuple(gpus.items()))


def wait(owner: str = "ana", prio: int = HIGH, **need: int) -> Waiting:
    """Waiting work placed already: `need` GPUs on each host."""
    return Waiting.placed("deadline", owner, prio, need)


def anywhere(owner: str, prio: int, *gpus: int, hosts: Sequence[str]) -> Waiting:
    """Waiting work of one replica per item of `gpus`, each on any of `hosts`."""
    return Waiting("deadline", owner, prio, tuple(Replica(n, tuple(hosts)) for n in gpus))


def jobs(v: tuple[Victim, ...] | None) -> list[str] | None:
    return None if v is None else [x.job for x in v]


NONE = Policy()
QUOTA = Policy(guarantees=(("ana", 4), ("bo", 2)))

CASES = [
    # (what, waiting, running, free, policy, victims)
    ("fits already: nothing preempted", wait(h1=2), [run("sweep", h1=2)], {"h1": 2}, NONE, []),
    ("a lower priority sweep leaves", wait(h1=2), [run("sweep", h1=4)], {"h1": 0}, NONE, ["sweep"]),
    ("the same priority stays", wait(prio=LOW, h1=2), [run("sweep", h1=4)], {"h1": 0}, NONE, None),
    ("a higher priority stays", wait(prio=NORMAL, h1=2), [run("x", prio=HIGH, h1=4)], {"h1": 0}, NONE, None),
    ("not preemptible stays", wait(h1=2), [run("sweep", preemptible=False, h1=4)], {"h1": 0}, NONE, None),
    (
        "the latest started leaves first (least work lost)",
        wait(h1=2),
        [run("old", started=1, h1=2), run("new", started=9, h1=2)],
        {"h1": 0},
        NONE,
        ["new"],
    ),
    (
        "the lowest priority leaves before a newer one",
        wait(h1=2),
        [run("lowest", prio=10, started=1, h1=2), run("low", prio=LOW, started=9, h1=2)],
        {"h1": 0},
        NONE,
        ["lowest"],
    ),
    (
        "work on other hosts does not help and stays",
        wait(h1=2),
        [run("elsewhere", started=9, h2=4), run("here", started=1, h1=2)],
        {"h1": 0, "h2": 0},
        NONE,
        ["here"],
    ),
    (
        "free GPUs count: one of two small jobs is enough",
        wait(h1=3),
        [run("a", started=1, h1=2), run("b", started=2, h1=2)],
        {"h1": 1},
        NONE,
        ["b"],
    ),
    (
        "a victim not needed after all is spared",
        wait(h1=4),
        [run("small", started=9, h1=1), run("big", started=1, h1=4)],
        {"h1": 0},
        NONE,
        ["big"],
    ),
    (
        "two hosts: one victim on each",
        wait(h1=2, h2=2),
        [run("a", h1=2), run("b", h2=2)],
        {"h1": 0, "h2": 0},
        NONE,
        ["a", "b"],
    ),
    ("cannot fit even with every candidate gone: nothing", wait(h1=8), [run("a", h1=4)], {"h1": 0}, NONE, None),
    (
        "within its guarantee, equal priority: the borrower leaves",
        wait(owner="ana", prio=NORMAL, h1=2),
        [run("bo-extra", owner="bo", prio=NORMAL, h1=4)],
        {"h1": 0},
        QUOTA,
        ["bo-extra"],
    ),
    (
        "beyond its guarantee, equal priority: nobody leaves",
        wait(owner="ana", prio=NORMAL, h1=6),
        [run("bo-extra", owner="bo", prio=NORMAL, h1=4)],
        {"h1": 2},
        QUOTA,
        None,
    ),
    (
        "a borrower is not taken below its guarantee",
        wait(owner="ana", prio=NORMAL, h1=2),
        [run("bo-own", owner="bo", prio=NORMAL, h1=2)],
        {"h1": 0},
        QUOTA,
        None,
    ),
    (
        "borrowing is preempted before lower priority",
        wait(owner="ana", prio=NORMAL, h1=2),
        [run("lowjob", owner="cy", prio=LOW, started=9, h1=2), run("bo-extra", owner="bo", prio=NORMAL, h1=4)],
        {"h1": 0},
        QUOTA,
        ["bo-extra"],
    ),
    (
        "the waiting job itself is never its own victim",
        Waiting.placed("deadline", "ana", HIGH, {"h1": 2}),
        [Running("deadline", "ana", LOW, True, 0, (("h1", 2),))],
        {"h1": 0},
        NONE,
        None,
    ),
    (
        "each borrower goes only while its owner borrows: after one, the other is bob's guarantee",
        wait(owner="ana", prio=NORMAL, h1=4, h2=4),
        [
            run("bob-a", owner="bob", prio=NORMAL, started=1, h1=4),
            run("bob-b", owner="bob", prio=NORMAL, started=2, h2=4, h3=4),
        ],
        {"h1": 0, "h2": 0, "h3": 0},
        Policy(guarantees=(("ana", 8), ("bob", 4))),
        None,
    ),
    (
        "where it goes is free: one borrower emptying two hosts is enough",
        anywhere("ana", NORMAL, 4, 4, hosts=("h1", "h2", "h3")),
        [
            run("bob-a", owner="bob", prio=NORMAL, started=1, h1=4),
            run("bob-b", owner="bob", prio=NORMAL, started=2, h2=4, h3=4),
        ],
        {"h1": 0, "h2": 0, "h3": 0},
        Policy(guarantees=(("ana", 8), ("bob", 4))),
        ["bob-b"],
    ),
    (
        "the same, the smaller borrower started last: the one that frees two hosts goes",
        anywhere("ana", NORMAL, 4, 4, hosts=("h1", "h2", "h3")),
        [
            run("bob-a", owner="bob", prio=NORMAL, started=2, h1=4),
            run("bob-b", owner="bob", prio=NORMAL, started=1, h2=4, h3=4),
        ],
        {"h1": 0, "h2": 0, "h3": 0},
        Policy(guarantees=(("ana", 8), ("bob", 4))),
        ["bob-b"],
    ),
    (
        "a replica is never split across hosts",
        anywhere("ana", HIGH, 4, hosts=("h1", "h2")),
        [run("a", started=1, h1=2), run("b", started=2, h2=2)],
        {"h1": 2, "h2": 2},
        NONE,
        ["b"],
    ),
    (
        "either host would do: the latest started leaves (the least work lost)",
        anywhere("ana", HIGH, 4, hosts=("h1", "h2")),
        [run("big", started=1, h1=4), run("small", started=9, h2=1)],
        {"h1": 0, "h2": 3},
        NONE,
        ["small"],
    ),
]


@pytest.mark.parametrize(("what", "w", "running", "free", "policy", "victims"), CASES, ids=[c[0] for c in CASES])
def test_decide(
    what: str, w: Waiting, running: list[Running], free: dict[str, int], policy: Policy, victims: list[str] | None
) -> None:
    assert jobs(decide(w, running, free, policy)) == victims


def test_each_victim_says_why() -> None:
    got = decide(
        wait(owner="ana", prio=NORMAL, h1=4),
        [run("b", owner="bo", prio=NORMAL, h1=4), run("c", owner="cy", prio=LOW, h1=2)],
        {"h1": 0},
        QUOTA,
    )
    assert got == (Victim("b", "bo", Why.BORROWING),)


def test_groups_share_a_guarantee() -> None:
    p = Policy(guarantees=(("vision", 4),), groups=(("ana", "vision"), ("eli", "vision")))
    assert p.guarantee("eli") == 4 and p.guarantee("bo") == 0
    # eli's 2 GPUs count against vision's 4: ana's 2 more still fit within it.
    got = decide(
        wait(owner="ana", prio=NORMAL, h1=2),
        [run("eli-job", owner="eli", prio=NORMAL, preemptible=False, h2=2), run("bo-x", owner="bo", prio=NORMAL, h1=2)],
        {"h1": 0, "h2": 0},
        p,
    )
    assert jobs(got) == ["bo-x"]


# --------------------------------------------------------------------------- the rule, for every shape

EXAMPLES = int(os.environ.get("PROVISION_HYPOTHESIS_EXAMPLES", "400"))
OWNERS = ("ana", "bob", "cy", "eli")


@st.composite
def shapes(draw: st.DrawFn) -> tuple[Waiting, list[Running], dict[str, int], Policy]:
    """A cluster of up to 4 hosts of up to 4 GPUs (each its own count), up to 6 running
    jobs of a few owners, each of replicas on one or more hosts, owners' guarantees (two
    of them sharing a group's, now and then), and waiting work of up to 3 replicas, each
    allowed on some of the hosts."""
    hosts = {f"h{i}": draw(st.integers(1, 4)) for i in range(1, draw(st.integers(1, 4)) + 1)}
    names = sorted(hosts)
    left = dict(hosts)
    running = []
    for i in range(draw(st.integers(0, 6))):
        held: dict[str, int] = {}
        for _ in range(draw(st.integers(1, 3))):
            h = draw(st.sampled_from(names))
            n = draw(st.integers(1, hosts[h]))
            if left[h] >= n:
                left[h] -= n
                held[h] = held.get(h, 0) + n
        if held:
            owner = draw(st.sampled_from(OWNERS))
            prio = draw(st.sampled_from((LOW, NORMAL, NORMAL, HIGH)))
            preemptible = draw(st.sampled_from((True, True, True, False)))
            started = float(draw(st.integers(0, 5)))
            running.append(Running(f"j{i}", owner, prio, preemptible, started, tuple(sorted(held.items()))))
    replicas = tuple(
        Replica(draw(st.integers(1, 4)), tuple(sorted(draw(st.sets(st.sampled_from(names), min_size=1)))))
        for _ in range(draw(st.integers(1, 3)))
    )
    w = Waiting("w", draw(st.sampled_from(OWNERS)), draw(st.sampled_from((LOW, NORMAL, NORMAL, HIGH))), replicas)
    guarantees = tuple((o, draw(st.integers(0, 10))) for o in (*OWNERS, "team") if draw(st.booleans()))
    groups = (("cy", "team"), ("eli", "team")) if draw(st.booleans()) else ()
    return w, running, left, Policy(guarantees=guarantees, groups=groups)


# The rule as docs/inventory.md states it, written here apart from rules/preemption.py.


def fits_by_force(w: Waiting, free: dict[str, int], gone: Sequence[Running]) -> bool:
    room = dict(free)
    for r in gone:
        for h, n in r.gpus:
            room[h] += n
    for hosts in itertools.product(*(r.hosts for r in w.replicas)):
        took: dict[str, int] = {}
        for h, r in zip(hosts, w.replicas, strict=True):
            took[h] = took.get(h, 0) + r.gpus
        if all(n <= room[h] for h, n in took.items()):
            return True
    return False


def usage(running: Sequence[Running], policy: Policy) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in running:
        out[policy.quota_of(r.owner)] = out.get(policy.quota_of(r.owner), 0) + sum(n for _, n in r.gpus)
    return out


def whys(w: Waiting, running: Sequence[Running], policy: Policy) -> dict[str, Why]:
    """Who may leave for `w`, and why: preemptible work of a lower priority; or, when `w`
    fits within its owner's guarantee, preemptible work of another owner beyond theirs."""
    use = usage(running, policy)
    need = sum(r.gpus for r in w.replicas)
    within = use.get(policy.quota_of(w.owner), 0) + need <= policy.guarantee(w.owner)
    out = {}
    for r in running:
        q = policy.quota_of(r.owner)
        if not r.preemptible:
            continue
        if r.priority < w.priority:
            out[r.job] = Why.LOWER_PRIORITY
        elif within and q != policy.quota_of(w.owner) and use.get(q, 0) > policy.guarantee(r.owner):
            out[r.job] = Why.BORROWING
    return out


def rank_key(r: Running, why: Why) -> tuple[bool, int, float, str]:
    """The documented order: borrowing first, then the lowest priority, then the latest started."""
    return (why is not Why.BORROWING, r.priority, -r.started, r.job)


def within_guarantees(
    victims: Sequence[Running], why: dict[str, Why], running: Sequence[Running], policy: Policy
) -> bool:
    """Taken in the documented order, each borrower leaves while its owner (less the
    victims of that owner before it) still uses more than it is guaranteed."""
    use = usage(running, policy)
    for r in victims:
        q = policy.quota_of(r.owner)
        if why[r.job] is Why.BORROWING and use.get(q, 0) <= policy.guarantee(r.owner):
            return False
        use[q] = use.get(q, 0) - sum(n for _, n in r.gpus)
    return True


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes())
def test_the_rule_holds_for_every_shape(shape: tuple[Waiting, list[Running], dict[str, int], Policy]) -> None:
    """Whenever some set of victims the rule allows (preemptible; of a lower priority, or
    borrowing while the waiting work is within its owner's guarantee; no borrower taken
    once its owner is back within its guarantee) lets the waiting work fit, each replica
    whole on one of its hosts, the decision frees room with such a set; the set is the one
    the documented order prefers (the latest in the order leaves only when nothing before
    it would do, then the next, ...), so nothing is preempted that is not needed; and when
    no such set exists, nothing is preempted."""
    w, running, free, policy = shape
    why = whys(w, running, policy)
    cands = sorted((r for r in running if r.job in why), key=lambda r: rank_key(r, why[r.job]))
    rank = {r.job: i for i, r in enumerate(cands)}
    allowed = []
    for k in range(len(cands) + 1):
        for s in itertools.combinations(cands, k):  # in the documented order
            if within_guarantees(s, why, running, policy) and fits_by_force(w, free, s):
                allowed.append(s)
    got = decide(w, running, free, policy)
    if not allowed:
        assert got is None, (got, w, running, free, policy)
        return
    assert got is not None, (allowed, w, running, free, policy)
    by = {r.job: r for r in running}
    victims = [by[v.job] for v in got]
    assert [v.why for v in got] == [why[v.job] for v in got]  # each says why, as the rule has it
    assert [rank[v.job] for v in got] == sorted(rank[v.job] for v in got)  # taken in the order
    assert within_guarantees(victims, why, running, policy)  # no work within its guarantee
    assert fits_by_force(w, free, victims)  # the waiting work fits
    for v in victims:  # no victim it could do without
        assert not fits_by_force(w, free, [x for x in victims if x is not v]), (got, w, running, free, policy)
    best = min(allowed, key=lambda s: sorted((rank[r.job] for r in s), reverse=True))
    assert [v.job for v in got] == [r.job for r in best], (got, best, w, running, free, policy)
    need = need_of(w, free, victims)  # where it goes: each replica whole, within the room made
    assert need is not None and sum(need.values()) == w.gpus


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 4), st.sets(st.sampled_from(("a", "b", "c")), min_size=1)), max_size=4),
    st.fixed_dictionaries({h: st.integers(0, 6) for h in ("a", "b", "c")}),
)
def test_fit_is_exact(reps: list[tuple[int, set[str]]], room: dict[str, int]) -> None:
    replicas = tuple(Replica(n, tuple(sorted(hs))) for n, hs in reps)
    w = Waiting("w", "ana", NORMAL, replicas)
    got = fit(replicas, room)
    assert (got is not None) == fits_by_force(w, room, ())
    if got is not None:
        assert all(n <= room[h] for h, n in got.items()) and sum(got.values()) == w.gpus


def test_a_search_out_of_steps_preempts_nothing_on_a_guess() -> None:
    w = anywhere("ana", HIGH, 4, 4, hosts=("h1", "h2", "h3"))
    running = [run("a", started=1, h1=4), run("b", started=2, h2=4), run("c", started=3, h3=4)]
    free = {"h1": 0, "h2": 0, "h3": 0}
    assert jobs(decide(w, running, free, NONE)) == ["c", "b"]
    assert decide(w, running, free, NONE, budget=0) is None


@pytest.mark.parametrize(
    ("value", "policy", "want"),
    [(7, Policy(), 7), ("high", Policy(), HIGH), ("urgent", Policy(classes=(("urgent", 5000),)), 5000)],
)
def test_level(value: int | str, policy: Policy, want: int) -> None:
    assert level(value, policy) == want


def test_an_unknown_class_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(PriorityError) as e:
        level("urgent", Policy())
    assert (
        str(e.value)
        == "priority: 'urgent' is not a class of the team's policy (known: low (100), normal (500), high (1000))"
    )


def test_names_and_queue_order() -> None:
    assert name_of(HIGH, Policy()) == "high" and name_of(42, Policy()) == "42"
    waiting = [("a", LOW, 1.0), ("b", HIGH, 5.0), ("c", HIGH, 2.0), ("d", NORMAL, 0.0)]
    assert [j for j, p, t in sorted(waiting, key=lambda x: queue_key(x[1], x[2], x[0]))] == ["c", "b", "d", "a"]
