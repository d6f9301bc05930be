"""The health of GPUs and hosts, as tables: what the read's text means (host/health.py), the
signals it gives (rules/health.py, rules/xids.py), what they decide, the events and
incidents of a change (rules/healthlog.py), the host's refusals (host/ledger.py) and the
policy's health: (rules/policyfile.py). The same on real hosts: tests/integration/test_health.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from provision.core.errors import ValidationError
from provision.core.events import Kind
from provision.host import health as hosthealth
from provision.host import layout, ledger
from provision.host.protocol import ProbeReport, Reservation
from provision.io import probe
from provision.rules import health as hl
from provision.rules import healthlog, xids
from provision.rules.health import Change, HostHealth, Level, Mark, Signal, State
from provision.rules.policyfile import from_json, parse, to_json
from provision.rules.xids import XidClass

NOW = 1_800_000_000.0
LINE79 = f"{NOW:.6f} host-1 kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


# --------------------------------------------------------------------------- the kernel's lines


@pytest.mark.parametrize(
    ("line", "source", "want"),
    [
        (LINE79, "journal", (NOW, (0, 0x18, 0), 79)),
        ("[ 12.500000] NVRM: Xid (PCI:0000:3b:00): 48, pid=7, DBE", "dmesg", (NOW - 100 + 12.5, (0, 0x3B, 0), 48)),
        (
            "1800000000.5 h kernel: NVRM: Xid (PCI:0001:af:00.0): 13, Graphics Exception",
            "file",
            (1800000000.5, (1, 0xAF, 0), 13),
        ),
        ("1800000000.5 h kernel: NVRM: GPU at PCI:0000:18:00: GPU-1", "journal", None),  # not an Xid
        ("1800000000.5 h kernel: NVRM: Xid (PCI:0000:18:00): 99999, x", "journal", None),  # not a number it has
        ("no time here NVRM: Xid (PCI:0000:18:00): 79, x", "journal", (None, (0, 0x18, 0), 79)),
    ],
)
def test_an_xid_line_is_read_as_the_driver_writes_it(line, source, want):
    got = xids.parse_line(line, source, NOW - 100)
    assert (None if got is None else (got.at, got.pci, got.code)) == want


def test_only_lines_after_the_last_look_are_new_and_a_full_read_may_have_missed_some():
    read = {"source": "file", "now": NOW, "uptime": 10.0, "after": NOW - 5, "lines": [
        f"{NOW - 10:.6f} h kernel: NVRM: Xid (PCI:0000:18:00): 79, old",
        f"{NOW - 1:.6f} h kernel: NVRM: Xid (PCI:0000:18:00): 79, new",
    ]}  # fmt: skip
    lines, more = xids.new_lines(read)
    assert [x.line.endswith("new") for x in lines] == [True] and not more
    flood = {**read, "after": None, "lines": [LINE79] * hosthealth.XID_LIMIT}
    lines, more = xids.new_lines(flood)
    assert len(lines) == hosthealth.XID_LIMIT and more


@pytest.mark.parametrize(
    ("code", "overrides", "want"),
    [(79, (), XidClass.FATAL), (13, (), XidClass.PROGRAM), (31, ((31, XidClass.FATAL),), XidClass.FATAL),
     (8, (), XidClass.WARN), (555, (), XidClass.WARN), (79, ((79, XidClass.IGNORE),), XidClass.IGNORE)],
)  # fmt: skip
def test_the_xid_table_and_the_policy_over_it(code, overrides, want):
    assert xids.classify(code, overrides) is want


def test_dcgm_health_report_is_read_per_gpu():
    text = """+---------------------------+------------------+
| Health Monitor Report                        |
+===========================+==================+
| Group 0                   | Overall Health: Failure |
| -> GPU ID: 1              | Failure          |
|                           | NVLink: a fatal  |
|                           | error            |
| -> GPU ID: 2              | Warning          |
+---------------------------+------------------+"""
    v = xids.parse_dcgm(text.splitlines())
    assert v.overall == "Failure" and v.gpus == {1: ("Failure", "NVLink: a fatal error"), 2: ("Warning", "")}


# --------------------------------------------------------------------------- the read's text


def test_probe_sh_runs_the_health_read_as_the_agent_does():
    """One text for both readers: the loaded probe.sh holds host/health.HEALTH_SH as it is
    written, in place of its one placeholder line."""
    text = (Path(hosthealth.__file__).parent / "probe.sh").read_text()
    assert text.count("@HEALTH_SH@") == 1 and "nvidia-smi --query-gpu=$hfields" not in text
    loaded = probe.script()
    assert "@HEALTH_SH@" not in loaded
    assert "\n".join(line for line in hosthealth.HEALTH_SH.splitlines() if line.strip()) in loaded
    assert "'" not in hosthealth.HEALTH_SH and "\\" not in hosthealth.HEALTH_SH  # probe.sh travels single-quoted


def test_the_health_section_is_parsed_with_its_parts_bounded():
    lines = [
        "noise", "@health", "@hgpus 0",
        "0, 00000000:18:00.0, 0x00000000000000C0, 3, 5, 8, 16, Yes, 61, 2, Yes, No",
        "1, 00000000:2A:00.0, [N/A], [N/A], 5, 16, 16, No, 0, [N/A], [N/A], [N/A]",
        "@hgpus-end", f"@xid file {NOW:.0f} 100.5 {NOW - 60:.6f}", LINE79, "@xid-end",
        "@dcgm 127", "sh: dcgmi: not found", "@dcgm-end", "@health-end",
    ]  # fmt: skip
    got = hosthealth.parse_section(lines)
    assert got is not None
    g0, g1 = got["gpus"]
    assert (g0["pci"], g0["throttle"], g0["gen"], g0["width"], g0["remap_failed"], g0["retired_dbe"]) == (
        "00000000:18:00.0", 0xC0, 3, 8, True, 61)  # fmt: skip
    assert (g0["ecc_uncorrected"], g0["remap_pending"], g0["retired_pending"]) == (2, True, False)
    assert (g1["throttle"], g1["gen"], g1["remap_failed"], g1["ecc_uncorrected"], g1["remap_pending"]) == (
        None, None, False, None, None)  # fmt: skip
    assert got["xid"] == {"source": "file", "now": NOW, "uptime": 100.5, "after": NOW - 60, "lines": [LINE79]}
    assert got["dcgm"] == {"code": 127, "lines": ["sh: dcgmi: not found"]}
    assert hosthealth.parse_section(["@gpus 0"]) is None
    long = hosthealth.parse_section(["@health", "@xid file", "x" * 10_000, "@xid-end", "@health-end"])
    assert long is not None and len(long["xid"]["lines"][0]) == hosthealth.LINE_CHARS


def test_the_agent_runs_the_read_on_a_host_with_nothing_to_read(tmp_path, monkeypatch):
    """No nvidia-smi query asked, a sandbox's kernel file: the agent's own read of it."""
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(LINE79 + "\nsomething else\n")
    monkeypatch.setattr(layout, "SANDBOX_KMSG", str(kmsg))
    monkeypatch.setattr(layout, "XID_AFTER_PATH", str(tmp_path / "after"))
    got = hosthealth.read({"timeout": 5}, gpu_ok=False)
    assert got["gpus"] is None and got["xid"]["source"] == "file" and got["xid"]["lines"] == [LINE79]
    assert got["xid"]["after"] is None
    (tmp_path / "after").write_text(f"{NOW:.6f}\n")
    assert hosthealth.read({"timeout": 5}, gpu_ok=False)["xid"]["after"] == NOW


# --------------------------------------------------------------------------- signals


def report(facts=None, gpus=None, health=None, disk=None, rec=None) -> ProbeReport:
    checks = {"gpus": gpus or {"error": None, "health": []}, "health": health or {}}
    if disk is not None:
        checks["disk"] = disk
    return ProbeReport(facts=facts or {"nvidia_smi": "ok", "gpus": [{"index": 0}, {"index": 1}]}, checks=checks,
                       health=rec)  # fmt: skip


ROWS = [
    {"index": 0, "pci": "00000000:18:00.0", "throttle": 0, "gen": 5, "gen_max": 5, "width": 16, "width_max": 16,
     "remap_failed": False, "retired_dbe": 0},
    {"index": 1, "pci": "00000000:2A:00.0", "throttle": 0, "gen": 5, "gen_max": 5, "width": 16, "width_max": 16,
     "remap_failed": False, "retired_dbe": 0},
]  # fmt: skip


def _row(i, **kw):
    return [dict(r, **kw) if r["index"] == i else r for r in ROWS]


def xid(*lines, after=None):
    return {"gpus": ROWS, "xid": {"source": "file", "now": NOW, "uptime": 5.0, "after": after, "lines": list(lines)}}


@pytest.mark.parametrize(
    ("r", "want"),
    [
        (report(health={"gpus": ROWS}), []),
        (report(health=xid(LINE79)), [(0, Level.FATAL, "xid")]),
        (report(health=xid(LINE79, after=NOW)), []),  # seen at the last look
        (report(health=xid(LINE79.replace(": 79,", ": 13,"))), [(0, Level.PROGRAM, "xid")]),
        (report(health=xid(LINE79.replace(": 79,", ": 8,"))), [(0, Level.WARN, "xid")]),
        (report(health=xid(LINE79.replace("0000:18:00", "0000:99:00"))), [(None, Level.FATAL, "xid")]),  # not listed
        (report(gpus={"health": [{"index": 1, "ecc_uncorrected": 3}]}), [(1, Level.FATAL, "ecc")]),
        (report(health={"gpus": _row(1, ecc_uncorrected=3)}), [(1, Level.FATAL, "ecc")]),
        (report(gpus={"health": [{"index": 1, "ecc_uncorrected": 3}]}, health={"gpus": ROWS}), []),  # its own query's
        (report(gpus={"health": [{"index": 1, "remap_pending": True}]}), [(1, Level.WARN, "remap")]),
        (report(health={"gpus": _row(1, remap_failed=True)}), [(1, Level.FATAL, "remap")]),
        (report(health={"gpus": _row(0, retired_dbe=60)}), [(0, Level.FATAL, "retired")]),
        (report(health={"gpus": _row(0, retired_dbe=59)}), []),
        (report(health={"gpus": _row(0, throttle=0x40)}), [(0, Level.WARN, "throttle")]),
        (report(health={"gpus": _row(0, throttle=0x4 | 0x1)}), []),  # the power cap and idle: by choice
        (report(health={"gpus": _row(0, width=8)}), [(0, Level.WARN, "pcie")]),
        (report(health={"gpus": _row(0, gen=1)}), []),  # an idle GPU slows its link down: not a fault
        (report(facts={"nvidia_smi": "ok", "gpus": [{"index": 0, "util_pct": 90}, {"index": 1}]},
                health={"gpus": _row(0, gen=3)}), [(0, Level.WARN, "pcie")]),  # fmt: skip
        (report(facts={"nvidia_smi": "ok", "gpus": [{"index": 0}]}), [(None, Level.FATAL, "gone")]),
        (report(facts={"nvidia_smi": "nvidia-smi: timed out after 10s", "gpus": []}), [(None, Level.FATAL, "nvidia-smi")]),
        (report(facts={"nvidia_smi": "Unable to determine the device handle: GPU is lost", "gpus": []}),
         [(None, Level.FATAL, "nvidia-smi")]),  # fmt: skip
        (report(health={"dcgm": {"code": 127, "lines": ["not found"]}}), []),
        (report(health={"dcgm": {"code": 0, "lines": ["| Group 0 | Overall Health: Failure |",
                                                       "| -> GPU ID: 1 | Failure |"]}}), [(1, Level.FATAL, "dcgm")]),
        (report(disk={"/": 10 << 30, "/dev/shm": 64 << 20}), [(None, Level.WARN, "disk")]),
    ],
)  # fmt: skip
def test_each_signal_the_read_gives(r, want):
    got = hl.signals(2, r, outputs="/dev/shm/runs")
    assert [(s.gpu, s.level, s.kind) for s in got] == want, got


def test_a_flood_of_one_xid_is_one_signal():
    got = hl.signals(2, report(health=xid(*[LINE79] * hosthealth.XID_LIMIT)))
    assert len(got) == 1 and "200 times (at least" in got[0].what and got[0].evidence == LINE79


def test_the_policy_changes_what_an_xid_is():
    r = report(health=xid(LINE79.replace(": 79,", ": 31,")))
    assert [s.level for s in hl.signals(2, r)] == [Level.PROGRAM]
    assert [s.level for s in hl.signals(2, r, hl.HealthPolicy(((31, XidClass.FATAL),)))] == [Level.FATAL]
    assert hl.signals(2, r, hl.HealthPolicy(((31, XidClass.IGNORE),))) == ()


def test_the_last_look_moves_to_the_newest_line_or_to_the_read_when_it_missed_some():
    assert hl.xid_after(report(health=xid(LINE79))) == NOW
    assert hl.xid_after(report(health=xid(LINE79, after=NOW))) is None
    assert (
        hl.xid_after(report(health={**xid(*[LINE79] * 200), "xid": {**xid(*[LINE79] * 200)["xid"], "now": NOW + 9}}))
        == NOW + 9
    )


# --------------------------------------------------------------------------- deciding

FATAL0 = Signal(0, Level.FATAL, "Xid 79: GPU has fallen off the bus", LINE79, "xid")
WARN1 = Signal(1, Level.WARN, "PCIe link x8 of x16", "pcie.link.width.current = 8", "pcie")
HOSTBAD = Signal(None, Level.FATAL, "a GPU is gone", "nvidia-smi lists 1", "gone")
ALL = (State.HEALTHY, State.SUSPECT)


def marks(host=None, **gpus) -> HostHealth:
    return HostHealth(host, {int(k[1:]): m for k, m in gpus.items()})


@pytest.mark.parametrize(
    ("health", "found", "now", "want"),
    [
        (marks(), (FATAL0,), NOW, [(0, State.QUARANTINED, ALL, "job", "ann")]),
        (marks(g0=Mark(State.QUARANTINED, since=NOW)), (FATAL0,), NOW, []),  # once
        (marks(g0=Mark(State.SUSPECT, since=NOW)), (FATAL0,), NOW, [(0, State.QUARANTINED, ALL, "job", "ann")]),
        (marks(), (WARN1,), NOW, [(1, State.SUSPECT, (State.HEALTHY,), "", "")]),
        (marks(), (HOSTBAD,), NOW, [(None, State.DRAINING, ALL, "", "")]),
        (marks(), (Signal(0, Level.PROGRAM, "Xid 13", "x", "xid"),), NOW, []),  # the program's: nothing
        (marks(g1=Mark(State.SUSPECT, since=NOW - 60)), (), NOW, []),  # too soon to clear
        (marks(g1=Mark(State.SUSPECT, since=NOW - hl.SUSPECT_HOLD)), (), NOW, [(1, State.HEALTHY, (State.SUSPECT,), "", "")]),
        (marks(g1=Mark(State.SUSPECT, since=NOW - hl.SUSPECT_HOLD)), (WARN1,), NOW, []),  # still warns
        (marks(g0=Mark(State.TESTING, since=NOW - hl.TEST_STALE)), (), NOW, [(0, State.QUARANTINED, (State.TESTING,), "", "")]),
    ],
)  # fmt: skip
def test_what_the_signals_decide(health, found, now, want):
    got = hl.decide(health, found, now, "svc", {0: ("job", "ann")})
    assert [(c.gpu, c.to, c.expect, c.job, c.owner) for c in got] == want


def test_a_target_is_host_or_host_colon_gpu():
    assert hl.parse_target("gpu-1") == ("gpu-1", None) and hl.parse_target("gpu-1:3") == ("gpu-1", 3)
    for bad in ("", ":1", "gpu-1:", "gpu-1:x", "gpu-1:-1", "gpu-1:99999"):
        with pytest.raises(ValueError):
            hl.parse_target(bad)


def test_a_record_from_the_host_is_checked_field_by_field():
    rec = {"host": {"state": "draining", "reason": "r\x1b[31m", "since": NOW}, "gpus": {
        "0": {"state": "quarantined", "reason": "x" * 5000, "since": "soon"}, "x": {"state": "quarantined"},
        "1": {"state": "bogus"}, "2": "not a mark", "3": {"state": "healthy"}}}  # fmt: skip
    h = HostHealth.from_record(rec)
    assert h.host is not None and h.host.state is State.DRAINING and "\x1b" not in h.host.reason
    assert list(h.gpus) == [0] and len(h.gpus[0].reason) == hl.TEXT and h.gpus[0].since is None
    assert HostHealth.from_record({"_unreadable": "bad"}).unreadable == "bad"
    assert HostHealth.from_record(None) == HostHealth() and HostHealth.from_record([1]) == HostHealth()


# --------------------------------------------------------------------------- events and incidents


def known(**gpus) -> healthlog.Known:
    return healthlog.Known({k[1:] if k != "host" else k: m for k, m in gpus.items()}, 2)


Q = Mark(State.QUARANTINED, "Xid 79", LINE79, NOW, "svc", "job", "ann")


@pytest.mark.parametrize(
    ("prev", "cur", "kinds", "opened", "closed"),
    [
        (known(), marks(g0=Q), [Kind.GPU_QUARANTINED], 1, 0),
        (known(g0=Q), marks(g0=Q), [], 0, 0),  # nothing new: nothing said
        (known(g0=Q), marks(), [Kind.GPU_RELEASED], 0, 1),
        (known(g0=Q), marks(g0=Mark(State.TESTING, since=NOW + 5)), [], 1, 1),
        (
            known(g0=Mark(State.TESTING, since=NOW + 5)),
            marks(g0=Mark(State.QUARANTINED, "failed its test", since=NOW + 9)),
            [Kind.GPU_QUARANTINED],
            1,
            1,
        ),  # fmt: skip
        (known(g0=Mark(State.TESTING, since=NOW + 5)), marks(), [Kind.GPU_RELEASED], 0, 1),
        (known(), marks(g1=Mark(State.SUSPECT, since=NOW)), [], 1, 0),  # an incident, no event
        (known(), marks(host=Mark(State.DRAINING, "a GPU is gone", since=NOW)), [Kind.HOST_DRAINED], 1, 0),
        (known(host=Mark(State.DRAINING, since=NOW)), marks(), [Kind.HOST_RELEASED], 0, 1),
    ],
)
def test_what_changed_is_told_once(prev, cur, kinds, opened, closed):
    events, op, cl, now = healthlog.transitions("host-1", prev, cur, 2, NOW + 10)
    assert [e.kind for e in events] == kinds
    assert (len(op), len(cl)) == (opened, closed)
    again = healthlog.transitions("host-1", now, cur, 2, NOW + 20)
    assert again[:3] == ([], [], [])  # the same marks again: nothing


def test_the_quarantine_event_names_the_gpu_the_job_and_its_owner_by_its_key():
    (e,), _, _, _ = healthlog.transitions("host-1", None, marks(g0=Q), 2, NOW)
    assert (e.kind, e.key, e.job, e.owner, e.host) == (
        Kind.GPU_QUARANTINED,
        f"quarantine:host-1:0:{NOW}",
        "job",
        "ann",
        "host-1",
    )
    assert "GPU 0 of host-1 quarantined by svc: Xid 79" in e.words


def test_an_outage_is_an_incident_until_the_host_answers():
    _, op, _, k = healthlog.transitions("host-1", known(g0=Q), HostHealth(), 4, NOW, answered=False)
    assert [i.state for i in op] == ["unreachable"] and k.away == NOW and k.marks == known(g0=Q).marks
    _, op2, _, k2 = healthlog.transitions("host-1", k, HostHealth(), 4, NOW + 5, answered=False)
    assert op2 == [] and k2.away == NOW  # still the same outage
    _, _, cl, k3 = healthlog.transitions("host-1", k2, marks(g0=Q), 4, NOW + 3600)
    assert cl == [(op[0].key, NOW + 3600)] and k3.away is None


def test_the_report_ranks_by_incidents_then_gpu_hours_lost():
    I = healthlog.Incident  # noqa: N806
    rows = [
        I("a", "h1", 0, "quarantined", "Xid 79", "", NOW, NOW + 7200),
        I("b", "h1", 0, "quarantined", "Xid 48", "", NOW + 9000, None),
        I("c", "h2", None, "draining", "a GPU is gone", "", NOW, NOW + 3600, gpus=8),
        I("d", "h2", None, "testing", "a test runs", "", NOW + 3600, NOW + 3700, gpus=8),
        I("e", "h3", 1, "suspect", "throttled", "", NOW, None),
    ]
    got = healthlog.rank(rows, NOW + 10800)
    assert [(r.target, r.incidents, r.gpu_hours_lost) for r in got] == [
        ("h1:0", 2, 2.5), ("h2", 1, round(8 + 8 * 100 / 3600, 3)), ("h3:1", 1, 0.0)]  # fmt: skip
    assert healthlog.lost_hours(rows[0], NOW + 10800, NOW + 3600) == 1.0  # only within the window


# --------------------------------------------------------------------------- the host


@pytest.fixture
def ledger_dir(tmp_path, monkeypatch):
    d = tmp_path / ".ledger"
    monkeypatch.setattr(layout, "LEDGER_DIR", str(d))
    monkeypatch.setattr(layout, "LEDGER_LOCK", str(d / ".lock"))
    monkeypatch.setattr(layout, "HEALTH_PATH", str(d / ".health.json"))
    monkeypatch.setattr(layout, "XID_AFTER_PATH", str(d / ".xid-after"))
    monkeypatch.setattr(layout, "INVOCATION_PREFIX", str(tmp_path / "invocation:"))
    return d


def res(job, gpus, units=None) -> Reservation:
    return Reservation(job=job, owner={"lineage": "L-" + job, "who": "me@here"}, gpus=list(gpus),
                       units=units or [f"provision-{job}-chief-0.service"])  # fmt: skip


def change(gpu, to, expect=None, reason="r") -> dict:
    return Change(gpu, State(to), tuple(State(s) for s in (expect or STATES)), reason, "e", "me").to_wire()


STATES = [s.value for s in State]


def test_the_host_refuses_a_quarantined_gpu_it_was_not_told_of(ledger_dir):
    """The controller planned GPU 1 free; the host's record says quarantined: refused, nothing written."""
    hosthealth.op_health(_req([change(1, "quarantined")]))
    assert ledger.reserve(res("a", [1]), NOW) == ["GPU 1 is quarantined here (r): no new work is placed on it"]
    assert ledger.read_all() == {}
    assert ledger.reserve(res("a", [0]), NOW) == []  # its other GPUs are free
    hosthealth.op_health(_req([change(None, "draining")]))
    assert ledger.reserve(res("b", [1]), NOW)[0].startswith("this host is draining (r): no new work")
    assert ledger.reserve(res("c", []), NOW) != []  # not even a task without a GPU


def test_what_runs_goes_on_and_a_rerun_does_not(ledger_dir, tmp_path):
    assert ledger.reserve(res("a", [0, 1]), NOW) == []
    ledger.mark_started("a", NOW)
    (tmp_path / "invocation:provision-a-chief-0.service").symlink_to("x")  # its unit runs
    hosthealth.op_health(_req([change(1, "quarantined"), change(None, "draining")]))
    assert ledger.reserve(res("a", [0, 1]), NOW + 1) == []  # the same work, changed: it goes on
    assert ledger.start_refusals("a", ["provision-a-chief-0.service"]) == []
    (tmp_path / "invocation:provision-a-chief-0.service").unlink()  # it ended: its rerun is new work
    why = ledger.start_refusals("a", ["provision-a-chief-0.service"])
    assert why[0].startswith("this host is draining") and why[1].startswith("GPU 1 is quarantined")


def test_a_change_that_finds_the_mark_otherwise_is_refused(ledger_dir):
    rep = hosthealth.op_health(_req([change(0, "healthy", ["quarantined"])]))
    assert rep.refused == ["GPU 0 is healthy, not quarantined: nothing was changed"] and rep.record == {}
    rep = hosthealth.op_health(_req([change(0, "quarantined", ["healthy", "suspect"])], after=NOW))
    assert rep.record["gpus"]["0"]["state"] == "quarantined" and rep.refused == []
    assert (ledger_dir / ".xid-after").read_text() == f"{NOW:.6f}\n"
    rep = hosthealth.op_health(_req([change(0, "quarantined", ["healthy", "suspect"])]))
    assert rep.refused == ["GPU 0 is quarantined, not healthy or suspect: nothing was changed"]
    rep = hosthealth.op_health(_req([{"gpu": "1; rm -rf /", "to": "quarantined"}, {"to": "gone"}]))
    assert [r.split(":")[0] for r in rep.refused] == ["not a GPU number", "not a health change"]
    rep = hosthealth.op_health(_req([change(0, "healthy", ["quarantined"])]))
    assert rep.record == {} and not (ledger_dir / ".health.json").exists()  # healthy again: no record left


def _req(changes, after=None):
    from provision.host.protocol import HealthRequest

    return HealthRequest(changes=changes, xid_after=after)


def test_a_test_with_nothing_to_test_with_says_so_and_leaves_the_mark(ledger_dir, monkeypatch):
    monkeypatch.setattr(hosthealth, "run_test", lambda gpus, t: ("", None, "nothing to test with: no dcgmi"))
    from provision.host.protocol import HealthTestRequest

    hosthealth.op_health(_req([change(1, "quarantined", reason="Xid 79")]))
    rep = hosthealth.op_healthtest(HealthTestRequest(gpus=[1], by="me"))
    assert rep.passed is None and rep.record["gpus"]["1"]["reason"] == "Xid 79"
    monkeypatch.setattr(hosthealth, "run_test", lambda gpus, t: ("dcgmi diag -r 2", False, "Memory: Fail - GPU: 1"))
    rep = hosthealth.op_healthtest(HealthTestRequest(gpus=[1], by="me"))
    m = rep.record["gpus"]["1"]
    assert (m["state"], m["evidence"]) == ("quarantined", "Memory: Fail - GPU: 1") and "failed its test" in m["reason"]
    monkeypatch.setattr(hosthealth, "run_test", lambda gpus, t: ("dcgmi diag -r 2", True, "every test passed"))
    assert hosthealth.op_healthtest(HealthTestRequest(gpus=[1], by="me")).record == {}


def test_dcgm_diag_failures_are_its_failed_rows():
    text = """+-----+------+
| Diagnostic | Result |
| PCIe | Pass |
| Memory | Fail - GPU: 1 |
|        | GPU 1: a memory error (DBE) |
+-----+------+"""
    assert hosthealth._failures(text) == ["Memory: Fail - GPU: 1 GPU 1: a memory error (DBE)"]


def test_the_gpu_test_runs_through_torch_on_this_machine_s_cpu():
    """The test the project ships, on the CPU (a GPU host runs it on CUDA)."""
    pytest.importorskip("torch")
    env = {**os.environ, "PROVISION_GPU_TEST_DEVICE": "cpu", "PROVISION_GPU_TEST_BYTES": str(1 << 20)}
    p = subprocess.run(
        [sys.executable, "-c", hosthealth.TORCH_TEST], capture_output=True, text=True, env=env, timeout=300
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "matmul within" in p.stdout and "1 MiB of memory patterns read back" in p.stdout
    p = subprocess.run([sys.executable, "-c", hosthealth.TORCH_TEST], capture_output=True, text=True,
                       env={**env, "PROVISION_GPU_TEST_DEVICE": "cuda", "CUDA_VISIBLE_DEVICES": ""}, timeout=300)  # fmt: skip
    assert p.returncode == 4 and "no CUDA GPU" in p.stdout


# --------------------------------------------------------------------------- the policy


def test_the_policy_s_health_round_trips():
    p = parse("health: {xids: {31: fatal, 43: warn}, test_before_release: false}\n", "p.yaml")
    assert p.health == hl.HealthPolicy(((31, XidClass.FATAL), (43, XidClass.WARN)), False)
    assert from_json(to_json(p)) == p


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("health: {xids: {abc: fatal}}", "p.yaml:1: health.xids.abc: an Xid is a number from 1 to 1023, got 'abc'"),
        ("health: {xids: {0: fatal}}", "p.yaml:1: health.xids.0: an Xid is a number from 1 to 1023"),
        ("health: {xids: {31: deadly}}", "p.yaml:1: health.xids.31: expected one of fatal, program, warn, ignore"),
        ("health: {test_before_release: maybe}", "p.yaml:1: health.test_before_release: expected true or false"),
        ("health: {tests: 1}", "p.yaml:1: health.tests: unknown key"),
    ],
)
def test_a_bad_health_policy_is_one_line_naming_the_place(text, want):
    with pytest.raises(ValidationError) as e:
        parse(text, "p.yaml")
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(want), e.value.problems


def test_the_bench_knob_leaves_the_health_read_out_of_the_survey_and_only_it() -> None:
    """What the read costs the idle service is measured with it and without (bench/serve_idle.py)."""
    code = "from provision.run.survey import SURVEY_ASK as a; print(a.health, a.tenancy, a.gpu_apps, a.logins)"
    for value, want in (("1", "False True True True"), ("", "True True True True")):
        env = {**os.environ, "PROVISION_BENCH_NO_HEALTH": value}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert got.stdout.split() == want.split()
