"""Every `--json` document has the shape docs/commands.md documents.

The documented example of each command (its ```json block, `...` elisions removed) is
compared with real output, key by key and type by type: first from the pure code that
builds each document (no hosts), then, on sandbox hosts, from the commands themselves
(`plan`, `apply`, `status`, `facts`). Every document carries `format_version`; absent
values are null, never "-"; times are ISO 8601; durations are numbers of seconds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from clirun import cli

REPO = Path(__file__).resolve().parent.parent
COMMANDS = REPO / "docs" / "commands.md"
TUNING = REPO / "docs" / "tuning.md"  # `provision tune --status --json`
ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


# --------------------------------------------------------------------------- the documented examples


def _section(name: str, page: Path = COMMANDS) -> str:
    text = page.read_text(encoding="utf-8")
    start = text.index(f"## `provision {name}`")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


ELIDED = "..."  # the key standing for an object's elided keys


def lenient_json(text: str) -> Any:
    """A documented example as data: `{...}` is an elided object (any keys), `, ...}` the
    rest of an object's keys elided (marked with the key "..."), `, ...]` and a line of
    `...` elided list entries."""
    text = text.replace("{...}", "{}").replace("[...]", "[]")
    text = re.sub(r",\s*\.\.\.(\s*)}", r', "...": true\1}', text)
    text = re.sub(r",\s*\.\.\.(\s*)]", r"\1]", text)
    text = re.sub(r"^\s*\.\.\.\s*,?\s*$", "", text, flags=re.M)
    text = re.sub(r",(\s*[}\]])", r"\1", text)  # a comma left before a closing bracket
    return json.loads(text)


def documented(name: str, page: Path = COMMANDS) -> Any:
    """The first ```json block of `provision NAME`'s section (in docs/commands.md, or `page`)."""
    m = re.search(r"```json\n(.*?)```", _section(name, page), re.S)
    assert m, f"docs/{page.name}: `provision {name}` has no ```json example"
    return lenient_json(m.group(1))


# --------------------------------------------------------------------------- comparing shapes

DYNAMIC = {"hosts", "outcome", "params", "nics", "near_nic", "labels", "not_answering"}  # objects keyed by host name,
# by a study's parameter names, by device (a host's NICs and GPUs) or by label name


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


def shape_problems(doc: Any, real: Any, path: str = "$", *, dynamic: bool = False) -> list[str]:  # noqa: C901  one branch per JSON type compared
    """Where `real` differs from the documented `doc`: missing or extra keys, other types.
    null in either is allowed where the other has a value (a value that may be absent);
    an elided object ({...} in the docs) or empty list matches anything of its type."""
    if doc is None or real is None:
        return []
    if _kind(doc) != _kind(real):
        return [f"{path}: documented as {_kind(doc)}, is {_kind(real)} ({real!r:.60})"]
    out: list[str] = []
    if isinstance(doc, dict):
        if not doc:
            return []
        if dynamic:  # HOST -> value: every real value has the shape of the documented ones
            sample = next(iter(v for v in doc.values() if isinstance(v, dict) and len(v) > 1), None)
            for k, v in real.items():
                out += shape_problems(sample, v, f"{path}.{k}") if sample is not None else []
            return out
        for k in sorted((set(doc) | set(real)) - {ELIDED}):
            if k not in real:
                out.append(f"{path}.{k}: documented, not in the output")
            elif k not in doc:
                if ELIDED in doc:
                    continue
                out.append(f"{path}.{k}: in the output, not documented")
            else:
                out += shape_problems(doc[k], real[k], f"{path}.{k}", dynamic=k in DYNAMIC)
    elif isinstance(doc, list) and doc and real:
        sample = doc[0]
        for i, v in enumerate(real):
            out += shape_problems(sample, v, f"{path}[{i}]")
    return out


def style_problems(real: Any, path: str = "$") -> list[str]:
    """What no document may hold: "-" for an absent value, a duration or time as text."""
    out: list[str] = []
    if isinstance(real, dict):
        for k, v in real.items():
            p = f"{path}.{k}"
            if v == "-":
                out.append(f'{p}: "-" (absent values are null)')
            if (k.endswith("_seconds") or k.startswith("since")) and v is not None and _kind(v) != "number":
                out.append(f"{p}: a duration as {v!r} (seconds as a number)")
            if (k.endswith("_at") or k == "since") and v is not None and not (isinstance(v, str) and ISO.match(v)):
                out.append(f"{p}: a time as {v!r} (ISO 8601)")
            out += style_problems(v, p)
    elif isinstance(real, list):
        for i, v in enumerate(real):
            out += style_problems(v, f"{path}[{i}]")
    return out


def check(name: str, real: Any, page: Path = COMMANDS) -> None:
    assert isinstance(real, dict) and "format_version" in real, f"{name}: no format_version"
    doc = documented(name, page)
    problems = shape_problems(doc, real) + style_problems(real)
    shown = f"provision {name}" + ("" if name.endswith("--json") else " --json")
    assert not problems, f"{shown} vs docs/{page.name}:\n" + "\n".join(problems)


# --------------------------------------------------------------------------- the checker itself


def test_lenient_json_and_shape_problems():
    doc = lenient_json('{"a": 1, "b": [{"x": "s"}, ...], "hosts": {"h1": {"k": 1, "e": null}, "h2": {...}}}')
    assert doc == {"a": 1, "b": [{"x": "s"}], "hosts": {"h1": {"k": 1, "e": None}, "h2": {}}}
    assert lenient_json('{"a": 1, ...}') == {"a": 1, "...": True}
    assert shape_problems({"a": 1, "...": True}, {"a": 2, "b": 3}) == []
    good = {"a": 2.5, "b": [{"x": "t"}, {"x": "u"}], "hosts": {"n1": {"k": 3, "e": "why"}}}
    assert shape_problems(doc, good) == []
    bad = {"a": "2", "b": [{"x": "t", "y": 1}], "hosts": {"n1": {"e": None}}, "c": 1}
    assert shape_problems(doc, bad) == [
        "$.a: documented as number, is str ('2')",
        "$.b[0].y: in the output, not documented",
        "$.c: in the output, not documented",
        "$.hosts.n1.k: documented, not in the output",
    ]
    assert style_problems({"gpus": "-", "since": "37s", "ended_at": 17.0, "age_seconds": 3}) == [
        '$.gpus: "-" (absent values are null)',
        "$.since: a duration as '37s' (seconds as a number)",
        "$.since: a time as '37s' (ISO 8601)",
        "$.ended_at: a time as 17.0 (ISO 8601)",
    ]


# --------------------------------------------------------------------------- from the code (no hosts)

INVENTORY = """\
job: first
hosts:
- {name: gpu-1, address: 192.0.2.11, accelerators: {type: nvidia-l4, count: 1}}
- {name: gpu-2, address: 192.0.2.12, accelerators: {type: nvidia-l4, count: 1}}
pools:
  chief: {replicas: 1, accelerators: 1, command: [python3, train.py]}
  worker: {replicas: 1, accelerators: 1, command: [python3, train.py]}
"""


@pytest.fixture
def first(tmp_path):
    from provision.inventory.inventory import parse
    from provision.render.files import render

    inv = parse(INVENTORY, tmp_path / "inventory.yaml")
    return inv, render(inv)


def test_plan_json_shape_offline(first):
    from provision.core.target import Target
    from provision.host.protocol import ProbeReport
    from provision.rules.planner import make_plan

    inv, rendered = first
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    p = make_plan(rendered, targets, {n: ProbeReport(facts={"systemd_pid1": True}) for n in targets})
    check("plan", json.loads(json.dumps(p.to_json())))


def test_apply_json_shape_offline(first):
    from provision.cli.output import change_json
    from provision.core.target import Target
    from provision.host.protocol import ProbeReport
    from provision.rules.planner import make_plan
    from provision.run.apply import HostOutcome

    inv, rendered = first
    targets = {h.name: Target.from_host(h) for h in inv.hosts}
    p = make_plan(rendered, targets, {n: ProbeReport(facts={"systemd_pid1": True}) for n in targets})
    check("apply", json.loads(json.dumps(change_json(p, {"gpu-1": HostOutcome("gpu-1", started=["chief-0"])}))))


def test_status_json_shape_offline(first):
    from provision.host.protocol import ProbeReport
    from provision.rules.status import job_status

    inv, rendered = first
    done = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}
    reports = {
        h: ProbeReport(
            units={f"provision-first-{t}.service": done},
            exits={f"provision-first-{t}.service": [["1767225590", "success", "exited", "0"]]},
            now=1767225600.0,
            now_monotonic_us=10**9,
        )
        for h, t in (("gpu-1", "chief-0"), ("gpu-2", "worker-0"))
    }
    st = job_status(inv, list(rendered.placement.tasks), reports, {})
    real = json.loads(json.dumps(st.to_json()))
    check("status", real)
    assert real["tasks"][0]["ended_at"] == "2025-12-31T23:59:50Z"


def test_facts_json_shape_offline():
    from provision.cli.output import facts_json
    from provision.host.protocol import ProbeReport
    from provision.rules.fabricfacts import fabric_of
    from provision.rules.facts import summary_row
    from provision.rules.health import health_words

    facts = {"os": "Debian GNU/Linux 12 (bookworm)", "cpus": 4, "memory_bytes": 2**33}
    row = summary_row("gpu-1", facts)
    assert row["gpu_model"] is None and row["systemd"] is None  # absent: null, not "-" or "none"
    health = health_words(1, ProbeReport(facts={}, checks={"health": {}}, health={}))
    fabric = fabric_of(facts)  # as `provision facts` adds it (cli/observe.py)
    doc = {**row, "fabric": fabric.to_json(), "labels": fabric.labels(), "problems": [], "health": health}
    check("facts", json.loads(json.dumps(facts_json({"gpu-1": doc}))))


def test_check_bandwidth_json_shape_offline():
    from provision.rules import fabric as F
    from provision.rules.bisection import Bisection
    from provision.run.bandwidth import BandwidthResult, Round

    hosts = [f"gpu-{i}" for i in range(1, 5)]
    base = F.Baseline("nvidia-h100x8", "nccl-tests", 46.7, 46.0, 4, 256 << 20, "2026-11-30T09:12:44Z", "ana", "mnist")
    b = Bisection(hosts, base)
    while (step := b.next()) is not None:
        b.record([F.Figure(g, len(b.rounds) + 1, 11.0 if "gpu-3" in g else 46.0, 0.02) for g in step[1]])
    res = BandwidthResult("mnist", F.Tool.NCCL, 256 << 20, hosts, "nvidia-h100x8", baseline=base, seconds=9.0)
    res.rounds = [Round(i, kind, js, 2.0) for i, ((kind, _), js) in enumerate(zip(b.rounds, b.judged()), 1)]
    res.verdict = b.verdict()
    real = json.loads(json.dumps(res.to_json()))
    assert real["slow_hosts"] == ["gpu-3"] and real["ok"] is False
    check("check --bandwidth", real)


def test_state_show_json_shape_offline(tmp_path):
    from provision.core.records import HostRecord, TaskRecord
    from provision.io.state import LocalStore, State
    from provision.io.stateops import show_json
    from provision.placement.tasks import Slot

    store = LocalStore(tmp_path / "mnist.state.json")
    st = State.load(store, "mnist")
    st.set_placement({"chief-0": Slot("gpu-1", 2222, (0, 1))})
    st.record_host("gpu-1", HostRecord("192.0.2.11", 22, tasks={"chief-0": TaskRecord("u", "k", 1)}))
    st.note("ana@lab.example", "apply", "Apply complete! Resources: 9 added, 0 changed, 0 destroyed.")
    lock = store.lock("apply").acquire()
    try:
        real = json.loads(json.dumps(show_json(store, State.load(store, "mnist"))))
    finally:
        lock.release()
    assert real["lock"]["who"] and real["last_change"]["who"] == "ana@lab.example"
    check("state show", {**real, "lock": None})  # documented unheld; its shape is said in words
    assert set(real["lock"]) == {"id", "who", "pid", "machine", "operation", "created"}


# --------------------------------------------------------------------------- from the commands (sandbox hosts)


@pytest.mark.integration
def test_json_shapes_of_real_commands(sandbox3, sandbox_inventory, tmp_path):
    sb = dataclasses.replace(sandbox3, hosts=sandbox3.hosts[:2])  # the session's hosts: two listed
    inv = tmp_path / "inv.yaml"
    try:
        sandbox_inventory(
            sb,
            job="shapes",
            path=inv,
            pools={
                "chief": {"replicas": 1, "hosts": ["host-1"], "command": ["/bin/sh", "-c", "echo hi; sleep 2"]},
                # Fails after the apply saw it start (an immediate exit 3 fails the apply itself).
                "worker": {"replicas": 1, "hosts": ["host-2"], "command": ["/bin/sh", "-c", "sleep 2; exit 3"]},
            },
        )
        plan = cli("plan", "--json", inv, cwd=tmp_path)
        assert plan.returncode == 0, plan.stderr
        check("plan", json.loads(plan.stdout))
        apply = cli("apply", "-y", "--json", inv, cwd=tmp_path)
        assert apply.returncode == 0, apply.stderr
        check("apply", json.loads(apply.stdout))
        cli("wait", "--timeout", "60", inv, cwd=tmp_path)
        status = cli("status", "--json", inv, cwd=tmp_path)
        assert status.returncode == 0, status.stderr
        real = json.loads(status.stdout)
        check("status", real)
        worker = next(t for t in real["tasks"] if t["task"] == "worker-0")
        assert worker["exit_code"] == 3 and worker["last_lines"] and isinstance(worker["since_seconds"], int)
        facts = cli("facts", "--json", inv, cwd=tmp_path)
        assert facts.returncode == 0, facts.stderr
        check("facts", json.loads(facts.stdout))
    finally:
        destroy = cli("destroy", "-y", inv, cwd=tmp_path)  # also after a failure: the hosts are shared
    assert destroy.returncode == 0, destroy.stderr
