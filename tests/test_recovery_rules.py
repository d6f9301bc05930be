"""The recovery's rules as tables (rules/recovery.py, rules/progress.py): where a run broke,
what is done about it, the bound of `progress: auto`, and placement onto spares."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from provision.core.lifecycle import TaskState
from provision.core.model import Accelerators, Host, Inventory, Pool, SSHSettings
from provision.core.recovery import Broke, Incident, ProgressSpec, RecoveryRecord, RecoverySpec, Stage
from provision.host.protocol import ProbeReport
from provision.placement.tasks import place, set_aside
from provision.rules import progress
from provision.rules.recovery import Do, Facts, TaskFact, broken, decide, stacks_culprits

R, F, U, S = TaskState.RUNNING, TaskState.FAILED, TaskState.UNKNOWN, TaskState.STOPPED
SPEC = RecoverySpec(max=3, window_s=3600)
NOW = 10_000.0


def facts(*tasks: tuple[str, str, TaskState, str, float | None], away=(), stall=None, run=4, **kw) -> Facts:
    return Facts(
        "j",
        tuple(TaskFact(t, t.rsplit("-", 1)[0], h, s, d, e) for t, h, s, d, e in tasks),
        {h: 9_000.0 for h in away},
        stall,
        run,
        **kw,
    )


HEALTHY = facts(("chief-0", "gpu-1", R, "", None), ("worker-0", "gpu-2", R, "", None))
PEER_LOST = facts(("chief-0", "gpu-1", F, "exit code 1", 9_100.0), away=("gpu-2",))
BLINK = facts(("chief-0", "gpu-1", R, "", None), away=("gpu-2",))
FAILED = facts(
    ("chief-0", "gpu-1", F, "exit code 1", 9_200.0),
    ("worker-0", "gpu-2", F, "killed by SIGSEGV", 9_100.0),
)
HUNG = facts(("chief-0", "gpu-1", R, "", None), ("worker-0", "gpu-2", R, "", None), stall=progress.Stall(9_000.0, 60))
DONE_OK = facts(("chief-0", "gpu-1", TaskState.SUCCEEDED, "exited 0", 9_000.0), succeeded=True)
STOPPED = facts(("chief-0", "gpu-1", S, "stopped by hand", 9_000.0), stopped=True)
TASKS = {"chief-0": "gpu-1", "worker-0": "gpu-2"}


@pytest.mark.parametrize(
    "f, broke, host, words",
    [
        (HEALTHY, None, None, None),
        (BLINK, None, None, None),  # a host away while the others run on: never a restart
        (DONE_OK, None, None, None),
        (STOPPED, None, None, None),
        (PEER_LOST, Broke.HOST, "gpu-2", "worker-0's host gpu-2 stopped answering at"),
        (FAILED, Broke.FAILED, "gpu-2", "worker-0 on gpu-2 failed first (killed by SIGSEGV)"),
        (HUNG, Broke.HUNG, "", "hung: no progress since"),
    ],
)
def test_where_it_broke(f, broke, host, words):
    from provision.rules.recovery import _with_away_tasks

    got = broken(_with_away_tasks(f, TASKS))
    if broke is None:
        assert got is None
        return
    assert got is not None and got.broke is broke and got.host == host and got.words.startswith(words), got


def inc(n, broke=Broke.FAILED, host="gpu-2", sig="failed:exit code 1", stage=Stage.DONE, run=1, detected=NOW - 100):
    return Incident(n, broke, "worker-0", host, "w", sig, run, detected, detected, stage=stage, aside=(host,))


@pytest.mark.parametrize(
    "record, f, do, why",
    [
        (RecoveryRecord(), HEALTHY, Do.NONE, ""),
        (RecoveryRecord(), BLINK, Do.WAIT, ""),
        (RecoveryRecord(), PEER_LOST, Do.RECOVER, "stopped answering"),
        (RecoveryRecord(), FAILED, Do.RECOVER, "failed first"),
        (RecoveryRecord(), HUNG, Do.RECOVER, "hung"),
        # a recovery under way is finished first, whatever the look shows
        (RecoveryRecord(incidents=(inc(1, stage=Stage.STOPPING, run=4),)), HEALTHY, Do.FINISH, ""),
        # ... and closed once its new run runs
        (RecoveryRecord(incidents=(inc(1, stage=Stage.PLACING, run=3),)), HEALTHY, Do.CLOSE, ""),
        # the budget: 3 within the window
        (
            RecoveryRecord(incidents=(inc(1), inc(2), inc(3, host="gpu-5", sig="host"))),
            PEER_LOST,
            Do.GIVE_UP,
            "3 times",
        ),
        # ... older ones do not count
        (
            RecoveryRecord(incidents=(inc(1, detected=1.0), inc(2, detected=2.0), inc(3, detected=3.0))),
            PEER_LOST,
            Do.RECOVER,
            "",
        ),
        # the same failure on another host: its own bug
        (
            RecoveryRecord(incidents=(inc(1, host="gpu-7", sig="failed:killed by SIGSEGV"),)),
            FAILED,
            Do.GIVE_UP,
            "the same way on gpu-7 and gpu-2",
        ),
        # a host lost twice is hardware, not a bug
        (RecoveryRecord(incidents=(inc(1, broke=Broke.HOST, host="gpu-7", sig="host"),)), PEER_LOST, Do.RECOVER, ""),
        # the run the last incident ended, seen again before its stop shows: nothing new
        (RecoveryRecord(incidents=(inc(1, run=4),)), FAILED, Do.NONE, ""),
    ],
)
def test_what_recovery_does(record, f, do, why):
    v = decide(SPEC, record, f, NOW, TASKS)
    assert v.do is do, v
    assert why in v.words
    if do is Do.RECOVER:
        assert v.incident is not None and v.incident.n == record.next_number() and v.incident.detected == NOW


def test_the_same_failure_gives_its_first_host_back():
    v = decide(SPEC, RecoveryRecord(("gpu-7",), (inc(1, host="gpu-7", sig="failed:killed by SIGSEGV"),)), FAILED, NOW)
    assert v.do is Do.GIVE_UP and v.give_back == ("gpu-7",) and v.incident.stage is Stage.GAVE_UP


def test_without_recovery_a_hang_is_reported_not_acted_on():
    assert decide(None, RecoveryRecord(), HUNG, NOW).do is Do.REPORT


def test_a_set_aside_host_running_the_job_again_is_stopped_there():
    f = dataclasses.replace(HEALTHY, aside_live=("gpu-2",))
    v = decide(SPEC, RecoveryRecord(("gpu-2",)), f, NOW)
    assert v.do is Do.STOP_THERE and v.hosts == ("gpu-2",)


@pytest.mark.parametrize(
    "states, culprits",
    [
        ({"gpu-1": ["S", "S"], "gpu-2": ["T"]}, ("gpu-2",)),
        ({"gpu-1": ["R"]}, ()),
        ({"a": ["D"], "b": ["t"]}, ("a", "b")),
    ],
)
def test_a_hangs_culprit_is_the_host_of_a_stopped_rank(states, culprits):
    assert stacks_culprits(states) == culprits


@pytest.mark.parametrize(
    "spec, intervals, bound",
    [
        (ProgressSpec(600), (), 600.0),
        (ProgressSpec(None), (), 600.0),  # auto, nothing learnt yet
        (ProgressSpec(None), (1.0, 1.0, 2.0), 60.0),  # 5 x 1 s, at least 60 s
        (ProgressSpec(None), (20.0, 20.0, 30.0, 10.0), 100.0),  # 5 x the median (20 s)
    ],
)
def test_the_progress_bound(spec, intervals, bound):
    assert progress.bound(spec, intervals) == bound


@pytest.mark.parametrize(
    "last, started, now, stall",
    [
        (None, None, 100.0, False),
        (None, 0.0, 30.0, False),
        (None, 0.0, 61.0, False),  # no sign of this run yet: its start-up too (120 s)
        (None, 0.0, 121.0, True),
        (-500.0, 0.0, 100.0, False),  # a sign of the run before only
        (-500.0, 0.0, 121.0, True),
        (20.0, 0.0, 100.0, False),  # a sign at its start: the start's own (its checkpoint directory made)
        (50.0, 0.0, 100.0, False),
        (50.0, 0.0, 111.0, True),
    ],
)
def test_a_stall_is_past_the_bound_since_the_last_sign_or_the_start(last, started, now, stall):
    assert (progress.stalled(ProgressSpec(60), (), last, started, now) is not None) is stall


def test_progress_ages_are_taken_on_the_hosts_clock():
    asked = {
        "h": [
            progress.Watched("/b", progress.Sign.HEARTBEAT, "chief-0"),
            progress.Watched("/c", progress.Sign.CHECKPOINT),
        ]
    }
    # the host's clock is 1000 s ahead: a heartbeat 5 s old there is 5 s old here
    rep = ProbeReport(now=2_000.0, progress={"/b": 1_995, "/c": 1_900})
    seen = progress.seen(asked, {"h": rep}, 1_000.0)
    assert seen.latest == 995.0 and seen.checkpoint == 900.0 and seen.tasks == {"chief-0": 995.0}
    assert progress.learnt((), 900.0, 995.0) == (95.0,) and progress.learnt((), 995.0, 995.0) == ()


def _inv(hosts: int, spares: tuple[str, ...], gpus: int = 1, replicas: int = 3) -> Inventory:
    hs = tuple(
        Host(f"gpu-{i}", f"10.0.0.{i}", SSHSettings(), f"10.0.0.{i}", Accelerators("nvidia-h100", gpus))
        for i in range(1, hosts + 1)
    )
    pool = Pool("worker", replicas, accelerators=1, command=("/bin/true",))
    return Inventory(Path("/x.yaml"), "j", SSHSettings(), hs, (pool,), spares=spares)


def test_spares_wait_while_every_host_is_in_service():
    inv = _inv(4, ("gpu-4",))
    first = place(inv)
    assert [t.host.name for t in first.tasks] == ["gpu-1", "gpu-2", "gpu-3"]
    # gpu-2 is set aside for the job: its replica goes to the spare; the others stay
    again = place(set_aside(inv, {"gpu-2"}), first.slots())
    assert [t.host.name for t in again.tasks] == ["gpu-1", "gpu-4", "gpu-3"]
    assert again.tasks[0] == first.tasks[0] and again.tasks[2] == first.tasks[2]
    # deterministic
    assert place(set_aside(inv, {"gpu-2"}), first.slots()) == again


def test_a_spare_is_used_when_nothing_else_fits():
    inv = _inv(3, ("gpu-3",), replicas=3)
    assert [t.host.name for t in place(inv).tasks] == ["gpu-1", "gpu-2", "gpu-3"]


# --------------------------------------------------------------------------- the hosts' health


def mark(state, by="provision serve (ctl)", job="j", reason="Xid 79: fallen off the bus"):
    from provision.rules.health import Mark, State

    return Mark(State(state), reason, "", 9_000.0, by, job)


def test_a_fatal_health_mark_names_where_it_broke():
    from provision.rules.health import HostHealth
    from provision.rules.recovery import health_notes

    healths = {
        "gpu-1": HostHealth(gpus={5: mark("quarantined")}),
        "gpu-2": HostHealth(gpus={0: mark("quarantined", job="other")}),  # another job's GPU
        "gpu-3": HostHealth(host=mark("quarantined", by="provision recovery of j")),  # this recovery's own
        "gpu-4": HostHealth(gpus={1: mark("suspect")}),  # a warning is not fatal
    }
    notes = health_notes("j", ["gpu-1", "gpu-2", "gpu-3", "gpu-4"], healths)
    assert list(notes) == ["gpu-1"] and notes["gpu-1"].startswith("GPU 5 of gpu-1 quarantined at ")
    assert notes["gpu-1"].endswith(": Xid 79: fallen off the bus")
    # The task that failed on the sick host comes first, though another failed before it.
    got = broken(dataclasses.replace(FAILED, health={"gpu-1": "GPU 5 of gpu-1 quarantined"}))
    assert got is not None and got.host == "gpu-1" and got.words.endswith("; GPU 5 of gpu-1 quarantined"), got
    # A hang on a host with a fatal mark: that host is the culprit.
    got = broken(dataclasses.replace(HUNG, health={"gpu-2": "gpu-2 draining at 14:01: PCIe gone"}))
    assert got is not None and got.host == "gpu-2" and "; gpu-2 draining" in got.words, got
    # A host that stopped answering, with what another host's health says.
    got = broken(_away(dataclasses.replace(PEER_LOST, health={"gpu-1": "GPU 0 of gpu-1 quarantined"})))
    assert got is not None and got.host == "gpu-2" and got.words.endswith("; GPU 0 of gpu-1 quarantined"), got


def _away(f):
    from provision.rules.recovery import _with_away_tasks

    return _with_away_tasks(f, TASKS)


def test_the_service_looks_every_round_while_a_job_is_watched():
    from provision.core.recovery import ROUND_S
    from provision.rules.recovery import Memory
    from provision.serve.gpusample import SAMPLE_EVERY
    from provision.serve.recovery import Recoverer

    assert ROUND_S == SAMPLE_EVERY  # the shortest progress bound is one round
    r = Recoverer(None, print)  # type: ignore[arg-type]
    assert not r.hurry()
    r.memory["j"] = Memory()
    assert r.hurry()


def test_a_round_that_began_before_a_recovery_ended_starts_no_other(monkeypatch):
    # The round read the failed task's host before the recovery placed the job again and
    # the others after it started the new run: what it saw is the failure just recovered.
    import provision.serve.recovery as sr
    from provision.rules.progress import Seen
    from provision.rules.rounds import JobWatch, Round

    acts: list[str] = []
    r = sr.Recoverer(None, print)  # type: ignore[arg-type]
    monkeypatch.setattr(sr, "troubled", lambda f, marked, *_: True)
    monkeypatch.setattr(r, "_act", lambda job, w, f: acts.append(job))
    watch = {"j": JobWatch("j.yaml", None, RecoverySpec(), {}, Seen())}
    r.acted["j"] = 1000.0  # its last recovery ended then
    r.on_round(Round(7, 990.0, {}, {"hosts": {}, "jobs": []}, watch=watch))  # type: ignore[typeddict-item]
    r.wait()
    assert acts == []
    r.on_round(Round(8, 1001.0, {}, {"hosts": {}, "jobs": []}, watch=watch))  # type: ignore[typeddict-item]
    r.wait()
    assert acts == ["j"]


def test_the_rounds_remember_the_newest_checkpoint_when_the_saving_host_is_gone():
    # The chief's host saved at 130; once it is gone a round sees only the worker's
    # checkpoint directory, never written since the run began (100): the newest is still 130.
    from provision.rules.progress import Seen
    from provision.rules.recovery import Memory, facts_of_round, remember
    from provision.rules.rounds import JobWatch, Round

    tasks = {"chief-0": "gpu-1", "worker-0": "gpu-2"}

    def seen_at(began: float, checkpoint: float) -> tuple[JobWatch, Round]:
        w = JobWatch("j.yaml", None, RecoverySpec(), tasks, Seen(latest=began, checkpoint=checkpoint))
        return w, Round(1, began, {}, {"hosts": {}, "jobs": []}, watch={"j": w})  # type: ignore[typeddict-item]

    m = Memory()
    for began, ck, newest in ((120.0, 100.0, 100.0), (140.0, 130.0, 130.0), (150.0, 100.0, 130.0)):
        w, r = seen_at(began, ck)
        m = remember(m, w, r)
        assert m.checkpoint == newest
    assert facts_of_round("j", w, r, m).checkpoint == 130.0


# --------------------------------------------------------------------------- goodput


def test_goodput_counts_each_incidents_time_and_the_work_redone():
    from provision.core.recovery import goodput, lost

    # Broke at 1000 (its last checkpoint at 980), seen at 1012, stopped at 1015, running at 1040.
    done = Incident(1, Broke.HOST, "worker-0", "gpu-2", "w", "host", 1, 1000.0, 1012.0, 1015.0, 1040.0, 980.0,
                    stage=Stage.DONE, started=0.0)  # fmt: skip
    got = lost(done, 5000.0)
    assert (got.detect, got.stop, got.run_again, got.redone, got.total) == (12.0, 3.0, 25.0, 20.0, 60.0)
    assert got.words() == "seen in 12 s, stopped in 3 s, running again in 25 s, 20 s of work redone"
    # One under way at 2000 counts until now; one given up costs nothing after it was seen.
    open_ = Incident(2, Broke.HUNG, "", "", "w", "hung", 2, 2000.0, 2100.0, stage=Stage.STOPPING)
    gave = Incident(3, Broke.FAILED, "", "", "w", "f", 3, 3000.0, 3010.0, stage=Stage.GAVE_UP)
    assert lost(open_, 2200.0).total == 200.0 and lost(gave, 9000.0).total == 10.0
    g = goodput(RecoveryRecord(incidents=(done,)), 500.0, 1000.0 * 10)
    assert g is not None and g["wall_seconds"] == 10_000.0 and g["lost_seconds"] == 60.0 and g["ratio"] == 0.994
    assert g["incidents"][0]["run_again_seconds"] == 25.0
    # Nothing lost: all of it progressed; nothing known of its start: no figure.
    assert goodput(RecoveryRecord(), 100.0, 200.0)["ratio"] == 1.0  # type: ignore[index]
    assert goodput(RecoveryRecord(), None, 200.0) is None
    # The record's survives the state's file.
    assert Incident.from_json(done.to_json()) == done


def test_a_recovered_runs_start_up_is_lost_time_too():
    from provision.core.recovery import goodput, lost

    # Running again at 1040, its first step (a sign of progress) at 1052: 12 s of start-up.
    up = Incident(1, Broke.FAILED, "worker-0", "gpu-2", "w", "f", 1, 1000.0, 1012.0, 1015.0, 1040.0, 1000.0,
                  stage=Stage.DONE, started=0.0, progressing=1052.0)  # fmt: skip
    got = lost(up, 5000.0)
    assert (got.start_up, got.redone, got.total) == (12.0, 0.0, 52.0)
    assert (
        got.words() == "seen in 12 s, stopped in 3 s, running again in 25 s, progressing 12 s later, 0 s of work redone"
    )
    g = goodput(RecoveryRecord(incidents=(up,)), 0.0, 1000.0)
    assert g is not None and g["incidents"][0]["start_up_seconds"] == 12.0 and g["lost_seconds"] == 52.0
    assert Incident.from_json(up.to_json()) == up
    # A state written before the field: no start-up known, none counted.
    old = {k: v for k, v in up.to_json().items() if k != "progressing"}
    assert lost(Incident.from_json(old), 5000.0).start_up is None  # type: ignore[arg-type]


def test_the_service_keeps_a_recovered_jobs_first_progress_once(monkeypatch):
    import provision.serve.recovery as sr
    from provision.rules.progress import Seen
    from provision.rules.recovery import Memory
    from provision.rules.rounds import JobWatch, Round

    r = sr.Recoverer(None, print)  # type: ignore[arg-type]
    kept: list[tuple[str, str, RecoveryRecord | None]] = []
    before = RecoveryRecord(incidents=(Incident(3, Broke.FAILED, "w-0", "h", "w", "f", 1, 1000.0, running=1040.0),))
    monkeypatch.setattr(sr, "troubled", lambda *_: False)
    monkeypatch.setattr(r, "_keep", lambda job, file, change, what: kept.append((job, what, change(before))))
    r.starting["j"] = sr.Starting(3, 1040.0)
    watch = {"j": JobWatch("j.yaml", None, RecoverySpec(), {}, Seen())}

    def round_(n: int, latest: float | None) -> None:
        monkeypatch.setattr(sr, "remember", lambda m, w, r_: Memory(latest))
        r.on_round(Round(n, 1000.0 + n, {}, {"hosts": {}, "jobs": []}, watch=watch))  # type: ignore[typeddict-item]

    round_(1, 1030.0)  # the old run's heartbeat: not the new run's progress
    assert kept == []
    round_(2, 1051.5)
    round_(3, 1060.0)
    assert [(j, w) for j, w, _ in kept] == [("j", "its progress after incident 3")]
    got = kept[0][2]
    assert got is not None and got.incidents[0].progressing == 1051.5
    assert sr._progressing(sr.Starting(3, 1040.0), 1070.0)(got) is None  # once
    r.starting["k"] = sr.Starting(1, 1040.0)
    round_(4, 1070.0)  # k is no longer watched: forgotten
    assert "k" not in r.starting and len(kept) == 1


def test_the_service_keeps_an_auto_bound_it_learnt_when_it_moves(monkeypatch):
    import provision.serve.recovery as sr
    from provision.core.recovery import AUTO_FLOOR_S, ProgressSpec
    from provision.rules.progress import Seen, bound, bound_moved, learnt_bound
    from provision.rules.recovery import Memory
    from provision.rules.rounds import JobWatch, Round

    auto = ProgressSpec(None)
    assert learnt_bound(auto, [1.0, 1.0]) is None and learnt_bound(ProgressSpec(30), [1.0] * 9) is None
    assert learnt_bound(auto, [1.0] * 9) == AUTO_FLOOR_S and learnt_bound(auto, [30.0] * 9) == 150.0
    # A look with no intervals of its own judges by what the service learnt.
    assert bound(auto, (), 150.0) == 150.0 and bound(auto, ()) == 600.0 and bound(auto, (), 1.0) == AUTO_FLOOR_S
    assert bound_moved(None, 60.0) and not bound_moved(60.0, 70.0) and bound_moved(60.0, 80.0)
    assert not bound_moved(60.0, None)

    r = sr.Recoverer(None, print)  # type: ignore[arg-type]
    kept: list[RecoveryRecord | None] = []
    monkeypatch.setattr(sr, "troubled", lambda *_: False)
    monkeypatch.setattr(r, "_keep", lambda job, file, change, what: kept.append(change(RecoveryRecord())))
    watch = {"j": JobWatch("j.yaml", auto, RecoverySpec(), {}, Seen())}
    for n, every in enumerate([1.0] * 12 + [30.0] * 12):
        r.memory["j"] = Memory(None, (every,) * 9)
        monkeypatch.setattr(sr, "remember", lambda m, w, r_: m)
        r.on_round(Round(n, 1000.0 + n, {}, {"hosts": {}, "jobs": []}, watch=watch))  # type: ignore[typeddict-item]
    assert [k.learnt for k in kept if k is not None] == [AUTO_FLOOR_S, 150.0]  # twice, not every round


class _Inline:
    """threading.Thread that runs its target at start()."""

    def __init__(self, target, args=(), **_):  # type: ignore[no-untyped-def]
        self.target, self.args = target, args

    def start(self) -> None:
        self.target(*self.args)

    def is_alive(self) -> bool:
        return False


def test_goodput_is_on_metrics():
    from provision.web.metrics import exposition

    doc = {"hosts": {}, "jobs": [{"job": "bert", "owner": "ann", "state": "running",
                                  "goodput": {"ratio": 0.93, "wall_seconds": 600.0, "lost_seconds": 42.0,
                                              "incidents": [{"n": 1}]}}]}  # fmt: skip
    text = exposition(doc, {}, 0.0)
    assert 'provision_job_goodput_ratio{job="bert",owner="ann"} 0.93' in text
    assert 'provision_job_incidents{job="bert",owner="ann"} 1' in text
    assert 'provision_job_lost_seconds{job="bert",owner="ann"} 42' in text


def test_status_says_where_it_broke_its_goodput_and_its_incidents():
    import click

    from provision.cli.output import status_lines
    from provision.core.lifecycle import JobPhase
    from provision.core.recovery import goodput
    from provision.rules.status import JobStatus

    done = Incident(1, Broke.HOST, "worker-0", "gpu-2", "worker-0's host gpu-2 stopped answering at 14:02", "host",
                    1, 1000.0, 1012.0, 1015.0, 1040.0, 980.0, stage=Stage.DONE, started=0.0)  # fmt: skip
    rec = RecoveryRecord(("gpu-2",), (done,))
    st = JobStatus("bert", JobPhase.RUNNING, "", (), broke=done.words, recovery=rec, goodput=goodput(rec, None, 6000.0))
    text = "\n".join(click.unstyle(x) for x in status_lines(st))
    assert "Broke: worker-0's host gpu-2 stopped answering at 14:02" in text
    assert "Goodput: 99% of 100m, 1 incident, 60s lost" in text, text
    assert (
        "incident 1 (done): worker-0's host gpu-2 stopped answering at 14:02: seen in 12 s, stopped in 3 s, "
        "running again in 25 s, 20 s of work redone" in text
    )
    doc = st.to_json()
    assert doc["goodput"]["incidents"][0]["detect_seconds"] == 12.0 and doc["recovery"]["aside"] == ["gpu-2"]


def test_an_incident_row_of_the_history_is_recovered():
    from provision.rules.historyview import KINDS, row_json

    assert "incident" in KINDS
    how = "recovered: worker-0's host gpu-2 stopped answering at 14:02; seen in 9 s, stopped in 2 s, ..."
    row = {"kind": "incident", "job": "bert", "owner": "ann", "started": 100.0, "ended": 125.0, "how": how,
           "hosts": ("gpu-2",), "gpus": 0, "submission": "recovered:bert:1"}  # fmt: skip
    got = row_json(row, 200.0)  # type: ignore[arg-type]
    assert got["state"] == "recovered" and got["seconds"] == 25.0 and got["gpu_hours"] == 0.0


def test_status_says_whether_an_auto_bound_is_the_services_learnt_one():
    from provision.cli.output import recovery_lines
    from provision.core.lifecycle import JobPhase
    from provision.rules.progress import ProgressView
    from provision.rules.status import JobStatus

    def said(view: ProgressView) -> str:
        return recovery_lines(JobStatus("bert", JobPhase.RUNNING, "", (), progress=view))[0]

    assert "(auto, learnt by the service)" in said(ProgressView(None, None, 150.0, True, False, True))
    assert "(auto, until the service learns it)" in said(ProgressView(None, None, 600.0, True, False))
    assert "auto" not in said(ProgressView(None, None, 30.0, False, False))
