"""Desired (rendered files) vs. what each host reports → the changes to make. Pure.

What counts as a resource in the summary: HostPlan.resources() (one line of the plan each).
Drift is anything that differs from what provision last wrote: a managed file edited or
removed by hand, a task stopped by hand.
"""

from __future__ import annotations

import base64
import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as with_fields
from enum import StrEnum
from typing import Any

from provision.core.encode import env_escape
from provision.core.errors import ProvisionError
from provision.core.imagechange import ImageChange
from provision.core.lifecycle import (
    FINISHED_REASONS,
    Action,
    Decision,
    Reason,
    decide,
    finished,
    synchronous,
    whole_job,
)
from provision.core.model import Host
from provision.core.records import Applied
from provision.core.runs import merged, next_number, starts_run
from provision.core.target import HostError, Target
from provision.host import layout
from provision.host.protocol import FileInfo, ProbeReport, Reservation
from provision.host.taskenv import parse_env
from provision.render.files import SECRET_MASK, FileKind, HostBundle, Rendered, RenderedFile, TaskUnit
from provision.rules.facts import mismatches
from provision.rules.sharing import OtherJob, judge, setup_note, setup_reason, taken_problem


class FileAction(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    DELETE = "delete"

    @property
    def symbol(self) -> str:
        return {"create": "+", "update": "~", "delete": "-"}[self.value]


@dataclass(frozen=True)
class FileChange:
    path: str
    action: FileAction
    kind: FileKind
    reason: str
    drift: bool = False
    diff: str | None = None
    keep_original: bool = False  # replace: true over a host file provision did not write
    replaces: Applied | None = None  # another identity applied what is there (rules/provenance.py)

    def to_json(self) -> dict[str, Any]:
        theirs = self.replaces
        return {
            "path": self.path,
            "action": self.action.value,
            "kind": self.kind.value,
            "reason": self.reason,
            "drift": self.drift,
            "diff": self.diff,
            "keep_original": self.keep_original,
            "replaces": {"who": theirs.who, "at": theirs.at, "serial": theirs.serial} if theirs else None,
        }


@dataclass(frozen=True)
class TaskChange:
    task: str
    unit: str
    action: Action
    reason: Reason
    detail: str
    phase: int
    drift: bool = False
    new: bool = False

    @property
    def why(self) -> str:
        return Decision(self.action, self.reason, self.detail, self.drift, self.new).describe()

    @property
    def symbol(self) -> str:
        """Its marker: "+" a new task, "-" one that stops for good, "~" a (re)start of one there."""
        return "+" if self.new else "-" if self.action is Action.STOP else "~"

    def to_json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "unit": self.unit,
            "action": self.action.value,
            "reason": self.reason.name.lower(),
            "why": self.why,
            "phase": self.phase,
            "drift": self.drift,
            "new": self.new,
        }


@dataclass(frozen=True)
class Shown:
    """One resource line of the plan: its marker and what it is about."""

    symbol: str  # "+", "~" or "-"
    item: str | ImageChange | Reservation | TaskChange | FileChange  # str: why the setup runs


@dataclass(frozen=True)
class HostPlan:
    """What apply does on one host, and why not. Data once made: the planner's later rules
    (rules/planner.py) make new values with dataclasses.replace, and nothing edits a plan
    apply was given (Terraform's rule)."""

    name: str
    target: Target
    bundle: HostBundle | None  # None: nothing of the job belongs here any more
    error: HostError | None = None
    problems: tuple[str, ...] = ()  # refuse the apply: nothing changes anywhere
    files: tuple[FileChange, ...] = ()
    tasks: tuple[TaskChange, ...] = ()
    report: ProbeReport | None = None
    reserve: Reservation | None = None  # the host's ledger entry to write (tenancy.py)
    warnings: tuple[str, ...] = ()  # worth knowing; the apply goes ahead
    setup: str | None = None  # why the setup runs here: "new", "changed", "forced"
    # A setup that does not run: done here already, and which other jobs use it (setup_note)
    setup_done: str | None = None
    images: tuple[ImageChange, ...] = ()  # to ship or pull first (images.py)
    shared: tuple[tuple[str, str], ...] = ()  # (path, other job): same bytes, not written
    # (path, other job): a running job that shares the file changed it after this one had
    # finished; left as it is, and this job may not start with it (as_a_unit)
    taken: tuple[tuple[str, str], ...] = ()

    @property
    def changed(self) -> bool:
        return (
            bool(self.images)
            or bool(self.files)
            or any(t.action is not Action.NONE for t in self.tasks)
            or self.reserve is not None
            or self.setup is not None
        )

    @property
    def units_changed(self) -> bool:
        return any(f.kind in (FileKind.UNIT, FileKind.TARGET) for f in self.files)

    @property
    def adopt(self) -> bool:
        """The host runs this job (its manifest says so) but nothing changes there: the
        state must still know it (an apply killed before recording it, a lost state)."""
        return (
            self.error is None
            and self.bundle is not None
            and self.report is not None
            and self.report.readable_manifest() is not None
        )

    def starts(self) -> list[TaskChange]:
        return [t for t in self.tasks if t.action.starts]

    def stops(self) -> list[TaskChange]:
        """Tasks to stop, in stop order (the start order reversed)."""
        return sorted((t for t in self.tasks if t.action is Action.STOP), key=lambda t: -t.phase)

    # The one counting rule: every line the plan shows with a marker is one
    # resource, counted by its marker: "+" to add, "~" to change, "-" to destroy. That is
    # the setup run, each image, the ledger entry, each task that changes, each file
    # (env, unit, target, pushed; the manifest only when nothing else changes). Headers,
    # problems, warnings and diff lines carry no marker and do not count. The text plan
    # (output.plan_lines) prints these lines; counts() tallies them for the summary line,
    # the --json "summary" and apply's and destroy's closing line.
    def resources(self) -> list[Shown]:
        out = [Shown("~", self.setup)] if self.setup is not None else []
        out += [Shown("+", im) for im in self.images]
        if self.reserve is not None:  # a new entry, or this job's entry that changes
            out.append(Shown("+" if self.reserve.expect_lineage is None else "~", self.reserve))
        out += [Shown(t.symbol, t) for t in self.tasks if t.action is not Action.NONE]
        shown = [f for f in self.files if f.kind is not FileKind.MANIFEST] or self.files
        return out + [Shown(f.action.symbol, f) for f in shown]

    def counts(self) -> tuple[int, int, int]:
        """(add, change, destroy): the resources() lines by marker."""
        symbols = [r.symbol for r in self.resources()]
        return symbols.count("+"), symbols.count("~"), symbols.count("-")


@dataclass(frozen=True)
class Plan:
    job: str
    hosts: tuple[HostPlan, ...]

    @property
    def unreachable(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.error is not None and h.error.unreachable]

    @property
    def errors(self) -> list[HostPlan]:
        return [h for h in self.hosts if h.error is not None or h.problems]

    @property
    def problems(self) -> list[str]:
        return [f"{h.target.where}: {m}" for h in self.hosts for m in h.problems]

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

    def new_run(self) -> int | None:
        """The number of the run this plan starts, or None when its starts join the run
        under way or it starts nothing (the rule: core/runs.py)."""
        kept = [t for h in self.hosts if h.error is None for t in h.tasks if t.action is not Action.STOP]
        starting = sum(1 for t in kept if t.action.starts)
        running = sum(1 for t in kept if t.action is Action.NONE and t.reason is Reason.RUNNING)
        if not starts_run(starting, len(kept), running):
            return None
        return next_number(merged(h.report.runs for h in self.hosts if h.report is not None))

    def finished(self) -> str | None:
        """How the job ended, in words, when every task plan looked at has finished (the
        one rule of lifecycle.finished, as --rerun uses it); None otherwise. Plan and apply
        then say so instead of a bare "No changes"."""
        kept = [t for h in self.hosts if h.error is None for t in h.tasks if t.action is not Action.STOP]
        decisions = {t.task: Decision(t.action, t.reason, t.detail, t.drift, t.new) for t in kept}
        if not finished(decisions):
            return None
        failed = sorted(t.task for t in kept if t.reason is Reason.FAILED)
        ended = next((t.detail for t in kept if t.reason is Reason.JOB_ENDED and t.detail), "")
        if ended:
            if ended == "stopped":
                return "the job was stopped (provision stop)"
            return f"the job {ended}" if ended in ("succeeded", "failed") else f"the job ended ({ended})"
        return f"{', '.join(failed)} failed" if failed else "every task exited 0"

    def to_json(self) -> dict[str, Any]:
        a, c, d = self.counts()
        return {
            "format_version": 2,
            "job": self.job,
            "changes": self.changed,
            "finished": self.finished(),
            "summary": {"add": a, "change": c, "destroy": d},
            "unreachable": [h.name for h in self.unreachable],
            "hosts": {
                h.name: {
                    "address": h.target.where,
                    "error": h.error.message if h.error else None,
                    "unreachable": bool(h.error and h.error.unreachable),
                    "problems": list(h.problems),
                    "warnings": list(h.warnings),
                    "remove_all": h.bundle is None,
                    "reserve": {"gpus": h.reserve.gpus, "ports": h.reserve.ports} if h.reserve else None,
                    "setup": {"run": True, "why": h.setup}
                    if h.setup
                    else {"run": False, "done": h.setup_done}
                    if h.setup_done
                    else None,
                    "images": [i.to_json() for i in h.images],
                    "tasks": [t.to_json() for t in h.tasks],
                    "files": [f.to_json() for f in h.files],
                    "shared_files": [{"path": p, "job": j} for p, j in h.shared],
                }
                for h in self.hosts
            },
        }


# --------------------------------------------------------------------------- diffing


def scrub(text: str, secret_values: Iterable[str]) -> str:
    """Every secret value (as it would be written in an env file, or raw) masked, whatever
    file it shows up in."""
    forms = {form for value in secret_values if value for form in (value, env_escape(value))}
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, SECRET_MASK)
    return text


def unified_diff(path: str, old: bytes | None, new: bytes, secret_values: Iterable[str] = ()) -> str | None:
    """A unified diff for text files; None for binary ones or when the old bytes are unknown."""
    try:
        new_t = new.decode("utf-8")
        old_t = old.decode("utf-8") if old is not None else ""
    except UnicodeDecodeError:
        return None
    if "\x00" in new_t or "\x00" in old_t:
        return None
    lines = difflib.unified_diff(
        old_t.splitlines(keepends=True), new_t.splitlines(keepends=True), f"a{path}", f"b{path}", n=1
    )
    out = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return scrub(out, secret_values) if out else None


# --------------------------------------------------------------------------- host plans


def owners_wanted(hp: HostPlan) -> list[str]:
    """Paths whose other owners plan must know to judge them: pushed files the host has
    that this job did not write (another job's?), and this job's pushed files that change."""
    own = {f.path for f in hp.files if f.kind is FileKind.FILE and f.action is FileAction.UPDATE}
    foreign = [p.split(" ", 1)[0] for p in hp.problems if p.endswith(NOT_MANAGED)]
    return sorted(own | set(foreign) | set(_setup_owners_wanted(hp)))


def _setup_owners_wanted(hp: HostPlan) -> list[str]:
    """A shared setup the host has that this job did not write: which jobs use it (plan
    says so). One path, in the round trip pushed files ask anyway (a trial's do)."""
    s = hp.bundle.setup if hp.bundle is not None else None
    if s is None or hp.report is None or hp.setup is not None:
        return []
    unit = layout.setup_unit_path(s.key)
    recorded = (hp.report.readable_manifest() or {}).get("files", {})
    return [unit] if hp.report.files.get(unit) is not None and unit not in recorded else []


NOT_MANAGED = (
    "exists and is not managed by provision; set `replace: true` on its files: "
    "entry to let provision replace it (the original is kept and put back by destroy)"
)


@dataclass
class _Draft:
    """A host's plan while plan_host makes it (HostPlan itself is frozen)."""

    problems: list[str] = field(default_factory=list)
    files: list[FileChange] = field(default_factory=list)
    tasks: list[TaskChange] = field(default_factory=list)
    shared: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    taken: list[tuple[str, str]] = field(default_factory=list)

    def host_plan(self, name: str, target: Target, bundle: HostBundle | None, **more: Any) -> HostPlan:
        return HostPlan(
            name,
            target,
            bundle,
            problems=tuple(self.problems),
            files=tuple(self.files),
            tasks=tuple(self.tasks),
            shared=tuple(self.shared),
            warnings=tuple(self.warnings),
            taken=tuple(self.taken),
            **more,
        )


def _judged_as_shared(
    hp: _Draft, path: str, f: Any, a: FileInfo | None, rec: Any, others: Sequence[OtherJob] | None
) -> bool:
    """A pushed file other jobs list too (sharing.judge): True when that settles it."""
    if not others or a is None or a.type != "file" or f.kind is not FileKind.FILE:
        return False
    v = judge(path, f, a, rec, others)
    hp.problems += [v.problem] if v.problem else []
    hp.warnings += [v.warning] if v.warning else []
    hp.taken += [(path, v.taken_by)] if v.taken_by else []
    hp.shared += [(path, v.shared_with)] if v.shared_with else []
    return v.settled


def _files_plan(  # noqa: C901  one branch per state a file can be found in on the host
    hp: _Draft,
    bundle: HostBundle,
    report: ProbeReport,
    recorded: dict[str, Any],
    secrets: tuple[str, ...],
    shared: Mapping[str, Sequence[OtherJob]],
) -> set[str]:
    """File changes of a host that keeps the job; returns the paths that change."""
    desired = bundle.file_map()
    changed: set[str] = set()
    for path, f in desired.items():
        a = report.files.get(path)
        rec = recorded.get(path)
        if _judged_as_shared(hp, path, f, a, rec, shared.get(path)):
            continue
        if a is None or a.type != "file":
            drift = rec is not None
            reason = "removed by hand" if drift else "new"
            if a is not None:
                reason, drift = f"a {a.type} is in the way", True
            hp.files.append(FileChange(path, FileAction.CREATE, f.kind, reason, drift))
            changed.add(path)
            continue
        if rec is None and f.kind is FileKind.FILE:
            # Not provision's: overwriting it would lose it for good (destroy deletes what
            # provision wrote). Only with replace: true, which keeps it aside for destroy.
            if not f.replace:
                hp.problems.append(f"{path} {NOT_MANAGED}")
                continue
            if a.sha256 != f.sha256 or a.mode != f.mode or a.uid != 0:
                why = "replaces the host's own file (kept for destroy)"
                hp.files.append(FileChange(path, FileAction.UPDATE, f.kind, why, keep_original=True))
                changed.add(path)
            continue
        if a.sha256 != f.sha256:
            drift = rec is not None and rec.get("sha256") != a.sha256
            reason = "edited by hand" if drift else "content changed"
            old = base64.b64decode(a.content) if a.content is not None else None
            hp.files.append(
                FileChange(
                    path, FileAction.UPDATE, f.kind, reason, drift, _diff(f, old, secrets) if old is not None else None
                )
            )
            changed.add(path)
        elif a.mode != f.mode or a.uid != 0:
            hp.files.append(
                FileChange(
                    path, FileAction.UPDATE, f.kind, f"owner/mode {a.uid}/{oct(a.mode or 0)} changed by hand", True
                )
            )
            changed.add(path)
    for path, rec in sorted(recorded.items()):
        if path not in desired and report.files.get(path) is not None:
            hp.files.append(FileChange(path, FileAction.DELETE, FileKind(rec.get("kind", "file")), Reason.LEFT.value))
    return changed


DROPIN = "a drop-in provision did not write: it changes what {} runs"


def _dropins_plan(hp: _Draft, job: str, bundle: HostBundle, report: ProbeReport) -> dict[str, list[str]]:
    """Drop-ins systemd reads for the job's units (the probe lists them; provision writes
    none): each is drift, removed by apply (then daemon-reload, and its task restarts).
    Returns unit -> the drop-ins that apply to it."""
    units = [u.unit for u in bundle.tasks] + [layout.target_name(job)]
    units += [bundle.setup.unit] if bundle.setup is not None else []
    of = {u: [p for p in report.dropins or [] if layout.dropin_applies(p, u)] for u in units}
    for path in sorted({p for paths in of.values() for p in paths}):
        unit = next(u for u in units if path in of[u])
        hp.files.append(FileChange(path, FileAction.DELETE, FileKind.UNIT, DROPIN.format(unit), drift=True))
    return of


def _leaving(name: str, rec: dict[str, Any]) -> TaskChange:
    return TaskChange(name, rec.get("unit", ""), Action.STOP, Reason.LEFT, "", int(rec.get("phase", 0)))


def _all_leaves(hp: _Draft, report: ProbeReport, job: str, recorded: dict[str, Any], m_tasks: dict[str, Any]) -> None:
    """The job leaves this host: its tasks stop (in stop order), its files and manifest go."""
    for t, mt in sorted(m_tasks.items(), key=lambda kv: -int(kv[1].get("phase", 0))):
        hp.tasks.append(_leaving(t, mt))
    for path, rec in sorted(recorded.items()):
        if report.files.get(path) is not None:
            hp.files.append(FileChange(path, FileAction.DELETE, FileKind(rec.get("kind", "file")), Reason.LEFT.value))
    if report.manifest is not None:
        hp.files.append(
            FileChange(layout.manifest_path(job), FileAction.DELETE, FileKind.MANIFEST, "job removed from this host")
        )
    if report.files.get(layout.setup_hold_path(job)) is not None:  # a study's: its trials' setups
        why = "the study's hold on its trials' setup"
        hp.files.append(FileChange(layout.setup_hold_path(job), FileAction.DELETE, FileKind.SETUP, why))


def plan_host(
    name: str,
    target: Target,
    host: Host | None,
    bundle: HostBundle | None,
    report: ProbeReport | HostError,
    *,
    job: str,
    secrets: tuple[str, ...] = (),
    replace: set[str] | None = None,
    new_image: set[str] | None = None,
    force_setup: bool = False,
    shared: Mapping[str, Sequence[OtherJob]] | None = None,
) -> HostPlan:
    """`shared`: pushed paths other jobs on the host list too (owners_wanted asks which)."""
    if isinstance(report, HostError):
        return HostPlan(name, target, bundle, error=report)
    hp = _Draft()
    if host is not None and bundle is not None and report.facts is not None:
        hp.problems = mismatches(host, report.facts)
    manifest = report.readable_manifest()
    recorded: dict[str, Any] = (manifest or {}).get("files", {})
    m_tasks: dict[str, Any] = (manifest or {}).get("tasks", {})

    if bundle is None:  # everything of the job goes
        _all_leaves(hp, report, job, recorded, m_tasks)
        return hp.host_plan(name, target, bundle, report=report)

    changed = _files_plan(hp, bundle, report, recorded, secrets, shared or {})
    dropins = _dropins_plan(hp, job, bundle, report)
    setup = setup_reason(bundle.setup, report, force_setup) if bundle.setup is not None else None
    done = None
    if bundle.setup is not None and setup is None:
        others = (shared or {}).get(layout.setup_unit_path(bundle.setup.key), ())
        done = setup_note([o.job for o in others])
    desired = bundle.file_map()
    replace = replace or set()
    pushed_changed = sorted(p for p in changed if desired[p].kind is FileKind.FILE)
    drift_paths = {f.path for f in hp.files if f.drift}
    for u in bundle.tasks:
        own = [p for p in (u.env_path, u.unit_path) if p in changed]
        mt = m_tasks.get(u.task.name)
        # A host whose record matches what an earlier provision rendered runs the same:
        # its files are rewritten, the task is not restarted (an upgrade keeps training).
        inputs_changed = mt is not None and mt.get("inputs") not in (u.inputs, *u.accepted)
        # Inputs changed: name everything that changed; otherwise only what drifted.
        why = own + pushed_changed if inputs_changed else [p for p in own if p in drift_paths]
        why += dropins[u.unit]
        if u.task.name in (new_image or ()):  # the host got its image with another ID
            inputs_changed, why = True, [*why, "its image"]
        hp.tasks.append(_task_change(u, mt is not None, inputs_changed, why, report, u.task.name in replace))
    names = {u.task.name for u in bundle.tasks}
    for t, mt in sorted(m_tasks.items(), key=lambda kv: -int(kv[1].get("phase", 0))):
        if t not in names:
            hp.tasks.append(_leaving(t, mt))
    return hp.host_plan(name, target, bundle, report=report, setup=setup, setup_done=done)


def _task_change(
    u: TaskUnit, known: bool, inputs_changed: bool, why: list[str], report: ProbeReport, replace: bool
) -> TaskChange:
    """The lifecycle's decision (core/lifecycle.decide) for one task of the host."""
    d = decide(
        u.task.name,
        known,
        inputs_changed,
        why,
        report.units.get(u.unit),
        report.exits.get(u.unit),
        report.lifecycle,
        replace,
        restart_limit=u.restart_limit,
    )
    return TaskChange(u.task.name, u.unit, d.action, d.reason, d.detail, u.phase, d.drift, d.new)


def env_diff(path: str, old: bytes, new: bytes, secrets: tuple[str, ...] = ()) -> str | None:
    """Per variable; JSON values (TF_CONFIG, CLUSTER_SPEC) diffed as indented JSON; a
    variable whose old or new value is a secret is shown masked. The files read as the
    task's exec reads them (host/taskenv.py); an old file that is not provision's any more
    (edited by hand) is shown as a text diff."""
    try:
        a, b = dict(parse_env(old.decode("utf-8"))), dict(parse_env(new.decode("utf-8")))
    except UnicodeDecodeError:
        return None
    except ValueError:
        return unified_diff(path, old, new, secrets)
    lines = []
    for key in list(dict.fromkeys([*a, *b])):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if va in secrets or vb in secrets:
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


def _diff(f: RenderedFile, old: bytes | None, secrets: tuple[str, ...]) -> str | None:
    if f.kind is FileKind.MANIFEST:
        return None
    if f.kind is FileKind.FILE:
        try:
            data = f.data()
        except OSError:
            return None
        if len(data) > 256 * 1024:
            return None
        return unified_diff(f.path, old, data, secrets)
    if f.kind is FileKind.ENV and old is not None:
        text = env_diff(f.path, old, f.data(), secrets)
        return scrub(text, secrets) if text else None
    return unified_diff(f.path, old, f.data(), secrets)


def as_a_unit(plan: Plan, rendered: Rendered, *, rerun: bool, partial: bool) -> Plan:
    """The job as one unit (lifecycle.whole_job): a synchronous job restarts together, and
    never in part while one of its hosts cannot be reached (unless partial); rerun starts
    a finished job again, whole. The plan with those decisions."""
    job_tasks = [t for hp in plan.hosts if hp.error is None for t in hp.tasks if t.action is not Action.STOP]
    decisions = {t.task: Decision(t.action, t.reason, t.detail, t.drift, t.new) for t in job_tasks}
    if rerun and not finished(decisions):
        live = sorted(t for t, d in decisions.items() if not (d.action is Action.NONE and d.reason in FINISHED_REASONS))
        raise ProvisionError(
            f"--rerun: job {plan.job} has not finished ({', '.join(live[:5])} still to run or running); "
            "--rerun starts a Succeeded or Failed job again (use --replace TASK to restart a running task)"
        )
    sync = synchronous(p.role for p in rendered.inventory.pools if p.replicas)
    whole = whole_job(decisions, sync=sync, rerun=rerun)

    def job_wide(t: TaskChange) -> TaskChange:
        d = whole.get(t.task) if t.action is not Action.STOP else None
        if d is None or d == decisions[t.task]:
            return t
        return with_fields(t, action=d.action, reason=d.reason, detail=d.detail)

    hosts = [
        with_fields(hp, tasks=tuple(job_wide(t) for t in hp.tasks)) if hp.error is None else hp for hp in plan.hosts
    ]
    hosts = [
        with_fields(hp, problems=(*hp.problems, *(taken_problem(p, o) for p, o in hp.taken)))
        if hp.taken and hp.starts()
        else hp
        for hp in hosts
    ]
    down = sorted(hp.name for hp in hosts if hp.error is not None and hp.name in rendered.hosts)
    restarting = {hp.name for hp in hosts if hp.error is None and any(t.action.starts and not t.new for t in hp.tasks)}
    if sync and down and restarting and not partial:
        why = (
            f"job {plan.job} runs its tasks together, and {', '.join(down)} cannot be reached: restarting only "
            "the others would leave them waiting for the rest (use --partial to do it anyway)"
        )
        hosts = [with_fields(hp, problems=(*hp.problems, why)) if hp.name in restarting else hp for hp in hosts]
    return with_fields(plan, hosts=tuple(hosts))
