"""The job as a unit (lifecycle.whole_job, finished, synchronous): pure rules, as tables."""

from __future__ import annotations

import pytest

from provision.core.lifecycle import Action, Decision, Reason, decide, finished, synchronous, whole_job

RUN = Decision(Action.NONE, Reason.RUNNING, "")
CHANGED = Decision(Action.RESTART, Reason.INPUTS_CHANGED, "env")
NEW = Decision(Action.START, Reason.NEW, "", new=True)
LEAVING = Decision(Action.STOP, Reason.LEFT, "")
DONE = Decision(Action.NONE, Reason.COMPLETED, "")
ENDED = Decision(Action.NONE, Reason.JOB_ENDED, "succeeded")
FAILED = Decision(Action.NONE, Reason.FAILED, "failed (exit 1)")


@pytest.mark.parametrize(
    "roles, sync",
    [(["chief", "worker"], True), (["worker", "reduction_server"], True), (["chief", "worker", "ps"], False)],
)
def test_which_jobs_run_in_lockstep(roles, sync):
    assert synchronous(roles) is sync


def actions(ds):
    return {t: (d.action, d.reason) for t, d in ds.items()}


def test_one_restart_restarts_every_task_of_a_synchronous_job():
    out = whole_job({"chief-0": RUN, "worker-0": CHANGED, "worker-1": RUN, "worker-2": LEAVING}, sync=True, rerun=False)
    assert actions(out) == {
        "chief-0": (Action.RESTART, Reason.WITH_JOB),
        "worker-0": (Action.RESTART, Reason.INPUTS_CHANGED),
        "worker-1": (Action.RESTART, Reason.WITH_JOB),
        "worker-2": (Action.STOP, Reason.LEFT),
    }
    assert out["chief-0"].describe() == "restarts with the job (worker-0 restarts: its tasks run together)"


def test_a_ps_job_restarts_only_what_changed():
    ds = {"chief-0": RUN, "worker-0": CHANGED, "ps-0": RUN}
    assert whole_job(ds, sync=False, rerun=False) == ds


def test_new_tasks_alone_restart_nothing():
    # a first apply, or a grown pool whose env leaves the others unchanged
    ds = {"chief-0": RUN, "worker-1": NEW}
    assert whole_job(ds, sync=True, rerun=False) == ds


def test_rerun_restarts_everything_but_what_leaves():
    out = whole_job({"chief-0": ENDED, "worker-0": DONE, "worker-1": LEAVING}, sync=True, rerun=True)
    assert actions(out) == {
        "chief-0": (Action.RESTART, Reason.RERUN),
        "worker-0": (Action.RESTART, Reason.RERUN),
        "worker-1": (Action.STOP, Reason.LEFT),
    }


@pytest.mark.parametrize(
    "ds, done",
    [
        ({"chief-0": ENDED, "worker-0": ENDED}, True),
        ({"chief-0": DONE, "worker-0": FAILED}, True),
        ({"chief-0": DONE, "worker-0": RUN}, False),
        ({"chief-0": NEW}, False),
        ({"chief-0": LEAVING}, False),
        ({}, False),
    ],
)
def test_finished(ds, done):
    assert finished(ds) is done


ACTIVE = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
DEAD = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}
STOP_MARK = {"phase": "Stopped", "reason": "stopped by ana (provision stop)"}


@pytest.mark.parametrize(
    "changed, drifted, unit, ended, want",
    [
        # item 13: stopped, then its inputs changed: it stays stopped, and --rerun takes it.
        (True, ["env"], DEAD, STOP_MARK, (Action.NONE, Reason.JOB_ENDED)),
        (False, ["env"], DEAD, STOP_MARK, (Action.NONE, Reason.JOB_ENDED)),  # edited by hand: rewritten, not started
        (True, ["env"], DEAD, {"phase": "Succeeded"}, (Action.NONE, Reason.JOB_ENDED)),
        (True, ["env"], DEAD, None, (Action.NONE, Reason.COMPLETED)),  # exited 0, no end marker yet
        (True, ["env"], ACTIVE, None, (Action.RESTART, Reason.INPUTS_CHANGED)),  # running: restarts
        (True, ["env"], ACTIVE, STOP_MARK, (Action.RESTART, Reason.INPUTS_CHANGED)),  # still running
    ],
)
def test_a_finished_task_is_not_started_by_a_change(changed, drifted, unit, ended, want):
    exits = [["100", "success", "exited", "0"]] if unit is DEAD else []
    d = decide("chief-0", True, changed, drifted, unit, exits, ended, False)
    assert (d.action, d.reason) == want
    if d.action is Action.NONE:
        assert finished({"chief-0": d})  # so --rerun takes the job: the two agree
        assert whole_job({"chief-0": d}, sync=True, rerun=True)["chief-0"].reason is Reason.RERUN
