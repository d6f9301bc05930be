"""What the service does to a dev session (rules/devidle.py decides): a warning to the
terminals logged in to it, and its end. One agent round trip to the session's host each,
over the session of a Context that reaches that host (the rounds' own).

The end is the session job's stop, as `provision stop` makes one: the end marker first
(Stopped, with why: the session's program reads it to tell its terminals, and `status`,
`dev --list` and the event stream say it), then its units stopped; its ledger entry then
holds nothing, so its GPUs are free for the next apply at once. The files stay for
`provision dev --stop NAME` (or the next session of that name) to remove.
"""

from __future__ import annotations

import time

from provision.core.lifecycle import STOP_PHASE
from provision.core.target import Target
from provision.host.protocol import BatchReport, BatchRequest, DevReport, DevRequest, UnitsRequest
from provision.io.ssh import Session, call_agent


def warn(session: Session, target: Target, job: str, units: tuple[str, ...], text: str) -> int:
    """`text` to the session's logged-in terminals: how many it reached."""
    sent = 0
    for unit in units:
        report: DevReport = call_agent(session, target, DevRequest(job, warn=text, unit=unit))
        sent += report.warned
    return sent


def marker(reason: str) -> dict[str, str]:
    return {"phase": STOP_PHASE, "reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def end(session: Session, target: Target, job: str, units: tuple[str, ...], reason: str) -> list[str]:
    """Mark the session Stopped (why: `reason`), then stop its units; the host's errors."""
    batch = BatchRequest([UnitsRequest(job, lifecycle=marker(reason)), UnitsRequest(job, [["stop", list(units)]])])
    report: BatchReport = call_agent(session, target, batch)
    return [e for r in report.results for e in getattr(r, "errors", [])]
