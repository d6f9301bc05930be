"""A first apply's guard (host/fresh.py) against the controller's presumed answer
(run/firstapply.presumed), as a table: the presumed answer passes; each thing a plan made
without asking takes for absent, present, is a refusal; the guard's messages cross the wire."""

from __future__ import annotations

import dataclasses
import json

import pytest

from provision.host import fresh
from provision.host import protocol as P
from provision.run.firstapply import SKEW, presumed

JOB = "j"
REQ = P.ProbeRequest(
    job=JOB,
    want={"/etc/provision/j/w-0.env": "a" * 64, "/etc/systemd/system/provision-j-w-0.service": "b" * 64},
    programs=["/bin/sleep"],
    units=["provision-j-w-0.service"],
    facts="check",
    tenancy=True,
    checks={"clock": True, "ports": [2222], "disk": []},
)
NOW = 1_000_000.0
BASE = presumed(REQ, NOW)
FILE = P.FileInfo("file", 0o644, 0, 3)


def _with(**changes: object) -> P.ProbeReport:
    return dataclasses.replace(BASE, **changes)


def test_the_presumed_answer_is_fresh():
    assert fresh.refusals(BASE, REQ, [2222], NOW, SKEW) == []
    # A real host's answer carries more than the presumed one where plan does not look.
    real = _with(listening=[22, 39481], listening_local=[39481], boot_id="x", now=NOW + 0.3)
    assert fresh.refusals(real, REQ, [2222], NOW, SKEW) == []


@pytest.mark.parametrize(
    ("report", "why"),
    [
        (_with(manifest={"files": {}}), "the job's manifest is here"),
        (_with(lifecycle={"reason": "succeeded"}), "the job's end marker is here"),
        (_with(runs=[{"run": 1}]), "the job's runs is here"),
        (_with(setup_key="k"), "a setup's mark is here"),
        (_with(files={**BASE.files, "/etc/provision/j/w-0.env": FILE}), "/etc/provision/j/w-0.env is here"),
        (_with(files={**BASE.files, "/bin/sleep": None}), "/bin/sleep is not an executable file here"),
        (_with(files={**BASE.files, "/bin/sleep": FILE}), "/bin/sleep is not an executable file here"),
        (
            _with(units={"provision-j-w-0.service": {"LoadState": "not-found", "ActiveState": "failed"}}),
            "systemd knows provision-j-w-0.service",
        ),
        (_with(exits={"provision-j-w-0.service": [["1", "exit-code", "1", "-"]]}), "exit records"),
        (
            _with(dropins=["/etc/systemd/system/provision-j-w-0.service.d/x.conf"]),
            "drop-in /etc/systemd/system/provision-j-w-0.service.d/x.conf",
        ),
        (_with(ledger={"other": {"job": "other", "ports": [2222]}}), "the ledger holds other"),
        (_with(ledger_records={"other": {"runs": []}}), "the ledger holds entries"),
        (_with(health={"host": {"state": "draining"}}), "health record"),
        (_with(listening=[22, 2222]), "port 2222 in use"),
        (_with(checks={"ports": {"2222": {"pid": 7}}}), "port 2222 in use"),
        (_with(facts={"systemd_pid1": False}), "systemd is not PID 1"),
        (_with(now=NOW + SKEW + 1), "the clock is"),
    ],
)
def test_each_difference_is_refused(report, why):
    got = fresh.refusals(report, REQ, [2222], NOW, SKEW)
    assert got and all(g.startswith(JOB + ": ") for g in got)
    assert any(why in g for g in got), got


def test_a_drop_in_of_another_job_is_not_a_refusal():
    other = _with(dropins=["/etc/systemd/system/provision-k-w-0.service.d/x.conf"])
    assert fresh.refusals(other, REQ, [2222], NOW, SKEW) == []


def test_the_guard_crosses_the_wire_first_in_its_batch():
    guard = P.FreshRequest(JOB, REQ, [2222], NOW, SKEW)
    batch = P.BatchRequest([guard, P.UnitsRequest(job=JOB)])
    back = P.request_from_wire(json.loads(json.dumps(P.to_wire(batch))))
    assert back == batch
    answer = {"results": [P.to_wire(P.FreshReport(BASE, ["j: why"]))]}
    rep = P.batch_from_wire(batch, json.loads(json.dumps(answer)))
    assert rep.results[0].errors == ["j: why"] and rep.results[0].probe == BASE


def test_the_agent_runs_the_guard(monkeypatch):
    from provision.host import agent

    monkeypatch.setattr(agent, "op_probe", lambda req: _with(manifest={"files": {}}))
    rep = agent.OPS["fresh"](P.FreshRequest(JOB, REQ, [2222], 0.0, SKEW))
    assert rep.errors == ["j: the job's manifest is here"]
    # A batch stops after the refusal: nothing after it runs.
    ran = []
    monkeypatch.setitem(agent.OPS, "units", lambda req: ran.append(req))
    out = agent.op_batch(P.BatchRequest([P.FreshRequest(JOB, REQ, [2222], 0.0, SKEW), P.UnitsRequest(job=JOB)]))
    assert len(out.results) == 1 and ran == []
