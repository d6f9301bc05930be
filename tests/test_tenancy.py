"""Shared hosts, pure parts: the hold rule, ownership, reservations, placement around what
others hold, and the host ledger's compare-and-set (run locally on a temporary directory)."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from pathlib import Path

import pytest

from clirun import wait_until
from provision.core.model import Accelerators, Host, Inventory, Pool, SSHSettings
from provision.host import layout, ledger
from provision.host.protocol import ProbeReport, Reservation
from provision.io.steps import GroupResult, Step
from provision.placement.tasks import Held, PlacementError, place
from provision.rules.priority import Policy
from provision.rules.tenancy import (
    Hold,
    Owner,
    held_for,
    holders,
    host_view,
    jobs_json,
    jobs_lines,
    judge,
    owner_problem,
    queued_lines,
    reservation,
)

NOW = 1_800_000_000.0
HERE = socket.gethostname()


def dead_pid() -> int:
    """A PID no process has: above the largest pid_max Linux allows (2**22). A process that
    just exited would do only until its PID is given again: the suite spawns tens of
    thousands, and pid_max is often 32768 (this case once failed so in CI)."""
    return 2**22 + 1


def entry(
    job="other",
    *,
    gpus=(0, 1),
    ports=(2222,),
    started=True,
    units=None,
    owner=None,
    updated=NOW,
    token="t1",
    held=False,
):
    return {
        **({"held": True} if held else {}),
        "job": job,
        "owner": owner or {"lineage": "L-" + job, "who": "alice@ws-3", "host": "ws-3", "pid": 1, "state": "/s"},
        "since": NOW - 7200,
        "updated": updated,
        "token": token,
        "gpus": list(gpus),
        "ports": list(ports),
        "units": units if units is not None else [f"provision-{job}-chief-0.service"],
        "started": started,
    }


ACTIVE = {"ActiveState": "active", "SubState": "running"}
RESTARTING = {"ActiveState": "activating", "SubState": "auto-restart"}
ENDED = {"ActiveState": "inactive", "SubState": "dead"}
FAILED = {"ActiveState": "failed", "SubState": "failed"}


@pytest.mark.parametrize(
    "e, state, want",
    [
        (entry(), ACTIVE, Hold.RUNNING),
        (entry(), RESTARTING, Hold.RUNNING),
        (entry(), ENDED, Hold.ENDED),
        (entry(), FAILED, Hold.ENDED),
        (entry(started=False), ENDED, Hold.RESERVED),  # an apply under way elsewhere
        (entry(started=False, updated=NOW - 3600), ENDED, Hold.STALE),  # too old
        (
            entry(started=False, owner={"lineage": "L", "who": "me@here", "host": HERE, "pid": dead_pid()}),
            ENDED,
            Hold.STALE,
        ),
        (
            entry(started=False, owner={"lineage": "L", "who": "me@here", "host": HERE, "pid": os.getpid()}),
            ENDED,
            Hold.RESERVED,
        ),
        # An apply from this machine that is still alive holds, however old (a long setup).
        (
            entry(
                started=False,
                updated=NOW - 3600,
                owner={"lineage": "L", "who": "me@here", "host": HERE, "pid": os.getpid()},
            ),
            ENDED,
            Hold.RESERVED,
        ),
        (entry(started=False), ACTIVE, Hold.RUNNING),
        # `provision stop --hold`: ended, yet holding, however old.
        (entry(held=True, updated=NOW - 86400), ENDED, Hold.HELD),
        (entry(held=True), ACTIVE, Hold.RUNNING),
    ],
)
def test_the_hold_rule(e, state, want):
    assert judge(e, {u: state for u in e["units"]}, NOW) is want


def report(*entries, units=None, listening=(22,)) -> ProbeReport:
    led = {e["job"]: e for e in entries}
    return ProbeReport(ledger=led, ledger_units=units or {}, listening=list(listening))


def test_held_for_placement_counts_running_and_reserved_jobs_and_foreign_listeners():
    run = entry("run", gpus=(0,), ports=(2222,))
    gone = entry("gone", gpus=(1,), ports=(2223,))
    rep = report(run, gone, units={run["units"][0]: ACTIVE, gone["units"][0]: ENDED}, listening=(22, 2222, 8888))
    hs = holders("gpu-1", rep, NOW)
    held = held_for("mine", hs, rep.listening or [], NOW)
    assert held.gpus == {0} and held.ports == {22, 2222, 8888}  # 2222 is run's own listener
    assert held.by[0].startswith("GPU 0, port 2222 held by job run (alice@ws-3, running 2h)")
    assert held.by[-1] == "port 8888 in use by processes provision did not start"
    # its own entry never blocks a job
    assert held_for("run", hs, [], NOW).gpus == frozenset()


def me(lineage="L-me", state="/home/me/.provision/j.state.json") -> Owner:
    return Owner(lineage, "me@here", HERE, os.getpid(), state)


def test_ownership():
    own = holders("h", report(entry("j", owner=me("L-other", "/elsewhere").to_json())), NOW)[0]
    assert "belongs to me@here" in (owner_problem("j", own, me(), False) or "")
    assert owner_problem("j", own, me(), True) is None  # --take-over
    assert owner_problem("j", None, me(), False) is None  # nobody's yet
    mine = holders("h", report(entry("j", owner=me().to_json())), NOW)[0]
    assert owner_problem("j", mine, me(), False) is None
    # the same state file recreated (lost or moved away): the same owner, adopted
    lost = holders("h", report(entry("j", owner=me("L-old").to_json())), NOW)[0]
    assert owner_problem("j", lost, me(), False) is None


def test_reservation_only_when_the_entry_differs():
    task = type("T", (), {"accelerators": (0, 1), "port": 2222})()
    unit = "provision-j-chief-0.service"
    other = entry("other", gpus=(), ports=(2300,), token="tok")
    hs = holders("h", report(other, units={other["units"][0]: ENDED}), NOW)
    r = reservation("j", [task], [unit], hs, me(), {0: "GPU-a", 1: "GPU-b"})
    assert r is not None and r.gpus == [0, 1] and r.ports == [2222] and r.gpu_uuids == ["GPU-a", "GPU-b"]
    assert r.free == {"other": "tok"} and r.expect_lineage is None
    there = entry("j", gpus=(0, 1), ports=(2222,), units=[unit], owner=me().to_json())
    assert reservation("j", [task], [unit], holders("h", report(there), NOW), me(), {}) is None


def test_placement_goes_around_what_others_hold():
    hosts = tuple(
        Host(f"h{i}", f"10.0.0.{i}", SSHSettings(), f"10.0.0.{i}", Accelerators("nvidia-h100", 2)) for i in (1, 2)
    )
    pools = (
        Pool(role="chief", replicas=1, accelerators=1, command=("x",)),
        Pool(role="worker", replicas=1, accelerators=1, command=("x",)),
    )
    inv = Inventory(Path("inv.yaml"), "j", SSHSettings(), hosts, pools)
    free = place(inv)
    assert [(t.host.name, t.accelerators, t.port) for t in free.tasks] == [("h1", (0,), 2222), ("h2", (0,), 2222)]
    held = {n: Held(frozenset({0}), frozenset({2222}), ("GPU 0 held by job a",)) for n in ("h1", "h2")}
    around = place(inv, free.slots(), held)  # previous slots that are held now are not kept
    assert [(t.host.name, t.accelerators, t.port) for t in around.tasks] == [("h1", (1,), 2223), ("h2", (1,), 2223)]
    full = {n: Held(frozenset({0, 1}), frozenset(), (f"GPUs 0-1 held by job a{n}",)) for n in ("h1", "h2")}
    with pytest.raises(PlacementError) as e:
        place(inv, None, full)
    assert e.value.held and e.value.details == ["h1: GPUs 0-1 held by job ah1", "h2: GPUs 0-1 held by job ah2"]


def test_jobs_view_shapes():
    run = entry("run", gpus=(0,), ports=(2222,))
    rep = report(run, units={run["units"][0]: ACTIVE}, listening=(22, 2222, 9000))
    view = jobs_json([host_view("gpu-1", 2, rep, NOW)], NOW)
    assert view["format_version"] == 1
    assert view["jobs"] == [
        {
            "job": "run",
            "owner": "alice@ws-3",
            "lineage": "L-run",
            "state": "running",
            "since": "2027-01-15T06:00:00Z",
            "age_seconds": 7200,
            "queued": None,
            "priority": "normal",  # an entry written before priorities: normal
            "priority_level": 500,
            "preemptible": False,
            "submitted": "2027-01-15T06:00:00Z",
            "dev": None,  # not a dev session
            "hosts": {"gpu-1": {"state": "running", "gpus": [0], "ports": [2222], "preempted_by": None}},
        }
    ]
    assert view["hosts"]["gpu-1"] == {
        "error": None,
        "gpus": 2,
        "free_gpus": [1],
        "held": {"run": {"gpus": [0], "ports": [2222]}},
        "foreign_ports": [9000],
        "unreadable": [],
        "health": {"host": {"state": "healthy"}, "gpus": {"0": {"state": "healthy"}, "1": {"state": "healthy"}}},
    }


def test_jobs_show_each_priority_as_the_policy_names_it():
    me = {"lineage": "L-q", "who": "ana@lab", "host": HERE, "pid": os.getpid(), "state": "/s"}
    run = {**entry("run", gpus=(0,), ports=(2222,)), "priority": 1000, "preemptible": True}
    low = {**entry("low", gpus=(), ports=(), started=False, owner=me), "priority": 100, "submitted": NOW - 60}
    low["queued"] = {"since": NOW - 60, "waiting_for": "room", "gpus": 1}
    urgent = {**low, "job": "urgent", "priority": 750, "submitted": NOW - 30}
    rep = report(run, low, urgent, units={run["units"][0]: ACTIVE})
    policy = Policy(classes=(("low", 100), ("normal", 500), ("high", 1000)))
    views = [host_view("gpu-1", 2, rep, NOW)]
    jobs = {j["job"]: j for j in jobs_json(views, NOW, policy)["jobs"]}
    assert (jobs["run"]["priority"], jobs["run"]["priority_level"], jobs["run"]["preemptible"]) == ("high", 1000, True)
    assert (jobs["urgent"]["priority"], jobs["urgent"]["state"]) == ("750", "queued")  # no class has 750
    table = jobs_lines(views, NOW, policy)[0]
    assert table[0] == ["JOB", "OWNER", "STATE", "PRIORITY", "SINCE", "HOSTS"]
    assert [r[3] for r in table[1:]] == ["low", "high", "750"]
    lines = queued_lines(views, NOW, policy)  # in the queue's order: 750 before low
    assert [x.split(" ")[0] for x in lines] == ["urgent", "low"] and "(ana@lab, priority low)" in lines[1]


# --------------------------------------------------------------------------- the host ledger


@pytest.fixture
def ledger_dir(tmp_path, monkeypatch):
    d = tmp_path / ".ledger"
    monkeypatch.setattr(layout, "LEDGER_DIR", str(d))
    monkeypatch.setattr(layout, "LEDGER_LOCK", str(d / ".lock"))
    return d


def res(job, gpus=(), ports=(), *, free=None, expect=None, lineage=None) -> Reservation:
    return Reservation(
        job=job,
        owner={"lineage": lineage or "L-" + job, "who": "me@here"},
        gpus=list(gpus),
        ports=list(ports),
        units=[f"provision-{job}-chief-0.service"],
        free=free or {},
        expect_lineage=expect,
    )


def test_reserve_is_compare_and_set(ledger_dir):
    assert ledger.reserve(res("a", [0, 1], [2222]), NOW) == []
    assert ledger.reserve(res("b", [1], [2300]), NOW) == ["GPU 1 taken by job a (me@here) since plan"]
    assert ledger.reserve(res("b", [2], [2222]), NOW) == ["port 2222 taken by job a (me@here) since plan"]
    assert sorted(ledger.read_all()) == ["a"]  # the loser wrote nothing
    # a finished job the controller saw, unchanged since: its GPUs may be taken
    tok = ledger.read_all()["a"]["token"]
    assert ledger.reserve(res("b", [0, 1], [2222], free={"a": tok}), NOW) == []
    # ...but not once it changed (re-applied) after plan
    ledger.mark_started("a", NOW)
    assert ledger.reserve(res("c", [0], [], free={"a": tok}), NOW) != []


def test_an_entry_said_ended_whose_units_run_now_is_a_conflict(ledger_dir, tmp_path, monkeypatch):
    # The controller looked between the entry's start mark and its units' start (or any
    # other misjudgment): the host, which sees the run's invocation link, refuses.
    monkeypatch.setattr(layout, "INVOCATION_PREFIX", str(tmp_path / "invocation:"))
    assert ledger.reserve(res("a", [0, 1], [2222]), NOW) == []
    ledger.mark_started("a", NOW)
    tok = ledger.read_all()["a"]["token"]
    (tmp_path / "invocation:provision-a-chief-0.service").symlink_to("0123abcd")
    why = ledger.reserve(res("b", [0, 1], [2300], free={"a": tok}), NOW)
    assert why == ["GPU 0, 1 taken by job a (me@here) since plan"]
    (tmp_path / "invocation:provision-a-chief-0.service").unlink()  # its run ended
    assert ledger.reserve(res("b", [0, 1], [2300], free={"a": tok}), NOW) == []


def test_a_take_over_since_plan_is_a_conflict(ledger_dir):
    assert ledger.reserve(res("j", [0], lineage="L-alice"), NOW) == []
    why = ledger.reserve(res("j", [0], lineage="L-bob", expect=None), NOW)
    assert why == ["job j here was taken over by me@here since plan"]
    assert ledger.reserve(res("j", [0], lineage="L-bob", expect="L-alice"), NOW) == []  # --take-over, seen at plan


def test_a_held_entry_holds_until_the_job_starts_again(ledger_dir):
    assert ledger.reserve(res("a", [0], [2222]), NOW) == []
    ledger.mark_started("a", NOW)
    ledger.hold("a", NOW + 1)
    e = ledger.read_all()["a"]
    assert judge(e, {}, NOW + 2) is Hold.HELD and Hold.HELD.holds
    assert ledger.reserve(res("b", [0], [2300]), NOW) == ["GPU 0 taken by job a (me@here) since plan"]
    ledger.mark_started("a", NOW + 3)  # its rerun: its units hold what it needs from now on
    assert judge(ledger.read_all()["a"], {}, NOW + 4) is Hold.ENDED


def test_a_queued_apply_is_marked_and_unmarked(ledger_dir):
    me = {"lineage": "L-q", "who": "ana@lab", "host": HERE, "pid": os.getpid(), "state": "/s"}
    ledger.queue("q", me, "replica 0 does not fit", NOW)
    e = ledger.read_all()["q"]
    assert e["queued"] == {"since": NOW, "waiting_for": "replica 0 does not fit", "gpus": 1} and e["gpus"] == []
    assert judge(e, {}, NOW) is Hold.QUEUED and not Hold.QUEUED.holds
    ledger.queue("q", me, "something else", NOW + 5)
    assert ledger.read_all()["q"]["queued"] == {"since": NOW, "waiting_for": "something else", "gpus": 1}  # since stays
    hs = holders("h1", ProbeReport(ledger=ledger.read_all(), ledger_units={}, listening=[], now=NOW + 6), NOW + 6)
    assert hs[0].queued == (NOW, "something else")
    ledger.queue("q", me, None, NOW + 7)  # the wait ended: an entry that only held the mark goes
    assert "q" not in ledger.read_all()
    # A job with a real entry keeps it; only the mark comes and goes.
    assert ledger.reserve(res("a", [0], [2222]), NOW) == []
    ledger.queue("a", me, "grow", NOW)
    ledger.queue("a", me, None, NOW)
    assert "queued" not in ledger.read_all()["a"] and ledger.read_all()["a"]["gpus"] == [0]


def test_entries_record_the_jobs_turn_and_old_entries_read_as_normal(ledger_dir):
    """priority, preemptible and submitted in the entry (reserve and queue marks);
    an entry written before them reads as normal, not preemptible, submitted at `since`."""
    r = dataclasses.replace(res("a", [0]), priority=1000, preemptible=True, submitted=NOW - 60)
    assert ledger.reserve(r, NOW) == []
    e = ledger.read_all()["a"]
    assert (e["priority"], e["preemptible"], e["submitted"]) == (1000, True, NOW - 60)
    assert ledger.reserve(dataclasses.replace(r, submitted=None), NOW + 5) == []  # a re-apply keeps it
    assert ledger.read_all()["a"]["submitted"] == NOW - 60
    me = {"lineage": "L-q", "who": "ana@lab", "host": HERE, "pid": os.getpid(), "state": "/s"}
    ledger.queue("q", me, "room", NOW, 100, NOW - 30)
    q = ledger.read_all()["q"]
    assert (q["priority"], q["submitted"]) == (100, NOW - 30)
    ledger.reserve(res("old", [1]), NOW)
    old = {k: v for k, v in ledger.read_all()["old"].items() if k not in ("priority", "preemptible", "submitted")}
    hs = holders("h1", ProbeReport(ledger={**ledger.read_all(), "old": old}, ledger_units={}, now=NOW), NOW)
    turns = {h.job: (h.priority, h.preemptible, h.submitted) for h in hs}
    assert turns == {"a": (1000, True, NOW - 60), "q": (100, False, NOW - 30), "old": (500, False, NOW)}


def test_release_leaves_nothing_once_empty(ledger_dir):
    ledger.reserve(res("a", [0]), NOW)
    ledger.reserve(res("b", [1]), NOW)
    ledger.release("a")
    assert sorted(os.listdir(ledger_dir)) == [".lock", "b.json"]
    ledger.release("b")
    assert not ledger_dir.exists()


def test_racing_reservations_never_share_a_gpu(ledger_dir):
    """Threads race for the same GPUs: the flock lets exactly one win each round."""
    for rnd in range(20):
        results: dict[str, list[str]] = {}
        barrier = threading.Barrier(4)

        def go(job, barrier=barrier, results=results):
            barrier.wait()
            results[job] = ledger.reserve(res(job, [0, 1]), NOW)

        threads = [threading.Thread(target=go, args=(f"j{rnd}-{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(1 for why in results.values() if not why) == 1, results
        for job in results:
            ledger.release(job)


@pytest.mark.parametrize(
    "line, want",
    [
        ("0: 00000000:08AE 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 111 1 x", (2222, "111")),
        ("1: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 7 1 x", (22, "7")),
        ("2: " + "0" * 32 + ":1F90 " + "0" * 32 + ":0000 0A 0:0 00:0 0 0 0 9 1 x", (8080, "9")),
        ("3: 0100007F:08AE 0100007F:9C40 01 00000000:00000000 00:00000000 00000000 0 0 333 1 x", None),
        ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode", None),
        ("junk", None),
    ],
)
def test_listeners_from_proc_net_tcp(line, want):
    assert ledger.proc_pair(line) == want


@pytest.mark.parametrize(
    "line, want",
    [("2222 111", (2222, "111")), ("22 0", (22, "0")), ("", None), ("x 1", None), ("1 2 3", None)],
)
def test_listeners_as_the_shell_probe_writes_them(line, want):
    assert ledger.pair(line) == want


def test_listening_ports_each_once():
    assert ledger.listening([(2222, "1"), (22, "2"), (2222, "3")]) == [22, 2222]


def test_group_result_updated_takes_the_retried_hosts():
    from provision.core.target import HostError, Target

    t = Target("b", "10.0.0.2", 22, "root", None, None, 10, "accept-new")
    first: GroupResult[int] = GroupResult(
        Step.PROBE, ok={"a": 1}, unreachable={"b": HostError(t, "down", unreachable=True)}
    )
    again: GroupResult[int] = GroupResult(Step.PROBE, ok={"b": 2})
    both = first.updated(again)
    assert both.ok == {"a": 1, "b": 2} and not both.errors


def test_an_unreadable_entry_holds_what_it_might_hold(ledger_dir):
    """`echo garbage > .ledger/steal.json` made that job's GPUs look free,
    and a truncated entry stopped the agent with a SystemError naming no file."""
    ledger_dir.mkdir()
    (ledger_dir / "steal.json").write_text("garbage\n")
    (ledger_dir / "cut.json").write_bytes(b'{"job": "cut", "gpus": [0, 1')
    entries = ledger.read_all()
    assert set(entries) == {"steal", "cut"} and all("_unreadable" in e for e in entries.values())
    # On the host, at reserve time: refused, each file named.
    why = ledger.reserve(res("mine", [0], [2222]), NOW)
    assert len(why) == 2 and all("cannot be read" in w for w in why)
    assert any(str(ledger_dir / "steal.json") in w for w in why)
    assert sorted(ledger.read_all()) == ["cut", "steal"]  # nothing written
    # On the controller: the plan refuses the host, naming the file; jobs shows it.
    from provision.rules.tenancy import unreadable_entries, unreadable_problem

    rep = ProbeReport(ledger=entries, listening=[])
    bad = unreadable_entries(rep, but="mine")
    assert [b.split(" ")[0] for b in bad] == [str(ledger_dir / "cut.json"), str(ledger_dir / "steal.json")]
    assert unreadable_problem(bad).startswith(f"ledger entry {ledger_dir / 'cut.json'} (")
    view = jobs_json([host_view("gpu-1", 2, rep, NOW)], NOW)
    assert view["hosts"]["gpu-1"]["free_gpus"] == [] and len(view["hosts"]["gpu-1"]["unreadable"]) == 2


@pytest.mark.parametrize("skew", [-3600.0, 0.0, 10 * 365 * 86400.0])
def test_ages_are_judged_on_the_hosts_clock(skew):
    """item 8: a host clock an hour behind made a fresh reservation look stale
    (double-booked within one apply); ten years ahead held GPUs forever and `jobs` printed a
    negative age. The entry's times and the judging clock are the host's."""
    host_now = NOW + skew
    fresh = entry(started=False, updated=host_now - 10)
    fresh["since"] = host_now - 60
    old = entry("old", started=False, updated=host_now - 3600, gpus=(1,), ports=(2300,))
    old["since"] = host_now + 86400  # written while the host's clock was ahead: never shown in the future
    rep = report(fresh, old)
    rep = ProbeReport(ledger=rep.ledger, ledger_units=rep.ledger_units, now=host_now, listening=[])
    hs = {h.job: h for h in holders("gpu-1", rep, NOW)}
    assert hs["other"].hold is Hold.RESERVED and hs["old"].hold is Hold.STALE
    assert hs["other"].since == pytest.approx(NOW - 60)  # shown on the controller's clock
    view = jobs_json([host_view("gpu-1", 2, rep, NOW)], NOW)
    assert view["jobs"] and all(j["age_seconds"] >= 0 for j in view["jobs"])


def test_a_long_setup_keeps_its_reservation_fresh(ledger_dir):
    """item 8: 602 s into an 11-minute setup another controller took the job's
    GPUs (the entry's age said stale). While the setup runs, the agent renews the entry."""
    import time

    then = time.time() - 100
    assert ledger.reserve(res("slow", [0, 1], [2222]), then) == []
    done = ledger.renewing("slow", 0.05)
    try:

        def renewed() -> bool:
            return ledger.read_all()["slow"]["updated"] > then

        wait_until(renewed, 10, 0.02, what="the agent to renew the entry")
    finally:
        done.set()
    e = ledger.read_all()["slow"]
    assert (e["gpus"], e["ports"], e["since"]) == ([0, 1], [2222], then)  # only `updated` moves
    ledger.renew("gone", NOW)  # no entry: nothing written
    assert sorted(ledger.read_all()) == ["slow"]


def test_the_owner_is_named_as_a_team_knows_them(tmp_path, monkeypatch):
    """`root@vm` identified nobody."""
    from provision.rules.tenancy import identity

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.delenv("PROVISION_OWNER", raising=False)
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    monkeypatch.chdir(tmp_path)
    identity.cache_clear()
    assert identity("ws-3").endswith("@ws-3")  # nothing better known
    (tmp_path / ".gitconfig").write_text("[user]\n\temail = alice@example.com\n")
    identity.cache_clear()
    assert identity("ws-3") == "alice@example.com"
    monkeypatch.setenv("PROVISION_OWNER", "Alice (ML platform)")
    identity.cache_clear()
    assert identity("ws-3") == "Alice (ML platform)"
    identity.cache_clear()


@pytest.mark.parametrize(
    "line, lo",
    [
        ("   0: 0B00007F:9C41 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1234 1", True),  # 127.0.0.11
        ("   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 1235 1", False),  # 0.0.0.0
        ("   2: 00000000000000000000000001000000:0277 00000000000000000000000000000000:0000 0A 0 0 0 0 0 99 1", True),
        ("   3: 00000000000000000000000000000000:08AE 00000000000000000000000000000000:0000 0A 0 0 0 0 0 98 1", False),
        ("   4: 0000000000000000FFFF00000100007F:1F90 00000000000000000000000000000000:0000 0A 0 0 0 0 0 97 1", True),
    ],
)
def test_loopback_listeners_are_the_hosts_own(line, lo):
    assert ledger.proc_loopback(line) is lo


def test_a_port_only_on_loopback_is_avoided_but_not_named():
    assert ledger.local_only([(40000, True), (22, False), (8080, True), (8080, False)]) == [40000]
    assert ledger.pair("40000 0 lo") == (40000, "0") and ledger.pair("40000 0 x") is None
    held = held_for("j", [], [22, 40000, 5000], NOW, local=[40000])
    assert 40000 in held.ports and 5000 in held.ports
    assert held.by == ("port 5000 in use by processes provision did not start",)


def test_a_queue_mark_is_not_a_change_of_what_the_entry_holds(ledger_dir):
    """A preempted job waiting to resume marks its entry queued; its preemptor, which saw the
    entry at plan, still takes the GPUs it left (the mark holds nothing)."""
    me = {"lineage": "L-a", "who": "ana@lab", "host": HERE, "pid": os.getpid(), "state": "/s"}
    assert ledger.reserve(res("a", [0, 1], [2222]), NOW) == []
    tok = ledger.read_all()["a"]["token"]
    ledger.queue("a", me, "2 GPUs on h1", NOW + 1)
    assert ledger.read_all()["a"]["token"] == tok
    assert ledger.reserve(res("b", [0, 1], [2300], free={"a": tok}), NOW + 2) == []
