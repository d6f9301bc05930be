"""The job's status from what the hosts report: one row per task, and the job's phase. Pure.

The rules (task state, restart budget, job phase) are lifecycle.py's; this module puts
them together per task for `status`, `wait` and the end-of-job stop.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NotRequired, TypedDict

from provision.core.events import EventJson
from provision.core.explain import exit_words, reason
from provision.core.lifecycle import (
    PREEMPT_PHASE,
    STOP_PHASE,
    JobPhase,
    TaskRow,
    TaskState,
    job_phase,
    restart_budget,
    restarts,
    task_state,
)
from provision.core.model import Inventory
from provision.core.recovery import GoodputJson, RecoveryJson, RecoveryRecord
from provision.core.runs import Run, RunJson, merged
from provision.core.tuning import TrialJson
from provision.host import layout
from provision.host.protocol import ProbeReport
from provision.placement.tasks import PlacedTask
from provision.rules import preempted
from provision.rules.checkpoints import CopyJson
from provision.rules.health import task_notes
from provision.rules.historyview import HistoryRowJson
from provision.rules.jobsdoc import JobHostJson
from provision.rules.progress import ProgressJson, ProgressView
from provision.rules.queueorder import place_in_queue
from provision.rules.tenancy import holders


class TaskJson(TypedDict):
    task: str
    role: str
    host: str
    address: str
    gpus: list[int]
    state: str
    exit_code: int | None
    restarts: int
    since_seconds: int | None
    detail: str
    ended_at: str | None
    last_lines: list[str]
    gpu_util_pct: int | None


class StatusJson(TypedDict):
    """`provision status --json` (JobStatus.to_json)."""

    format_version: int
    job: str
    phase: str
    reason: str | None
    unreachable: list[str]
    tasks: list[TaskJson]
    left_behind: list[str]
    owner: str | None
    run: RunJson | None
    setup_lines: dict[str, list[str]]
    health: list[str]
    # A job with `progress:` or `recovery:` (rules/recovery.judged): its progress, where its
    # run broke (one line), its recoveries.
    progress: NotRequired[ProgressJson]
    broke: NotRequired[str]
    recovery: NotRequired[RecoveryJson]
    goodput: NotRequired[GoodputJson]
    checkpoint_copy: NotRequired[CopyJson]  # its newest checkpoint kept off its host (rules/checkpoints.py)


class JobDoc(StatusJson):
    """The dashboard's job (web/inventories.InventorySource.job): the status, the inventory's
    env with every secret_env value masked, its study (or null), and the actions its phase
    allows (of stop, rerun, cancel)."""

    env: dict[str, str]
    study: str | None
    actions: list[str]
    # The service's: what it kept of the job (its runs in the history, its events, its logs),
    # and a trial's row of its study and what it reported.
    runs: NotRequired[list[HistoryRowJson]]
    timeline: NotRequired[list[EventJson]]
    kept_logs: NotRequired[bool]
    trial: NotRequired[TrialJson]
    reports: NotRequired[list[list[float]]]  # [[step, value], ...]
    known: NotRequired[str]  # where the page's words come from when no inventory names the job: "history"
    held: NotRequired[dict[str, JobHostJson]]  # such a job's entries in the hosts' ledgers now


@dataclass(frozen=True)
class TaskStatus:
    task: str
    role: str
    host: str
    address: str
    gpus: list[int]
    state: TaskState
    exit_code: int | None
    restarts: int
    since: int | None  # seconds in this state, None when unknown
    detail: str
    ended_at: float | None = None  # host clock (epoch seconds) of the exit that ended it
    last_lines: tuple[str, ...] = ()  # its journal's last lines, for a task that failed
    gpu_util: int | None = None  # % over its GPUs while it runs (rules/gpuuse.with_task_util); None: unknown

    def to_json(self) -> TaskJson:
        return {
            "task": self.task,
            "role": self.role,
            "host": self.host,
            "address": self.address,
            "gpus": self.gpus,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "restarts": self.restarts,
            "since_seconds": self.since,
            "detail": self.detail,
            "ended_at": iso_time(self.ended_at),
            "last_lines": list(self.last_lines),
            "gpu_util_pct": self.gpu_util,
        }


@dataclass(frozen=True)
class JobStatus:
    job: str
    phase: JobPhase
    reason: str
    tasks: tuple[TaskStatus, ...]
    unreachable: tuple[str, ...] = ()
    # Hosts the job left (not in the inventory any more) that still hold some of it, one
    # line each (left_behind): their tasks could run beside their replacements.
    left_behind: tuple[str, ...] = ()
    owner: str | None = None  # who applied the job, as the hosts' ledgers say
    stopped: Mapping[str, Any] | None = None  # `provision stop`'s marker, when it stopped the job
    run: Run | None = None  # the latest run (core/runs.py)
    setup_lines: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # host -> a failed setup's last lines
    # Preempted on some hosts, its tasks still running (or stopping) on others:
    # who acts for the job preempts it there too (run/victim.py).
    rest: preempted.Rest | None = None
    # A job watched for progress or recovered (rules/recovery.judged): its progress, where
    # its run broke (one line), and its recoveries as its state keeps them.
    progress: ProgressView | None = None
    broke: str = ""
    recovery: RecoveryRecord | None = None
    goodput: GoodputJson | None = None  # core/recovery.goodput
    checkpoint_copy: CopyJson | None = None  # rules/checkpoints.view
    # What the hosts' health says of the GPUs its tasks run on (rules/health.task_notes).
    health: tuple[str, ...] = ()

    def to_json(self) -> StatusJson:
        out = self._json()
        if self.progress is not None:
            out["progress"] = self.progress.to_json()
        if self.broke:
            out["broke"] = self.broke
        if self.recovery is not None:
            out["recovery"] = self.recovery.to_json()
        if self.goodput is not None:
            out["goodput"] = self.goodput
        if self.checkpoint_copy is not None:
            out["checkpoint_copy"] = self.checkpoint_copy
        return out

    def _json(self) -> StatusJson:
        return {
            "format_version": 2,
            "job": self.job,
            "phase": self.phase.value,
            "reason": self.reason or None,
            "unreachable": list(self.unreachable),
            "tasks": [t.to_json() for t in self.tasks],
            "left_behind": list(self.left_behind),
            "owner": self.owner,
            "run": self.run.to_json() if self.run is not None else None,
            "setup_lines": {h: list(v) for h, v in self.setup_lines.items()},
            "health": list(self.health),
        }

    @property
    def setup_failed(self) -> list[str]:
        """Hosts whose setup failed, holding back their tasks (none started there)."""
        return sorted(
            {t.host for t in self.tasks if t.state is TaskState.PENDING and t.detail.startswith(SETUP_FAILED)}
        )

    def task(self, name: str) -> TaskStatus:
        for t in self.tasks:
            if t.task == name:
                return t
        raise KeyError(name)


def job_status(
    inv: Inventory,
    tasks: list[PlacedTask],
    reports: Mapping[str, ProbeReport],
    unreachable: Mapping[str, str],
) -> JobStatus:
    """`reports`: host → probe report, for the hosts that answered; `unreachable`: host →
    why not. Tasks on hosts in neither (not asked, e.g. --target) are left out."""
    rows = []
    for t in tasks:
        gpus = list(t.accelerators)
        unit = layout.unit_name(inv.job, t.name)
        rep = reports.get(t.host.name)
        if rep is None:
            if t.host.name in unreachable:
                why = f"host unreachable: {unreachable[t.host.name]}"
                rows.append(
                    TaskStatus(t.name, t.role, t.host.name, t.address, gpus, TaskState.UNKNOWN, None, 0, None, why)
                )
            continue
        u = rep.units.get(unit)
        ex = rep.exits.get(unit)
        pool = inv.pool(t.role)
        limit = restart_budget(pool.restart) if pool is not None else None
        out = task_state(u, ex, rep.lifecycle, limit)
        setup_unit = next((x for x in rep.units if layout.is_setup_unit(x)), None)  # the host's setup's
        waiting = setup_state(rep.units.get(setup_unit) if setup_unit else None)
        if out.state is TaskState.PENDING and waiting:  # the host's setup holds it back
            out = out._replace(detail=waiting)
        ended_at = None
        if out.state.ended and ex:
            try:
                ended_at = float(ex[-1][0])
            except (TypeError, ValueError):
                ended_at = None
        rows.append(
            TaskStatus(
                t.name,
                t.role,
                t.host.name,
                t.address,
                gpus,
                out.state,
                out.exit_code,
                restarts(u, ex, out.state),
                _since(u, rep.now_monotonic_us, ex, rep.now),
                out.detail,
                ended_at,
            )
        )
    return _judged(inv, rows, reports, unreachable)


def _judged(
    inv: Inventory, rows: list[TaskStatus], reports: Mapping[str, ProbeReport], unreachable: Mapping[str, str]
) -> JobStatus:
    """The job's phase and why from its tasks' rows and its hosts' end markers."""
    stopped = stop_marker(reports)
    rows, preempted_why = _preempted(rows, reports, inv.job)
    phase, why = job_phase(
        inv.success, [TaskRow(r.task, r.role, r.host, r.state, r.detail, r.ended_at) for r in rows], stopped
    )
    rest = None
    if phase is JobPhase.PREEMPTED:  # preempted on some hosts, running on others
        live = {h: any(r.state.live for r in rows if r.host == h) for h in reports}
        rest = preempted.rest({h: r.lifecycle for h, r in reports.items()}, live)
        preempted_why += preempted.rest_words(rest)
    why = (_setup_reason(rows) or why) if stopped is None else preempted_why if phase is JobPhase.PREEMPTED else why
    runs = merged(rep.runs for rep in reports.values())
    last = runs[-1] if runs else None
    declared = {h.name: h.accelerator_count for h in inv.hosts}
    notes = tuple(
        n
        for r in rows
        if r.host in reports
        for n in task_notes(r.task, r.host, r.gpus, reports[r.host], declared.get(r.host, 0))
    )
    return JobStatus(
        inv.job, phase, why, tuple(rows), tuple(sorted(unreachable)), stopped=stopped, run=last, rest=rest, health=notes
    )


def stop_marker(reports: Mapping[str, ProbeReport]) -> dict[str, Any] | None:
    """The end marker `provision stop` (or a preemption) wrote, as any reached host of the
    job has it (the first host in name order, so every command reads the same one)."""
    for _, rep in sorted(reports.items()):
        lc = rep.lifecycle
        if isinstance(lc, dict) and lc.get("phase") in (STOP_PHASE, PREEMPT_PHASE):
            return lc
    return None


def _preempted(rows: list[TaskStatus], reports: Mapping[str, ProbeReport], job: str) -> tuple[list[TaskStatus], str]:
    """The rows with each task the preemption's deadline killed saying so, and the reason
    of a preempted job (rules/preempted.py)."""
    found = preempted.marks({h: r.lifecycle for h, r in reports.items()})
    if not found:
        return rows, ""
    out = []
    for r in rows:
        rep = reports.get(r.host)
        ex = rep.exits.get(layout.unit_name(job, r.task)) if rep is not None else None
        why = preempted.killed_at_deadline(found, ex[-1] if ex else None) if r.state.ended else None
        out.append(replace(r, detail=why) if why else r)
    # Its place in the queue where it held GPUs, from the ledgers a tenancy probe brought.
    held_by = {h: holders(h, r, r.now) for h, r in reports.items() if r.ledger is not None}
    place = place_in_queue(job, [h for h, _ in found], held_by) if held_by else None
    return out, preempted.reason(found, place=place)


def _setup_reason(rows: Sequence[TaskStatus]) -> str | None:
    """A failed setup is why nothing started: the job's reason says so, not "not started"."""
    if any(r.state is not TaskState.PENDING for r in rows):
        return None
    failed = sorted({r.host: r.detail for r in rows if r.detail.startswith(SETUP_FAILED)}.items())
    if not failed:
        return None
    return f"setup failed on {', '.join(h for h, _ in failed)}: {failed[0][1][len(SETUP_FAILED) + 2 :]}"


SETUP_FAILED = "setup failed"
_CODE_KIND = {"1": "exited", "2": "killed", "3": "dumped"}  # systemd's ExecMainCode


def setup_state(unit: Mapping[str, str] | None) -> str | None:
    """What the job's setup unit on a host says about tasks that have not started there:
    running, or failed and how (None: no setup, or it succeeded)."""
    if not unit or unit.get("LoadState") in (None, "not-found"):
        return None
    if unit.get("ActiveState") == "activating":
        return "waiting for the host's setup (running)"
    result = unit.get("Result", "success")
    if unit.get("ActiveState") == "failed" or result not in ("", "success"):
        kind = _CODE_KIND.get(unit.get("ExecMainCode", ""), "exited")
        how = exit_words(kind, unit.get("ExecMainStatus", "?"), result)
        return f"{SETUP_FAILED}: {how} (provision logs --setup shows its output)"
    return None


def needs_lines(st: JobStatus) -> dict[str, list[str]]:
    """host -> tasks whose journal explains their state: tasks that failed, and tasks
    waiting to restart after systemd could not start their program."""
    out: dict[str, list[str]] = {}
    for t in st.tasks:
        if t.state is TaskState.FAILED or (
            t.state is TaskState.RESTARTING and t.exit_code is not None and t.exit_code >= 200
        ):
            out.setdefault(t.host, []).append(t.task)
    return out


def with_lines(inv: Inventory, st: JobStatus, lines: Mapping[str, Sequence[str]]) -> JobStatus:
    """The status with each task's last journal lines, its detail made precise with them
    (explain.reason: the path and error of a program systemd could not start), and the
    job's reason worded again from those details."""
    if not lines:
        return st
    rows = []
    for t in st.tasks:
        got = lines.get(t.task)
        if got is None:
            rows.append(t)
            continue
        rows.append(replace(t, detail=reason(t.detail, t.exit_code, got), last_lines=tuple(got)))
    phase, why = job_phase(
        inv.success, [TaskRow(r.task, r.role, r.host, r.state, r.detail, r.ended_at) for r in rows], st.stopped
    )
    if phase is not st.phase:  # the same rows: never happens; keep what was decided
        phase, why = st.phase, st.reason
    return replace(st, phase=phase, reason=why, tasks=tuple(rows))


def iso_time(epoch: float | None) -> str | None:
    """Epoch seconds as ISO 8601 in UTC (`2026-01-01T10:00:00Z`), for --json."""
    if epoch is None:
        return None
    return _dt.datetime.fromtimestamp(epoch, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _since(
    unit: Mapping[str, str] | None,
    now_us: int | None,
    exits: Sequence[Sequence[str]] | None = None,
    now: float | None = None,
) -> int | None:
    """Seconds the task has been in its state: systemd's clock while it runs, else the time
    of its last recorded exit (systemd forgets unloaded units)."""
    if not now_us:
        return None
    unit = unit or {}
    try:
        if unit.get("ActiveState") == "active" and unit.get("ActiveEnterTimestampMonotonic", "0") != "0":
            return max(0, (int(now_us) - int(unit["ActiveEnterTimestampMonotonic"])) // 1_000_000)
        if exits and now:
            return max(0, int(now - float(exits[-1][0])))
    except (ValueError, TypeError):
        return None
    return None


def left_behind(
    host: str, units: Mapping[str, str], report: ProbeReport | None, why: str | None
) -> tuple[str, bool] | None:
    """A line for a host the job left that was not cleaned yet (`units`: unit -> task, as
    the state recorded them), and whether it still runs some of them; None when nothing of
    the job is left there."""
    if report is None:
        return (
            f"{host} left the job while it could not be reached ({why}): its tasks "
            f"({', '.join(sorted(units.values())) or 'none recorded'}) may start again when it boots; "
            "the next apply that reaches it stops them",
            False,
        )
    live = sorted(t for u, t in units.items() if task_state(report.units.get(u), report.exits.get(u)).state.live)
    if live:
        return f"{host} left the job but still runs {', '.join(live)}: the next apply stops them", True
    if report.readable_manifest() is not None:
        return f"{host} left the job; its files are still there: the next apply removes them", False
    return None
