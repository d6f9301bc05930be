"""Preemption on the host: a job leaves its GPUs to higher-priority work, keeping
its checkpoint.

The preemptor's controller asks (PreemptRequest); here, in order:
1. under the ledger's lock the victim's entry is marked {"preempted": {by, who, host, pid,
   priority, at, deadline, ...}}: a second preemptor finds the mark and is refused (nothing
   is preempted twice); the same preemptor asking again renews it (a host that came back);
2. the deadline is written to layout.preempt_at_path (PROVISION_PREEMPT_AT, in a
   preemptible job's env) and the Preempted end marker to the job's lifecycle file;
3. the job's units are stopped without waiting (`systemctl stop --no-block`). A preemptible
   job's units carry the preemption's signal as KillSignal= and its grace in
   TimeoutStopSec= (render/files.py): systemd itself sends the signal, and kills what is
   left at the deadline, even if the preemptor is gone by then; the stop is recorded as one
   (no automatic restart, and ExecStop= marks the exit).
The entry's units ending frees nothing for others: until the preemptor's reserve takes the
GPUs (ledger.reserve drops them from the entry), they are held for it (tenancy.judge).

A job is preempted whole: whoever acts for it (the service, its owner's status or apply)
asks its other hosts the same with `follows` (the host whose marker it follows), and the
preemptor's words: the same marker and stop, but no reservation (the preemptor may not
know this host), so its GPUs are free once its units have ended.

A recovery (run/recover.py) stops a job the same way, marked by the job itself (`by` its
own name: its GPUs wait for its next run, nobody else's) with the recovery in its marker.

The next start of the job (its owner's apply, or the service's) clears the marker, and,
because it resumes, writes layout.resume_env_path (PROVISION_RESUME=1): clear_lifecycle.
Its units' start clears the entry's mark on every host (ledger.mark_started): the resumed
run is a new one, which the next preemptor may preempt again.

Runs on the host (shipped by host/bundle.py, imported only by the requests that use it),
stdlib only.
"""

from __future__ import annotations

import os
import time

from . import layout, ledger
from . import protocol as P
from .hostlib import json, read_json, run

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

PREEMPT_PHASE = "Preempted"  # core/lifecycle.PREEMPT_PHASE (the host has no core/)
_SPAN_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def timespan_s(text: str) -> float | None:
    """systemd's time span as `systemctl show` prints it ("2min 30s", "10s", "500ms") in
    seconds; None for "infinity" or anything else."""
    total, seen = 0.0, False
    for word in text.split():
        num = word.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = word[len(num) :] or "s"
        if not num or unit not in _SPAN_UNITS:
            return None
        try:
            total += float(num) * _SPAN_UNITS[unit]
        except ValueError:
            return None
        seen = True
    return total if seen else None


def grace_of(units: list[str]) -> float:
    """The longest TimeoutStopSec= of the units: how long systemd lets them save (90 s,
    systemd's default, when none says)."""
    if not units:
        return 0.0
    code, out, _ = run(["systemctl", "show", "-p", "TimeoutStopUSec", "--value", "--"] + units)
    spans = [timespan_s(line) for line in out.splitlines()] if code == 0 else []
    known = [s for s in spans if s is not None]
    return max(known) if known else 90.0


def _mark(req: P.PreemptRequest, grace: float, now: float) -> tuple[Any, str]:
    """Mark the victim's entry under the ledger's lock: (entry, "") or (None, why not) or
    (None, "refused:JOB") when JOB preempted it first."""
    with ledger.FileLock(layout.LEDGER_DIR, layout.LEDGER_LOCK):
        entry = ledger.read_entry(layout.ledger_path(req.job))
        if not isinstance(entry, dict) or "_unreadable" in entry:
            return None, "job %s has no readable ledger entry here" % req.job
        old = entry.get("preempted")
        if isinstance(old, dict) and old.get("by") not in (None, req.by):
            return None, "refused:" + str(old.get("by"))
        mark = dict(old) if isinstance(old, dict) else {"at": now, "deadline": now + grace}
        if old is not None and req.follows:
            return entry, ""  # marked here already (by its preemptor, or an earlier follow)
        mark.pop("follows", None)  # its preemptor's own mark replaces a follow
        mark.update(
            by=req.by,
            who=str(req.owner.get("who", "?")),
            host=str(req.owner.get("host", "")),
            pid=req.owner.get("pid") if isinstance(req.owner.get("pid"), int) else 0,
            priority=req.priority,
            priority_name=req.priority_name,
            need=req.gpus,
            gpus=list(entry.get("gpus") or []),
            updated=now,  # the preemptor's heartbeat: its reservation lapses without one
        )
        if req.follows:  # the job's own stop: nobody's reservation (tenancy.judge)
            mark.update(follows=req.follows, host="", pid=0)
        entry["preempted"] = mark
        entry.update(updated=now, token=os.urandom(8).hex())
        ledger.write_entry(req.job, entry)
    return entry, ""


def _end_marker(job: str, mark: dict[str, Any], recovery: dict[str, Any] | None = None) -> None:
    """The Preempted end marker (status reads who, when, for what), unless the job ended
    before (its own marker stands)."""
    path = layout.lifecycle_path(job)
    if not os.path.isdir(layout.job_dir(job)):
        return
    old = read_json(path)
    if isinstance(old, dict) and old.get("phase") not in (None, PREEMPT_PHASE):
        return
    marker = {
        "phase": PREEMPT_PHASE,
        "reason": ("recovering: %s" % recovery.get("words", "")) if recovery else "preempted by %s" % mark["by"],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(mark["at"])),
        "host_time": mark["at"],
        "preempted": {
            k: mark[k]
            for k in ("by", "who", "priority", "priority_name", "at", "deadline", "gpus", "need", "follows")
            if k in mark
        },
    }
    if recovery:  # the same marker and resume; status words it as the recovery it is
        marker["recovery"] = {k: recovery[k] for k in ("n", "words") if k in recovery}
    _atomic(path, json.dumps(marker).encode(), 0o600)


def _atomic(path: str, data: bytes, mode: int) -> None:
    tmp = path + layout.TMP_SUFFIX
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, path)


def op_preempt(req: P.PreemptRequest) -> P.PreemptReport:
    now = time.time()
    units = [u for u in (ledger.read_entry(layout.ledger_path(req.job)) or {}).get("units") or [] if isinstance(u, str)]
    grace = grace_of(units)
    entry, why = _mark(req, grace, now)
    if entry is None:
        if why.startswith("refused:"):
            return P.PreemptReport(refused=why[len("refused:") :])
        return P.PreemptReport(errors=[why])
    mark = entry["preempted"]
    errors: list[str] = []
    try:
        os.makedirs(layout.state_dir(req.job), 0o755, exist_ok=True)
        _atomic(layout.preempt_at_path(req.job), ("%.3f\n" % mark["deadline"]).encode(), 0o644)
        _end_marker(req.job, mark, req.recovery if isinstance(req.recovery, dict) else None)
    except OSError as e:
        errors.append("%s: %s" % (e.filename or layout.state_dir(req.job), e.strerror))
    try:  # the job ended: a boot starts nothing of it (agent.start_at_boot)
        os.unlink(layout.wants_link(req.job))
    except OSError:
        pass
    if units:
        code, _, err = run(["systemctl", "stop", "--no-block", "--"] + units)
        if code != 0:
            errors.append("systemctl stop: " + (err.strip() or "exit %d" % code))
    return P.PreemptReport(errors, "", mark["deadline"], grace, list(entry.get("gpus") or []))


def clear_lifecycle(job: str, resume: bool = False) -> None:
    """A start of the job clears its end marker (agent._after_write); when that marker says
    Preempted (or `resume`: a recovery's run, on a host new to the job that no stop marked),
    this run resumes: its units read PROVISION_RESUME=1 (resume_env_path).
    Any other start is a fresh run: no resume file, no deadline."""
    marker = read_json(layout.lifecycle_path(job))
    resumes = resume or (isinstance(marker, dict) and marker.get("phase") == PREEMPT_PHASE)
    gone = [layout.lifecycle_path(job), layout.preempt_at_path(job)]
    for path in gone + ([] if resumes else [layout.resume_env_path(job)]):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if resumes:
        os.makedirs(layout.state_dir(job), 0o755, exist_ok=True)
        _atomic(layout.resume_env_path(job), b'PROVISION_RESUME="1"\n', 0o644)
