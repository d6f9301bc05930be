"""Preemption's pure parts: the Preempted phase and the resume decision, the hold
of a preempted entry (its GPUs wait for the preemptor alone), the ledger's side (a second
preemptor refused, the victim's GPUs taken by the preemptor's reserve), the status line,
and which victims one look finds. The host side runs on a temporary ledger."""

from __future__ import annotations

import os
import socket
import time

import pytest

from provision.core.lifecycle import Action, JobPhase, Reason, TaskRow, TaskState, decide, job_phase
from provision.core.model import Accelerators, Host, Inventory, Pool, SSHSettings
from provision.core.scheduling import PreemptMark
from provision.host import layout, ledger
from provision.host import preempt as host_preempt
from provision.host.protocol import PreemptRequest, ProbeReport, Reservation
from provision.placement.tasks import PlacedTask
from provision.rules import preempted
from provision.rules.preemption import Replica
from provision.rules.tenancy import Hold, Holder, Owner, held_for, holders, judge, reservation
from provision.rules.victims import candidates, replicas

NOW = 1_800_000_000.0
HERE = socket.gethostname()
UNIT = "provision-low-chief-0.service"
ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
ENDED = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead"}


def dead_pid() -> int:
    """A PID no process has: above the largest pid_max Linux allows (2**22). A process that
    just exited would do only until its PID is given again: the suite spawns tens of
    thousands, and pid_max is often 32768 (this case once failed so in CI)."""
    return 2**22 + 1


def victim(*, by="high", pid=None, host=HERE, gpus=(0, 1), updated=NOW) -> dict:
    return {
        "job": "low",
        "owner": {"lineage": "L-low", "who": "bob@lab", "host": "ws", "pid": 1, "state": "/s"},
        "since": NOW - 600,
        "updated": NOW,
        "token": "t-low",
        "gpus": list(gpus),
        "ports": [2222] if gpus else [],
        "units": [UNIT],
        "started": True,
        "priority": 100,
        "preemptible": True,
        "preempted": {"by": by, "who": "ana@lab", "host": host, "pid": os.getpid() if pid is None else pid,
                      "at": NOW - 5, "deadline": NOW + 5, "updated": updated},
    }  # fmt: skip


# --------------------------------------------------------------------------- phase and plan


def test_a_preempted_job_is_preempted_unless_it_had_ended_before():
    marker = {"phase": "Preempted", "reason": "preempted by high", "host_time": NOW}
    stopped_row = TaskRow("chief-0", "chief", "h", TaskState.STOPPED, "stopped", NOW + 1)
    assert job_phase("chief", [stopped_row], marker)[0] is JobPhase.PREEMPTED
    # Exited 0 on the signal, after the preemption: still Preempted (it did not finish).
    done = TaskRow("chief-0", "chief", "h", TaskState.SUCCEEDED, "exited 0", NOW + 1)
    assert job_phase("chief", [done], marker)[0] is JobPhase.PREEMPTED
    # Succeeded before the preemption: Succeeded.
    early = TaskRow("chief-0", "chief", "h", TaskState.SUCCEEDED, "exited 0", NOW - 1)
    assert job_phase("chief", [early], marker)[0] is JobPhase.SUCCEEDED
    assert not JobPhase.PREEMPTED.ended  # `wait`, the service's watch and restart rules go on


def test_its_owners_apply_resumes_it_once_its_tasks_ended():
    marker = {"phase": "Preempted"}
    exits = [["1800000000", "success", "exited", "0", "stop"]]
    d = decide("chief-0", True, False, [], ENDED, exits, marker, False)
    assert (d.action, d.reason, d.describe()) == (Action.RESTART, Reason.RESUMED, "resumes after preemption")
    assert decide("chief-0", True, False, [], ACTIVE, None, marker, False).action is Action.NONE  # still saving
    assert decide("chief-0", True, False, [], ENDED, exits, {"phase": "Stopped"}, False).action is Action.NONE


# --------------------------------------------------------------------------- holds


@pytest.mark.parametrize(
    "e, state, want",
    [
        (victim(), ACTIVE, Hold.RUNNING),  # still saving its checkpoint
        (victim(), ENDED, Hold.PREEMPTED),  # ended: held for the preemptor
        (victim(pid=dead_pid()), ENDED, Hold.ENDED),  # the preemptor died on the way: free
        (victim(host="elsewhere", updated=NOW - 3600), ENDED, Hold.ENDED),  # ... elsewhere: no renewal
        (victim(host="elsewhere"), ENDED, Hold.PREEMPTED),
        (victim(gpus=()), ENDED, Hold.ENDED),  # the preemptor took them: holds nothing
    ],
)
def test_the_hold_of_a_preempted_entry(e, state, want):
    assert judge(e, {UNIT: state}, NOW) is want


def test_a_preempted_entrys_gpus_are_the_preemptors_alone():
    hs = holders("h", ProbeReport(ledger={"low": victim()}, ledger_units={UNIT: ENDED}, listening=[]), NOW)
    (h,) = hs
    assert h.hold is Hold.PREEMPTED and h.preempted_by == "high" and h.priority == 100 and h.preemptible
    assert not held_for("high", hs, [], NOW).gpus  # the preemptor may take them
    assert held_for("third", hs, [], NOW).gpus == {0, 1}  # nobody else
    assert held_for("low", hs, [], NOW).gpus == {0, 1}  # nor the victim itself
    assert "reserved for job high, which preempted job low" in held_for("low", hs, [], NOW).by[0]


def test_the_preemptors_reservation_names_the_victim_free():
    hs = holders("h", ProbeReport(ledger={"low": victim()}, ledger_units={UNIT: ENDED}, listening=[]), NOW)
    task = PlacedTask("chief", 0, Host("h", "10.0.0.1", SSHSettings(), "10.0.0.1"), 2223, (0, 1))

    def free(job: str) -> dict[str, str]:
        r = reservation(job, [task], ["u"], hs, Owner("L-" + job, job, "ws", 1, "/s"), {})
        assert r is not None
        return r.free

    assert free("high") == {"low": "t-low"}  # ledger.conflicts lets it take them
    assert free("third") == {}


# --------------------------------------------------------------------------- the host's side


@pytest.fixture
def host_dirs(tmp_path, monkeypatch):
    d = tmp_path / ".ledger"
    monkeypatch.setattr(layout, "LEDGER_DIR", str(d))
    monkeypatch.setattr(layout, "LEDGER_LOCK", str(d / ".lock"))
    monkeypatch.setattr(layout, "VAR", str(tmp_path / "var"))
    monkeypatch.setattr(layout, "ETC", str(tmp_path / "etc"))
    calls: list[list[str]] = []

    def run(argv, timeout=60):
        calls.append(argv)
        return (0, "10s\n", "") if argv[:2] == ["systemctl", "show"] else (0, "", "")

    monkeypatch.setattr(host_preempt, "run", run)
    return calls


def res(job, gpus, *, free=None) -> Reservation:
    return Reservation(
        job,
        {"lineage": "L-" + job, "who": job + "@lab"},
        list(gpus),
        [],
        [],
        [f"provision-{job}-c.service"],
        free or {},
    )


def test_one_preemptor_marks_the_victim_a_second_is_refused(host_dirs):
    assert ledger.reserve(res("low", [0, 1]), NOW) == []
    os.makedirs(layout.job_dir("low"))
    owner = {"who": "ana@lab", "host": HERE, "pid": os.getpid()}
    a = host_preempt.op_preempt(PreemptRequest("low", "high-a", owner, 1000, "high", 2))
    assert not a.errors and not a.refused and a.grace == 10.0 and a.gpus == [0, 1]
    assert ["systemctl", "stop", "--no-block", "--", "provision-low-c.service"] in host_dirs
    b = host_preempt.op_preempt(PreemptRequest("low", "high-b", owner, 1000, "high", 2))
    assert b.refused == "high-a"
    again = host_preempt.op_preempt(PreemptRequest("low", "high-a", owner, 1000, "high", 2))
    assert not again.refused and again.deadline == a.deadline  # a renewal, the same deadline
    deadline = float(open(layout.preempt_at_path("low")).read())
    assert deadline == pytest.approx(a.deadline, abs=0.001)
    e = ledger.read_all()["low"]
    assert e["preempted"]["by"] == "high-a" and e["gpus"] == [0, 1]
    marker = ledger.read_entry(layout.lifecycle_path("low"))
    assert marker["phase"] == "Preempted" and marker["preempted"]["priority_name"] == "high"

    # The victim itself cannot take back its GPUs while they wait for the preemptor...
    assert ledger.reserve(res("low", [0, 1]), NOW) == ["GPU 0, 1 reserved for job high-a, which preempted this job"]
    # ... the preemptor takes them (the controller saw the entry ended), and the victim holds nothing.
    assert ledger.reserve(res("high-a", [0, 1], free={"low": e["token"]}), NOW) == []
    after = ledger.read_all()["low"]
    assert after["gpus"] == [] and after["ports"] == [] and after["preempted"]["by"] == "high-a"


def test_the_next_start_resumes_and_a_fresh_one_does_not(host_dirs):
    os.makedirs(layout.job_dir("low"))
    os.makedirs(layout.state_dir("low"))
    with open(layout.lifecycle_path("low"), "w") as f:
        f.write('{"phase": "Preempted"}')
    open(layout.preempt_at_path("low"), "w").write("1\n")
    host_preempt.clear_lifecycle("low")
    assert open(layout.resume_env_path("low")).read() == 'PROVISION_RESUME="1"\n'
    assert not os.path.exists(layout.lifecycle_path("low")) and not os.path.exists(layout.preempt_at_path("low"))
    host_preempt.clear_lifecycle("low")  # the next start (no marker): a fresh run
    assert not os.path.exists(layout.resume_env_path("low"))


def test_a_recoverys_start_resumes_on_a_host_new_to_the_job(host_dirs):
    """No end marker there (the stop never reached it): the write says the run resumes."""
    from provision.host import agent
    from provision.host.protocol import WriteRequest

    agent._after_write(WriteRequest("low", clear_lifecycle=True, run={"run": 2, "by": "ann", "resume": True}), [])
    assert open(layout.resume_env_path("low")).read() == 'PROVISION_RESUME="1"\n'
    agent._after_write(WriteRequest("low", clear_lifecycle=True), [])  # the next start: a fresh run
    assert not os.path.exists(layout.resume_env_path("low"))


def test_the_jobs_own_stop_on_another_host_follows_and_reserves_nothing(host_dirs):
    """A job preempted on another host is stopped here by its own side (preempted
    whole): the same marker and stop, but its GPUs wait for nobody once its units ended."""
    assert ledger.reserve(res("low", [0, 1]), NOW) == []
    os.makedirs(layout.job_dir("low"))
    by = {"who": "ana@lab"}
    rep = host_preempt.op_preempt(PreemptRequest("low", "high", by, 1000, "high", 0, follows="host-1"))
    assert not rep.errors and not rep.refused and rep.grace == 10.0
    assert ["systemctl", "stop", "--no-block", "--", "provision-low-c.service"] in host_dirs
    e = ledger.read_all()["low"]
    assert e["preempted"]["follows"] == "host-1" and e["preempted"]["by"] == "high" and e["preempted"]["pid"] == 0
    marker = ledger.read_entry(layout.lifecycle_path("low"))
    assert marker["phase"] == "Preempted" and marker["preempted"]["follows"] == "host-1"
    assert judge(e, {}, NOW) is Hold.ENDED  # units ended: nobody's reservation
    assert judge(e, {"provision-low-c.service": ACTIVE}, NOW) is Hold.RUNNING  # still saving
    # Asked again (a second look): the mark stays as it was.
    again = host_preempt.op_preempt(PreemptRequest("low", "high", by, 1000, "high", 0, follows="host-1"))
    assert not again.refused and again.deadline == rep.deadline
    # Marked for another preemptor: refused, as a preemptor would be.
    assert host_preempt.op_preempt(PreemptRequest("low", "other", by, 1000, "high", 0, follows="h")).refused == "high"
    # Its resume takes its GPUs back here: nothing waits for a preemptor.
    assert ledger.reserve(res("low", [0, 1]), NOW) == []


LOW_UNIT = "provision-low-c.service"
LOW_TASK = PlacedTask("chief", 0, Host("h", "10.0.0.1", SSHSettings(), "10.0.0.1"), 2222, (0, 1))
LOW_OWNER = Owner("L-low", "bob@lab", "ws", 1, "/s")


def low_holders(units: dict) -> list[Holder]:
    return holders("h", ProbeReport(ledger=ledger.read_all(), units=units, listening=[]), NOW)


def preempted_earlier(how: str) -> None:
    """The job `low` ran here and its earlier run was preempted, as `how` says."""
    r = reservation("low", [LOW_TASK], [LOW_UNIT], [], LOW_OWNER, {})
    assert r is not None and ledger.reserve(r, NOW) == []
    ledger.mark_started("low", NOW)
    os.makedirs(layout.job_dir("low"))
    ana = {"who": "ana@lab", "host": HERE, "pid": os.getpid()}
    if how == "follows":  # its preemptor knew another host: its own side stopped it here
        rep = host_preempt.op_preempt(PreemptRequest("low", "high", ana, 1000, "high", 0, follows="host-1"))
    elif how == "lapsed":  # its preemptor died before it took the GPUs
        gone = dict(ana, pid=dead_pid())
        rep = host_preempt.op_preempt(PreemptRequest("low", "high", gone, 1000, "high", 2))
    else:  # its preemptor took the GPUs, ran, and left
        rep = host_preempt.op_preempt(PreemptRequest("low", "high", ana, 1000, "high", 2))
        token = ledger.read_all()["low"]["token"]
        assert ledger.reserve(res("high", [0, 1], free={"low": token}), NOW) == []
        ledger.release("high")
    assert not rep.errors and not rep.refused
    assert ledger.read_all()["low"]["preempted"]["by"] == "high"


@pytest.mark.parametrize("how", ["follows", "lapsed", "taken"])
def test_a_resumed_run_carries_no_mark_of_the_earlier_runs_preemption(host_dirs, how):
    """A job preempted in part (its preemptor named some of its hosts) is resumed as one new
    run everywhere: on a host where its entry is unchanged (same GPUs, ports and units) the
    plan reserves nothing, yet the new run must not keep the earlier run's mark, or it could
    never be preempted again (a second preemptor is refused, and looks skip it)."""
    preempted_earlier(how)
    hs = low_holders({LOW_UNIT: ENDED})
    r = reservation("low", [LOW_TASK], [LOW_UNIT], hs, LOW_OWNER, {})
    if r is not None:  # the resume's plan reserves where the entry changed (the GPUs were taken)
        assert ledger.reserve(r, NOW + 1) == []
    ledger.mark_started("low", NOW + 2)  # its units start: the new run

    e = ledger.read_all()["low"]
    assert "preempted" not in e and e["gpus"] == [0, 1], e
    (h,) = low_holders({LOW_UNIT: ACTIVE})
    assert (h.hold, h.preempted_by) == (Hold.RUNNING, "")
    seen = candidates("urgent", {"h": 2}, {"h": [h]}, lambda held: {"h": 2}, {}, NOW)
    assert [(c.job, c.gpus) for c in seen.running] == [("low", (("h", 2),))]  # a candidate again
    urgent = {"who": "cy@lab", "host": HERE, "pid": os.getpid()}
    rep = host_preempt.op_preempt(PreemptRequest("low", "urgent", urgent, 2000, "urgent", 2))
    assert not rep.refused and not rep.errors
    assert ledger.read_all()["low"]["preempted"]["by"] == "urgent"


@pytest.mark.parametrize(
    "marked, live, want",
    [
        ((), {"h1": True, "h2": True}, ()),  # not preempted anywhere
        (("h1",), {"h1": False, "h2": True}, ("h2",)),  # preempted on h1, running on h2
        (("h1",), {"h1": True, "h2": True, "h3": False}, ("h2",)),  # h1 stopping, h3 ended
        (("h1", "h2"), {"h1": False, "h2": True}, ()),  # h2 marked too: stopping
        (("h2",), {"h1": True, "h2": False, "h3": True}, ("h1", "h3")),
    ],
)
def test_a_job_preempted_on_one_host_is_preempted_on_the_others(marked, live, want):
    assert preempted.to_stop(set(marked), live) == want


def test_the_rest_of_a_job_preempted_in_part_and_its_words():
    mark = {"by": "high", "who": "ana", "priority_name": "high", "at": NOW, "deadline": NOW + 10, "gpus": [0]}
    pre = {"phase": "Preempted", "preempted": mark}
    follow = {"phase": "Preempted", "preempted": dict(mark, follows="h1")}
    assert preempted.rest({"h1": pre, "h2": None}, {"h1": False, "h2": False}) is None  # ended everywhere
    assert preempted.rest({"h1": None, "h2": None}, {"h1": True, "h2": True}) is None  # not preempted
    r = preempted.rest({"h1": pre, "h2": None}, {"h1": False, "h2": True})
    assert r == preempted.Rest("h1", PreemptMark.parse(mark), ("h2",), ())
    assert preempted.rest_words(r).startswith("; still running on h2: not preempted there yet")
    r = preempted.rest({"h1": pre, "h2": follow}, {"h1": False, "h2": True})
    assert r == preempted.Rest("h1", PreemptMark.parse(mark), (), ("h2",))
    assert preempted.rest_words(r) == "; stopping on h2 (its tasks save a checkpoint)"
    assert preempted.rest_words(None) == ""
    # Its preemptor's marker goes first (when, by whom), whatever the hosts' names.
    r = preempted.rest({"a": follow, "h1": pre}, {"a": True, "h1": False})
    assert r is not None and r.first == "h1" and r.stopping == ("a",)


@pytest.mark.parametrize(
    "text, want", [("10s", 10.0), ("2min", 120.0), ("1min 30s", 90.0), ("500ms", 0.5), ("infinity", None), ("", None)]
)
def test_systemd_time_spans(text, want):
    assert host_preempt.timespan_s(text) == want


# --------------------------------------------------------------------------- status


def test_the_status_line_and_a_task_killed_at_the_deadline():
    found = preempted.marks(
        {
            "gpu-3": {
                "phase": "Preempted",
                "preempted": {"by": "deadline-run", "who": "ana", "priority_name": "high", "priority": 1000,
                              "at": NOW, "deadline": NOW + 120, "gpus": [0, 1]},
            },
            "gpu-4": {"phase": "Stopped"},
        }
    )  # fmt: skip
    line = preempted.reason(found, clock=time.gmtime)
    assert (
        line
        == f"at {time.strftime('%H:%M', time.gmtime(NOW))} by deadline-run (ana, priority high): 2 GPUs on gpu-3; resumes when 2 GPUs are free"
    )
    assert preempted.reason(found, clock=time.gmtime, place=3).endswith(
        "resumes when 2 GPUs are free (3rd in the queue)"
    )
    assert [preempted.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"
    ]  # fmt: skip
    # A tuning trial's words when it pauses.
    assert (
        preempted.paused(found[0][1], 1) == "preempted by deadline-run (ana, priority high); resumes when 1 GPU is free"
    )
    assert preempted.killed_at_deadline(found, ["1", "timeout", "killed", "KILL", "stop"]) == (
        "killed at the preemption's deadline: it had not exited 120 s after the preemption's signal"
    )
    assert preempted.killed_at_deadline(found, ["1", "success", "exited", "0", "stop"]) is None


# --------------------------------------------------------------------------- one look


def holder(job, gpus, hold=Hold.RUNNING, *, prio=500, preemptible=False, by="") -> Holder:
    return Holder(
        "h", job, None, tuple(gpus), (), NOW - 60, hold, "t", priority=prio, preemptible=preemptible, preempted_by=by
    )


def test_one_look_finds_candidates_leaving_victims_and_the_need():
    hs = {"h": [holder("low", [0, 1], prio=100, preemptible=True), holder("mid", [2], prio=500), holder("mine", [])]}
    seen = candidates("mine", {"h": 4}, hs, lambda held: {"h": 4 - len(held["h"].gpus)}, {}, NOW)
    assert seen.leaving == () and seen.free == (("h", 1),) and seen.need == (("h", 3),)
    assert [(r.job, r.priority, r.preemptible, r.gpus) for r in seen.running] == [
        ("low", 100, True, (("h", 2),)),
        ("mid", 500, False, (("h", 1),)),
    ]
    # Once preempted by `mine`, `low` is leaving: its GPUs count as free, it is no candidate.
    hs = {"h": [holder("low", [0, 1], Hold.PREEMPTED, prio=100, preemptible=True, by="mine"), holder("mid", [2])]}
    seen = candidates("mine", {"h": 4}, hs, lambda held: {"h": 2}, {}, NOW)
    assert seen.leaving == (("low", "h"),) and seen.free == (("h", 3),) and [r.job for r in seen.running] == ["mid"]
    # Nothing placeable even with every preemptible job gone: no need.
    assert candidates("mine", {"h": 4}, hs, lambda held: None, {}, NOW).need is None


def test_the_waiting_jobs_replicas_may_go_on_any_host_their_pool_may_use():
    def host(name: str, drain: bool = False) -> Host:
        return Host(name, "10.0.0.1", SSHSettings(), "10.0.0.1", Accelerators("nvidia-h100", 4), drain=drain)

    pools = (
        Pool("chief", 1, 4, ("/bin/true",)),
        Pool("worker", 2, 2, ("/bin/true",), host_names=("h2", "h3")),
        Pool("ps", 1, 0, ("/bin/true",)),
    )
    inv = Inventory(None, "j", SSHSettings(), (host("h1"), host("h2"), host("h3"), host("h4", drain=True)), pools)
    # h3 was not reached (nothing known there: nothing placed there), h4 is drained.
    assert replicas(inv, {"h1", "h2", "h4"}) == (
        Replica(4, ("h1", "h2")),
        Replica(2, ("h2",)),
        Replica(2, ("h2",)),
    )


def test_planned_goes_on_from_the_callers_held_try(monkeypatch: pytest.MonkeyPatch) -> None:
    """apply tries its plan before it loads the preemption step (cli/change.py): the step
    goes on from that try's error, not with a second plan first; an error that is not
    held is raised as it was."""
    from provision.placement.tasks import PlacementError
    from provision.run import preempt as run_preempt

    monkeypatch.setattr(run_preempt, "TICK", 0.0)
    pre = run_preempt.Preemptor.__new__(run_preempt.Preemptor)
    steps: list[int] = []

    def step() -> float:
        steps.append(len(steps))
        return 5.0

    monkeypatch.setattr(pre, "step", step)
    plans: list[int] = []

    def make() -> str:
        plans.append(len(plans))
        return "planned"

    assert pre.planned(make, held=PlacementError("worker", "held", held=True)) == "planned"
    assert (steps, plans) == ([0], [0])  # one look, then one plan: the caller's try was not repeated
    not_held = PlacementError("worker", "does not fit")
    with pytest.raises(PlacementError) as e:
        pre.planned(make, held=not_held)
    assert e.value is not_held and steps == [0]
