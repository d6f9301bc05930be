"""rules/admission.admit as a table: which queued applies get a worker after a round."""

from __future__ import annotations

from typing import Any

from provision.rules.admission import AGAIN_S, AT_ONCE, RECHECK_S, Queued, admit
from provision.rules.rounds import Round

NOW = 10_000.0


def rnd(free: dict[str, int], demand: dict[str, Any]) -> Round:
    doc = {"hosts": {h: {"error": None, "free_gpus": list(range(n))} for h, n in free.items()}, "jobs": []}
    return Round(1, NOW, {}, doc, demand=demand)


def q(sid: str, priority: int = 500, submitted: float = 1.0, looked: float = 0.0) -> Queued:
    return Queued(sid, sid, priority, submitted, looked)


ONE = ((1, frozenset({"h1", "h2"})),)


def test_those_that_fit_are_admitted_in_the_queues_order_and_take_their_gpus() -> None:
    r = rnd({"h1": 1, "h2": 1}, {"a": ONE, "b": ONE, "c": ONE})
    got = admit([q("c", submitted=3), q("a", submitted=1), q("b", submitted=2)], r, NOW)
    assert got == ["a", "b"]  # c: the two free GPUs went to those ahead


def test_a_higher_priority_goes_first_and_a_strict_queue_blocks_the_hosts_of_one_that_does_not_fit() -> None:
    big = ((4, frozenset({"h1"})),)
    r = rnd({"h1": 2, "h2": 1}, {"big": big, "small": ((1, frozenset({"h1"})),), "other": ((1, frozenset({"h2"})),)})
    got = admit([q("small", submitted=1), q("big", priority=1000, submitted=2), q("other", submitted=3)], r, NOW)
    assert got == ["other"]  # big waits on h1 and holds small back there; h2 is free for other


def test_new_ones_are_looked_at_a_few_at_a_time_and_not_again_at_once() -> None:
    r = rnd({}, {})  # not in the round yet: their snapshots are new
    assert admit([q(f"s{n}") for n in range(10)], r, NOW) == [f"s{n}" for n in range(AT_ONCE)]
    assert admit([q("s0", looked=NOW - AGAIN_S / 2)], r, NOW) == []
    assert admit([q("s0")], r, NOW, running=AT_ONCE) == []


def test_one_that_does_not_fit_waits_as_a_row_until_it_is_due_a_look() -> None:
    r = rnd({"h1": 0, "h2": 0}, {"a": ONE})
    assert admit([q("a")], r, NOW) == []  # never looked at, and the round says no room: no worker
    assert admit([q("a", looked=NOW - 60)], r, NOW) == []
    assert admit([q("a", looked=NOW - RECHECK_S)], r, NOW) == ["a"]  # what a round cannot see: looked at again
