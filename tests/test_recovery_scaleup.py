"""An elastic job's scale-up onto a spare, as tables (rules/recovery.scale_up, decide,
troubled): when the lost workers are placed again, and when they are not."""

from __future__ import annotations

import dataclasses

import pytest

from provision.core.lifecycle import TaskState
from provision.core.recovery import Broke, Incident, RecoveryRecord, RecoverySpec, Stage
from provision.rules.recovery import LOST_S, Do, Facts, TaskFact, decide, scale_up, troubled

R, F = TaskState.RUNNING, TaskState.FAILED
NOW = 10_000.0
SPEC = RecoverySpec(max=3, window_s=3600)
ON = {"chief-0": "h1", "worker-0": "h2", "worker-1": "h3"}


def facts(*tasks: tuple[str, str, TaskState], away: dict[str, float | None], elastic="worker", **kw) -> Facts:
    return Facts(
        "j", tuple(TaskFact(t, t.rsplit("-", 1)[0], h, s) for t, h, s in tasks), away, run=2, elastic=elastic, **kw
    )


LIVE = (("chief-0", "h1", R), ("worker-0", "h2", R))
LOST = NOW - LOST_S
BLINKED = NOW - LOST_S + 5


@pytest.mark.parametrize(
    "f, on, hosts, tasks",
    [
        # a worker's host lost past LOST_S while the rest train on: its worker placed again
        (facts(*LIVE, away={"h3": LOST}), ON, ("h3",), ("worker-1",)),
        (facts(*LIVE, away={"h3": LOST - 600}), ON, ("h3",), ("worker-1",)),
        # away for less: it may only have blinked
        (facts(*LIVE, away={"h3": BLINKED}), ON, None, None),
        # since when unknown (one look, an owner's apply): never
        (facts(*LIVE, away={"h3": None}), ON, None, None),
        # not elastic: a lost host is recovery's, once the job shows it broke
        (facts(*LIVE, away={"h3": LOST}, elastic=""), ON, None, None),
        # the chief's host: the rendezvous is gone, a recovery's
        (facts(("worker-0", "h2", R), away={"h1": LOST}), ON, None, None),
        # a host of a worker and the chief (both placed there): not the elastic pool's alone
        (facts(("worker-0", "h2", R), away={"h1": LOST}), {**ON, "worker-1": "h1"}, None, None),
        # nothing runs any more: a recovery's, not a scale-up
        (facts(("chief-0", "h1", F), away={"h3": LOST}), ON, None, None),
        (facts(*LIVE, away={"h3": LOST}, succeeded=True), ON, None, None),
        (facts(*LIVE, away={"h3": LOST}, stopped=True), ON, None, None),
        # two workers' hosts lost: both placed again, one verdict
        (
            facts(("chief-0", "h1", R), away={"h2": LOST, "h3": LOST}),
            ON,
            ("h2", "h3"),
            ("worker-0", "worker-1"),
        ),
        # one lost, one only blinking: the lost one
        (facts(("chief-0", "h1", R), away={"h2": BLINKED, "h3": LOST}), ON, ("h3",), ("worker-1",)),
    ],
)
def test_which_lost_workers_are_placed_again(f, on, hosts, tasks):
    v = scale_up(f, on, NOW)
    if hosts is None:
        assert v is None
        return
    assert v is not None and v.do is Do.SCALE_UP and v.hosts == hosts and v.tasks == tasks, v
    assert "stopped answering at" in v.words and f"{tasks[0]}'s host {hosts[0]}" in v.words, v.words


def test_decide_scales_up_only_without_evidence_it_broke_and_no_recovery_under_way():
    f = facts(*LIVE, away={"h3": LOST})
    assert decide(SPEC, RecoveryRecord(), f, NOW, ON).do is Do.SCALE_UP
    # the status's one look (no placement given): nothing to scale
    assert decide(SPEC, RecoveryRecord(), f, NOW).do is Do.WAIT
    # a task failed: the job broke, recovered whole
    broke = facts(("chief-0", "h1", F), ("worker-0", "h2", R), away={"h3": LOST})
    assert decide(SPEC, RecoveryRecord(), broke, NOW, ON).do is Do.RECOVER
    # a recovery under way is finished first
    open_ = Incident(1, Broke.HOST, "worker-1", "h3", "w", "host", 1, NOW - 50, stage=Stage.STOPPING)
    assert decide(SPEC, RecoveryRecord(incidents=(open_,)), f, NOW, ON).do is Do.FINISH
    # a blink is waited for
    assert decide(SPEC, RecoveryRecord(), facts(*LIVE, away={"h3": BLINKED}), NOW, ON).do is Do.WAIT


def test_the_service_looks_closer_at_a_lost_elastic_worker():
    assert troubled(facts(*LIVE, away={"h3": LOST}), False, ON, NOW)
    assert not troubled(facts(*LIVE, away={"h3": BLINKED}), False, ON, NOW)
    assert not troubled(facts(*LIVE, away={"h3": LOST}), False)  # no placement: as before


# --------------------------------------------------------------------------- set aside per GPU


def _inc(broke=Broke.FAILED, host="g2", aside=("g2",)):
    return Incident(1, broke, "worker-0", host, "w", "failed:exit code 1", 2, NOW - 30, aside=aside)


@pytest.mark.parametrize(
    "inc, held, answers, sick, whole, gpus",
    [
        # the failed task held GPUs 2-3 and its host answers: those GPUs only
        (_inc(), {"g2": [2, 3]}, {"g2"}, {}, (), (("g2", (2, 3)),)),
        # a fatal mark (an Xid on GPU 3) among them: that GPU only
        (_inc(), {"g2": [2, 3]}, {"g2"}, {"g2": (3,)}, (), (("g2", (3,)),)),
        # a mark on a GPU it did not hold is not this job's evidence: its own GPUs
        (_inc(), {"g2": [2, 3]}, {"g2"}, {"g2": (7,)}, (), (("g2", (2, 3)),)),
        # the host itself marked (drained by its health): the whole host
        (_inc(), {"g2": [2, 3]}, {"g2"}, {"g2": (None, 3)}, ("g2",), ()),
        # it does not answer (now): the whole host
        (_inc(), {"g2": [2, 3]}, set(), {}, ("g2",), ()),
        # a host that stopped answering is never per GPU, whatever it held
        (_inc(Broke.HOST), {"g2": [2, 3]}, {"g2"}, {}, ("g2",), ()),
        # a task that held no GPU (a CPU host): the whole host
        (_inc(), {"g2": []}, {"g2"}, {}, ("g2",), ()),
        # a hang's culprits: each per its own evidence
        (
            _inc(Broke.HUNG, "g2", ("g2", "g3")),
            {"g2": [0], "g3": []},
            {"g2", "g3"},
            {},
            ("g3",),
            (("g2", (0,)),),
        ),
        (_inc(aside=()), {"g2": [2]}, {"g2"}, {}, (), ()),  # nothing set aside
    ],
)
def test_what_is_set_aside_host_or_gpus(inc, held, answers, sick, whole, gpus):
    from provision.rules.recovery import aside_of

    assert aside_of(inc, held, answers, sick) == (whole, gpus)


def test_a_fatal_health_mark_names_gpus_or_the_host():
    from provision.rules.health import HostHealth, Mark, State
    from provision.rules.recovery import sick_of

    def m(state):
        return Mark(State(state), "Xid 79", "", 9_000.0, "provision serve (ctl)", "j")

    assert sick_of(HostHealth(gpus={5: m("quarantined"), 1: m("suspect")})) == (5,)
    assert sick_of(HostHealth(host=m("draining"), gpus={2: m("quarantined")})) == (None, 2)
    assert sick_of(HostHealth()) == ()


def test_the_record_keeps_gpus_per_host_and_a_whole_host_over_them():
    rec = RecoveryRecord().with_aside((), (("g2", (3,)),))
    assert rec.aside == () and rec.gpu_map == {"g2": (3,)}
    rec = rec.with_aside((), (("g2", (1,)), ("g4", (0,))))
    assert rec.gpu_map == {"g2": (1, 3), "g4": (0,)}
    assert RecoveryRecord.from_json(rec.to_json()) == rec
    assert rec.to_json()["gpus"] == {"g2": [1, 3], "g4": [0]}
    whole = rec.with_aside(("g2",))  # set aside whole later: its GPUs no longer listed apart
    assert whole.aside == ("g2",) and whole.gpu_map == {"g4": (0,)}
    assert whole.without_aside(("g2", "g4")) == RecoveryRecord()
    # what a state by hand or an older version wrote: read, the malformed left out
    assert RecoveryRecord.from_json({"aside": [], "gpus": {"g2": [1, "x", -1, True], 3: [0]}}).gpu_map == {"g2": (1,)}
    inc = dataclasses.replace(_inc(), gpus=(("g2", (3,)),))
    assert Incident.from_json(inc.to_json()) == inc


def _gpu_inv(hosts: int, gpus: int, replicas: int, per: int, spares=()):
    from pathlib import Path

    from provision.core.model import Accelerators, Host, Inventory, Pool, SSHSettings

    hs = tuple(
        Host(f"g{i}", f"10.0.0.{i}", SSHSettings(), f"10.0.0.{i}", Accelerators("nvidia-h100", gpus))
        for i in range(1, hosts + 1)
    )
    pool = Pool("worker", replicas, accelerators=per, command=("/bin/true",))
    return Inventory(Path("/x.yaml"), "j", SSHSettings(), hs, (pool,), spares=spares)


def test_a_replica_whose_gpu_is_set_aside_moves_to_the_same_hosts_other_gpus():
    from provision.placement.tasks import place, set_aside

    inv = _gpu_inv(3, 4, replicas=2, per=2, spares=("g3",))
    first = place(inv)
    assert [(t.host.name, t.accelerators) for t in first.tasks] == [("g1", (0, 1)), ("g2", (0, 1))]
    # GPU 1 of g1 set aside for the job: worker-0 goes to g1's other free GPUs, the lowest
    # (best fit, before the empty spare); worker-1 does not move
    again = place(set_aside(inv, (), {"g1": (1,)}), first.slots())
    assert [(t.host.name, t.accelerators) for t in again.tasks] == [("g1", (0, 2)), ("g2", (0, 1))]
    # GPUs 1-3 of g1: no two left there, so the spare
    again = place(set_aside(inv, (), {"g1": (1, 2, 3)}), first.slots())
    assert [(t.host.name, t.accelerators) for t in again.tasks] == [("g3", (0, 1)), ("g2", (0, 1))]
    # the whole host set aside (it does not answer): the spare, as before
    again = place(set_aside(inv, ("g1",), {"g1": (1,)}), first.slots())
    assert [(t.host.name, t.accelerators) for t in again.tasks] == [("g3", (0, 1)), ("g2", (0, 1))]
    # withheld GPUs are this job's only: the inventory's host is otherwise as written
    assert set_aside(inv, (), {}) is inv and set_aside(inv, (), {"g1": ()}) is inv


def test_a_scale_up_is_one_job_scaled_event_naming_the_lost_host_and_the_new_one():
    from provision.core.events import Kind
    from provision.serve.recovery import Recoverer

    class Store:
        events: list = []

        def emit(self, events):
            self.events.extend(events)

    said: list[str] = []
    r = Recoverer(Store(), said.append)  # type: ignore[arg-type]
    v = scale_up(facts(*LIVE, away={"h3": LOST}), ON, NOW)
    assert v is not None
    r._scaled("j", v.words, v.hosts, 2, {"worker-1": "h9"}, "ann@example.com")
    (e,) = Store.events
    assert e.kind is Kind.JOB_SCALED and e.key == "scaled:j:2:h3" and e.run == 2 and e.hosts == ("h9",), e
    assert e.words.startswith("job j scaled up: worker-1's host h3 stopped answering at ") and e.words.endswith(
        "; started worker-1 on h9 (the running tasks go on)"
    ), e.words
    assert said == [e.words] and r.scaled == [{"worker-1": "h9"}]
