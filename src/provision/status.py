"""Job phase and task states from what the hosts report (systemd unit properties). Pure.

Task states: Pending (not started yet), Running, Restarting (between tries), Succeeded
(exit 0), Failed (exited non-zero or was killed, restart budget spent), Stopped (stopped
by provision when the job ended, or by hand).
Job phase (cluster-env.md, Lifecycle): Failed when any task failed for good; Succeeded
when the success policy holds (the chief exited 0, worker 0 when there is no chief, or
every worker with `all_workers`); Running while any task runs; Pending before that.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .model import Inventory
from .placement import PlacedTask



@dataclass(frozen=True)
class TaskStatus:
    task: str
    role: str
    host: str
    address: str
    gpus: str
    state: str
    exit_code: int | None
    restarts: int
    since: str
    detail: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class JobStatus:
    job: str
    phase: str
    reason: str
    tasks: tuple[TaskStatus, ...]
    unreachable: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "job": self.job,
            "phase": self.phase,
            "reason": self.reason,
            "unreachable": list(self.unreachable),
            "tasks": [t.to_json() for t in self.tasks],
        }


CLD_EXITED, CLD_KILLED, CLD_DUMPED = "1", "2", "3"  # systemd's ExecMainCode
_KIND = {CLD_EXITED: "exited", CLD_KILLED: "killed", CLD_DUMPED: "dumped"}


def task_state(unit: dict | None, exits: list | None = None, ended: dict | None = None) -> tuple[str, int | None, str]:
    """(state, exit code, detail) of one task. The one place that decides a task's state.

    `unit`: `systemctl show` properties; `exits`: the task's ExecStopPost records
    ([time, SERVICE_RESULT, EXIT_CODE, EXIT_STATUS], oldest first), which survive systemd
    unloading an inactive unit; `ended`: the job's end marker on this host, if any.
    """
    if not unit or unit.get("LoadState") in (None, "not-found"):
        return "Pending", None, "not applied"
    active, sub = unit.get("ActiveState"), unit.get("SubState")
    last = exits[-1] if exits else None
    if active in ("active", "reloading", "deactivating") or (active == "activating" and sub != "auto-restart"):
        return "Running", None, "stopping" if active == "deactivating" else (sub or "")
    if last is None:
        # No record yet: fall back to what systemd still remembers, if anything.
        code = unit.get("ExecMainCode", "0")
        if code == "0":
            return "Pending", None, "not started"
        last = ["0", unit.get("Result", ""), _KIND.get(code, code), unit.get("ExecMainStatus", "0")]
    _, result, kind, status = last[:4]
    exit_code = int(status) if kind == "exited" and status.lstrip("-").isdigit() else None
    how = f"exit code {status}" if kind == "exited" else f"killed by {'SIG' + status if not status.isdigit() else 'signal ' + status}"
    if active == "activating" and sub == "auto-restart":
        return "Restarting", exit_code, f"last try: {how}"
    if kind == "exited" and status == "0":
        return "Succeeded", 0, "exited 0"
    if result == "success" and kind == "killed":
        who = f"by provision: job {str(ended.get('phase', 'ended')).lower()}" if ended else "by hand"
        return "Stopped", None, f"stopped {who}"
    if unit.get("Result") == "start-limit-hit":
        how += ", restart limit reached"
    return "Failed", exit_code, how


def restarts(unit: dict | None, exits: list | None) -> int:
    """Automatic restarts in the current run (the exit file is reset by every apply start)."""
    n = len(exits or [])
    running = (unit or {}).get("ActiveState") in ("active", "activating", "reloading")
    return n if running else max(0, n - 1)


def job_status(
    inv: Inventory,
    tasks: list[tuple[PlacedTask, str]],
    reports: dict[str, dict],
    unreachable: list[str],
) -> JobStatus:
    """`tasks`: (placed task, unit name); `reports`: host → probe answer."""
    rows = []
    by_name: dict[str, TaskStatus] = {}
    for t, unit in tasks:
        rep = reports.get(t.host.name)
        if rep is None:
            ts = TaskStatus(t.name, t.role, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-", "Unknown", None, 0, "", "host unreachable")
        else:
            u = rep.get("units", {}).get(unit)
            ex = rep.get("exits", {}).get(unit)
            state, code, detail = task_state(u, ex, rep.get("lifecycle"))
            since = _since(u, rep.get("now_monotonic_us"), ex, rep.get("now"))
            ts = TaskStatus(t.name, t.role, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-", state, code, restarts(u, ex), since, detail)
        rows.append(ts)
        by_name[t.name] = ts
    phase, reason = _phase(inv, rows)
    return JobStatus(inv.job, phase, reason, tuple(rows), tuple(unreachable))


def _phase(inv: Inventory, rows: list[TaskStatus]) -> tuple[str, str]:
    failed = [r for r in rows if r.state == "Failed"]
    if failed:
        f = failed[0]
        return "Failed", f"{f.task} on {f.host} failed: {f.detail}"
    chief = [r for r in rows if r.role == "chief"]
    workers = [r for r in rows if r.role == "worker"]
    if inv.success == "all_workers":
        if workers and all(r.state == "Succeeded" for r in workers):
            return "Succeeded", "every worker exited 0"
    else:
        lead = chief[0] if chief else (next((w for w in workers if w.task == "worker-0"), None))
        if lead is not None and lead.state == "Succeeded":
            return "Succeeded", f"{lead.task} exited 0"
    if any(r.state in ("Running", "Restarting") for r in rows):
        return "Running", ""
    if rows and all(r.state == "Pending" for r in rows):
        return "Pending", "not started"
    if any(r.state == "Unknown" for r in rows):
        return "Unknown", "some hosts are unreachable"
    return "Pending", ""


def _since(unit: dict | None, now_us, exits: list | None = None, now: float | None = None) -> str:
    """How long the task has been in its state: systemd's clock while it runs, else the
    time of its last recorded exit (systemd forgets unloaded units)."""
    if not unit or not now_us:
        return ""
    secs = None
    try:
        if unit.get("ActiveState") == "active" and unit.get("ActiveEnterTimestampMonotonic", "0") != "0":
            secs = max(0, (int(now_us) - int(unit["ActiveEnterTimestampMonotonic"])) // 1_000_000)
        elif exits and now:
            secs = max(0, int(now - float(exits[-1][0])))
    except (ValueError, TypeError):
        secs = None
    if secs is None:
        return ""
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    return f"{secs // 3600}h"
