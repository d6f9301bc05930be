"""What a preempted job's status says (issue 42), from the end markers host/preempt.py wrote
on its hosts: who preempted it, when, for what, and when it resumes. Pure.

    Preempted at 14:02 by deadline-run (ana, priority high): 2 GPUs on gpu-3; resumes when
    2 GPUs are free (3rd in the queue)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from provision.core.lifecycle import PREEMPT_PHASE

# The exit record's SERVICE_RESULT of a task systemd killed at TimeoutStopSec=.
KILLED_AT_DEADLINE = "timeout"


def marks(lifecycles: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(host, the marker's "preempted" record) for every host whose end marker says
    Preempted, in host order."""
    out = []
    for host, lc in sorted(lifecycles.items()):
        if isinstance(lc, dict) and lc.get("phase") == PREEMPT_PHASE and isinstance(lc.get("preempted"), dict):
            out.append((host, lc["preempted"]))
    return out


def _n(x: int, word: str) -> str:
    return f"{x} {word}{'' if x == 1 else 's'}"


def _by(first: Mapping[str, Any]) -> str:
    """'by deadline-run (ana, priority high)'."""
    prio = first.get("priority_name") or first.get("priority")
    who = ", ".join(str(x) for x in (first.get("who"), f"priority {prio}" if prio not in (None, "") else None) if x)
    return f"by {first.get('by', '?')}" + (f" ({who})" if who else "")


def _resumes(gpus: int, place: int | None) -> str:
    when = (
        f"resumes when {_n(gpus, 'GPU')} {'is' if gpus == 1 else 'are'} free" if gpus else "resumes when room returns"
    )
    return when + (f" ({ordinal(place)} in the queue)" if place is not None else "")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ... 11th, 12th, 13th, ... 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def reason(found: Sequence[tuple[str, dict[str, Any]]], clock: Any = time.localtime, place: int | None = None) -> str:
    """The status line's reason (after "Preempted "): at, by whom, what it held where, and
    (`place`: rules/queueorder.place_in_queue) its place in the queue."""
    if not found:
        return "preempted"
    first = found[0][1]
    at = first.get("at")
    when = f"at {time.strftime('%H:%M', clock(at))} " if isinstance(at, (int, float)) else ""
    held = [(h, len(m.get("gpus") or [])) for h, m in found]
    where = ", ".join(f"{_n(n, 'GPU')} on {h}" for h, n in held if n) or "its hosts"
    return f"{when}{_by(first)}: {where}; {_resumes(sum(n for _, n in held), place)}"


def paused(marker: Mapping[str, Any] | None, gpus: int) -> str:
    """A tuning trial's words when its job was preempted (`marker`: the end marker's
    "preempted" record; `gpus`: what the trial takes): 'preempted by deadline-run (ana,
    priority high); resumes when 1 GPU is free'."""
    by = _by(marker) if isinstance(marker, Mapping) else "by higher-priority work"
    return f"preempted {by}; {_resumes(gpus, None)}"


def killed_at_deadline(found: Sequence[tuple[str, dict[str, Any]]], last_exit: Sequence[str] | None) -> str | None:
    """The detail of a task systemd killed at the preemption's deadline (it did not exit
    within the grace after the signal), else None."""
    if not found or not last_exit or len(last_exit) < 2 or last_exit[1] != KILLED_AT_DEADLINE:
        return None
    m = found[0][1]
    at, deadline = m.get("at"), m.get("deadline")
    grace = f" {int(deadline - at)} s" if isinstance(at, (int, float)) and isinstance(deadline, (int, float)) else ""
    return f"killed at the preemption's deadline: it had not exited{grace} after the preemption's signal"
