"""A first apply's guard (host/fresh.py) against the controller's presumed answer
(run/firstapply.presumed), as a table: the presumed answer passes; each thing a plan made
without asking takes for absent, present, is a refusal; the guard's messages cross the wire."""

from __future__ import annotations

import dataclasses
import json
import os

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

    monkeypatch.setattr(fresh, "op_probe", lambda req: _with(manifest={"files": {}}))
    rep = agent.OPS["fresh"](P.FreshRequest(JOB, REQ, [2222], 0.0, SKEW))
    assert rep.errors == ["j: the job's manifest is here"]
    # A batch stops after the refusal: nothing after it runs.
    ran = []
    monkeypatch.setitem(agent.OPS, "units", lambda req: ran.append(req))
    out = agent.op_batch(P.BatchRequest([P.FreshRequest(JOB, REQ, [2222], 0.0, SKEW), P.UnitsRequest(job=JOB)]))
    assert len(out.results) == 1 and ran == []


# --------------------------------------------------------------------------- the controller's side


def _ctx(tmp_path, extra: str = "", env: str = "{NCCL_SOCKET_IFNAME: eth0, GLOO_SOCKET_IFNAME: eth0}", gpus: int = 0):
    from provision.run.context import open_context

    key = tmp_path / "id"
    key.write_text("k\n")
    key.chmod(0o600)
    acc = f", accelerators: {{type: nvidia-h100, count: {gpus}}}" if gpus else ""
    hosts = "".join(f"  - {{name: h{i}, address: 10.0.0.{i}{acc}}}\n" for i in range(1, 4))
    each = f"accelerators: {min(gpus, 1)}, " if gpus else ""
    (tmp_path / "inv.yaml").write_text(
        f"job: fa\nssh: {{user: root, identity_file: {key}}}\nenv: {env}\nhosts:\n{hosts}"
        f"pools:\n  chief: {{replicas: 1, {each}command: [/bin/sleep, infinity]}}\n"
        f"  worker: {{replicas: 2, {each}command: [/bin/sleep, infinity]}}\n" + extra
    )
    return open_context(str(tmp_path / "inv.yaml"), operation="apply")


FLAGS = {"replace": set(), "rerun": False, "partial": False, "force_setup": False, "checks": True}


def test_which_first_applies_plan_without_asking(tmp_path, monkeypatch):
    from provision.run.firstapply import eligible

    ctx = _ctx(tmp_path)
    try:
        assert eligible(ctx, auto_approve=True, flags=FLAGS)
        assert not eligible(ctx, auto_approve=False, flags=FLAGS)  # asked: probe first
        assert not eligible(ctx, auto_approve=True, flags={**FLAGS, "rerun": True})
        assert not eligible(ctx, auto_approve=True, flags={**FLAGS, "replace": {"chief-0"}})
        monkeypatch.setenv("PROVISION_FIRST_APPLY", "probe")
        assert not eligible(ctx, auto_approve=True, flags=FLAGS)
    finally:
        ctx.close()
    monkeypatch.delenv("PROVISION_FIRST_APPLY")
    for sub, extra, env in (
        ("ifname", "", "{X: y}"),  # each host's interface to look up
        ("setup", 'setup: {commands: ["true"]}\n', None),
    ):
        d = tmp_path / sub
        d.mkdir()
        ctx = _ctx(d, extra, env) if env else _ctx(d, extra)
        try:
            assert not eligible(ctx, auto_approve=True, flags=FLAGS), sub
        finally:
            ctx.close()


def test_the_presumed_plan_creates_everything_and_its_manifests_are_the_rendered_ones(tmp_path):
    import copy

    from provision.render.files import FileKind, manifest_bytes
    from provision.run.apply import _manifests
    from provision.run.firstapply import presumed_plan

    ctx = _ctx(tmp_path)
    try:
        pre = presumed_plan(ctx, checks=True)
        assert pre is not None and not pre.plan.problems
        assert {hp.name for hp in pre.plan.hosts if hp.changed} == {"h1", "h2", "h3"}
        for hp in pre.plan.hosts:
            assert all(f.action.value == "create" for f in hp.files)
            assert [t.action.value for t in hp.tasks] == ["start"]
            final = hp.bundle.manifest
            interim = copy.deepcopy(final)  # as apply made them before: deep copies, encoded
            for t in hp.starts():
                interim["tasks"][t.task]["inputs"] = "pending"
            want = (manifest_bytes(interim), manifest_bytes(interim), manifest_bytes(final))
            assert _manifests(hp) == want
            assert want[2] == next(f.data() for f in hp.bundle.files if f.kind is FileKind.MANIFEST)
            # A host with an old manifest: pending lists the old files and tasks too.
            old = {"files": {"/old": {"sha256": "x"}}, "tasks": {"gone-0": {"unit": "u", "inputs": "i"}}}
            hp2 = dataclasses.replace(hp, report=dataclasses.replace(hp.report, manifest=old))
            pending = json.loads(_manifests(hp2)[0])
            assert pending["files"]["/old"] == {"sha256": "x"} and pending["tasks"]["gone-0"]["inputs"] == "pending"
            assert set(final["files"]) < set(pending["files"]) and "/old" not in final["files"]
    finally:
        ctx.close()


def test_the_context_asks_who_applies_once_and_finds_hosts_by_name(tmp_path, monkeypatch):
    from provision.rules import tenancy

    ctx = _ctx(tmp_path)
    calls = []
    real = tenancy.Owner.here
    monkeypatch.setattr(tenancy.Owner, "here", classmethod(lambda cls, *a: calls.append(a) or real(*a)))
    try:
        assert ctx.owner is ctx.owner and len(calls) == 1
        assert ctx.host("h2") is ctx.inventory.hosts[1] and ctx.host("nope") is None
        ctx.inventory = dataclasses.replace(ctx.inventory, hosts=ctx.inventory.hosts[:1])
        assert ctx.host("h2") is None  # a new inventory: looked up in it
    finally:
        ctx.close()


def test_a_port_something_listens_on_is_in_use_and_a_free_one_is_not():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        with socket.socket() as t:  # a port just freed is free
            t.bind(("0.0.0.0", 0))
            free = t.getsockname()[1]
        assert fresh.in_use([busy, free]) == [busy]
    # The guard asks no listening ports (listening None): the ports the binds found are in use.
    quiet = _with(listening=None)
    assert fresh.refusals(quiet, REQ, [], NOW, SKEW) == []
    assert "port 2222 in use" in fresh.refusals(quiet, REQ, [2222], NOW, SKEW)[0]


def test_a_clock_off_the_other_hosts_is_a_warning_after_the_guards_answers():
    from provision.run.firstapply import clock_warnings

    def answer(skew: float) -> tuple[P.ProbeReport, float, float]:
        return (_with(now=NOW + 0.5 + skew), NOW, NOW + 1.0)

    answers = {"h1": answer(0), "h2": answer(0.2), "h3": answer(12.0), "h4": (None, NOW, NOW + 1)}
    got = clock_warnings(answers)
    assert len(got) == 1 and got[0].startswith("h3: warning: clock") and "ahead of" in got[0]
    assert clock_warnings({"h1": answer(0), "h2": answer(0.3)}) == []


# --------------------------------------------------------------------------- GPUs, outputs, files:

H100 = {"count": 2, "words": ["h100"], "mib": 0}
GPUS = [{"index": i, "uuid": f"GPU-{i}", "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559} for i in range(2)]
FACTS = {"systemd_pid1": True, "nvidia_smi": "ok", "gpus": GPUS}
CHECK = {"health": [{"index": 0, "driver": "550"}, {"index": 1, "driver": "550"}], "apps": []}


@pytest.mark.parametrize(
    ("facts", "checks", "want", "why"),
    [
        (FACTS, {"gpus": CHECK}, H100, None),
        (FACTS, None, H100, None),  # asked without checks: the count and model alone
        (FACTS, None, {}, None),  # no GPUs presumed: none looked at
        (FACTS, None, {**H100, "mib": 80 * 1024}, None),
        ({**FACTS, "gpus": GPUS[:1]}, None, H100, "1 GPUs here (nvidia-smi: ok), not 2"),
        ({"nvidia_smi": "not found"}, None, H100, "0 GPUs here (nvidia-smi: not found)"),
        (FACTS, None, {**H100, "words": ["a100"]}, "the GPUs here are NVIDIA H100 80GB HBM3"),
        (FACTS, None, {**H100, "mib": 40 * 1024}, "81559 MiB of memory"),
        (FACTS, {"gpus": {**CHECK, "apps": [{"pid": 9, "gpu_uuid": "GPU-1"}]}}, H100, "a compute process is on a GPU"),
        (FACTS, {"gpus": {**CHECK, "health": [{"index": 1, "ecc_uncorrected": 2}]}}, H100, "ECC errors"),
        (FACTS, {"gpus": {"error": "timed out"}}, H100, "the GPU check failed: timed out"),
    ],
)
def test_the_guard_holds_the_gpus_to_those_presumed(facts, checks, want, why):
    got = fresh.gpu_refusals(facts, checks, want)
    assert (got == []) if why is None else any(why in g for g in got), got


def test_the_gpus_presumed_are_the_inventorys_and_the_guard_fills_in_their_uuids():
    from provision.core.model import Accelerators, Host, SSHSettings
    from provision.run.firstapply import gpus_presumed

    def host(type_: str, n: int) -> Host:
        return Host("g", "a", SSHSettings(), "a", accelerators=Accelerators(type_, n))

    assert gpus_presumed(host("nvidia-h100-80gb", 8)) == {"count": 8, "words": ["h100"], "mib": 80 * 1024}
    assert gpus_presumed(host("tpu-v5e", 4)) == {} and gpus_presumed(None) == {}
    res = P.Reservation(job=JOB, gpus=[1], gpu_uuids=[""], ports=[2222], units=["u"])
    write = P.WriteRequest(job=JOB, reserve=res)
    got = fresh.completed(P.FreshReport(_with(facts=FACTS)), write)
    assert got.reserve.gpu_uuids == ["GPU-1"] and got.reserve.gpus == [1]
    assert fresh.completed(P.FreshReport(None), write) == write  # nothing read: as planned
    # The agent's batch completes the write that follows the guard, and only that one.
    import unittest.mock

    from provision.host import agent

    seen = []
    ops = {**agent.OPS, "fresh": lambda r: P.FreshReport(_with(facts=FACTS)), "write": seen.append}
    with unittest.mock.patch.dict(agent.OPS, ops):
        agent.op_batch(P.BatchRequest([P.FreshRequest(JOB, REQ), write]))
        agent.op_batch(P.BatchRequest([write]))
    assert [w.reserve.gpu_uuids for w in seen] == [["GPU-1"], [""]]


def test_the_guard_refuses_files_without_room(tmp_path, monkeypatch):
    """Each destination's bytes summed on the file system of its nearest existing
    directory, with the margin beyond (a free 1,000 bytes here)."""
    d = tmp_path / "data"
    asked = []

    def statvfs(path):
        asked.append(path)
        return os.statvfs_result((4096, 1, 10, 10, 1000, 0, 0, 0, 0, 255))

    monkeypatch.setattr(fresh.os, "statvfs", statvfs)
    assert fresh.room_refusals({"need": [[str(d / "new" / "dir"), 600], [str(d), 400]], "margin": 0}) == []
    assert asked == [str(tmp_path)]
    got = fresh.room_refusals({"need": [[str(d / "x"), 600], [str(tmp_path), 401]], "margin": 0})
    assert got == [f"1000 bytes free on {tmp_path}, files: need 1001 and room beyond"], got
    assert fresh.room_refusals({"need": [[str(d), 10]], "margin": 991}) != []


def test_gpu_jobs_outputs_and_files_plan_without_asking_and_reserve_the_gpus(tmp_path):
    from provision.run.firstapply import eligible, guard, presumed_plan

    src = tmp_path / "data.txt"
    src.write_text("x" * 100)
    ctx = _ctx(tmp_path, f"outputs: /data/out\nfiles:\n  - {{src: {src}, dest: /opt/in/}}\n", gpus=2)
    try:
        assert eligible(ctx, auto_approve=True, flags=FLAGS)
        pre = presumed_plan(ctx, checks=True)
        assert pre is not None and not pre.plan.problems, pre and pre.plan.problems
        reserved = {hp.name: hp.reserve.gpus for hp in pre.plan.hosts if hp.reserve is not None}
        assert reserved == {"h1": [0], "h2": [0], "h3": [0]}
        req = guard(ctx, pre, checks=True)(ctx.targets["h1"])
        assert req.gpus == {"count": 2, "words": ["h100"], "mib": 0} and req.probe.checks["gpus"] is True
        assert req.room["need"] == [["/opt/in", 100]]
        assert fresh.refusals(presumed(req.probe, NOW, ctx.host("h1")), req.probe, [], NOW, SKEW) == []
        assert not guard(ctx, pre, checks=False)(ctx.targets["h1"]).room
    finally:
        ctx.close()


def test_gpu_drivers_that_differ_across_hosts_are_a_warning_after_the_guards_answers():
    from provision.run.firstapply import driver_warnings

    def answer(driver: str) -> tuple[P.ProbeReport, float, float]:
        return (_with(checks={"gpus": {"health": [{"index": 0, "driver": driver}]}}), NOW, NOW + 1)

    got = driver_warnings({"h1": answer("550.1"), "h2": answer("550.1"), "h3": answer("535.2"), "h4": (None, 0, 0)})
    assert len(got) == 1 and got[0].startswith("h3: warning: driver 535.2 here, 550.1 on h1, h2"), got
    assert driver_warnings({"h1": answer("550.1"), "h2": answer("550.1")}) == []
    assert driver_warnings({"h1": (BASE, NOW, NOW)}) == []  # no GPUs
