"""What jobs on a host share: pushed files two jobs list (a variant of a job pushes the
same files): who may change one, and what a finished job's claim means; and a `setup:`
(keyed by what it is, render/files.setup_key): whether it runs, or is done there already
for every job that needs it. Pure; plan.py applies the verdicts.

The host's owners report (ledger.other_owners) says which other jobs' manifests list a
path and the bytes each recorded; the ledger's holds (tenancy.judge) say which of them
may read it now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from provision.host import layout
from provision.host.protocol import FileInfo, ProbeReport
from provision.render.files import SetupUnit


@dataclass(frozen=True)
class OtherJob:
    """Another job on the host whose manifest lists a path this job pushes: who, and the
    content it recorded (the owners report)."""

    job: str
    sha256: str
    who: str = "?"
    # It may read the file: its tasks run, or an apply of it is under way (or the ledger
    # does not say). A finished job (succeeded, failed, stopped) reads nothing until rerun.
    running: bool = True


# host -> path -> the other jobs that list it (only paths plan asked about).
Shared = Mapping[str, Mapping[str, Sequence[OtherJob]]]


@dataclass(frozen=True)
class Verdict:
    settled: bool  # nothing more to plan for the path (shared, refused or left)
    problem: str | None = None  # refuses the apply
    warning: str | None = None
    shared_with: str | None = None  # the same bytes as this job's: not written
    taken_by: str | None = None  # a running job changed it after this one had finished: left


def judge(path: str, f: Any, a: FileInfo, rec: Any, others: Sequence[OtherJob]) -> Verdict:
    """The rules for a pushed file (f: this job's, a: the host's, rec: what this job's
    manifest recorded) that other jobs list too."""
    if rec is not None and rec.get("sha256") == f.sha256 != a.sha256:
        changer = next((o for o in others if o.running and o.sha256 == a.sha256), None)
        if changer is not None:  # it could change it only because this job had finished
            left = (
                f"{path} was changed by job {changer.job} ({changer.who}), which shares it and runs, after "
                f"this job had finished: left as it is; this job cannot start again while {changer.job} runs with it"
            )
            return Verdict(True, warning=left, taken_by=changer.job)
    why = _other_owner_problem(path, f, a, rec, others)
    if why is not None:
        return Verdict(True, problem=why)
    note = finished_users_note(path, f, a, others) if rec is not None else None
    if rec is None:
        return Verdict(True, warning=note, shared_with=others[0].job)
    return Verdict(False, warning=note)


def taken_problem(path: str, other: str) -> str:
    """A job whose file a running one changed may not start with it (plan.as_a_unit)."""
    return (
        f"{path} is shared with job {other}, which changed it and runs: this job would start with "
        f"{other}'s bytes; give this job's files: entry another dest, or start it once {other} has finished"
    )


def _other_owner_problem(path: str, f: Any, a: FileInfo, rec: Any, others: Sequence[OtherJob]) -> str | None:
    """The rule for a pushed path other jobs list too: the same bytes are shared (None);
    different bytes are refused, naming the job that has the path (replace: true never takes
    another job's file, and changing a shared file would change what the other job runs)."""
    names = ", ".join(f"{o.job} ({o.who})" for o in others)
    if rec is None:
        if a.sha256 == f.sha256 and all(o.sha256 in ("", f.sha256) for o in others):
            return None
        return (
            f"{path} belongs to job {names} with other content; two jobs may share a pushed file only "
            "with the same bytes: give this job's files: entry another dest"
        )
    # Writing it changes it for the others: refused while one that runs has other bytes; a
    # finished one's claim does not hold the file (its rerun meets the same rule).
    users = [o for o in others if o.running and o.sha256 not in ("", f.sha256)]
    if a.sha256 != f.sha256 and users:
        names = ", ".join(f"{o.job} ({o.who})" for o in users)
        return (
            f"{path} is shared with job {names}: changing it would change what that job runs; "
            "give this job's files: entry another dest"
        )
    return None


def finished_users_note(path: str, f: Any, a: FileInfo, others: Sequence[OtherJob]) -> str | None:
    """What a change of a file that finished jobs also list means for them (plan says it)."""
    ended = [o for o in others if not o.running and o.sha256 not in ("", f.sha256)]
    if a.sha256 == f.sha256 or not ended:
        return None
    names = ", ".join(o.job for o in ended)
    return (
        f"{path} is shared with job {names}, which has finished: this apply changes it; a rerun of "
        f"{names} writes its own bytes back, and is refused while a running job uses these"
    )


# --------------------------------------------------------------------------- shared setups
#
# Who uses a setup on a host is what the jobs' manifests there list (its unit file), as for
# a pushed file: the owners report names them (plan.owners_wanted asks when the host has
# a setup this job did not write), and the last job to leave removes it (host/setups.py).


def setup_reason(setup: SetupUnit, report: ProbeReport, force: bool) -> str | None:
    """Whether the host's setup runs, and why (None: it is done there, by this job or by
    another with the same setup: setup_done)."""
    if force:
        return "forced"
    if setup_done(setup, report):
        return None
    m = report.readable_manifest() or {}
    before = m.get("setup") if isinstance(m.get("setup"), dict) else None
    return "changed" if before is not None and before.get("key") not in (setup.key, setup.legacy_key) else "new"


def setup_done(setup: SetupUnit, report: ProbeReport) -> bool:
    """The host has run this setup and it succeeded: its done mark is there (the probe
    reads it, run/context.probe_request) beside its unit (a mark whose unit went with the
    last job that used it is not trusted), or this job ran it per job under a release up to
    1a5e7ca (layout.setup_key_path)."""
    mark, unit = report.files.get(setup.done_path), report.files.get(layout.setup_unit_path(setup.key))
    if mark is not None and unit is not None and unit.type == "file":
        if mark.type == "file" and mark.sha256 == hashlib.sha256(layout.setup_done_record(setup.key)).hexdigest():
            return True
    return setup.legacy_key is not None and report.setup_key == setup.legacy_key


def setup_note(others: Sequence[str]) -> str:
    """What plan says of a setup done here already, and which other jobs use it (those the
    owners report named: none when it was not asked)."""
    if not others:
        return "done on this host"
    names = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    return f"done on this host, shared with {len(others)} other job{'s' if len(others) > 1 else ''} ({names})"
