"""The plan's summary counts what the plan shows: a user who counts the `+`,
`~` and `-` lines of the text plan gets the summary's "N to add, M to change, K to
destroy", and `--json` carries the same numbers. Plans built without hosts, as a table."""

from __future__ import annotations

import hashlib
import re
from dataclasses import FrozenInstanceError, fields, replace

import click
import pytest

from provision.cli.output import plan_lines
from provision.core.imagechange import ImageChange
from provision.core.target import Target
from provision.host import layout
from provision.host.protocol import FileInfo, ProbeReport, Reservation
from provision.inventory.inventory import parse
from provision.render.files import Rendered, render
from provision.rules.plan import Plan, plan_host
from provision.rules.planner import make_plan

INVENTORY = """\
job: counts
ssh: {user: root}
hosts:
  - {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-l4, count: 2}}
  - {name: gpu-2, address: 192.0.2.12, accelerators: {type: nvidia-l4, count: 2}}
pools:
  chief:  {replicas: 1, accelerators: 1, command: [/usr/bin/python3, /opt/counts/train.py]}
  worker: {replicas: 2, accelerators: 1, command: [/usr/bin/python3, /opt/counts/train.py]}
files:
  - {src: train.py, dest: /opt/counts/train.py}
  - {src: data.txt, dest: /opt/counts/data.txt}
"""
SETUP = "setup:\n  commands: [/usr/bin/true]\n"
RUNNING = {"LoadState": "loaded", "ActiveState": "active", "SubState": "running"}
FIRST = {"facts": {"systemd_pid1": True}}


def rendered(tmp_path, extra: str = "", train: str = "print('hello')\n") -> Rendered:
    (tmp_path / "train.py").write_text(train)
    (tmp_path / "data.txt").write_text("1 2 3\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY + extra)
    return render(parse(path.read_text(), path))


def targets(r: Rendered) -> dict[str, Target]:
    return {h.name: Target.from_host(h) for h in r.inventory.hosts}


def applied(r: Rendered, name: str) -> ProbeReport:
    """What a host reports once `r` is applied there and its tasks run."""
    b = r.hosts[name]
    files = {f.path: FileInfo("file", f.mode, 0, sha256=f.sha256) for f in b.files}
    if b.setup:  # and its setup done (the mark host/setups.py writes)
        done = hashlib.sha256(layout.setup_done_record(b.setup.key)).hexdigest()
        files[b.setup.done_path] = FileInfo("file", 0o600, 0, sha256=done)
    return ProbeReport(
        manifest=b.manifest, files=files, units={u.unit: RUNNING for u in b.tasks}, facts={"systemd_pid1": True}
    )


def first_apply(tmp_path) -> Plan:
    r = rendered(tmp_path)
    return make_plan(r, targets(r), {n: ProbeReport(**FIRST) for n in targets(r)})


def with_setup(tmp_path) -> Plan:
    r = rendered(tmp_path, SETUP)
    return make_plan(r, targets(r), {n: ProbeReport(**FIRST) for n in targets(r)})


def with_ledger_and_image(tmp_path) -> Plan:
    """What build_plan adds: the ledger entry and the images to ship."""
    p = first_apply(tmp_path)
    reserve = Reservation("counts", gpus=[0, 1], ports=[2222])
    images = (ImageChange("trainer:1", "ship", 2_000_000, "sha256:a"),)
    return replace(p, hosts=(replace(p.hosts[0], reserve=reserve, images=images), *p.hosts[1:]))


def with_ledger_entry_changed(tmp_path) -> Plan:
    """This job's entry is there already (its lineage seen at plan time): it changes."""
    p = first_apply(tmp_path)
    reserve = Reservation("counts", gpus=[0, 1], ports=[2222], expect_lineage="lineage-1")
    return replace(p, hosts=(replace(p.hosts[0], reserve=reserve), *p.hosts[1:]))


def change(tmp_path) -> Plan:
    """The pushed script edited: it is rewritten on both hosts and every task restarts."""
    (tmp_path / "a").mkdir()
    before = rendered(tmp_path / "a")
    after = rendered(tmp_path, train="print('bye')\n")
    return make_plan(after, targets(after), {n: applied(before, n) for n in targets(after)})


def setup_changed(tmp_path) -> Plan:
    (tmp_path / "a").mkdir()
    before = rendered(tmp_path / "a", SETUP)
    after = rendered(tmp_path, "setup:\n  commands: [/usr/bin/true, /usr/bin/true]\n")
    return make_plan(after, targets(after), {n: applied(before, n) for n in targets(after)})


def shrink(tmp_path) -> Plan:
    """One worker fewer: its task and its files go, the others' env files change."""
    (tmp_path / "a").mkdir()
    before = rendered(tmp_path / "a")
    after = rendered(tmp_path)
    after = render(replace(after.inventory, pools=[replace(p, replicas=1) for p in after.inventory.pools]))
    return make_plan(after, targets(after), {n: applied(before, n) for n in targets(after)})


def bookkeeping_only(tmp_path) -> Plan:
    """Only the manifest differs: the one line shown is the manifest's."""
    r = rendered(tmp_path)
    reports = {n: applied(r, n) for n in targets(r)}
    b = r.hosts["gpu-1"]
    manifest = next(f for f in b.files if f.kind.value == "manifest")
    files = {**reports["gpu-1"].files, manifest.path: FileInfo("file", manifest.mode, 0, sha256="0" * 64)}
    reports["gpu-1"] = replace(reports["gpu-1"], files=files)
    return make_plan(r, targets(r), reports)


def destroy(tmp_path) -> Plan:
    """As engine.destroy_plan builds it: every host loses the job."""
    r = rendered(tmp_path)
    ts = targets(r)
    return Plan("counts", tuple(plan_host(n, t, None, None, applied(r, n), job="counts") for n, t in ts.items()))


SUMMARY = re.compile(r"^Plan: (\d+) to add, (\d+) to change, (\d+) to destroy\.$")
MARKED = re.compile(r"^  ([+~-]) \S")  # a resource line; diff lines are indented further


def shown(plan: Plan, destroying: bool) -> tuple[int, int, int]:
    """The `+`, `~` and `-` lines of the text plan, counted the way a reader would."""
    marks = [m.group(1) for line in plan_lines(plan, destroying=destroying) if (m := MARKED.match(click.unstyle(line)))]
    return marks.count("+"), marks.count("~"), marks.count("-")


# plan, destroying, expected (add, change, destroy). A first apply shows 3 tasks, their
# env and unit files, the job target on each of the 2 hosts and the 2 pushed files on each.
CASES = [
    (first_apply, False, (3 + 3 + 3 + 2 + 4, 0, 0)),
    (with_setup, False, (15 + 2 * 3, 2, 0)),  # setup: script, env, unit; "~ setup: run (new)"
    (with_ledger_and_image, False, (17, 0, 0)),  # a new ledger entry: "+"
    (with_ledger_entry_changed, False, (15, 1, 0)),
    (change, False, (0, 3 + 2, 0)),  # 3 restarts, train.py on 2 hosts
    # 2 setup runs, 3 restarts; a setup is named by its key: its 3 files go and 3 come, on 2 hosts
    (setup_changed, False, (2 * 3, 2 + 3, 2 * 3)),
    (shrink, False, (0, 2 + 2 + 1, 1 + 2)),  # 2 restarts, 2 env files, the target; worker-1 and its files
    (bookkeeping_only, False, (0, 1, 0)),
    (destroy, True, (0, 0, 15)),
]


@pytest.mark.parametrize("build, destroying, expected", CASES, ids=[c[0].__name__ for c in CASES])
def test_the_summary_counts_the_lines_the_plan_shows(tmp_path, build, destroying, expected):
    plan = build(tmp_path)
    m = SUMMARY.match(plan.summary())
    assert m, plan.summary()
    said = tuple(int(x) for x in m.groups())
    lines = "\n".join(click.unstyle(line) for line in plan_lines(plan, destroying=destroying))
    assert said == shown(plan, destroying), lines
    assert plan.to_json()["summary"] == dict(zip(("add", "change", "destroy"), said))
    assert said == expected, lines


def test_a_plan_is_data(tmp_path):
    """Plan and HostPlan are frozen and hold tuples: nothing edits a plan once made."""
    p = first_apply(tmp_path)
    with pytest.raises(FrozenInstanceError):
        p.hosts[0].problems = ("x",)  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        p.hosts = ()  # type: ignore[misc]
    for hp in p.hosts:
        for f in fields(hp):
            assert not isinstance(getattr(hp, f.name), (list, dict, set)), f.name
