"""The documents web/ and serve/ pass around are TypedDicts that mypy checks; each one names
exactly the keys its producer writes (required ones always there, optional ones only the
extras the dashboard adds), so a key added to a producer without its type fails here."""

from __future__ import annotations

import typing
from typing import Any

from provision.core.events import Event, EventJson, Kind, Stored
from provision.core.lifecycle import JobPhase, TaskState
from provision.core.runs import Run, RunJson
from provision.core.tuning import Goal, Metric, Param, ParamType, TrialJson, TrialRow, TrialState, Tune
from provision.rules.gpuuse import host_use
from provision.rules.jobsdoc import GpuAppJson, GpuUseJson, HostJson, JobHostJson, JobJson, JobsDoc
from provision.rules.status import JobStatus, StatusJson, TaskJson, TaskStatus
from provision.rules.studyview import MetricJson, ParamJson, StudyJson, space_json, study_json
from provision.rules.tenancy import host_view as tenancy_host_view
from provision.rules.tenancy import jobs_json
from provision.rules.usage import UsageDay, UsageDoc, UsageWeek
from provision.serve.source import usage_doc
from test_tenancy import ACTIVE, NOW, entry, report


def keys(t: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(required, optional) keys (the modules' postponed annotations hide NotRequired from
    __required_keys__ on Python 3.11: read from the hints)."""
    hints = typing.get_type_hints(t, include_extras=True)
    optional = frozenset(k for k, h in hints.items() if typing.get_origin(h) is typing.NotRequired)
    return frozenset(hints) - optional, optional


def same(t: Any, real: dict[str, Any]) -> None:
    required, optional = keys(t)
    assert required <= set(real), f"{t.__name__}: {sorted(required - set(real))} missing"
    assert set(real) <= required | optional, f"{t.__name__}: {sorted(set(real) - required - optional)} not typed"


def test_the_hosts_document_is_typed_as_jobs_json_writes_it():
    run = entry("run", gpus=(0,), ports=(2222,))
    doc = jobs_json([tenancy_host_view("gpu-1", 2, report(run, units={run["units"][0]: ACTIVE}), NOW)], NOW)
    same(JobsDoc, dict(doc))
    same(JobJson, dict(doc["jobs"][0]))
    same(JobHostJson, dict(doc["jobs"][0]["hosts"]["gpu-1"]))
    same(HostJson, dict(doc["hosts"]["gpu-1"]))
    # What a survey adds to a host (labels, drain, gpu_use) and the service (gpu_history) are the optional ones.
    assert keys(HostJson)[1] == {"labels", "drain", "gpu_use", "gpu_history"}
    assert keys(JobJson)[1] == {"gpus", "gpu_hours", "ended", "goodput"}  # goodput: a watched job's (survey)
    facts = {"gpus": [{"index": 0, "uuid": "GPU-a", "util_pct": 5, "memory_used_mib": 1, "memory_mib": 80}]}
    checks = {"gpus": {"apps": [{"gpu_uuid": "GPU-a", "pid": 7, "name": "py", "used_mib": 1, "owner": {}}]}}
    use = host_use(facts, checks, {})
    same(GpuUseJson, dict(use["0"]))
    same(GpuAppJson, dict(use["0"]["apps"][0]))


def test_the_status_and_the_study_are_typed_as_they_are_written():
    task = TaskStatus("chief-0", "chief", "h", "10.0.0.1", [0], TaskState.RUNNING, None, 0, 5, "running")
    st = JobStatus("j", JobPhase.RUNNING, "", (task,), run=Run(1, NOW, "ana"))
    same(StatusJson, dict(st.to_json()))
    same(TaskJson, dict(st.to_json()["tasks"][0]))
    same(RunJson, dict(Run(1, NOW, "ana").to_json()))
    tune = Tune(Metric("loss", Goal.MINIMIZE), (Param("lr", ParamType.DOUBLE, 0.1, 1.0),), max_trials=3)
    row = TrialRow(1, (("lr", 0.5),), TrialState.SUCCEEDED, 0.25, 10, 3.0, job="j-t1")
    doc = study_json("j", tune, [row], ended=None, picture=None)
    same(StudyJson, dict(doc))
    same(MetricJson, dict(doc["metric"]))
    same(TrialJson, dict(row.to_json()))
    same(ParamJson, dict(space_json(tune)[0]))


def test_the_events_and_the_usage_are_typed_as_they_are_written():
    got = Stored(1, NOW, Event(Kind.JOB_ENDED, "end:j:1", "j")).to_json()
    same(EventJson, dict(got))
    doc = usage_doc(
        [("day", "2027-01-15", NOW - 10, NOW), ("week", "2027-W03", NOW - 10, NOW)], [{"a": 1.0}, {"a": 2.0}]
    )
    same(UsageDoc, dict(doc))
    same(UsageDay, dict(doc["days"][0]))
    same(UsageWeek, dict(doc["weeks"][0]))


def test_a_watched_jobs_status_is_typed_as_it_is_written():
    from provision.core.recovery import (
        Broke,
        GoodputJson,
        Incident,
        IncidentJson,
        LostJson,
        RecoveryJson,
        RecoveryRecord,
        Stage,
        goodput,
    )  # fmt: skip
    from provision.rules.progress import ProgressJson, ProgressView

    inc = Incident(1, Broke.HOST, "worker-0", "h2", "w", "host", 1, NOW - 50, NOW - 40, NOW - 35, NOW - 20,
                   NOW - 60, stage=Stage.DONE, started=NOW - 100)  # fmt: skip
    rec = RecoveryRecord(("h2",), (inc,))
    view = ProgressView(NOW - 1, NOW - 5, 60.0, False, False)
    st = JobStatus(
        "j", JobPhase.RUNNING, "", (), progress=view, broke="w", recovery=rec, goodput=goodput(rec, None, NOW)
    )
    doc = st.to_json()
    same(StatusJson, dict(doc))
    assert keys(StatusJson)[1] >= {"progress", "broke", "recovery", "goodput"}
    same(ProgressJson, dict(doc["progress"]))
    same(RecoveryJson, dict(doc["recovery"]))
    same(IncidentJson, dict(doc["recovery"]["incidents"][0]))
    same(GoodputJson, dict(doc["goodput"]))
    same(LostJson, dict(doc["goodput"]["incidents"][0]))
