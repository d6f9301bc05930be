"""item 8: a teammate's newer apply is not reverted in silence. The state records
who applied each file's content (core/records.stamped, io/state); plan marks a change that
replaces or removes another identity's content (rules/provenance.mark); apply asks before
it even with -y, or refuses without a terminal, unless --force-conflicts. No hosts: plans
are built from rendered inventories and made-up reports, as tests/test_plan_counts.py does."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import click
import pytest

from provision.cli import change as change_cmd
from provision.cli.output import plan_lines
from provision.core.errors import ProvisionError
from provision.core.records import Applied, HostRecord, stamped
from provision.core.target import Target
from provision.host.protocol import FileInfo, ProbeReport
from provision.inventory.inventory import parse
from provision.io import state as S
from provision.render.files import Rendered, render
from provision.rules import provenance
from provision.rules.plan import FileAction, Plan
from provision.rules.planner import make_plan

INVENTORY = """\
job: prov
ssh: {user: root}
hosts:
  - {name: h1, address: 192.0.2.11}
pools:
  chief: {replicas: 1, command: [/usr/bin/python3, /opt/prov/train.py]}
files:
  - {src: train.py, dest: /opt/prov/train.py}
"""
TRAIN = "/opt/prov/train.py"
RUNNING = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}


def key(digest: str) -> str:
    """A stand-in for State.keyed (its own key): any fixed function of the digest."""
    return "hmac-sha256:" + digest[::-1]


def rendered(d, train: str, extra: str = "") -> Rendered:
    d.mkdir(parents=True, exist_ok=True)
    (d / "train.py").write_text(train)
    path = d / "inventory.yaml"
    path.write_text(INVENTORY + extra)
    return render(parse(path.read_text(), path))


def applied(r: Rendered) -> ProbeReport:
    """What h1 reports once `r` is applied there."""
    b = r.hosts["h1"]
    return ProbeReport(
        manifest=b.manifest,
        files={f.path: FileInfo("file", f.mode, 0, sha256=f.sha256) for f in b.files},
        units={u.unit: RUNNING for u in b.tasks},
        facts={"systemd_pid1": True},
    )


def record(r: Rendered, who: str, serial: int = 7) -> HostRecord:
    """The state's record of h1 after `who` applied `r` there."""
    files = {f.path: key(f.sha256) for f in r.hosts["h1"].files}
    return stamped(None, HostRecord("192.0.2.11", files=files), who, "2026-11-27T14:02:09+00:00", serial)


def b_plans(tmp_path, *, recorded_by: str = "ana@lab", me: str = "ben@lab", host_edit: bool = False) -> Plan:
    """ana applied v2; ben's checkout has v1 and plans."""
    theirs, mine = rendered(tmp_path / "a", "print('v2')\n"), rendered(tmp_path / "b", "print('v1')\n")
    report = applied(theirs)
    if host_edit:  # someone edited the file on the host since: drift, not ana's content
        report = replace(report, files={**report.files, TRAIN: FileInfo("file", 0o644, 0, sha256="e" * 64)})
    p = make_plan(mine, {"h1": Target.from_host(mine.inventory.hosts[0])}, {"h1": report})
    return provenance.mark(p, {"h1": record(theirs, recorded_by)}, key, me)


# --------------------------------------------------------------------------- the record


def test_new_content_is_stamped_and_unchanged_content_keeps_its_applier():
    rec = stamped(None, HostRecord("a", files={"/x": "hmac-sha256:" + "1" * 64}), "ana", "T1", 3)
    assert rec.applied == {"/x": Applied("ana", "T1", 3, "1" * 16)}
    # ben applies: /x is the same, /y is new.
    new = HostRecord("a", files={"/x": "hmac-sha256:" + "1" * 64, "/y": "hmac-sha256:" + "2" * 64})
    after = stamped(rec, new, "ben", "T2", 5)
    assert after.applied["/x"].who == "ana" and after.applied["/y"] == Applied("ben", "T2", 5, "2" * 16)
    # ben changes /x: his now; a file that left the host is forgotten.
    after = stamped(after, HostRecord("a", files={"/x": "hmac-sha256:" + "3" * 64}), "ben", "T3", 6)
    assert after.applied == {"/x": Applied("ben", "T3", 6, "3" * 16)}


def test_a_pending_record_keeps_who_applied_what_the_host_still_has():
    rec = stamped(None, HostRecord("a", files={"/x": "hmac-sha256:" + "1" * 64}), "ana", "T1", 3)
    pending = stamped(rec, HostRecord("a", files={"/x": "hmac-sha256:" + "9" * 64}, pending=True), "ben", "T2", 4)
    assert pending.applied == rec.applied
    # Killed, then ben's next apply finds his content there and records it: his.
    done = stamped(pending, HostRecord("a", files={"/x": "hmac-sha256:" + "9" * 64}), "ben", "T3", 5)
    assert done.applied["/x"].who == "ben"


def test_a_state_of_the_previous_release_loads_and_the_next_save_records_the_applier(tmp_path):
    sp = tmp_path / "j.state.json"
    old = {  # format 2 as the release before wrote it: no "applied"
        "format_version": 2,
        "serial": 4,
        "lineage": "l-1",
        "job": "j",
        "hosts": {"h1": {"address": "192.0.2.11", "files": {TRAIN: "hmac-sha256:" + "1" * 64}, "tasks": {}}},
        "placement": {},
    }
    sp.write_text(json.dumps(old))
    st = S.State.load(sp, "j")
    old_h1 = st.hosts["h1"]
    assert old_h1.applied == {}
    st.who = "ben@lab"
    # ben's apply adds /y and leaves train.py as the older release applied it: /y is his,
    # train.py nobody's (not ben's: he did not write it).
    st.record_host("h1", replace(old_h1, files={**old_h1.files, "/y": "hmac-sha256:" + "3" * 64}))
    assert set(st.hosts["h1"].applied) == {"/y"}
    # His next apply changes train.py: his now, at the serial of the save that keeps it.
    st.record_host("h1", replace(st.hosts["h1"], files={TRAIN: "hmac-sha256:" + "2" * 64}))
    doc = json.loads(sp.read_text())
    assert doc["format_version"] == 2 and doc["serial"] == 6
    mark = doc["hosts"]["h1"]["applied"][TRAIN]
    assert (mark["who"], mark["serial"], mark["digest"]) == ("ben@lab", 6, "2" * 16)
    assert S.State.load(sp, "j").hosts["h1"] == st.hosts["h1"]  # read back as written


def test_an_unreadable_applier_entry_only_loses_the_warning():
    rec = HostRecord.from_json(
        {"address": "a", "applied": {"/x": {"who": "ana"}, "/y": asdict(Applied("b", "t", 1, "d"))}}
    )
    assert rec.applied == {"/y": Applied("b", "t", 1, "d")}


def test_the_serial_recorded_is_the_save_that_keeps_it(tmp_path):
    st = S.State.load(tmp_path / "j.state.json", "j")
    st.who = "ana@lab"
    with st.deferred():  # one save for the step: the serial it gets
        st.record_host("h1", HostRecord("a", files={"/x": "hmac-sha256:" + "1" * 64}))
        st.record_host("h2", HostRecord("b", files={"/x": "hmac-sha256:" + "1" * 64}))
    assert st.serial == 1 and {h.applied["/x"].serial for h in st.hosts.values()} == {1}


# --------------------------------------------------------------------------- plan


@pytest.mark.parametrize(
    ("case", "kwargs", "marked"),
    [
        ("a teammate's content", {}, True),
        ("my own content", {"recorded_by": "ben@lab"}, False),
        ("edited on the host since (drift)", {"host_edit": True}, False),
    ],
)
def test_a_change_is_theirs_only_over_another_identitys_content(tmp_path, case, kwargs, marked):
    p = b_plans(tmp_path, **kwargs)
    train = next(f for f in p.hosts[0].files if f.path == TRAIN)
    assert train.action is FileAction.UPDATE
    assert (train.replaces is not None) == marked, case
    assert bool(provenance.theirs(p)) == marked
    others = [f for f in p.hosts[0].files if f.path != TRAIN]
    assert all(f.replaces is None for f in others)  # the env file did not change: no line


def test_a_state_without_appliers_marks_nothing(tmp_path):
    theirs, mine = rendered(tmp_path / "a", "print('v2')\n"), rendered(tmp_path / "b", "print('v1')\n")
    p = make_plan(mine, {"h1": Target.from_host(mine.inventory.hosts[0])}, {"h1": applied(theirs)})
    rec = replace(record(theirs, "ana@lab"), applied={})
    assert provenance.mark(p, {"h1": rec}, key, "ben@lab") == p
    assert provenance.mark(p, {}, key, "ben@lab") == p  # a host the state does not know


def test_removing_a_teammates_file_is_theirs_too(tmp_path):
    extra = "  - {src: eval.py, dest: /opt/prov/eval.py}\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "eval.py").write_text("print('eval')\n")
    theirs = rendered(tmp_path / "a", "print('v1')\n", extra)
    mine = rendered(tmp_path / "b", "print('v1')\n")
    p = make_plan(mine, {"h1": Target.from_host(mine.inventory.hosts[0])}, {"h1": applied(theirs)})
    p = provenance.mark(p, {"h1": record(theirs, "ana@lab")}, key, "ben@lab")
    [(_, f)] = [(hp, f) for hp, f in provenance.theirs(p) if f.path == "/opt/prov/eval.py"]
    assert f.action is FileAction.DELETE
    assert provenance.describe(f) == "removes ana@lab's content applied 2026-11-27 14:02 UTC (serial 7)"


def test_the_plan_says_who_applied_it_and_when(tmp_path):
    p = b_plans(tmp_path)
    text = [click.unstyle(line) for line in plan_lines(p)]
    line = next(line for line in text if line.startswith(f"  ~ file {TRAIN}"))
    assert line.endswith(": replaces ana@lab's content applied 2026-11-27 14:02 UTC (serial 7)"), line
    summary = provenance.summary(p)
    assert summary is not None and summary.startswith("1 change replaces content ana@lab applied")
    assert "--force-conflicts" in summary
    change = next(f for f in p.to_json()["hosts"]["h1"]["files"] if f["path"] == TRAIN)
    assert change["replaces"] == {"who": "ana@lab", "at": "2026-11-27T14:02:09+00:00", "serial": 7}
    assert all(f["replaces"] is None for f in p.to_json()["hosts"]["h1"]["files"] if f["path"] != TRAIN)


# --------------------------------------------------------------------------- apply's question


def test_without_a_terminal_apply_refuses_in_one_line_naming_the_flag(tmp_path, monkeypatch):
    p = b_plans(tmp_path)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    with pytest.raises(ProvisionError) as e:
        change_cmd._theirs_confirmed(p)
    msg = e.value.message
    assert "\n" not in msg and "--force-conflicts" in msg and "nothing was changed" in msg
    assert f"{TRAIN} on h1: replaces ana@lab's content applied 2026-11-27 14:02 UTC (serial 7)" in msg
    change_cmd._theirs_confirmed(b_plans(tmp_path / "mine", recorded_by="ben@lab"))  # nothing of theirs: no question


@pytest.mark.parametrize(("answer", "goes_on"), [("y", True), ("n", False), ("", False)])
def test_at_a_terminal_apply_asks_and_only_yes_replaces(tmp_path, monkeypatch, answer, goes_on):
    p = b_plans(tmp_path)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    asked = []

    def confirm(text: str, default: bool) -> bool:
        asked.append(text)
        return {"y": True, "n": False, "": default}[answer]

    monkeypatch.setattr(click, "confirm", confirm)
    if goes_on:
        change_cmd._theirs_confirmed(p)
    else:
        with pytest.raises(SystemExit) as e:
            change_cmd._theirs_confirmed(p)
        assert e.value.code == 1
    assert asked == ["\nReplace ana@lab's newer content?"]


def test_the_flag_is_applys():
    names = {o for p in change_cmd.apply.params for o in p.opts}
    assert "--force-conflicts" in names and "-y" in names
