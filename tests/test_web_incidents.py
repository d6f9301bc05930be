"""A recovered job on its page: its incidents drawn on the timeline (its outage from when it
broke to running again, ticked where it was seen and stopped, the work it redid before it),
its goodput and each incident in `status`'s words, and both in the job's JSON (a fake Source,
as tests/test_web.py's; the incidents and goodput made by core/recovery as a job's state
keeps them)."""

from __future__ import annotations

import re
import time
from typing import Any

from starlette.testclient import TestClient

from provision.core.recovery import Broke, Incident, RecoveryRecord, Stage, goodput, goodput_words, incident_words
from provision.web.app import make_app
from provision.web.auth import Auth
from provision.web.timecharts import incident_lines, incidents_of, timeline_svg
from test_web import EVIL, HERE, FakeSource

T0 = float(time.time() - 420)  # the job's first run started 7 minutes ago


def _record() -> RecoveryRecord:
    done = Incident(
        1, Broke.HOST, "worker-0", "gpu-2", f"worker-0's host gpu-2 stopped answering {EVIL}", "host",
        run=1, at=T0 + 120, detected=T0 + 129, stopped=T0 + 131, running=T0 + 145, checkpoint=T0 + 109,
        stage=Stage.DONE, new_run=2, started=T0,
    )  # fmt: skip
    open_ = Incident(
        2, Broke.FAILED, "worker-1", "gpu-3", "worker-1 exited 1", "exit 1",
        run=2, at=T0 + 360, detected=T0 + 365, stage=Stage.STOPPING, started=T0 + 145,
    )  # fmt: skip
    return RecoveryRecord(("gpu-2",), (done, open_))


def iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


class RecoveredSource(FakeSource):
    """bert recovered once and recovering again; `service`: with its runs and events (the
    service's history and stream)."""

    def __init__(self, service: bool = False) -> None:
        super().__init__()
        self.service = service

    def job(self, name: str) -> dict[str, Any]:
        doc = super().job(name)
        record = _record()
        g = goodput(record, T0 + 145, T0 + 420)  # as of a fixed now: each call says the same
        assert g is not None
        doc = {**doc, "recovery": record.to_json(), "goodput": g}
        if self.service:
            recovered = {"id": 7, "time": iso(T0 + 145), "kind": "job.recovered", "job": "bert", "owner": "ana",
                         "host": "gpu-2", "words": incident_words(record.incidents[0], T0 + 145), "how": None,
                         "run": 2, "hosts": ["gpu-1"], "gpus": 2}  # fmt: skip
            doc |= {"runs": _runs(), "timeline": [recovered], "kept_logs": False}
        return doc


def _runs() -> list[dict[str, Any]]:
    row = {"kind": "run", "job": "bert", "owner": "ana", "seconds": 1.0, "how": "", "hosts": ["gpu-1"], "gpus": 2,
           "gpu_hours": 1.0, "submission": ""}  # fmt: skip
    return [
        {**row, "started": iso(T0), "ended": iso(T0 + 131), "state": "failed"},
        {**row, "started": iso(T0 + 145), "ended": None, "state": "running"},
    ]


def test_the_timeline_draws_each_incident_from_broke_to_running_again() -> None:
    record = _record()
    now = T0 + 400
    svg = str(timeline_svg(_runs(), [], now, incidents_of(record.to_json())))  # type: ignore[arg-type]
    assert svg.count('class="incident ') == 2 and 'class="incident done"' in svg and 'class="incident stopping"' in svg
    assert svg.count('class="redone"') == 1 and "incident 1: 11 s of work redone" in svg
    # the done one ticked at each step; the open one where it broke and was seen
    for step in ("at", "detected", "stopped", "running"):
        assert svg.count(f'class="step {step}"') == (2 if step in ("at", "detected") else 1), step
    # its outage spans when it broke to running again, on the runs' axis
    done = re.search(
        r'<rect x="([0-9.]+)" y="60" width="([0-9.]+)" height="14" fill="#d62728" class="incident done"', svg
    )
    redone = re.search(r'<rect x="([0-9.]+)" y="60" width="([0-9.]+)" height="14" fill="#f4b183" class="redone"', svg)
    assert done and redone
    assert abs(float(redone[1]) + float(redone[2]) - float(done[1])) < 0.2  # the work redone ends where it broke
    assert float(done[2]) > float(redone[2])  # 25 s of outage, 11 s redone
    # each incident's tooltip is status's line, escaped
    assert str(incident_words(record.incidents[0], now)).replace("<", "&lt;").split(":")[0] in svg
    assert EVIL not in svg and "&lt;script&gt;" in svg
    assert "incidents</text>" in svg


def test_a_timeline_without_incidents_has_no_incident_lane() -> None:
    svg = str(timeline_svg(_runs(), [], T0 + 400))  # type: ignore[arg-type]
    assert 'class="incident' not in svg and "incidents</text>" not in svg


def test_the_job_page_shows_goodput_and_incidents_as_status_says_them() -> None:
    src = RecoveredSource()
    client = TestClient(make_app(src, auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    page = client.get("/jobs/bert")
    assert page.status_code == 200
    body = page.text
    doc = src.job("bert")
    words = goodput_words(doc["goodput"])
    assert words and words.startswith("Goodput: ") and "2 incidents" in words
    assert f'<p class="goodput" id="goodput">{words}</p>' in body
    # the incidents, newest first, in status's words (the host's text escaped)
    lines = incident_lines(doc["recovery"], time.time())
    assert lines[0].startswith("incident 2 (stopping): worker-1 exited 1: seen in 5 s, stopped in -")
    assert "incident 1 (done): worker-0's host gpu-2 stopped answering" in lines[1]
    assert "seen in 9 s, stopped in 2 s, running again in 14 s, 11 s of work redone" in lines[1]
    listed = body[body.index('id="incidents"') :]
    assert listed.index("incident 2 (stopping)") < listed.index("incident 1 (done)")
    assert EVIL not in body
    # the timeline is drawn from the incidents alone (this source has no history)
    assert "<h2>Timeline</h2>" in body and 'class="incident done"' in body
    api = client.get("/api/v1/jobs/bert").json()
    assert api["goodput"]["ratio"] == doc["goodput"]["ratio"] and len(api["goodput"]["incidents"]) == 2
    assert [i["n"] for i in api["recovery"]["incidents"]] == [1, 2]


def test_a_job_without_recovery_has_no_goodput_line() -> None:
    client = TestClient(make_app(FakeSource(), auth=Auth.loopback()), client=HERE, base_url="http://127.0.0.1:8470")
    body = client.get("/jobs/bert").text
    assert 'id="goodput"' not in body and 'id="incidents"' not in body and "<h2>Timeline</h2>" not in body
