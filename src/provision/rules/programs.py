"""Is each pool's program there to run? Plan's warning, before systemd's exit status 203.

The probe reports the paths plan asks about (host/protocol.py, ProbeRequest.paths →
FileInfo); plan asks about a pool's program (command[0]) on each host where a task of the
pool is about to start (new, or its inputs changed: a running task's program was there).
A bare name is looked up as systemd does, in its fixed search path. Container pools run
/usr/bin/docker, which facts and the engine check already. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from provision.core.model import Inventory
from provision.core.records import HostRecord
from provision.host.protocol import FileInfo
from provision.render.files import HostBundle

# systemd's search path for a bare ExecStart= name (systemd.service(5), "Command lines").
SYSTEMD_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def candidates(program: str) -> list[str]:
    """The paths systemd would try for `program`."""
    if program.startswith("/"):
        return [program]
    return [f"{d}/{program}" for d in SYSTEMD_PATH]


def starting(
    inv: Inventory, bundle: HostBundle | None, rec: HostRecord | None, keyed: Callable[[str], str]
) -> dict[str, tuple[str, list[str]]]:
    """program -> (pool role, tasks) for tasks of the host that an apply would start: no
    record of them, or their inputs changed since. Container pools are left out."""
    out: dict[str, tuple[str, list[str]]] = {}
    if bundle is None:
        return out
    for u in bundle.tasks:
        pool = inv.pool(u.task.role)
        if pool is None or pool.image or not pool.command:
            continue
        had = rec.tasks.get(u.task.name) if rec is not None else None
        if had is not None and had.inputs == keyed(u.inputs):
            continue
        role, tasks = out.setdefault(pool.command[0], (u.task.role, []))
        tasks.append(u.task.name)
    return out


def paths(inv: Inventory, bundle: HostBundle | None, rec: HostRecord | None, keyed: Callable[[str], str]) -> list[str]:
    """What the probe should stat for the programs (none that the job pushes itself)."""
    pushed = set(bundle.file_map()) if bundle is not None else set()
    out: set[str] = set()
    for program in starting(inv, bundle, rec, keyed):
        out |= {p for p in candidates(program) if p not in pushed}
    return sorted(out)


def _executable(info: FileInfo | None) -> bool | None:
    """True: runs; False: is there but cannot run; None: not there. A symlink is taken as
    runnable (the probe does not follow it)."""
    if info is None:
        return None
    if info.type == "symlink":
        return True
    if info.type == "file":
        return bool((info.mode or 0) & 0o111)
    return False


def warnings(
    inv: Inventory,
    host: str,
    bundle: HostBundle | None,
    rec: HostRecord | None,
    keyed: Callable[[str], str],
    files: Mapping[str, FileInfo | None],
    *,
    setup_pending: bool = False,
) -> list[str]:
    """One warning per program that systemd could not start on `host` (exit status 203).
    `setup_pending`: the host's setup runs before its tasks start in this apply, and may
    make the program (a venv's python): a missing one is not warned of then; if it is still
    missing after the setup, the start fails and apply says so (a warning users learn to
    ignore is worse than none)."""
    out: list[str] = []
    desired = bundle.file_map() if bundle is not None else {}
    for program, (role, tasks) in sorted(starting(inv, bundle, rec, keyed).items()):
        who = f"pools.{role}.command[0]: {program} ({', '.join(tasks)} on {host})"
        pushed = [desired[p] for p in candidates(program) if p in desired]
        if pushed:
            if not pushed[0].mode & 0o111:
                out.append(f"{who}: pushed by files: without execute permission (mode {pushed[0].mode:04o})")
            continue
        asked = [p for p in candidates(program) if p in files]
        if not asked:
            continue  # not probed (an older host agent): nothing to say
        found = [(p, files[p], _executable(files[p])) for p in asked]
        if any(ok for _, _, ok in found):
            continue
        there = [(p, info) for p, info, ok in found if ok is False]
        if there:
            p, info = there[0]
            assert info is not None
            what = (
                f"is not executable (mode {(info.mode or 0) & 0o7777:04o})"
                if info.type == "file"
                else f"is a {info.type}, not a program"
            )
            out.append(f"{who}: {p} {what}; systemd would fail to start it (exit status 203/EXEC)")
        elif setup_pending:
            continue
        elif program.startswith("/"):
            out.append(f"{who}: no such file on the host; systemd would fail to start it (exit status 203/EXEC)")
        else:
            out.append(
                f"{who}: not found in systemd's search path ({':'.join(SYSTEMD_PATH)}); "
                "give the absolute path, or install it"
            )
    return out
