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
from .plan import CLD_EXITED, CLD_KILLED

SIGNALS = {"1": "SIGHUP", "2": "SIGINT", "6": "SIGABRT", "9": "SIGKILL", "11": "SIGSEGV", "15": "SIGTERM"}


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


def task_state(unit: dict | None, ended: dict | None) -> tuple[str, int | None, str]:
    """(state, exit code, detail) of one task from `systemctl show` properties."""
    if not unit or unit.get("LoadState") in (None, "not-found"):
        return "Pending", None, "not applied"
    active, sub = unit.get("ActiveState"), unit.get("SubState")
    code, status, result = unit.get("ExecMainCode", "0"), unit.get("ExecMainStatus", "0"), unit.get("Result", "")
    exit_code = int(status) if status.lstrip("-").isdigit() and code != "0" else None
    if active == "active" or (active in ("activating", "reloading") and sub != "auto-restart"):
        return "Running", None, sub or ""
    if active == "activating" and sub == "auto-restart":
        return "Restarting", exit_code, f"last exit {_describe(code, status)}"
    if active == "deactivating":
        return "Running", None, "stopping"
    if unit.get("ExecMainStartTimestampMonotonic", "0") in ("0", "") and code == "0":
        return "Pending", None, "not started"
    if code == CLD_EXITED and status == "0":
        return "Succeeded", 0, "exited 0"
    if result == "success" and code == CLD_KILLED:
        who = f"by provision: job {str(ended.get('phase', 'ended')).lower()}" if ended else "by hand"
        return "Stopped", None, f"stopped {who}"
    detail = _describe(code, status)
    if result == "start-limit-hit":
        detail += ", restart limit reached"
    return "Failed", exit_code, detail


def _describe(code: str, status: str) -> str:
    if code == CLD_EXITED:
        return f"exit code {status}"
    if code in (CLD_KILLED, "3"):
        return f"killed by {SIGNALS.get(status, 'signal ' + status)}"
    return "no exit"


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
            state, code, detail = task_state(u, rep.get("lifecycle"))
            restarts = int((u or {}).get("NRestarts", "0") or 0)
            since = _since(u, rep.get("now_monotonic_us"))
            ts = TaskStatus(t.name, t.role, t.host.name, t.address, ",".join(map(str, t.accelerators)) or "-", state, code, restarts, since, detail)
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


def _since(unit: dict | None, now_us) -> str:
    if not unit or not now_us:
        return ""
    ts = unit.get("StateChangeTimestamp") or ""
    mono = unit.get("ActiveEnterTimestampMonotonic") if unit.get("ActiveState") == "active" else unit.get("InactiveEnterTimestampMonotonic")
    try:
        secs = max(0, (int(now_us) - int(mono)) // 1_000_000) if mono and mono != "0" else None
    except ValueError:
        secs = None
    if secs is None:
        return ts
    if secs < 120:
        return f"{secs}s"
    if secs < 7200:
        return f"{secs // 60}m"
    return f"{secs // 3600}h"
