"""rules/events.diff as tables: two rounds (and what the rounds before saw) in, the events out.

A round is built from what a host's tenancy probe reports (its ledger's entries, their units'
states, each job's runs and end marker), as serve/rounds.py builds it from real probes."""

from __future__ import annotations

from typing import Any

import pytest

from provision.core.events import How, Kind, parse_kinds
from provision.host.protocol import ProbeReport
from provision.rules.events import Seen, State, diff, study_of
from provision.rules.rounds import Round, host_seen, unreachable

OWNER = {"lineage": "l", "who": "ana@lab", "host": "ws", "pid": 0, "state": "/s"}
RUNNING = {"ActiveState": "active", "SubState": "running", "LoadState": "loaded"}
OK = {
    "ActiveState": "inactive",
    "SubState": "dead",
    "LoadState": "loaded",
    "Result": "success",
    "ExecMainCode": "1",
    "ExecMainStatus": "0",
}
FAIL = {**OK, "Result": "exit-code", "ExecMainStatus": "3"}
RESTARTING = {
    "ActiveState": "activating",
    "SubState": "auto-restart",
    "LoadState": "loaded",
    "Result": "exit-code",
    "ExecMainCode": "1",
    "ExecMainStatus": "1",
    "NRestarts": "1",
}


def unit(job: str, task: str) -> str:
    return f"provision-{job}-{task}.service"


def job_on(
    job: str,
    run: int | None,
    units: dict[str, dict[str, str]],
    *,
    gpus: list[int] | None = None,
    marker: Any = None,
    **entry: Any,
) -> tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, Any]]:
    """(ledger entry, unit states, records) of one job on one host."""
    e = {"job": job, "owner": OWNER, "gpus": gpus or [0], "ports": [2222], "units": [unit(job, t) for t in units],
         "started": run is not None, "since": 1.0, "updated": 1.0, "token": "t", **entry}  # fmt: skip
    records: dict[str, Any] = {"runs": [{"run": n, "at": float(n), "by": "ana"} for n in range(1, (run or 0) + 1)]}
    if marker is not None:
        records["lifecycle"] = marker
    return e, {unit(job, t): s for t, s in units.items()}, records


def host(name: str, *jobs: tuple[dict[str, Any], dict[str, dict[str, str]], dict[str, Any]]) -> Any:
    report = ProbeReport(
        ledger={e["job"]: e for e, _, _ in jobs},
        ledger_units={u: s for _, units, _ in jobs for u, s in units.items()},
        ledger_records={e["job"]: r for e, _, r in jobs},
        now=100.0,
    )
    return host_seen(name, 2, report, 100.0, job="_nobody")


def rnd(*hosts: Any, studies: frozenset[str] = frozenset(), n: int = 1) -> Round:
    return Round(n, 100.0, {h.view.name: h for h in hosts}, {}, studies=studies)


def run(*rounds: Round, seen: Seen | None = None) -> tuple[list[Any], Seen]:
    """The events of each round in turn after `seen` (default: the hosts watched, nothing run)."""
    seen = seen if seen is not None else Seen(hosts=frozenset(rounds[0].hosts))
    out = []
    for r in rounds:
        got, seen = diff(seen, r)
        out += got
    return out, seen


def kinds(events: list[Any]) -> list[tuple[str, str]]:
    return [(e.kind.value, e.how.value if e.how else "") for e in events]


def test_a_job_started_and_ended_once_with_how_it_ended() -> None:
    running = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING, "worker-0": RUNNING})))
    done = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": OK, "worker-0": OK})))
    events, seen = run(running, done, done)
    assert kinds(events) == [("job.started", ""), ("job.ended", "succeeded")]
    assert events[1].words == "job bert succeeded: chief-0 exited 0"
    assert events[1].key == "end:bert:1" and events[0].key == "start:bert:1"
    assert events[1].owner == "ana@lab" and events[1].hosts == ("gpu-1",) and events[1].gpus == 1
    assert seen.jobs["bert"].state is State.ENDED


def test_a_failed_task_is_said_once_and_the_job_fails() -> None:
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING, "worker-0": RUNNING})))
    r2 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING, "worker-0": FAIL})))
    r3 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": FAIL, "worker-0": FAIL})))
    events, _ = run(r1, r2, r2, r3)
    assert kinds(events) == [("job.started", ""), ("task.failed", ""), ("task.failed", ""), ("job.ended", "failed")]
    assert "worker-0 of job bert on gpu-1 failed" in events[1].words


def test_an_end_systemd_forgot_is_read_from_the_tasks_exits() -> None:
    """An ended unit systemd unloaded shows no outcome (ExecMainCode 0): its .exits has it."""
    forgot = {
        "ActiveState": "inactive",
        "SubState": "dead",
        "LoadState": "loaded",
        "Result": "success",
        "ExecMainCode": "0",
        "ExecMainStatus": "0",
    }
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    e, units, records = job_on("bert", 1, {"chief-0": forgot})
    records["exits"] = {unit("bert", "chief-0"): [["1", "exit-code", "exited", "2"]]}
    events, _ = run(r1, rnd(host("gpu-1", (e, units, records))))
    assert kinds(events) == [("job.started", ""), ("task.failed", ""), ("job.ended", "failed")]


def test_a_restart_between_rounds_is_a_task_failure() -> None:
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    r2 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RESTARTING})))
    events, _ = run(r1, r2, r2)
    assert kinds(events) == [("job.started", ""), ("task.failed", "")]
    assert "restart 1" in events[1].words


def test_a_run_that_started_and_ended_between_two_rounds_gives_both() -> None:
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": OK})))
    r2 = rnd(host("gpu-1", job_on("bert", 2, {"chief-0": OK})))
    events, _ = run(r1, r2, seen=Seen(hosts=frozenset({"gpu-1"})))
    # The first round is where the watch of bert begins on a watched host: its run 1 is new.
    assert [e.key for e in events] == ["start:bert:1", "end:bert:1", "start:bert:2", "end:bert:2"]


def test_what_a_host_runs_the_first_time_it_is_watched_says_nothing() -> None:
    r = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    events, seen = run(r, seen=Seen())
    assert events == [] and seen.jobs["bert"].state is State.RUNNING


@pytest.mark.parametrize(
    "marker, how",
    [
        ({"phase": "Stopped", "reason": "stopped by ana"}, "stopped"),
        ({"phase": "Preempted", "reason": "by x"}, "preempted"),
    ],
)
def test_a_stop_or_a_preemption_ends_the_run_as_such(marker: dict[str, str], how: str) -> None:
    stopped = {**OK, "ExecMainCode": "2", "ExecMainStatus": "15"}
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    r2 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": stopped}, marker=marker)))
    events, seen = run(r1, r2)
    want = (
        [("job.started", ""), ("job.preempted", ""), ("job.ended", how)]
        if how == "preempted"
        else [("job.started", ""), ("job.ended", how)]
    )
    assert kinds(events) == want
    if how == "preempted":
        r3 = rnd(host("gpu-1", job_on("bert", 2, {"chief-0": RUNNING})))
        more, _ = diff(seen, r3)
        assert kinds(more) == [("job.resumed", "")] and more[0].run == 2


def test_a_job_gone_while_it_ran_was_destroyed_and_a_blink_changes_nothing() -> None:
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})), host("gpu-2"))
    away = rnd(unreachable("gpu-1", 2, "connection refused"), host("gpu-2"))
    gone = rnd(host("gpu-1"), host("gpu-2"))
    events, _ = run(r1, away, r1, away, gone)
    assert kinds(events) == [
        ("job.started", ""),
        ("host.unreachable", ""),
        ("host.back", ""),
        ("host.unreachable", ""),
        ("host.back", ""),
        ("job.ended", "destroyed"),
    ]
    hosts = [e.key for e in events if e.kind in (Kind.HOST_UNREACHABLE, Kind.HOST_BACK)]
    assert hosts == ["down:gpu-1:1", "back:gpu-1:1", "down:gpu-1:2", "back:gpu-1:2"]


def test_a_job_on_a_host_away_is_not_judged_by_the_hosts_that_answer() -> None:
    both = rnd(
        host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})), host("gpu-2", job_on("bert", 1, {"worker-0": RUNNING}))
    )
    half = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": OK})), unreachable("gpu-2", 2, "timed out"))
    events, seen = run(both, half)
    assert kinds(events) == [("job.started", ""), ("host.unreachable", "")]
    assert seen.jobs["bert"].state is State.RUNNING  # kept as it was


def test_trials_of_a_study_surveyed_say_nothing_here() -> None:
    assert study_of("walk-t3", {"walk"}) == "walk" and study_of("walk-t0", {"walk"}) is None
    assert study_of("walk-t3", {"other"}) is None
    r1 = rnd(host("gpu-1", job_on("walk-t3", 1, {"chief-0": RUNNING})), studies=frozenset({"walk"}))
    r2 = rnd(host("gpu-1", job_on("walk-t3", 1, {"chief-0": OK})), studies=frozenset({"walk"}))
    events, seen = run(r1, r2)
    assert events == [] and seen.jobs["walk-t3"].state is State.ENDED


def test_seen_survives_its_json_and_a_broken_one_is_a_new_watch() -> None:
    r = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    _, seen = run(r)
    assert Seen.from_json(seen.to_json()) == seen
    assert Seen.from_json({"jobs": {"x": {"state": "bogus"}}}) == Seen()
    assert Seen.from_json("nonsense") == Seen()


def test_event_kinds_parse_with_families() -> None:
    assert parse_kinds("job.ended, trial.*") == (Kind.JOB_ENDED, Kind.TRIAL_ENDED)
    assert How.DESTROYED.value == "destroyed"
    with pytest.raises(ValueError, match="job.bogus"):
        parse_kinds("job.ended,job.bogus")


def test_tasks_stopped_without_a_marker_are_judged_at_the_next_round() -> None:
    """destroy stops the tasks, then removes the job: a round between the two must not call
    the run failed (every task ended without the policy holding)."""
    killed = {**OK, "ExecMainCode": "2", "ExecMainStatus": "15"}
    r1 = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": RUNNING})))
    stopped = rnd(host("gpu-1", job_on("bert", 1, {"chief-0": killed})))
    gone = rnd(host("gpu-1"))
    events, _ = run(r1, stopped, gone)
    assert kinds(events) == [("job.started", ""), ("job.ended", "destroyed")]
    events, seen = run(r1, stopped, stopped, stopped)
    assert kinds(events) == [("job.started", ""), ("job.ended", "stopped")]
    assert seen.jobs["bert"].state is State.ENDED
