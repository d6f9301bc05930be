"""Desired (rendered files) vs. what each host reports → the changes to make. Pure.

A task is one resource (its unit, env file and process); each pushed file is one; the
bookkeeping files (job target, manifest) count as one change when only they differ.
Drift is anything that differs from what provision last wrote: a managed file edited or
removed by hand, a task stopped by hand.
"""

from __future__ import annotations

import base64
import difflib
import re
from dataclasses import dataclass, field

from .facts import mismatches
from .model import Host
from .render import SECRET_MASK, HostBundle, Rendered, RenderedFile, TaskUnit
from .ssh import HostError, Target
from .status import task_state



@dataclass(frozen=True)
class FileChange:
    path: str
    action: str  # create | update | delete
    kind: str  # env | unit | target | manifest | file
    reason: str
    drift: bool = False
    diff: str | None = None


@dataclass(frozen=True)
class TaskChange:
    task: str
    unit: str
    action: str  # start | restart | stop | none
    reason: str
    phase: int
    drift: bool = False
    new: bool = False


@dataclass
class HostPlan:
    name: str
    target: Target
    bundle: HostBundle | None  # None: nothing of the job belongs here any more
    error: HostError | None = None
    problems: list[str] = field(default_factory=list)  # facts mismatches: stop the apply
    files: list[FileChange] = field(default_factory=list)
    tasks: list[TaskChange] = field(default_factory=list)
    report: dict | None = None

    @property
    def changed(self) -> bool:
        return bool(self.files) or any(t.action != "none" for t in self.tasks)

    @property
    def units_changed(self) -> bool:
        return any(f.kind in ("unit", "target") for f in self.files)

    def counts(self) -> tuple[int, int, int]:
        add = change = destroy = 0
        for t in self.tasks:
            if t.action == "none":
                continue
            if t.new:
                add += 1
            elif t.action == "stop":
                destroy += 1
            else:
                change += 1
        for f in self.files:
            if f.kind == "file":
                add += f.action == "create"
                change += f.action == "update"
                destroy += f.action == "delete"
        if self.files and (add, change, destroy) == (0, 0, 0):
            change = 1  # only bookkeeping files differ
        return add, change, destroy


@dataclass
class Plan:
    job: str
    hosts: list[HostPlan]

    @property
    def unreachable(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.error is not None and h.error.unreachable]

    @property
    def errors(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.error is not None or h.problems]

    @property
    def changed(self) -> bool:
        return any(h.changed for h in self.hosts if h.error is None)

    def counts(self) -> tuple[int, int, int]:
        tot = [0, 0, 0]
        for h in self.hosts:
            if h.error is None:
                for i, n in enumerate(h.counts()):
                    tot[i] += n
        return tot[0], tot[1], tot[2]

    def summary(self) -> str:
        a, c, d = self.counts()
        return f"Plan: {a} to add, {c} to change, {d} to destroy."

    def to_json(self) -> dict:
        a, c, d = self.counts()
        return {
            "format_version": 1,
            "job": self.job,
            "changes": self.changed,
            "summary": {"add": a, "change": c, "destroy": d},
            "unreachable": [h.name for h in self.unreachable],
            "hosts": {
                h.name: {
                    "address": h.target.where,
                    "error": h.error.message if h.error else None,
                    "unreachable": bool(h.error and h.error.unreachable),
                    "problems": h.problems,
                    "remove_all": h.bundle is None,
                    "tasks": [t.__dict__ for t in h.tasks],
                    "files": [{k: v for k, v in f.__dict__.items()} for f in h.files],
                }
                for h in self.hosts
            },
        }


# --------------------------------------------------------------------------- diffing


def _mask(text: str, secret_keys: tuple[str, ...]) -> str:
    if not secret_keys:
        return text
    pat = re.compile(r'^(' + "|".join(map(re.escape, secret_keys)) + r')=.*$', re.M)
    return pat.sub(lambda m: f"{m.group(1)}={SECRET_MASK}", text)


def unified_diff(path: str, old: bytes | None, new: bytes, secret_keys: tuple[str, ...] = ()) -> str | None:
    """A unified diff for text files; None for binary ones or when the old bytes are unknown."""
    try:
        new_t = new.decode("utf-8")
        old_t = old.decode("utf-8") if old is not None else ""
    except UnicodeDecodeError:
        return None
    if "\x00" in new_t or "\x00" in old_t:
        return None
    old_t, new_t = _mask(old_t, secret_keys), _mask(new_t, secret_keys)
    lines = difflib.unified_diff(
        old_t.splitlines(keepends=True), new_t.splitlines(keepends=True), f"a{path}", f"b{path}", n=1
    )
    out = "".join(l if l.endswith("\n") else l + "\n" for l in lines)
    return out if out else None


# --------------------------------------------------------------------------- tasks


def task_phase(unit_state: dict | None, exits: list | None) -> str:
    """running | completed | failed | stopped | never, from status.task_state (one rule)."""
    state = task_state(unit_state, exits)[0]
    return {"Running": "running", "Restarting": "running", "Succeeded": "completed", "Failed": "failed", "Stopped": "stopped"}.get(state, "never")


def _task_change(
    u: TaskUnit,
    manifest_task: dict | None,
    unit_state: dict | None,
    exits: list | None,
    drifted: list[str],
    ended: dict | None,
    replace: set[str],
) -> TaskChange:
    name, unit, phase = u.task.name, u.unit, u.phase
    if manifest_task is None:
        return TaskChange(name, unit, "start", "new task", phase, new=True)
    if name in replace:
        return TaskChange(name, unit, "restart", "replace requested", phase)
    if manifest_task.get("inputs") != u.inputs:
        what = ", ".join(drifted) if drifted else "its inputs"
        return TaskChange(name, unit, "restart", f"{what} changed", phase)
    if drifted:
        return TaskChange(name, unit, "restart", f"drift: {', '.join(drifted)} edited by hand", phase, drift=True)
    st = task_phase(unit_state, exits)
    if st == "running":
        return TaskChange(name, unit, "none", "running", phase)
    if ended:
        return TaskChange(name, unit, "none", f"job {ended.get('phase', 'ended').lower()}; not restarted", phase)
    if st == "completed":
        return TaskChange(name, unit, "none", "completed (exit 0)", phase)
    if st == "failed":
        how = task_state(unit_state, exits)[2]
        return TaskChange(name, unit, "none", f"failed ({how}); not restarted, use --replace {name}", phase)
    if st == "stopped":
        return TaskChange(name, unit, "start", "drift: stopped by hand", phase, drift=True)
    return TaskChange(name, unit, "start", "drift: not running", phase, drift=True)


# --------------------------------------------------------------------------- host plans


def plan_host(
    name: str,
    target: Target,
    host: Host | None,
    bundle: HostBundle | None,
    report: dict | HostError,
    secret_keys: tuple[str, ...] = (),
    replace: set[str] | None = None,
) -> HostPlan:
    hp = HostPlan(name, target, bundle)
    if isinstance(report, HostError):
        hp.error = report
        return hp
    hp.report = report
    if host is not None and bundle is not None and "facts" in report:
        hp.problems = mismatches(host, report["facts"])
    manifest = report.get("manifest")
    if isinstance(manifest, dict) and "_unreadable" in manifest:
        manifest = None
    actual: dict = report.get("files", {})
    recorded: dict = (manifest or {}).get("files", {})
    m_tasks: dict = (manifest or {}).get("tasks", {})
    units = report.get("units", {})
    exits = report.get("exits", {})

    if bundle is None:  # everything of the job goes
        for t, mt in sorted(m_tasks.items(), key=lambda kv: -int(kv[1].get("phase", 0))):
            hp.tasks.append(TaskChange(t, mt.get("unit", ""), "stop", "no longer in the inventory", int(mt.get("phase", 0))))
        for path, rec in sorted(recorded.items()):
            if actual.get(path) is not None:
                hp.files.append(FileChange(path, "delete", rec.get("kind", "file"), "no longer in the inventory"))
        if manifest is not None or report.get("manifest") is not None:
            hp.files.append(FileChange(f"/etc/provision/{bundle_job(report)}/manifest.json", "delete", "manifest", "job removed from this host"))
        return hp

    desired = bundle.file_map()
    changed_paths: set[str] = set()
    for path, f in desired.items():
        a = actual.get(path)
        rec = recorded.get(path)
        if a is None or a.get("type") != "file":
            drift = rec is not None
            reason = "removed by hand" if drift else "new"
            if a is not None:
                reason, drift = f"a {a.get('type')} is in the way", True
            hp.files.append(FileChange(path, "create", f.kind, reason, drift))
            changed_paths.add(path)
            continue
        if a.get("sha256") != f.sha256:
            drift = rec is not None and rec.get("sha256") != a.get("sha256")
            reason = "edited by hand" if drift else "content changed"
            old = base64.b64decode(a["content"]) if "content" in a else None
            hp.files.append(FileChange(path, "update", f.kind, reason, drift, _diff(f, old, secret_keys) if old is not None else None))
            changed_paths.add(path)
        elif a.get("mode") != f.mode or a.get("uid") != 0:
            hp.files.append(FileChange(path, "update", f.kind, f"owner/mode {a.get('uid')}/{oct(a.get('mode', 0))} changed by hand", True))
            changed_paths.add(path)
    for path, rec in sorted(recorded.items()):
        if path not in desired and actual.get(path) is not None:
            hp.files.append(FileChange(path, "delete", rec.get("kind", "file"), "no longer in the inventory"))

    ended = report.get("lifecycle")
    replace = replace or set()
    desired_tasks = {u.task.name for u in bundle.tasks}
    pushed_changed = sorted(p for p in changed_paths if desired[p].kind == "file")
    drift_paths = {f.path for f in hp.files if f.drift}
    for u in bundle.tasks:
        own = [p for p in (u.env_path, u.unit_path) if p in changed_paths]
        mt = m_tasks.get(u.task.name)
        # Inputs changed: name everything that changed; otherwise only what drifted.
        why = own + pushed_changed if mt is not None and mt.get("inputs") != u.inputs else [p for p in own if p in drift_paths]
        hp.tasks.append(_task_change(u, mt, units.get(u.unit), exits.get(u.unit), why, ended, replace))
    for t, mt in sorted(m_tasks.items(), key=lambda kv: -int(kv[1].get("phase", 0))):
        if t not in desired_tasks:
            hp.tasks.append(TaskChange(t, mt.get("unit", ""), "stop", "no longer in the inventory", int(mt.get("phase", 0))))
    return hp


def bundle_job(report: dict) -> str:
    m = report.get("manifest") or {}
    return m.get("job", "?") if isinstance(m, dict) else "?"


def parse_env(text: str) -> dict[str, str]:
    """Read back an env file as provision writes it (display only; systemd parses the real one)."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        if text[i] in "\n \t":
            i += 1
            continue
        if text[i] == "#":
            i = text.find("\n", i)
            i = n if i < 0 else i + 1
            continue
        eq = text.find('="', i)
        if eq < 0:
            break
        key, i, buf = text[i:eq], eq + 2, []
        while i < n and text[i] != '"':
            if text[i] == "\\" and i + 1 < n:
                i += 1
            buf.append(text[i])
            i += 1
        out[key] = "".join(buf)
        i += 1
    return out


def env_diff(path: str, old: bytes, new: bytes, secret_keys: tuple[str, ...] = ()) -> str | None:
    """Per variable; JSON values (TF_CONFIG, CLUSTER_SPEC) diffed as indented JSON."""
    import json

    try:
        a, b = parse_env(old.decode("utf-8")), parse_env(new.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    lines = []
    for key in list(dict.fromkeys([*a, *b])):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if key in secret_keys:
            lines.append(f"~ {key}={SECRET_MASK}")
            continue
        try:
            ja, jb = json.loads(va) if va else None, json.loads(vb) if vb else None
            if isinstance(ja, (dict, list)) or isinstance(jb, (dict, list)):
                pa = json.dumps(ja, indent=1, sort_keys=True).splitlines() if va is not None else []
                pb = json.dumps(jb, indent=1, sort_keys=True).splitlines() if vb is not None else []
                body = [l for l in difflib.unified_diff(pa, pb, lineterm="", n=1)][2:]
                lines.append(f"~ {key} (JSON):")
                lines += ["    " + l for l in body]
                continue
        except ValueError:
            pass
        if va is not None:
            lines.append(f"- {key}={va!r}")
        if vb is not None:
            lines.append(f"+ {key}={vb!r}")
    return "\n".join(lines) + "\n" if lines else None


def _diff(f: RenderedFile, old: bytes | None, secret_keys: tuple[str, ...]) -> str | None:
    if f.kind == "manifest":
        return None
    if f.kind == "file":
        try:
            data = f.data()
        except OSError:
            return None
        if len(data) > 256 * 1024:
            return None
        return unified_diff(f.path, old, data)
    if f.kind == "env" and old is not None:
        return env_diff(f.path, old, f.data(), secret_keys)
    return unified_diff(f.path, old, f.data(), ())


def make_plan(
    rendered: Rendered,
    targets: dict[str, Target],
    reports: dict[str, dict | HostError],
    *,
    replace: set[str] | None = None,
) -> Plan:
    inv = rendered.inventory
    hosts = {h.name: h for h in inv.hosts}
    plans = []
    for name, target in targets.items():
        plans.append(
            plan_host(
                name, target, hosts.get(name), rendered.hosts.get(name), reports[name], inv.secret_env, replace
            )
        )
    return Plan(inv.job, plans)
