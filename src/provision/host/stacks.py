"""A hung job's look on the host (run/recover.py asks it before the job is stopped): for
each of its units, the processes in its control group and the state the kernel gives each
(`T` stopped: SIGSTOP or a debugger; `D` in a device's wait), and each task's Python
stacks written into its own log (the journal, under the task's identifier: `provision
logs` shows them) where the host can give them: `py-spy dump --pid` when py-spy is
installed. What is read is bounded (MAX_PIDS processes a unit, DUMP_TIMEOUT s a dump).

Runs on the host (shipped by host/bundle.py, imported only by the request that uses it),
stdlib only.
"""

from __future__ import annotations

import shutil

from . import layout, logins
from . import protocol as P
from .hostlib import run

MAX_PIDS = 64
DUMP_TIMEOUT = 20


def _pids(unit: str, bases: list[str]) -> list[int]:
    """The unit's processes, from its cgroup in each hierarchy mounted (host/logins.py)."""
    return logins.unit_pids(unit, bases)[:MAX_PIDS]


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of a process (R, S, D, T, t, Z, ...), "" when gone."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            text = f.read()
    except OSError:
        return ""
    rest = text[text.rfind(")") + 2 :]
    return rest[:1]


def _into_log(ident: str, argv: list[str]) -> bool:
    """argv's output into the task's log, under its own identifier (systemd-cat connects
    it to the journal): True when it ran and exited 0."""
    code, _, _ = run(["systemd-cat", "-t", ident, "-p", "warning", "--"] + argv, timeout=DUMP_TIMEOUT)
    return code == 0


def op_stacks(req: P.StacksRequest) -> P.StacksReport:
    spy = shutil.which("py-spy")
    tasks: dict[str, dict[str, object]] = {}
    bases = logins.cgroup_bases()
    for unit in req.units[:MAX_PIDS]:
        task = layout.task_of_unit(req.job, unit)
        ident = layout.log_identifier(req.job, task)
        pids = _pids(unit, bases)
        states = {str(p): proc_state(p) for p in pids}
        dumped = False
        head = "provision: %s: the Python stacks of %s" % (req.why or "no progress", task)
        if spy is None:
            _into_log(
                ident, ["echo", "%s: py-spy is not installed on this host (pip install py-spy): none taken" % head]
            )
        for p in pids:
            if spy is None or states.get(str(p)) in ("", "Z"):
                continue
            _into_log(ident, ["echo", "%s (py-spy dump --pid %d, process state %s):" % (head, p, states[str(p)])])
            # --nonblocking: read its memory without pausing it (a stopped process stays as it is)
            dumped = _into_log(ident, [spy, "dump", "--nonblocking", "--pid", str(p)]) or dumped
        tasks[unit] = {"pids": pids, "states": states, "dumped": dumped, "py_spy": spy is not None}
    return P.StacksReport(tasks)
