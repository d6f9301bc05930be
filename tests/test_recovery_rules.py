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
        (None, 0.0, 61.0, True),
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
