"""rules/preemption.py and rules/priority.py as tables: who leaves so waiting work fits."""

from __future__ import annotations

import pytest

from provision.rules.preemption import Running, Victim, Waiting, Why, decide
from provision.rules.priority import DEFAULT_CLASSES, Policy, PriorityError, level, name_of, queue_key

LOW, NORMAL, HIGH = DEFAULT_CLASSES["low"], DEFAULT_CLASSES["normal"], DEFAULT_CLASSES["high"]


def run(
    job: str, owner: str = "bo", prio: int = LOW, *, started: float = 0.0, preemptible: bool = True, **gpus: int
) -> Running:
    return Running(job, owner, prio, preemptible, started, tuple(gpus.items()))


def wait(owner: str = "ana", prio: int = HIGH, **need: int) -> Waiting:
    return Waiting("deadline", owner, prio, tuple(need.items()))


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
        Waiting("deadline", "ana", HIGH, (("h1", 2),)),
        [Running("deadline", "ana", LOW, True, 0, (("h1", 2),))],
        {"h1": 0},
        NONE,
        None,
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
