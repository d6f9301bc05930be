"""The queue's order on a shared host (rules/queueorder.py): work that would fit
does not take GPUs where waiting work ahead of it (priority, then submission) needs some."""

from __future__ import annotations

import pytest

from provision.core.model import Host, Pool, SSHSettings
from provision.placement.tasks import PlacedTask, Placement, PlacementError
from provision.rules.priority import Policy
from provision.rules.queueorder import check_turn, place_in_queue, takes, waits_behind
from provision.rules.tenancy import Hold, Holder, Owner, Turn

NOW = 1_800_000_000.0
LOW, NORMAL, HIGH = 100, 500, 1000


def holder(job: str, *, host: str = "h1", prio: int = NORMAL, sub: float = NOW - 60, hold: Hold = Hold.QUEUED,
           gpus: tuple[int, ...] = (), need: int = 1) -> Holder:  # fmt: skip
    owner = Owner("L-" + job, f"{job}-owner@lab", "ws", 1, "/s")
    queued = (sub, "room") if hold is Hold.QUEUED else None
    return Holder(host, job, owner, gpus, (), sub, hold, "t", (), queued, prio, False, sub, need)


# (what else is on h1, my priority, my submission) -> the job I wait behind (None: I go)
CASES = [
    ([], NORMAL, NOW, None),
    ([holder("a", prio=HIGH)], NORMAL, NOW, "a"),  # higher priority waits: it goes first
    ([holder("a", prio=LOW)], NORMAL, NOW, None),  # lower priority: I go first
    ([holder("a", sub=NOW - 60)], NORMAL, NOW, "a"),  # same priority, earlier: first come
    ([holder("a", sub=NOW + 60)], NORMAL, NOW, None),  # same priority, later
    ([holder("a", prio=HIGH, sub=NOW + 60)], NORMAL, NOW, "a"),  # priority before time
    ([holder("a", prio=LOW, sub=NOW - 3600)], HIGH, NOW, None),
    ([holder("a", prio=HIGH, hold=Hold.STALE)], NORMAL, NOW, None),  # its apply is gone
    ([holder("a", prio=HIGH, hold=Hold.RUNNING, gpus=(0,))], NORMAL, NOW, None),  # running, not waiting
    ([holder("a", prio=HIGH, need=0)], NORMAL, NOW, None),  # needs no GPU here
    ([holder("a", prio=HIGH, host="h2")], NORMAL, NOW, None),  # waits on another host
    ([holder("a", prio=HIGH), holder("b", prio=HIGH, sub=NOW - 600)], NORMAL, NOW, "b"),  # the head
    ([holder("me", prio=HIGH)], NORMAL, NOW, None),  # my own mark
]


@pytest.mark.parametrize(("others", "prio", "sub", "want"), CASES)
def test_who_goes_first(others: list[Holder], prio: int, sub: float, want: str | None) -> None:
    held_by: dict[str, list[Holder]] = {}
    for h in others:
        held_by.setdefault(h.host, []).append(h)
    got = waits_behind("me", prio, sub, {"h1": {0}}, held_by)
    assert [b.ahead.job for b in got] == ([want] if want else [])


# A preempted job's place in the queue where it held GPUs: its entry (low,
# submitted NOW - 600) ordered against the waiting work there -> its place (None: no entry).
ME = holder("me", prio=LOW, sub=NOW - 600, hold=Hold.ENDED)
PLACES = [
    ([ME], 1),  # nothing waits: first
    ([ME, holder("a", prio=HIGH), holder("b", prio=NORMAL)], 3),  # two of higher priority
    ([ME, holder("a", prio=LOW, sub=NOW - 900)], 2),  # same priority, submitted earlier
    ([ME, holder("a", prio=LOW, sub=NOW - 60)], 1),  # same priority, later: behind it
    ([ME, holder("a", prio=HIGH, hold=Hold.STALE)], 1),  # its apply is gone
    ([ME, holder("a", prio=HIGH, hold=Hold.RUNNING, gpus=(0,))], 1),  # running, not waiting
    ([ME, holder("a", prio=HIGH, need=0)], 1),  # needs no GPU there
    ([ME, holder("a", prio=HIGH, host="h3")], 1),  # waits on a host it does not need
    ([ME, holder("a", prio=HIGH), holder("a", prio=HIGH, host="h2")], 2),  # one job on two hosts: once
    ([holder("a", prio=HIGH)], None),  # no entry of its own to order it by
]


@pytest.mark.parametrize(("entries", "want"), PLACES)
def test_a_preempted_jobs_place_in_the_queue(entries: list[Holder], want: int | None) -> None:
    held_by: dict[str, list[Holder]] = {}
    for h in entries:
        held_by.setdefault(h.host, []).append(h)
    assert place_in_queue("me", ["h1", "h2"], held_by) == want


def mk(name: str) -> Host:
    return Host(name, "10.0.0.1", SSHSettings(), "10.0.0.1")


def placed(host: str, *accs: int, role: str = "worker") -> PlacedTask:
    return PlacedTask(role, 0, mk(host), 2222, tuple(accs))


def test_takes_counts_only_new_gpus() -> None:
    p = Placement((placed("h1", 0, 1), placed("h2")))
    mine = Holder("h1", "me", None, (0, 1), (), NOW, Hold.RUNNING, "t")
    assert takes("me", p, {}) == {"h1": {0, 1}}
    assert takes("me", p, {"h1": [mine]}) == {}  # already mine: a re-apply waits behind no one
    ended = Holder("h1", "me", None, (0, 1), (), NOW, Hold.ENDED, "t")
    assert takes("me", p, {"h1": [ended]}) == {"h1": {0, 1}}  # ended: its rerun takes them anew


def test_a_plain_apply_fails_naming_the_work_ahead() -> None:
    p = Placement((placed("h1", 0),))
    ahead = holder("deadline", prio=HIGH, sub=NOW - 180)
    with pytest.raises(PlacementError) as e:
        check_turn("me", Turn(NORMAL, False, NOW), p, {"h1": [ahead]}, NOW, Policy())
    assert e.value.held
    assert e.value.message == (
        "pools.worker: waiting behind deadline (deadline-owner@lab, priority high, queued 3m ago) for GPUs on h1 "
        "(`provision apply --queue` waits its turn)"
    )
    check_turn("me", Turn(HIGH, False, NOW - 600), p, {"h1": [ahead]}, NOW, Policy())  # ahead of it: goes


def test_need_on_a_host_is_the_largest_eligible_task() -> None:
    from provision.rules.queueorder import need_on  # here: the one test of it

    class Inv:  # the two fields need_on reads
        hosts = (mk("h1"),)
        pools = (Pool("chief", 1, accelerators=2), Pool("worker", 2, accelerators=4))

    assert need_on(Inv(), "h1") == 4  # type: ignore[arg-type]
    assert need_on(Inv(), "elsewhere") == 0  # type: ignore[arg-type]


def test_a_fitted_queue_keeps_its_marks_until_the_apply_is_done() -> None:
    """No gap between the queue mark and the reservation: work behind it keeps waiting."""
    from provision.run.queue import Queue  # here: the one test that needs run/

    marks: list[str | None] = []
    tries = iter([PlacementError("worker", "full", held=True), None])

    def make() -> str:
        e = next(tries)
        if e is not None:
            raise e
        return "plan"

    q = Queue(None, lambda line: None, marks.append, poll=0.01)
    assert q.plan(make) == "plan" and marks == ["pools.worker: full"]
    q.done()
    q.done()  # once
    assert marks == ["pools.worker: full", None]

    failing = Queue(None, lambda line: None, marks.append, poll=0.01)
    bad = iter([PlacementError("worker", "full", held=True), PlacementError("worker", "bad")])

    def worse() -> str:
        raise next(bad)

    with pytest.raises(PlacementError):
        failing.plan(worse)
    assert marks[-1] is None  # a wait that ends without a plan takes its marks away at once
