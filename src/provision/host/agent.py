"""Runs ON the host, sent over SSH for each call: stdlib only, no state of its own.

The controller starts `python3 -S -c BOOT N` and writes N bytes of a bundle (host/bundle.py:
this module with layout.py and protocol.py) followed by a JSON request (protocol.py's wire
form) to stdin; the answer is one JSON report on stdout. One request does a whole
step on a host (read everything plan needs, or write every file), so each step costs one
SSH round trip per host. Facts (what the host reports) come back as data; deciding what to
change stays on the controller.
"""

from __future__ import annotations

import os
import sys
import time

from . import layout, ledger, trust
from . import protocol as P
from .hostlib import base64, dropins, json, read_json, run, sha256_file

# mypy reads the guarded imports (it takes any TYPE_CHECKING as true); hosts never import typing
# (~6 ms of their CPU per request), and annotations stay unevaluated (__future__, Python 3.7+).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any

    States = dict[str, dict[str, str]]  # unit -> systemctl show's properties

ledger.JSON = json

UNIT_PROPS = (
    "Id", "LoadState", "ActiveState", "SubState", "Result", "ExecMainCode", "ExecMainStatus", "ExecMainPID",
    "MainPID", "NRestarts", "InvocationID", "ActiveEnterTimestampMonotonic", "InactiveEnterTimestampMonotonic",
    "ExecMainStartTimestampMonotonic", "ExecMainExitTimestampMonotonic", "ExecMainStartTimestamp",
    "ExecMainExitTimestamp", "NeedDaemonReload", "StateChangeTimestamp",
)  # fmt: skip


# What the probes say of a unit whose run is live (its invocation link is there), without
# asking systemctl: plan and apply need no more of a running task (status does: it asks).
def running_state(unit: str) -> dict[str, str]:
    return {"Id": unit, "LoadState": "loaded", "ActiveState": "active", "SubState": "running"}


def unit_states(units: Iterable[str], known_only: bool = False, live: bool = False) -> States:
    """`systemctl show` for many units in one call, as {unit: {prop: value}}. With
    `known_only` (the probe) only units layout.unit_known_paths finds; the others are
    reported never loaded, as the shell probe does. With `live`, a unit whose invocation
    link is there is reported running_state without systemctl (the shell probe alike)."""
    units = sorted(set(units))
    if not units:
        return {}
    running = [u for u in units if ledger.runs_now(u)] if live else []
    rest = [u for u in units if u not in running]
    shown = [u for u in rest if any(os.path.lexists(p) for p in layout.unit_known_paths(u))] if known_only else rest
    out = run(["systemctl", "show", "--property=" + ",".join(UNIT_PROPS), "--"] + shown)[1] if shown else ""
    states = parse_unit_states(out, rest)
    states.update((u, running_state(u)) for u in running)
    return states


def parse_unit_states(out: str, units: Iterable[str]) -> States:
    """`systemctl show` output as {unit: {prop: value}} (shared with the controller's fast probe)."""
    states: States = {}
    for block in out.strip("\n").split("\n\n"):
        props: dict[str, str] = {}
        for line in block.splitlines():
            k, _, v = line.partition("=")
            props[k] = v
        if props.get("Id"):
            states[props["Id"]] = props
    # systemctl names unknown units by the name asked; keep the asked name as the key.
    for u in units:
        states.setdefault(u, {"Id": u, "LoadState": "not-found", "ActiveState": "inactive"})
    return states


def read_exits(job: str, units: Iterable[str]) -> dict[str, list[list[str]]]:
    """Each unit's .exits records (layout.parse_exits), [] when there are none."""
    out: dict[str, list[list[str]]] = {}
    for u in units:
        try:
            with open(layout.exits_path(job, layout.task_of_unit(job, u))) as f:
                out[u] = layout.parse_exits(f.read())
        except OSError:
            out[u] = []
    return out


def reset_exits(job: str, units: Iterable[str]) -> None:
    """A run provision starts counts its exits afresh (its gate: no boot or run recorded)."""
    for u in units:
        task = layout.task_of_unit(job, u)
        for path in (
            layout.exits_path(job, task),
            layout.stopping_path(job, task),
            layout.boot_path(job, task),
            layout.run_path(job, task),
        ):
            try:
                os.unlink(path)
            except OSError:
                pass


def file_info(path: str, want_sha: str | None, content_max: int, look: bool = False) -> P.FileInfo | None:
    """What path is; with `look` only its type, mode, owner and size (ProbeRequest.programs)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return P.FileInfo("error", error=str(e))
    import stat as S  # lazy: the other requests do not pay its import time

    if S.S_ISLNK(st.st_mode):
        return P.FileInfo("symlink")
    if not S.S_ISREG(st.st_mode):
        return P.FileInfo("dir" if S.S_ISDIR(st.st_mode) else "other")
    if look:
        return P.FileInfo("file", st.st_mode & 0o7777, st.st_uid, st.st_size)
    sha = sha256_file(path)
    content = None
    if want_sha is not None and sha != want_sha and st.st_size <= content_max:
        with open(path, "rb") as f:
            content = base64.b64encode(f.read()).decode()
    return P.FileInfo("file", st.st_mode & 0o7777, st.st_uid, st.st_size, sha, content)


def _checks(checks: dict[str, Any], facts_out: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = lazy("hostcheck").probe_checks(checks, facts_out)
    if checks.get("health"):  # the health read (host/health.py), as probe.sh makes it
        out["health"] = lazy("health").read(checks["health"], (facts_out or {}).get("nvidia_smi") == "ok")
    return out


def op_probe(req: P.ProbeRequest) -> P.ProbeReport:
    job = req.job
    manifest = read_json(layout.manifest_path(job))
    paths = set(req.listed())
    units = set(req.units)
    put: set[str] = set()  # what the manifest says provision put here
    if isinstance(manifest, dict) and "_unreadable" not in manifest:
        if req.files:
            put = set(manifest.get("files", {}))
            paths |= put
        units |= {t.get("unit") for t in manifest.get("tasks", {}).values() if t.get("unit")}
    # As the shell probe's LOOK; a program that is also a file the manifest names is read.
    look = set(req.looked()) - put
    files = {p: file_info(p, req.want.get(p), req.content_max, p in look) for p in sorted(paths)}
    facts_out = checks_out = interface = None
    gpu_check = bool(req.checks and req.checks.get("gpus"))  # one nvidia-smi run gives both
    if req.facts != P.NO_FACTS:
        only = req.facts_only if req.facts == P.CHECK_FACTS else None  # (hostfacts: a write reads no facts)
        facts_out = lazy("hostfacts").facts([g for g in only if g != "gpus"] if gpu_check and only else only)
    if req.checks is not None:
        checks_out = _checks(req.checks, facts_out)
    if req.cluster_address:
        interface = lazy("hostcheck").interface(req.cluster_address)
    held = held_units = listening = local = records = None
    if req.tenancy:
        held = ledger.read_all()
        # Only units whose file is there: the shell probe shows the same ones.
        others = [u for u in ledger.units_of(held, job) if os.path.exists(layout.SYSTEMD_DIR + "/" + u)]
        held_units = parse_unit_states("", [])
        if others:
            held_units = unit_states(others, live=not req.clocks)
        for u in ledger.units_of(held, job):
            held_units.setdefault(u, {"Id": u, "LoadState": "not-found", "ActiveState": "inactive"})
        records = ledger.records(held, job)
        listening, local = (ledger.proc_listening(), ledger.proc_local_only()) if req.listening else (None, None)
    logins = lazy("logins").logins() if req.logins else None
    return P.ProbeReport(
        manifest=manifest,
        lifecycle=read_json(layout.lifecycle_path(job)),
        files=files,
        units=unit_states(units, known_only=True, live=not req.clocks),
        exits=read_exits(job, units),
        facts=facts_out,
        now=time.time(),
        now_monotonic_us=int(time.monotonic() * 1e6),
        boot_id=layout.boot_id(),
        ledger=held,
        ledger_units=held_units,
        listening=listening,
        checks=checks_out,
        interface=interface,
        setup_key=read_key(layout.setup_key_path(job)),
        runs=read_json(layout.runs_path(job)),
        listening_local=local,
        dropins=dropins(layout.DROPIN_BASES, layout.PREFIX, layout.DROPIN_SUFFIX) if req.files else None,
        ledger_records=records,
        progress=mtimes(req.progress[: P.MAX_PROGRESS_PATHS]) if req.progress else None,
        health=(ledger.read_entry(layout.HEALTH_PATH) or {}) if req.tenancy else None,
        logins=logins,
    )


def mtimes(paths: Iterable[str]) -> dict[str, int]:
    """Each path's modification time (whole seconds), never through a link (the shell
    probe's `stat -c %Y`): what shows a job's progress (ProbeRequest.progress)."""
    out = {}
    for p in paths:
        try:
            out[p] = int(os.lstat(p).st_mtime)
        except OSError:
            pass
    return out


def _mkdirs(path: str, created: list[str]) -> None:
    missing = []
    d = path
    while d and d != "/" and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        os.mkdir(d, 0o755)
        created.append(d)


def atomic_write(path: str, data: bytes, mode: int, created: list[str]) -> None:
    """Temp file in the same directory, fsync, rename: a reader sees old or new, never half."""
    d = os.path.dirname(path)
    _mkdirs(d, created)
    tmp = os.path.join(d, ".%s.%d%s" % (os.path.basename(path), os.getpid(), layout.TMP_SUFFIX))  # one per agent
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    except OSError as e:  # named by the file asked for, not by the temp file
        raise OSError(e.errno, e.strerror, path) from None
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
        os.close(fd)
        fd = -1  # closed
        os.rename(tmp, path)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OSError(e.errno, e.strerror, path) from None


def _clean_tmp(dirs: Iterable[str]) -> None:
    """Temp files left by an apply that was killed mid-way."""
    for d in dirs:
        try:
            for name in os.listdir(d):
                if name.endswith(layout.TMP_SUFFIX):
                    os.unlink(os.path.join(d, name))
        except OSError:
            pass


def _record_dirs(job: str, created: list[str]) -> None:
    """Directories made for files, named before anything can fail (destroy removes them)."""
    if not created:
        return
    path = layout.created_dirs_path(job)
    old = read_json(path)
    old = old if isinstance(old, list) else []
    if set(created) <= set(old):
        return
    atomic_write(path, json.dumps(sorted(set(old + created))).encode(), 0o600, [])


def _failed(e: OSError, path: str) -> str:
    """A failed file operation as 'PATH: the system's words' (No space left on device)."""
    return "%s: %s" % (e.filename or path, e.strerror or e)


def _keep_original(job: str, path: str, created: list[str]) -> None:
    """Move the host's own file at path aside (once), for destroy to put back."""
    keep = layout.original_path(job, path)
    if os.path.lexists(keep) or not os.path.isfile(path) or os.path.islink(path):
        return
    _mkdirs(os.path.dirname(keep), created)
    os.rename(path, keep)


def systemctl(verb: str, units: Sequence[str], errors: list[str]) -> None:
    if not units:
        return
    # A stop waits for the tasks' grace period (TimeoutStopSec=, MAX_GRACE_PERIOD at most).
    code, _, err = run(["systemctl", verb, "--"] + list(units), timeout=420 if verb == "stop" else 120)
    # reset-failed complains about units that are not loaded (never started): harmless.
    if code != 0 and verb != "reset-failed":
        errors.append("systemctl %s %s: %s" % (verb, " ".join(units), err.strip() or "exit %d" % code))


def start(units: Sequence[str], errors: list[str]) -> None:
    """systemctl start. Unit files new to the host need no daemon-reload where systemd looks
    for a unit it has not loaded (246+); an older one says "not found" (exit 5): then
    reload and start again (those started already are left as they are)."""
    if not units:
        return
    code, _, err = run(["systemctl", "start", "--"] + list(units), timeout=120)
    if code == 5:
        rc, _, rerr = run(["systemctl", "daemon-reload"], timeout=120)
        if rc != 0:
            errors.append("systemctl daemon-reload: " + (rerr.strip() or "exit %d" % rc))
        code, _, err = run(["systemctl", "start", "--"] + list(units), timeout=120)
    if code != 0:
        errors.append("systemctl start %s: %s" % (" ".join(units), err.strip() or "exit %d" % code))


def through_link(path: str, reserved: Iterable[str] = layout.RESERVED_DIRS) -> str | None:
    """The reserved directory a file's directory reaches through a symbolic link on this
    host, if any: validation checks the destination as written, and only the host knows
    that /opt/x is a link to /etc/provision/J (a `replace: true` file there would then take
    the place of provision's own env file or a systemd unit)."""
    d = os.path.dirname(path)
    real = os.path.realpath(d)
    if real == d:
        return None
    for r in reserved:
        if (real == r or real.startswith(r + "/")) and not (d == r or d.startswith(r + "/")):
            return r
    return None


def _through_links(files: Iterable[P.FileWrite]) -> list[str]:
    """Refusals for files whose directory leads into provision's own through a link here."""
    linked = [(f.path, r) for f in files for r in [through_link(f.path)] if r]
    return [
        "%s: its directory leads into %s through a symbolic link on this host; refused "
        "(push it to a path that is not a link, or remove the link)" % (p, r)
        for p, r in linked
    ]


def _after_write(req: P.WriteRequest, errors: list[str]) -> None:
    """What systemd must hear once the files are in place, and the end marker cleared."""
    if req.daemon_reload:
        code, _, err = run(["systemctl", "daemon-reload"], timeout=120)
        if code != 0:
            errors.append("systemctl daemon-reload: " + (err.strip() or "exit %d" % code))
    if req.reset_failed:
        run(["systemctl", "reset-failed", "--"] + req.reset_failed)
    marks = (layout.lifecycle_path(req.job), layout.resume_env_path(req.job))
    if req.clear_lifecycle and ((req.run or {}).get("resume") or any(map(os.path.lexists, marks))):  # it resumes
        lazy("preempt").clear_lifecycle(req.job, bool((req.run or {}).get("resume")))  # a recovery's: anywhere
    if req.run:  # stamped with the host's clock, the one its journal uses
        runs = layout.with_run(read_json(layout.runs_path(req.job)), req.run, time.time())
        atomic_write(layout.runs_path(req.job), json.dumps(runs).encode(), 0o600, [])


def op_write(req: P.WriteRequest) -> P.WriteReport:  # noqa: C901  a write's steps on the host in their order (links, reservation, manifest, directories, files); stdlib only
    job = req.job
    # Before anything else is written or reserved: a file that would land in provision's
    # (or systemd's) own directories through a link, or outputs: others could redirect (host/outdirs.py), refuse it all.
    refused = _through_links(req.files) + (lazy("outdirs").refusals(req.outputs) if req.outputs else [])
    if refused:
        return P.WriteReport(0, 0, refused)
    if req.reserve is not None:
        # Before anything else: a reservation that lost a race writes nothing on the host.
        lost = ledger.reserve(req.reserve, time.time())
        if lost:
            return P.WriteReport(0, 0, lost, conflict=True)
    jd = layout.job_dir(job)
    errors: list[str] = []
    created: list[str] = []
    if not os.path.isdir(jd):
        _mkdirs(os.path.dirname(jd), created)
        os.mkdir(jd, 0o700)
        created.append(jd)
    os.chmod(jd, 0o700)
    dirs = {os.path.dirname(f.path) for f in req.files} | {jd}
    _clean_tmp(dirs)
    # The manifest first lists old and new files together, so a kill at any point leaves
    # every file provision put here named in it (destroy and the next plan find them all).
    if req.manifest_pending:
        atomic_write(layout.manifest_path(job), base64.b64decode(req.manifest_pending), 0o600, created)
    gone = ledger.missing(req.expect)  # shared files, not written: their other job may have left
    if gone:
        return P.WriteReport(0, 0, ["%s: removed by the job it was shared with" % p for p in gone], conflict=True)
    systemctl("stop", req.stop, errors)
    # Every directory the files need, made and recorded before any file is written: a write
    # that then fails (no space left, a kill) leaves no directory that destroy does not know.
    d, files = "", req.files
    try:
        for d in sorted({os.path.dirname(f.path) for f in req.files}):
            _mkdirs(d, created)
    except OSError as e:
        errors.append(_failed(e, d))
        files = []
    _record_dirs(job, [d for d in created if d != jd])
    f, written = None, 0
    try:
        for f in files:
            if f.keep_original:
                _keep_original(job, f.path, created)
            atomic_write(f.path, base64.b64decode(f.content), f.mode, created)
            written += 1
    except OSError as e:
        errors.append(_failed(e, f.path if f else ""))
    removed = ledger.remove_unowned(req.job, req.remove)
    _after_write(req, errors)
    _record_dirs(job, [d for d in created if d != jd])
    if req.manifest and not errors:
        atomic_write(layout.manifest_path(job), base64.b64decode(req.manifest), 0o600, [])
    _fsync_dirs(dirs)
    return P.WriteReport(written, removed, errors)


def _fsync_dirs(dirs: Iterable[str]) -> None:
    for d in sorted(dirs):
        try:
            fd = os.open(d, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        except OSError:
            pass


def start_at_boot(job: str, on: bool, errors: list[str] | None = None) -> None:
    """Enable (link into layout.BOOT_TARGET's wants) or disable the job's target, as
    `systemctl enable --no-reload` would: only a boot reads the link."""
    link, target = layout.wants_link(job), layout.target_path(job)
    try:
        if os.path.lexists(link):
            if on and os.path.islink(link) and os.readlink(link) == target:
                return
            os.unlink(link)
        if on and os.path.exists(target):  # never a dangling link
            _mkdirs(os.path.dirname(link), [])
            os.symlink(target, link)
    except OSError as e:
        if errors is not None:
            errors.append("%s: %s" % (link, e.strerror))


def op_units(req: P.UnitsRequest) -> P.UnitsReport:  # noqa: C901  one branch per systemctl verb, then the states asked for; stdlib only
    """systemctl verbs in order, then the states of the units named in `report`."""
    job = req.job
    errors: list[str] = []
    for verb, units in req.actions:
        ran = bool(units) and all(ledger.runs_now(u) for u in units)
        refused = ledger.start_refusals(job, units, running=ran) if verb in ("start", "restart") and units else []
        if refused:  # a GPU quarantined, a host draining since the reservation: nothing starts
            errors += refused
            break
        if verb == "restart":
            # stop, then forget the old run's exits (its ExecStopPost writes one more), then
            # start: the new run's record starts empty.
            systemctl("stop", units, errors)
            verb = "start"
        if verb == "start":
            reset_exits(job, units)
            if units:
                start_at_boot(job, True, errors)
                # The gate's records live here: made now, the gate's shell needs no mkdir.
                _mkdirs(layout.state_dir(job), [])
        waiting: list[str] = []
        if verb == "stop" and units:
            waiting = [u for u, st in unit_states(units).items() if st.get("SubState") == "auto-restart"]
        if verb == "start" and units:
            refused = ledger.start_locked(job, units, ran, start, errors)
            if refused:
                errors += refused
                break
        elif verb != "start":
            systemctl(verb, units, errors)
        for u in waiting:
            # A task stopped between tries ran no ExecStopPost now: record the stop, so its
            # last try's failure is not taken for its outcome.
            try:
                with open(layout.exits_path(job, layout.task_of_unit(job, u)), "a") as f:
                    f.write(layout.exit_record(int(time.time()), "success", "none", "-", True))
            except OSError:
                pass
    if req.lifecycle is not None and os.path.isdir(layout.job_dir(job)):
        # Stamped with the host's clock, the one its exit records use (job_phase compares).
        marker = dict(req.lifecycle, host_time=time.time())
        atomic_write(layout.lifecycle_path(job), json.dumps(marker).encode(), 0o600, [])
    if req.hold:
        ledger.hold(job, time.time())
    if req.lifecycle is not None:
        start_at_boot(job, False)  # the job ended: a boot starts nothing of it
    # A unit whose invocation link is there runs (systemd removes the link when the run
    # ends): reported so without a systemctl run (~5 ms of the host's CPU, and PID 1's
    # answer). The others, and every unit when something failed, as systemctl shows them.
    states = unit_states(req.report, live=not errors)
    # The manifest records a task's new inputs only once the task runs with them, so an
    # apply killed between writing and restarting still restarts it next time.
    if req.manifest and not errors:
        atomic_write(layout.manifest_path(job), base64.b64decode(req.manifest), 0o600, [])
    return P.UnitsReport(errors, states, read_exits(job, req.report))


def _restore_originals(job: str, errors: list[str]) -> None:
    d = layout.originals_dir(job)
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        path = "/" + name.replace("%2F", "/").replace("%25", "%")
        try:
            os.rename(os.path.join(d, name), path)
        except OSError as e:
            errors.append("%s: could not put the original back: %s" % (path, e.strerror))


def _units_of(job: str, manifest: dict[str, Any], stop: list[str]) -> list[str]:
    """The units destroy stops: those asked, every task's, and the setup's (an interrupted
    one) unless another job uses it too."""
    units = list(stop)
    units += [t["unit"] for t in manifest.get("tasks", {}).values() if t.get("unit") and t["unit"] not in units]
    setup = manifest.get("setup")
    if isinstance(setup, dict) and setup.get("unit") and setup["unit"] not in units:
        if not lazy("setups").used_elsewhere(job, setup):  # a shared one may run for another job
            units.append(setup["unit"])
    return units


def op_destroy(req: P.DestroyRequest) -> P.DestroyReport:  # noqa: C901  destroy's steps on the host in their order (units, files, directories, systemd); stdlib only
    job = req.job
    jd, sd = layout.job_dir(job), layout.state_dir(job)
    manifest = read_json(layout.manifest_path(job))
    errors: list[str] = []
    if not isinstance(manifest, dict) or "_unreadable" in manifest:
        manifest = {"files": {}, "tasks": {}}
    units = _units_of(job, manifest, req.stop)
    start_at_boot(job, False)
    systemctl("stop", units, errors)
    setups = lazy("setups")  # a shared setup goes with the last job using it, or stays held by a study
    kept = setups.hold(manifest.get("setup"), req.hold_setup) if req.hold_setup else []
    removed = ledger.remove_unowned(job, [p for p in manifest.get("files", {}) if p not in kept], errors)
    setups.release(manifest.get("setup"))
    setups.release_holds(job)
    _restore_originals(job, errors)
    dirs = read_json(layout.created_dirs_path(job))
    if isinstance(dirs, list):
        for d in sorted(dirs, key=len, reverse=True):
            try:
                os.rmdir(d)
            except OSError:
                pass  # not empty: something else lives there now
    if not errors:
        ledger.release(job)  # before VAR goes: the ledger leaves nothing once it is empty
        for d in (jd, sd):
            for root, _subdirs, names in os.walk(d, topdown=False):
                for name in names:
                    os.unlink(os.path.join(root, name))
                os.rmdir(root)
        for d in (layout.ETC, layout.VAR):
            try:
                os.rmdir(d)  # only when no other job is left
            except OSError:
                pass
    systemctl("reset-failed", units, [])  # none (a study's destroy): not every unit of the host
    if lazy("unitgc").needs_reload(manifest, units):
        code, _, err = run(["systemctl", "daemon-reload"], timeout=120)
        if code != 0:
            errors.append("systemctl daemon-reload: " + (err.strip() or "exit %d" % code))
        systemctl("reset-failed", units, [])
    return P.DestroyReport(removed, units, errors)


def read_key(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def op_batch(req: P.BatchRequest) -> P.BatchReport:
    """Several requests in one round trip, in order, stopping after the first with errors
    (apply writes a host's files and starts its first tasks this way)."""
    results: list[Any] = []
    for sub in req.requests:
        sub = lazy("fresh").completed(results[0], sub) if sub.op == "write" and req.requests[0].op == "fresh" else sub
        results.append(OPS[sub.op](sub))
        if getattr(results[-1], "errors", None):
            break
    return P.BatchReport(results)


def lazy(name: str) -> Any:
    """A module of this package imported when a request first needs it (bundle.LAZY): on a
    host the bundle's finder compiles it then; on the controller (tests), the package's own.
    __import__ with a fromlist gives the submodule itself without importing importlib."""
    return __import__(__name__.rsplit(".", 1)[0] + "." + name, fromlist=["_"])


OPS: dict[str, Callable[[Any], Any]] = {
    "probe": op_probe,
    "write": op_write,
    "units": op_units,
    "destroy": op_destroy,
    "batch": op_batch,
    "netcheck": lambda req: lazy("hostcheck").op_netcheck(req),
    "setup": lambda req: lazy("setups").op_setup(req),
    "owners": lambda req: P.OwnersReport(ledger.other_owners(req.job, req.paths)),
    "queue": lambda req: P.QueueReport(
        ledger.queue(req.job, req.owner, req.waiting, time.time(), req.priority, req.submitted, req.gpus)
    ),
    "preempt": lambda req: lazy("preempt").op_preempt(req),
    "stacks": lambda req: lazy("stacks").op_stacks(req),
    "health": lambda req: lazy("health").op_health(req),
    "healthtest": lambda req: lazy("health").op_healthtest(req),
    "fabric": lambda req: lazy("fabric").op_fabric(req),
    "dev": lambda req: lazy("devop").op_dev(req),
    "fresh": lambda req: lazy("fresh").op_fresh(req),
}


def untrusted(job: str) -> str | None:
    """The first of provision's directories (the job's too) that trust.py refuses, or None."""
    dirs = [layout.ETC, layout.VAR, layout.LEDGER_DIR, layout.SETUPS_VAR, os.path.dirname(layout.AGENT_CACHE)]
    if job:
        dirs += [layout.job_dir(job), layout.state_dir(job)]
    for d in dirs:
        why = trust.problem(d)
        if why:
            return why + " (fix its owner and mode; nothing was done on this host)"
    return None


def main() -> None:
    req = P.request_from_wire(json.loads(sys.stdin.buffer.read().decode("utf-8")))
    jobs = {getattr(r, "job", None) for r in getattr(req, "requests", None) or [req]}
    why = next((w for w in map(untrusted, sorted(j or "" for j in jobs)) if w), None)
    if why:
        sys.stdout.write(json.dumps({"fatal": why}))
        sys.stdout.flush()
        return
    try:
        res = P.to_wire(OPS[req.op](req))
    except OSError as e:  # a file the host would not take: its path and the system's words
        res = {"fatal": _failed(e, "") if e.filename else "%s: %s" % (type(e).__name__, e)}
    except Exception as e:  # reported to the controller as data, with the host's words
        res = {"fatal": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write(json.dumps(res))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
