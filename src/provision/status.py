"""Job phase and task states from what the hosts report (systemd unit properties). Pure.

Task states: Pending (not started yet), Running, Restarting (between tries), Succeeded
(exit 0), Failed (exited non-zero or was killed, restart budget spent), Stopped (stopped
by provision when the job ended, or by hand).
Job phase (cluster-env.md, Lifecycle): Succeeded when the success policy holds (the chief
exited 0, worker 0 when there is no chief, or every worker with `all_workers`) and no task
had failed for good before that; Failed when a task failed for good first (or every task
ended without the success policy holding); Running while any task runs; Pending before that.
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
    ended_at: float | None = None  # host clock (epoch seconds) of the exit that ended it

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

    def task(self, name: str) -> TaskStatus:
        for t in self.tasks:
            if t.task == name:
                return t
        raise KeyError(name)


CLD_EXITED, CLD_KILLED, CLD_DUMPED = "1", "2", "3"  # systemd's ExecMainCode
_KIND = {CLD_EXITED: "exited", CLD_KILLED: "killed", CLD_DUMPED: "dumped"}


def _how(kind: str, status: str) -> str:
    if kind == "none":
        return "between tries"
    if kind == "exited":
        return f"exit code {status}"
    sig = status if not status.isdigit() else None
    what = "core dumped, " if kind == "dumped" else ""
    return f"{what}killed by {'SIG' + sig if sig else 'signal ' + status}"


def task_state(
    unit: dict | None,
    exits: list | None = None,
    ended: dict | None = None,
    restart_limit: int | None = None,
) -> tuple[str, int | None, str]:
    """(state, exit code, detail) of one task. The one place that decides a task's state.

    `unit`: `systemctl show` properties; `exits`: the task's ExecStopPost records
    ([time, SERVICE_RESULT, EXIT_CODE, EXIT_STATUS] plus "stop" when the run ended because
    a stop was asked for; oldest first), which survive systemd unloading an inactive unit;
    `ended`: the job's end marker on this host, if any; `restart_limit`: the pool's restart
    budget, when known: a task waiting to restart that has spent it is Failed already
    (systemd would refuse the next start with "start request repeated too quickly").
    """
    if not unit or unit.get("LoadState") in (None, "not-found"):
        if exits:  # the unit file is gone but the outcome was recorded
            unit = {"ActiveState": "inactive", "SubState": "dead"}
        else:
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
    asked_stop = len(last) > 4 and last[4] == "stop"
    exit_code = int(status) if kind == "exited" and status.lstrip("-").isdigit() else None
    how = _how(kind, status)
    if asked_stop or (result == "success" and kind == "killed"):
        # Stopped on request: by provision at the end of the job, or by someone else.
        who = f"by provision: job {str(ended.get('phase', 'ended')).lower()}" if ended else "by hand"
        return "Stopped", exit_code, f"stopped {who} ({'exited ' + status if kind == 'exited' else how})"
    if active == "activating" and sub == "auto-restart":
        if restart_limit is not None and exits is not None and len(exits) > restart_limit:
            if kind == "exited" and status == "0":
                return "Succeeded", 0, "exited 0"
            return "Failed", exit_code, f"{how}, restart limit ({restart_limit}) reached"
        return "Restarting", exit_code, f"last try: {how}"
    if kind == "exited" and status == "0":
        return "Succeeded", 0, "exited 0"
    if unit.get("Result") == "start-limit-hit" or (
        restart_limit and exits is not None and len(exits) > restart_limit
    ):
        how += f", restart limit ({restart_limit if restart_limit is not None else '?'}) reached"
    return "Failed", exit_code, how


def restarts(unit: dict | None, exits: list | None) -> int:
    """Automatic restarts in the current run (the exit file is reset by every apply start):
    every recorded exit was followed by a restart while the task runs or waits to restart;
    the last one was not once it ended."""
    n = len(exits or [])
    u = unit or {}
    running = u.get("ActiveState") in ("active", "activating", "reloading", "deactivating")
    return n if running else max(0, n - 1)


def job_status(
    inv: Inventory,
    tasks: list[tuple[PlacedTask, str]],
    reports: dict[str, dict],
    unreachable: list[str],
) -> JobStatus:
    """`tasks`: (placed task, unit name); `reports`: host → probe answer."""
    rows = []
    for t, unit in tasks:
        rep = reports.get(t.host.name)
        gpus = ",".join(map(str, t.accelerators)) or "-"
        if rep is None:
            ts = TaskStatus(t.name, t.role, t.host.name, t.address, gpus, "Unknown", None, 0, "", "host unreachable")
        else:
            u = rep.get("units", {}).get(unit)
            ex = rep.get("exits", {}).get(unit)
            pool = inv.pool(t.role)
            limit = None
            if pool is not None:
                limit = 0 if pool.restart.policy == "Never" else pool.restart.limit
            state, code, detail = task_state(u, ex, rep.get("lifecycle"), limit)
            since = _since(u, rep.get("now_monotonic_us"), ex, rep.get("now"))
            n = restarts(u, ex)
            if state in ("Failed", "Succeeded", "Stopped"):
                n = max(0, len(ex or []) - 1)
            ended_at = None
            if state in ("Failed", "Succeeded", "Stopped") and ex:
                try:
                    ended_at = float(ex[-1][0])
                except (TypeError, ValueError):
                    ended_at = None
            ts = TaskStatus(t.name, t.role, t.host.name, t.address, gpus, state, code, n, since, detail, ended_at)
        rows.append(ts)
    phase, reason = _phase(inv, rows)
    return JobStatus(inv.job, phase, reason, tuple(rows), tuple(unreachable))


def _when(r: TaskStatus) -> float:
    return r.ended_at if r.ended_at is not None else float("inf")


def _phase(inv: Inventory, rows: list[TaskStatus]) -> tuple[str, str]:
    failed = sorted((r for r in rows if r.state == "Failed"), key=_when)
    chief = [r for r in rows if r.role == "chief"]
    workers = [r for r in rows if r.role == "worker"]
    success: tuple[float, str] | None = None
    if inv.success == "all_workers":
        if workers and all(r.state == "Succeeded" for r in workers):
            success = (max(_when(r) for r in workers), "every worker exited 0")
    else:
        lead = chief[0] if chief else next((w for w in workers if w.task == "worker-0"), None)
        if lead is not None and lead.state == "Succeeded":
            success = (_when(lead), f"{lead.task} exited 0")
    # A task that fails after the job succeeded (a worker losing its peers as the chief
    # leaves, say) does not undo the success; one that failed first decides the outcome.
    if failed and (success is None or _when(failed[0]) < success[0]):
        f = failed[0]
        return "Failed", f"{f.task} on {f.host} failed: {f.detail}"
    if success is not None:
        return "Succeeded", success[1]
    if any(r.state in ("Running", "Restarting") for r in rows):
        return "Running", ""
    if rows and all(r.state == "Pending" for r in rows):
        return "Pending", "not started"
    if any(r.state == "Unknown" for r in rows):
        return "Unknown", "some hosts are unreachable"
    if any(r.state == "Pending" for r in rows):
        return "Pending", ""
    # Every task ended (stopped by hand, or exited 0 without being the one that counts).
    stopped = [r for r in rows if r.state == "Stopped"]
    if stopped:
        return "Failed", f"every task ended without the success policy ({inv.success}) holding: {stopped[0].task} was {stopped[0].detail}"
    return "Failed", f"every task ended without the success policy ({inv.success}) holding"


def _since(unit: dict | None, now_us, exits: list | None = None, now: float | None = None) -> str:
    """How long the task has been in its state: systemd's clock while it runs, else the
    time of its last recorded exit (systemd forgets unloaded units)."""
    if not now_us:
        return ""
    unit = unit or {}
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
